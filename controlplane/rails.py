"""Safety rails: the checks every proposal passes before it may become an action, and again when it runs.

Pure: the caller hands in the mode, the pool, the recent actions and the time. `check` judges a
fresh proposal; `recheck` judges an approved action when it is due, against the pool as it is
then, since a person may approve minutes after the proposal and the fleet may have moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from controlplane.actions import ACTIVE_STATES, ActionState
from controlplane.config import Mode, Rails
from policies.types import ActionKind, PoolState, Proposal

__all__ = ["WAIT_REASONS", "DueAction", "PastAction", "RailsDecision", "RailsReason", "check", "recheck"]


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
    STALE = "stale"  # the pool no longer is what the approved action was computed from


# An approved action held back for one of these waits for a later tick; any other reason cancels it.
WAIT_REASONS = frozenset({RailsReason.IN_FLIGHT, RailsReason.COOLDOWN, RailsReason.POOL_NOT_SETTLED})


class PastAction(Protocol):
    """What the rails need to know of an earlier action."""

    @property
    def pool(self) -> str: ...

    @property
    def state(self) -> ActionState: ...

    @property
    def created_at(self) -> float: ...

    @property
    def finished_at(self) -> float | None: ...


class DueAction(PastAction, Protocol):
    """An approved action about to run."""

    @property
    def id(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> Mapping[str, Any]: ...


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


# Neither rejected, expired nor cancelled actions touched the fleet: they do not count against the rate limit.
_NEVER_RAN = frozenset({ActionState.REJECTED, ActionState.EXPIRED, ActionState.CANCELLED})
# A rejection starts the pool's cooldown too (a person said no; asking again next tick would nag);
# an expired or cancelled action may be proposed again at once, with fresh numbers.
_NO_COOLDOWN = frozenset({ActionState.EXPIRED, ActionState.CANCELLED})


def _held(reason: RailsReason, note: str) -> RailsDecision:
    return RailsDecision(reason, None, note)


def _pool_gates(pool: PoolState, rails: Rails, history: Sequence[PastAction], now: float) -> RailsDecision | None:
    """In flight, settling and cooldown: what keeps any action off a pool for now."""
    mine = [a for a in history if a.pool == pool.name]
    if any(a.state in ACTIVE_STATES for a in mine):
        return _held(RailsReason.IN_FLIGHT, f"an action on {pool.name} is already in flight")
    if pool.ready != pool.desired:
        return _held(RailsReason.POOL_NOT_SETTLED, f"{pool.name} has {pool.ready} of {pool.desired} replicas ready")
    # An action marked unknown (the process died while it ran) counts from when it was marked.
    last_finish = max((a.finished_at for a in mine if a.finished_at is not None and a.state not in _NO_COOLDOWN),
                      default=None)
    if last_finish is not None and now - last_finish < rails.cooldown:
        wait = rails.cooldown - (now - last_finish)
        return _held(RailsReason.COOLDOWN, f"{pool.name} is cooling down for {wait:.0f}s more")
    return None


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
        return _held(RailsReason.OBSERVE_MODE, "observe mode never acts")
    if proposal.kind is not ActionKind.SCALE_POOL:
        return _held(RailsReason.NOT_SUPPORTED, f"no actuator carries out {proposal.kind} yet")
    if pool is None:
        return _held(RailsReason.UNKNOWN_POOL, f"pool {proposal.pool!r} is not in the fleet file")
    gate = _pool_gates(pool, rails, history, now)
    if gate is not None:
        return gate
    recent = [a for a in history if now - a.created_at < 3600 and a.state not in _NEVER_RAN]
    if len(recent) >= rails.max_actions_per_hour:
        return _held(RailsReason.RATE_LIMITED,
                     f"{len(recent)} actions in the last hour (limit {rails.max_actions_per_hour})")
    step = max(-rails.max_step, min(rails.max_step, proposal.delta))
    target = max(pool.min_replicas, min(pool.max_replicas, pool.desired + step))
    if target == pool.desired:
        return _held(RailsReason.AT_LIMIT,
                     f"{pool.name} is at its bound ({pool.min_replicas}..{pool.max_replicas}, now {pool.desired})")
    note = f"scale {pool.name} {pool.desired} -> {target}"
    if mode is Mode.PROPOSE:
        return RailsDecision(RailsReason.NEEDS_APPROVAL, target, note + " (awaiting approval)")
    return RailsDecision(RailsReason.ALLOWED, target, note)


def recheck(
    action: DueAction,
    pool: PoolState | None,
    *,
    mode: Mode,
    rails: Rails,
    history: Sequence[PastAction],
    now: float,
) -> RailsDecision:
    """Decide whether an approved action may run now, on the pool as it is now.

    ALLOWED runs it; a reason in WAIT_REASONS keeps it approved for a later tick; anything else
    cancels it. The rate limit admitted it when it was proposed and is not counted again.
    """
    if mode is Mode.OBSERVE:
        return _held(RailsReason.OBSERVE_MODE, "the control plane is in observe mode now")
    if action.kind != ActionKind.SCALE_POOL:
        return _held(RailsReason.NOT_SUPPORTED, f"no actuator carries out {action.kind} yet")
    if pool is None:
        return _held(RailsReason.UNKNOWN_POOL, f"pool {action.pool!r} is not in the fleet file any more")
    others = [a for a in history if a is not action and getattr(a, "id", None) != action.id]
    gate = _pool_gates(pool, rails, others, now)
    if gate is not None:
        return gate
    start, target = int(action.params["from_replicas"]), int(action.params["replicas"])
    if pool.desired != start:
        return _held(RailsReason.STALE, f"approved as {pool.name} {start} -> {target}, but {pool.name} is at "
                                        f"{pool.desired} now")
    if not pool.min_replicas <= target <= pool.max_replicas:
        return _held(RailsReason.AT_LIMIT, f"{target} replicas is outside {pool.name}'s bounds now "
                                           f"({pool.min_replicas}..{pool.max_replicas})")
    return RailsDecision(RailsReason.ALLOWED, target, f"scale {pool.name} {start} -> {target}")
