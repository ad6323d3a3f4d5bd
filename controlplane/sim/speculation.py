"""Speculative decoding in the simulator: what a verification step yields per traffic class.

A drafter proposes `num_speculative_tokens` tokens; position i is accepted only if every earlier
one was, with probability a_i = first * decay^(i-1) for the request's traffic class. Draft
models (EAGLE, MTP) propose at every step; the ngram drafter only when the context repeats an
n-gram, which high-temperature sampling all but stops (measured on a real engine: 0 drafts).
Constrained decoding (JSON mode, tool calls) rejects most drafts: the grammar mask invalidates
them, the collapse the field reports. A step verifies k+1 tokens per sequence and costs a little
more than a plain decode step; a draft model adds its own forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.sim.engine import RankStats

__all__ = ["CLASSES", "ClassProfile", "SpecConfig", "StepGain", "step_gain"]


@dataclass(frozen=True, slots=True)
class ClassProfile:
    """How drafts fare for one traffic class."""

    first: float  # acceptance of the first draft position (draft-model drafters)
    decay: float  # each later position's acceptance relative to the one before
    ngram_draft_share: float  # steps on which the ngram drafter finds a match to propose
    ngram_first: float  # acceptance of an ngram proposal's first token


CLASSES: dict[str, ClassProfile] = {
    "text": ClassProfile(first=0.78, decay=0.88, ngram_draft_share=0.30, ngram_first=0.55),
    "code": ClassProfile(first=0.86, decay=0.92, ngram_draft_share=0.55, ngram_first=0.70),
    "json": ClassProfile(first=0.22, decay=0.55, ngram_draft_share=0.20, ngram_first=0.15),
    "random": ClassProfile(first=0.35, decay=0.60, ngram_draft_share=0.0, ngram_first=0.05),
}


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """A pool's `--speculative-config`: method and draft length; `none` disables speculation."""

    method: str = "none"  # none | ngram | eagle | eagle3 | mtp
    num_speculative_tokens: int = 0
    verify_cost: float = 0.06  # extra step time per verified draft position (decode is memory-bound)
    draft_cost: float = 0.04  # a draft model's forward pass per position, relative to a decode step

    def __post_init__(self) -> None:
        if self.method not in ("none", "ngram", "eagle", "eagle3", "mtp"):
            raise ValueError(f"speculative method must be none, ngram, eagle, eagle3 or mtp, got {self.method!r}")
        if self.method != "none" and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with method {self.method!r}")

    @property
    def enabled(self) -> bool:
        """Speculation is on."""
        return self.method != "none" and self.num_speculative_tokens > 0

    def step_cost(self) -> float:
        """A decode step's time relative to one without speculation."""
        if not self.enabled:
            return 1.0
        k = self.num_speculative_tokens
        drafter = 0.0 if self.method == "ngram" else self.draft_cost * k
        return 1.0 + self.verify_cost * k + drafter

    def count(self, stats: RankStats, gain: StepGain, steps: int) -> None:
        """Add `steps` verification steps of one sequence to vLLM's spec-decode counters."""
        stats.add("vllm:spec_decode_num_drafts", steps * gain.draft_share)
        stats.add("vllm:spec_decode_num_draft_tokens", steps * gain.draft_share * self.num_speculative_tokens)
        stats.add("vllm:spec_decode_num_accepted_tokens", steps * gain.mean_accepted)
        for i, p in enumerate(gain.per_position):
            stats.per_pos[i] += steps * p


@dataclass(frozen=True, slots=True)
class StepGain:
    """Expected outcome of one verification step, per sequence of the batch."""

    draft_share: float  # share of sequences that got a draft
    mean_accepted: float  # accepted draft tokens (so 1 + this tokens per step)
    per_position: tuple[float, ...]  # accepted tokens at each draft position


def _chain(first: float, decay: float, k: int) -> list[float]:
    """P(position i accepted) for i = 1..k: every earlier position must have been accepted too."""
    out, p, a = [], 1.0, first
    for _ in range(k):
        p *= min(1.0, a)
        out.append(p)
        a *= decay
    return out


def step_gain(spec: SpecConfig, classes: Sequence[str]) -> StepGain | None:
    """The batch's mean gain for its mix of traffic classes; None without speculation."""
    if not spec.enabled or not classes:
        return None
    k = spec.num_speculative_tokens
    share = 0.0
    per_pos = [0.0] * k
    for cls in classes:
        prof = CLASSES.get(cls, CLASSES["text"])
        if spec.method == "ngram":
            drafted, chain = prof.ngram_draft_share, _chain(prof.ngram_first, prof.decay, k)
        else:
            drafted, chain = 1.0, _chain(prof.first, prof.decay, k)
        share += drafted
        for i, p in enumerate(chain):
            per_pos[i] += drafted * p
    n = len(classes)
    per_position = tuple(p / n for p in per_pos)
    return StepGain(share / n, sum(per_position), per_position)
