"""Safety rails: the checks every proposal passes before it may become an action.

Pure: the caller hands in the mode, the pool, the recent actions and the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from controlplane.actions import ACTIVE_STATES
from controlplane.config import Mode, Rails
from policies.types import ActionKind, PoolState, Proposal

__all__ = ["RailsDecision", "RailsReason", "check"]



class RailsReason(StrEnum):
    """Why the rails allowed or held back a proposal; also a metric label, so keep spellings."""

    ALLOWED = "allowed"
    NEEDS_APPROVAL = "needs_approval"
    OBSERVE_MODE = "observe_mode"
    UNKNOWN_POOL = "unknown_pool"
    AT_LIMIT = "at_limit"
    IN_FLIGHT = "in_flight"
    COOLDOWN = "cooldown"
    RATE_LIMITED = "rate_limited"
    POOL_NOT_SETTLED = "pool_not_settled"
    NOT_SUPPORTED = "not_supported"  # no actuator can carry out this kind of action yet


class PastAction(Protocol):
    """What the rails need to know of an earlier action."""

    pool: str
    state: str
    created_at: float
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class RailsDecision:
    """The verdict on one proposal, with the replica count it may set when allowed."""

    reason: RailsReason
    target_replicas: int | None
    note: str

    @property
    def may_record(self) -> bool:
        """True when the proposal becomes an action row (run now or await approval)."""
        return self.reason in (RailsReason.ALLOWED, RailsReason.NEEDS_APPROVAL)


def check(
    proposal: Proposal,
    pool: PoolState | None,
    *,
    mode: Mode,
    rails: Rails,
    history: Sequence[PastAction],
    now: float,
) -> RailsDecision:
    """Decide what may happen to `proposal`; `history` holds recent actions, any pool."""
    if mode is Mode.OBSERVE:
        return RailsDecision(RailsReason.OBSERVE_MODE, None, "observe mode never acts")
    if proposal.kind is not ActionKind.SCALE_POOL:
        return RailsDecision(RailsReason.NOT_SUPPORTED, None, f"no actuator carries out {proposal.kind} yet")
    if pool is None:
        return RailsDecision(RailsReason.UNKNOWN_POOL, None, f"pool {proposal.pool!r} is not in the fleet file")
    mine = [a for a in history if a.pool == pool.name]
    if any(a.state in ACTIVE_STATES for a in mine):
        return RailsDecision(RailsReason.IN_FLIGHT, None, f"an action on {pool.name} is already in flight")
    if pool.ready != pool.desired:
        return RailsDecision(
            RailsReason.POOL_NOT_SETTLED, None, f"{pool.name} has {pool.ready} of {pool.desired} replicas ready"
        )
    last_finish = max((a.finished_at for a in mine if a.finished_at is not None), default=None)
    if last_finish is not None and now - last_finish < rails.cooldown:
        wait = rails.cooldown - (now - last_finish)
        return RailsDecision(RailsReason.COOLDOWN, None, f"{pool.name} is cooling down for {wait:.0f}s more")
    recent = [a for a in history if now - a.created_at < 3600 and a.state not in ("rejected", "expired")]
    if len(recent) >= rails.max_actions_per_hour:
        return RailsDecision(
            RailsReason.RATE_LIMITED, None, f"{len(recent)} actions in the last hour (limit {rails.max_actions_per_hour})"
        )
    step = max(-rails.max_step, min(rails.max_step, proposal.delta))
    target = max(pool.min_replicas, min(pool.max_replicas, pool.desired + step))
    if target == pool.desired:
        return RailsDecision(
            RailsReason.AT_LIMIT, None,
            f"{pool.name} is at its bound ({pool.min_replicas}..{pool.max_replicas}, now {pool.desired})",
        )
    note = f"scale {pool.name} {pool.desired} -> {target}"
    if mode is Mode.PROPOSE:
        return RailsDecision(RailsReason.NEEDS_APPROVAL, target, note + " (awaiting approval)")
    return RailsDecision(RailsReason.ALLOWED, target, note)
