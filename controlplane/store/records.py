"""The store's own value types: what goes in and what comes out, detached from any session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.actions import ActionState

__all__ = ["ARM_CHARS", "MAX_ID", "MAX_NAME", "ActionEvent", "ActionRecord", "AdviceRecord", "FindingRecord", "NewAction",
           "NewAdvice", "NewFinding", "NewVerdict", "Pause", "shortened"]

MAX_ID = 2**31 - 1  # the largest id an INTEGER column holds: a larger one no store holds, and PostgreSQL refuses
MAX_NAME = 255  # the longest name a person gives (who approved, who paused)


@dataclass(frozen=True, slots=True)
class NewFinding:
    """A finding to open, or the fresh content of an open one."""

    kind: str
    subject: str
    severity: str
    summary: str
    cause: str
    evidence: dict[str, Any]
    runbook: str


@dataclass(frozen=True, slots=True)
class FindingRecord:
    """A stored finding."""

    id: int
    kind: str
    subject: str
    state: str  # open | resolved
    severity: str
    summary: str
    cause: str
    evidence: dict[str, Any]
    runbook: str
    opened_at: float
    updated_at: float
    resolved_at: float | None


@dataclass(frozen=True, slots=True)
class NewAction:
    """An action to record as proposed, with the finding that caused it."""

    finding_id: int | None
    kind: str
    pool: str
    params: dict[str, Any]
    mode: str
    reason: str


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """A stored action: its current state; the audit log holds how it got there."""

    id: int
    finding_id: int | None
    kind: str
    pool: str
    params: dict[str, Any]
    mode: str
    state: ActionState
    reason: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    outcome: str | None
    approved_by: str | None = None
    actuator: str | None = None  # which actuator carried it out (kubernetes, simulator, dry_run)
    dry_run: bool = False  # True when the fleet was not changed
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """The kill switch as set: who paused acting, why, and when."""

    by: str
    reason: str
    at: float


ARM_CHARS = 255  # a verdict's baseline and canary as the store keeps them


def shortened(names: str, limit: int) -> str:
    """A comma-separated list cut to `limit` characters at a name's end, saying how many it left out."""
    if len(names) <= limit:
        return names
    parts = names.split(",")
    for keep in range(len(parts) - 1, 0, -1):
        text = f"{','.join(parts[:keep])} (+{len(parts) - keep} more)"
        if len(text) <= limit:
            return text
    return f"{names[:limit - 12]}… (cut)"


@dataclass(frozen=True, slots=True)
class NewVerdict:
    """A canary gate's verdict to keep: what was compared, over which window, and why it came out so."""

    gate: str
    pool: str
    baseline: str
    canary: str
    started_at: float
    finished_at: float
    result: str  # pass | marginal | fail | inconclusive
    score: float | None
    details: dict[str, Any]

    def __post_init__(self) -> None:
        # The arms are kept as names of up to 255 characters: a rollout's pods in a pool of ten ran past that, and the
        # row refused stopped every tick after it. Their full lists stay in `details`.
        for arm in ("baseline", "canary"):
            object.__setattr__(self, arm, shortened(getattr(self, arm), ARM_CHARS))

    @property
    def run(self) -> dict[str, Any]:
        """What it is the verdict of, by column: a store keeps one per gate run."""
        return {"gate": self.gate, "pool": self.pool, "baseline": self.baseline, "canary": self.canary,
                "started_at": self.started_at, "finished_at": self.finished_at}


@dataclass(frozen=True, slots=True)
class ActionEvent:
    """One entry of the audit log."""

    action_id: int
    ts: float
    event: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class NewAdvice:
    """A recommendation to keep with the effect it predicts: `metric` from `before` to `predicted`."""

    kind: str
    pool: str
    act: bool
    advice: str
    change: dict[str, Any]
    metric: str
    before: float
    predicted: float
    saving_per_day: float | None
    confidence: float
    evidence: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AdviceRecord:
    """A stored recommendation: open until superseded by different advice or followed by the fleet; followed, it is
    measured on what the fleet shows from then on, and once scored it is applied."""

    id: int
    kind: str
    pool: str
    act: bool
    advice: str
    change: dict[str, Any]
    metric: str
    before: float
    predicted: float
    saving_per_day: float | None
    confidence: float
    evidence: dict[str, Any]
    state: str  # open | superseded | followed | applied
    created_at: float
    updated_at: float
    applied_at: float | None = None  # when the fleet was first seen running the way it advised
    measured: float | None = None  # the metric as the fleet showed it after the change
    error: float | None = None  # (measured - predicted) / predicted; None where nothing was predicted (0)
