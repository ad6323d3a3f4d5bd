"""Mixture-of-experts expert parallelism: expert load across EP ranks, and EPLB.

Tokens pick experts with a skewed (Zipf-like) popularity that can shift (a hot expert). With
experts placed round-robin over the ranks, a rank's load is the popularity of its experts; all
ranks wait for the slowest at every all-to-all, so the expert layers of a step take as long as
the hottest rank needs: step time grows by `moe_share * (max/mean - 1)`. vLLM logs the same
ratio inverted as "balancedness" (mean/max tokens per rank).

EPLB (`--enable-eplb`, `--eplb-config` window_size / step_interval / num_redundant_experts)
re-places experts every `step_interval` steps from the load of the last `window_size` steps,
replicating the hottest onto redundant slots; each rearrangement stalls the group while weights
move, and gathering the load statistics costs a little on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EplbConfig", "ExpertParallel", "MoeSpec", "zipf_popularity"]


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """vLLM's `EPLBConfig` fields that change performance."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    rearrange_stall_s: float = 0.5  # moving expert weights between GPUs stops the group
    stats_overhead: float = 0.015  # per-step cost of recording expert load


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """An MoE model served with expert parallelism over `ranks` GPUs."""

    experts: int = 64
    ranks: int = 4
    zipf_s: float = 0.4
    moe_share: float = 0.55  # share of a step spent in the expert layers
    seed: int = 0


def zipf_popularity(experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Expert popularity from a Zipf law over a random ranking of the experts."""
    weights = 1.0 / np.arange(1, experts + 1) ** s
    rng.shuffle(weights)
    return np.asarray(weights / weights.sum(), dtype=float)


class ExpertParallel:
    """The EP group of one engine: popularity, placement, EPLB state and the step-time factor."""

    def __init__(self, spec: MoeSpec, eplb: EplbConfig | None = None) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.popularity = zipf_popularity(spec.experts, spec.zipf_s, self.rng)
        self.eplb = eplb
        self._slots = self._round_robin()
        self._steps_since = 0
        self.rearrangements = 0
        self.stall_s = 0.0  # time lost to rearrangements, owed to the next step
        self._refresh()

    def _round_robin(self) -> list[list[tuple[int, float]]]:
        """Each rank's (expert, share of that expert's tokens) with no replication."""
        slots: list[list[tuple[int, float]]] = [[] for _ in range(self.spec.ranks)]
        for e in range(self.spec.experts):
            slots[e % self.spec.ranks].append((e, 1.0))
        return slots

    def _balanced(self, redundant: int) -> list[list[tuple[int, float]]]:
        """Greedy placement as EPLB does: replicate the hottest, then fill the least-loaded rank."""
        copies = np.ones(self.spec.experts, dtype=int)
        for _ in range(redundant):
            copies[int(np.argmax(self.popularity / copies))] += 1
        items = sorted(((self.popularity[e] / copies[e], e) for e in range(self.spec.experts) for _ in range(copies[e])),
                       reverse=True)
        loads = [0.0] * self.spec.ranks
        slots: list[list[tuple[int, float]]] = [[] for _ in range(self.spec.ranks)]
        for load, e in items:
            r = loads.index(min(loads))
            loads[r] += load
            slots[r].append((e, 1.0 / copies[e]))
        return slots

    def _refresh(self) -> None:
        self.rank_load = np.array([sum(self.popularity[e] * w for e, w in rank) for rank in self._slots])
        self.imbalance = float(self.rank_load.max() / self.rank_load.mean())

    @property
    def balancedness(self) -> float:
        """vLLM's EPLB balancedness: mean over max tokens per rank (1.0 is perfectly balanced)."""
        return 1.0 / self.imbalance

    def step_factor(self) -> float:
        """Step time relative to a perfectly balanced group."""
        overhead = self.eplb.stats_overhead if self.eplb is not None else 0.0
        return (1.0 + self.spec.moe_share * (self.imbalance - 1.0)) * (1.0 + overhead)

    def rank_activity(self) -> list[float]:
        """Each rank's compute share relative to the hottest (what its tensor cores are busy with)."""
        peak = float(self.rank_load.max())
        return [float(v) / peak for v in self.rank_load]

    def advance(self, steps: int, now: float) -> None:
        """Count `steps` forward passes; EPLB rearranges when its interval has passed."""
        if self.eplb is None:
            return
        self._steps_since += steps
        if self._steps_since >= self.eplb.step_interval:
            self._steps_since = 0
            self._slots = self._balanced(self.eplb.num_redundant_experts)
            self._refresh()
            self.rearrangements += 1
            self.stall_s += self.eplb.rearrange_stall_s

    def set_eplb(self, eplb: EplbConfig | None) -> None:
        """Enable, retune or (None) disable EPLB; disabling returns to the static placement."""
        self.eplb = eplb
        self._steps_since = 0
        if eplb is None:
            self._slots = self._round_robin()
            self._refresh()

    def make_hot(self, share: float, expert: int | None = None) -> int:
        """Shift popularity so one expert takes `share` of the tokens (a hot expert); returns it."""
        e = int(np.argmin(self.popularity)) if expert is None else expert
        rest = 1.0 - share
        others = self.popularity.copy()
        others[e] = 0.0
        self.popularity = others / others.sum() * rest
        self.popularity[e] = share
        self._refresh()
        return e

    def reset_popularity(self) -> None:
        """Back to the original skew (the hot expert cools down)."""
        self.rng = np.random.default_rng(self.spec.seed)
        self.popularity = zipf_popularity(self.spec.experts, self.spec.zipf_s, self.rng)
        self._refresh()
