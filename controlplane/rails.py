"""Safety rails: the checks every proposal passes before it may become an action, and again when it runs.

Pure: the caller hands in the mode, the kill switch, the pool, the recent actions and the time.
`check` judges a fresh proposal; `recheck` judges an approved action when it is due, against the
pool as it is then, since a person may approve minutes after the proposal and the fleet may have
moved (a pod template changed since, a pool moved from the count it was asked to leave). Both hold every
kind of action to the same rules: the mode and the kill switch, what the actuator supports, one action
in flight per pool (reverts due first; a scale passes another kind's change that waits to run), a pool
that is still settling (not a revert's own: it may be what keeps it from settling; nor a scale-down of a
pool stalled short of ready engines, `PoolState.stalled_for`), a cooldown per
pool and kind, one disruptive change (a restart of a pool's engines) in the whole fleet at a time,
never more engines restarting at once than the pool allows, nothing resting on inputs that are
stale now (`PoolState.stale_inputs`), and a fleet-wide hourly rate limit. A fresh proposal is also
held while the same kind of change for the same finding is being judged, or after one did not help.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from controlplane.actions import ACTIVE_STATES, ActionState
from controlplane.config import Mode, Rails
from policies.inputs import stale_among
from policies.types import (
    ActionKind,
    Change,
    Drain,
    Eplb,
    PoolState,
    Proposal,
    RollBack,
    ScaleBy,
    ScaleTo,
    Speculation,
    change_from_dict,
    describe,
)

__all__ = ["DISRUPTIVE", "REVERT_WAITS", "WAIT_REASONS", "DueAction", "PastAction", "RailsDecision", "RailsReason",
           "check", "recheck", "rests_on", "revert_of"]


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
    NOT_SUPPORTED = "not_supported"  # the actuator cannot carry out this kind of action
    STALE = "stale"  # the pool no longer is what the approved action was computed from
    PAUSED = "paused"  # the kill switch is on: nothing acts
    ROLLOUT_IN_FLIGHT = "rollout_in_flight"  # another pool's engines are restarting: one pool at a time
    BLAST_RADIUS = "blast_radius"  # the change would restart more engines at once than the pool allows
    STALE_INPUTS = "stale_inputs"  # a signal it rests on is stale now (a target down, a series absent or frozen)
    TRIED = "tried"  # the same kind of change did not help this finding, or an engine setting this pool (in the history)
    VERIFYING = "verifying"  # the same kind of change for the same finding is still being judged
    POOL_UNREADABLE = "pool_unreadable"  # the pool's workload could not be read now: its replicas are not known
    SCALED_ELSEWHERE = "scaled_elsewhere"  # another controller (an HPA, KEDA's) sets the pool's replica count
    MADE = "made"  # the change stands already for this finding (its node is cordoned)


# An approved action held back for one of these waits for a later tick; any other reason cancels it.
WAIT_REASONS = frozenset({RailsReason.IN_FLIGHT, RailsReason.COOLDOWN, RailsReason.POOL_NOT_SETTLED,
                          RailsReason.PAUSED, RailsReason.ROLLOUT_IN_FLIGHT, RailsReason.STALE_INPUTS,
                          RailsReason.POOL_UNREADABLE})
# What holds a revert only for now: it is recorded to wait, as an approval waits (the approved are not counted against
# the hour's budget again), or nothing would undo the change: the policy's own proposal is held as tried.
REVERT_WAITS = WAIT_REASONS | {RailsReason.RATE_LIMITED}

# Kinds that change a pool's engine settings, which a revert puts back.
_SETTINGS = frozenset({ActionKind.TUNE_SPECULATION, ActionKind.DISABLE_SPECULATION, ActionKind.ENABLE_EPLB,
                       ActionKind.DISABLE_EPLB})

# Kinds that restart or replace engines of a pool: the fleet rolls one pool at a time.
DISRUPTIVE = frozenset({ActionKind.TUNE_SPECULATION, ActionKind.DISABLE_SPECULATION, ActionKind.ENABLE_EPLB,
                        ActionKind.DISABLE_EPLB, ActionKind.ROLLBACK, ActionKind.CORDON_NODE, ActionKind.DRAIN_ENGINE})
# Kinds that restart every engine of the pool by patching its pod template.
_RESTARTS_POOL = frozenset({ActionKind.TUNE_SPECULATION, ActionKind.DISABLE_SPECULATION, ActionKind.ENABLE_EPLB,
                            ActionKind.DISABLE_EPLB})


class PastAction(Protocol):
    """What the rails need to know of an earlier action."""

    @property
    def pool(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def state(self) -> ActionState: ...

    @property
    def created_at(self) -> float: ...

    @property
    def finished_at(self) -> float | None: ...

    @property
    def finding_id(self) -> int | None: ...

    @property
    def outcome(self) -> str | None: ...


class DueAction(PastAction, Protocol):
    """An approved action about to run."""

    @property
    def id(self) -> int: ...

    @property
    def params(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class RailsDecision:
    """The verdict on one proposal, with the change it may make when allowed (a scale step resolved to its target)."""

    reason: RailsReason
    change: Change | None
    note: str

    @property
    def may_record(self) -> bool:
        """True when the proposal becomes an action row (run now or await approval)."""
        return self.reason in (RailsReason.ALLOWED, RailsReason.NEEDS_APPROVAL)

    @property
    def target_replicas(self) -> int | None:
        """The replica count a scaling decision sets."""
        return self.change.replicas if isinstance(self.change, ScaleTo) else None


# Neither rejected, expired nor cancelled actions touched the fleet: they do not count against the rate limit.
_NEVER_RAN = frozenset({ActionState.REJECTED, ActionState.EXPIRED, ActionState.CANCELLED})
# A rejection starts the cooldown too (a person said no; asking again next tick would nag); an
# expired or cancelled action may be proposed again at once, with fresh numbers.
_NO_COOLDOWN = frozenset({ActionState.EXPIRED, ActionState.CANCELLED})


def _held(reason: RailsReason, note: str) -> RailsDecision:
    return RailsDecision(reason, None, note)


def _gates(kind: ActionKind, pool: PoolState, *, mode: Mode, paused: str | None, supported: Collection[ActionKind],
           rails: Rails, history: Sequence[PastAction], now: float, unsettled: Collection[str],
           inputs: Collection[str] = (), undoing: bool = False, sheds: bool = False,
           scales_down: bool = False) -> RailsDecision | None:
    """The rules every action passes, proposed or due: None when none holds it back. A revert (`undoing`) is not held
    by its own pool's settling or rollout: the change it undoes may be what keeps the pool from settling. Nor is a
    scale-down of a stalled pool that gives up only engines it waits for (`sheds`): they may never come. A scale-down
    (`scales_down`) waits for a cordon of another pool's to end."""
    if mode is Mode.OBSERVE:
        return _held(RailsReason.OBSERVE_MODE, "observe mode never acts")
    if paused is not None:
        return _held(RailsReason.PAUSED, f"acting is paused: {paused}")
    if kind not in supported:
        return _held(RailsReason.NOT_SUPPORTED, f"the actuator cannot carry out {kind}")
    if pool.unreadable is not None:
        return _held(RailsReason.POOL_UNREADABLE, f"{pool.name}'s workload cannot be read now: {pool.unreadable}")
    mine = [a for a in history if a.pool == pool.name]
    # A change running holds everything; one not yet run holds all but a scale, which does not restart engines and
    # is checked against the pool as it is then (a revert waiting on another pool's rollout must not freeze this
    # pool's size).
    if any(a.state == ActionState.STARTED
           or (a.state in ACTIVE_STATES and (kind is not ActionKind.SCALE_POOL or a.kind == kind)) for a in mine):
        return _held(RailsReason.IN_FLIGHT, f"an action on {pool.name} is already in flight")
    if scales_down and (cordons := sorted({a.pool for a in history if a.kind == ActionKind.CORDON_NODE
                                             and a.state == ActionState.STARTED and a.pool != pool.name})):
        # A cordon takes every pool's engines on its node out of routing until it evicts them: a scale-down meanwhile
        # would take those idle ones for its own, and route them again (on the faulty node) if it spared them.
        return _held(RailsReason.IN_FLIGHT, f"a cordon asked by {', '.join(cordons)} is moving engines off a node: "
                                            f"{pool.name} sheds none until it ends")
    if pool.ready != pool.desired and not undoing and not sheds:
        stalled = ("" if pool.stalled_for is None else
                   f" for {pool.stalled_for / 60:.0f} min (only a scale-down to {pool.ready} or more runs)")
        return _held(RailsReason.POOL_NOT_SETTLED,
                     f"{pool.name} has {pool.ready} of {pool.desired} replicas ready{stalled}")
    blocked = stale_among(inputs, pool.stale_inputs)
    if blocked:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(blocked.items()))
        return _held(RailsReason.STALE_INPUTS, f"the inputs of {kind} on {pool.name} are stale: {why}")
    # An action marked unknown (the process died while it ran) counts from when it was marked.
    last = max((a.finished_at for a in mine
                if a.kind == kind and a.finished_at is not None and a.state not in _NO_COOLDOWN), default=None)
    cooldown = rails.cooldown_for(kind)
    if last is not None and now - last < cooldown:
        return _held(RailsReason.COOLDOWN, f"{kind} on {pool.name} is cooling down for {cooldown - (now - last):.0f}s more")
    if kind in DISRUPTIVE:
        # Another pool mid-change (an action running, engines still coming up after one, a new template rolling
        # out) holds every disruptive change back: one pool at a time. So does the pool's own rollout, while
        # scaling it goes on (Argo Rollouts and Deployments scale a pool mid-rollout in proportion).
        busy = sorted({a.pool for a in history if a.pool != pool.name and a.state == ActionState.STARTED}
                      | {p for p in unsettled if p != pool.name} | ({pool.name} if pool.rolling and not undoing else set()))
        if busy:
            return _held(RailsReason.ROLLOUT_IN_FLIGHT, f"{', '.join(busy)} is still changing: one pool at a time")
    if kind in _RESTARTS_POOL and pool.gang > max(1, pool.max_unavailable or 1):
        return _held(RailsReason.BLAST_RADIUS,
                     f"a new pod template on {pool.name} restarts {pool.gang} engines together (one gang), more than "
                     f"its maxUnavailable of {pool.max_unavailable or 1}: roll it by hand")
    return None


def _asks(change: Change, pool: PoolState) -> int:
    """The engines a change asks the pool for (its count now for a change that is no scale)."""
    if isinstance(change, ScaleTo):
        return change.replicas
    return pool.desired + change.delta if isinstance(change, ScaleBy) else pool.desired


def _scales_down(change: Change, pool: PoolState) -> bool:
    return isinstance(change, ScaleBy | ScaleTo) and _asks(change, pool) < pool.desired


def _undoes_rollout(change: Change, pool: PoolState) -> bool:
    """Whether a change rolls its own pool back: a canary fails while its pool is mid-rollout (the new revision beside
    the old), so that rollout, and the surge or crash-looping pods it brings, must not hold its own undoing."""
    return isinstance(change, RollBack) and change.workload == pool.name


def _sheds(change: Change, pool: PoolState) -> bool:
    """Whether a change to a stalled pool gives up only engines it asks for and does not have ready."""
    return pool.stalled_for is not None and pool.ready <= _asks(change, pool) < pool.desired


def _shape(change: Change, kind: ActionKind, pool: PoolState, rails: Rails) -> RailsDecision:
    """The change as it may run on this pool: a scale resolved and clamped, a drain that leaves an engine."""
    if isinstance(change, ScaleBy | ScaleTo):
        if pool.scaled_by is not None:
            # Two controllers writing one count fight: each undoes the other, and every engine added starts cold.
            return _held(RailsReason.SCALED_ELSEWHERE, f"{pool.scaled_by} sets {pool.name}'s replica count: remove it, "
                                                       "or leave this pool's size to it")
        asked = _asks(change, pool)
        # A gang's engines (a LeaderWorkerSet group) come and go together: bounds and steps in whole groups, at
        # least one group a step. A target is a need, so it is met in whole groups: 7 engines in groups of 4 are
        # 8, and a pool of 8 asked for 7 keeps them (rounding down would halve it, and the next tick double it).
        g = max(1, pool.gang)
        if isinstance(change, ScaleTo):
            asked = -(-asked // g) * g
            if asked == pool.desired:
                return _held(RailsReason.AT_LIMIT, f"{pool.name} already has {pool.desired} engines: "
                                                   f"{change.replicas} in whole groups of {g}")
        lo, hi = -(-pool.min_replicas // g) * g, pool.most_replicas
        # The bounds first, then the step: a pool above a lowered maximum that is asked for one more engine must
        # not lose two, and one below its minimum steps up, not past what was asked.
        bounded = max(lo, min(hi, asked))
        if lo > hi or (bounded - pool.desired) * (asked - pool.desired) <= 0:
            return _held(RailsReason.AT_LIMIT,
                         f"{pool.name} is at its bound ({pool.min_replicas}..{pool.max_replicas}"
                         f"{f' in groups of {g}' if g > 1 else ''}, now {pool.desired})")
        step = max(g, rails.max_step // g * g)
        target = pool.desired + max(-step, min(step, bounded - pool.desired))
        target = -(-target // g) * g if target > pool.desired else target // g * g
        return RailsDecision(RailsReason.ALLOWED, ScaleTo(target), f"scale {pool.name} {pool.desired} -> {target}")
    if isinstance(change, Drain) and pool.ready <= 1:
        return _held(RailsReason.AT_LIMIT, f"{change.pod} is the last ready engine of {pool.name}: never drained")
    if isinstance(change, Drain) and pool.gang > 1:
        # Its workload (a LeaderWorkerSet) recreates a group whose pod goes: the group's other engines, still routed,
        # would drop their requests. A gang changes in whole groups, by a scale.
        return _held(RailsReason.BLAST_RADIUS, f"{change.pod} is one engine of a gang of {pool.gang} in {pool.name}: "
                                               "its whole group would restart, so it is never drained alone")
    return RailsDecision(RailsReason.ALLOWED, change, f"{describe(change)} ({pool.name})")


def check(
    proposal: Proposal,
    pool: PoolState | None,
    *,
    mode: Mode,
    rails: Rails,
    history: Sequence[PastAction],
    now: float,
    supported: Collection[ActionKind] = frozenset({ActionKind.SCALE_POOL}),
    paused: str | None = None,
    unsettled: Collection[str] = (),
    finding_id: int | None = None,
    observing: bool = False,
) -> RailsDecision:
    """Decide what may happen to `proposal` (asked for by finding `finding_id`); `history` holds recent
    actions, any pool, `unsettled` the pools whose engines are not all ready; `observing`: asked for an
    advisory, as observe mode asks what `act` would allow."""
    if mode is Mode.OBSERVE:
        return _held(RailsReason.OBSERVE_MODE, "observe mode never acts")
    if not observing:
        # Advice is what observe mode did: once acting, it changed nothing on the fleet, so it was no change that did
        # not help, starts no cooldown and spends none of the hour's budget (a switch from observe to act found the
        # remedies it had advised held as tried for hours, and the budget spent).
        history = [a for a in history if a.state != ActionState.ADVISORY]
    same = [a for a in history if finding_id is not None and a.finding_id == finding_id and a.kind == proposal.kind]
    # A pool's engine settings that did not help: a finding that went with the change and came back with its revert
    # is a new finding, and the change is no more likely to help it. Only for changes that ran, to the pool's
    # settings: a drain of another engine, or a rollback of another revision, is another change.
    tried = [*same, *(a for a in history if finding_id is not None and a.finding_id is not None
                      and a.kind == proposal.kind and a.pool == proposal.pool and a.kind in _SETTINGS
                      and a.state == ActionState.SUCCEEDED)]
    # A proposal rejected or left to expire changed nothing: the problem persisting then says nothing of the change.
    if any(a.outcome == "not_recovered" and a.state not in _NEVER_RAN for a in tried):
        # After a change that did not help (and was undone where it could be), asking again would
        # flap between the change and its revert.
        return _held(RailsReason.TRIED, f"a {proposal.kind} for this finding did not help")
    # Advice is what observe mode did; once acting, advice changed nothing on the fleet.
    made = (ActionState.SUCCEEDED, ActionState.ADVISORY) if observing else (ActionState.SUCCEEDED,)
    if proposal.kind == ActionKind.CORDON_NODE and any(a.state in made for a in same):
        # A fault holds its finding open for an hour whatever the cordon did; the node stays cordoned meanwhile (and
        # advice given once is not given again every verify window; once acting, advice is no cordon).
        return _held(RailsReason.MADE, "the node is cordoned, or advised to be, for this finding already")
    if any(a.state in made and a.outcome is None for a in same):
        # Another change before the last one is judged would stack changes nobody can tell apart.
        return _held(RailsReason.VERIFYING, f"a {proposal.kind} for this finding is still being judged")
    if proposal.kind not in supported:
        return _held(RailsReason.NOT_SUPPORTED, f"the actuator cannot carry out {proposal.kind}")
    if pool is None:
        return _held(RailsReason.UNKNOWN_POOL, f"pool {proposal.pool!r} is not in the fleet file")
    change = proposal.change
    # Stalled (and still short: readiness must hold for a few scrapes before the stall ends), fewer asked than ready.
    if pool.stalled_for is not None and _asks(change, pool) < pool.ready < pool.desired:
        # A stalled pool gives up the engines it waits for before any that serve: down to its ready ones, this time.
        change = ScaleTo(max(pool.ready, pool.min_replicas))
    gate = _gates(proposal.kind, pool, mode=mode, paused=paused, supported=supported, rails=rails, history=history,
                  now=now, unsettled=unsettled, inputs=proposal.inputs, undoing=_undoes_rollout(change, pool),
                  sheds=_sheds(change, pool), scales_down=_scales_down(change, pool))
    if gate is not None:
        return gate
    recent = [a for a in history if now - a.created_at < 3600 and a.state not in _NEVER_RAN]
    if len(recent) >= rails.max_actions_per_hour:
        return _held(RailsReason.RATE_LIMITED,
                     f"{len(recent)} actions in the last hour (limit {rails.max_actions_per_hour})")
    decision = _shape(change, proposal.kind, pool, rails)
    if decision.reason is RailsReason.ALLOWED and mode is Mode.PROPOSE:
        return RailsDecision(RailsReason.NEEDS_APPROVAL, decision.change, decision.note + " (awaiting approval)")
    return decision


def recheck(
    action: DueAction,
    pool: PoolState | None,
    *,
    mode: Mode,
    rails: Rails,
    history: Sequence[PastAction],
    now: float,
    supported: Collection[ActionKind] = frozenset({ActionKind.SCALE_POOL}),
    paused: str | None = None,
    unsettled: Collection[str] = (),
    router_template: str | None = None,
) -> RailsDecision:
    """Decide whether an approved action may run now, on the pool (and the router's template) as it is now.

    ALLOWED runs it; a reason in WAIT_REASONS keeps it approved for a later tick; anything else
    cancels it. The rate limit admitted it when it was proposed and is not counted again.
    """
    kind = ActionKind(action.kind)
    if pool is None:
        return _held(RailsReason.UNKNOWN_POOL, f"pool {action.pool!r} is not in the fleet file any more")
    others = [a for a in history if _bears_on(a, action) and a.state != ActionState.ADVISORY]  # advice changed nothing
    change = change_from_dict(action.params["change"])
    gate = _gates(kind, pool, mode=mode, paused=paused, supported=supported, rails=rails, history=others, now=now,
                  unsettled=unsettled, inputs=action.params.get("inputs", ()),
                  undoing="reverts" in action.params or _undoes_rollout(change, pool),
                  sheds=_sheds(change, pool), scales_down=_scales_down(change, pool))
    if gate is not None:
        return gate
    now_running = rests_on(change, pool, router_template)
    was = action.params.get("from_template")
    if _on_router(change) and was is not None and now_running is None:
        return _held(RailsReason.POOL_UNREADABLE, "the router's pod template cannot be read now: the rollback waits")
    if (kind in _RESTARTS_POOL or isinstance(change, RollBack)) and now_running is not None and was != now_running \
            and not (was is None and "reverts" in action.params):
        # A rollback approved after someone rolled back (or forward) by hand would go back one revision more. One
        # proposed while the template could not be read cannot tell: proposed afresh, it rests on what runs now. Not a
        # revert of the control plane's own change, which nothing would propose again.
        workload = "the router" if _on_router(change) else pool.name
        if was is None:
            return _held(RailsReason.STALE, f"{workload}'s pod template could not be read when {kind} was proposed: "
                                            "whether it changed since cannot be told")
        return _held(RailsReason.STALE, f"{workload}'s pod template changed since {kind} was proposed: what it was "
                                        "computed from is not what runs now")
    if isinstance(change, ScaleTo):
        start = int(action.params["from_replicas"])
        if pool.scaled_by is not None:  # it came after the approval: the change is its to make now
            return _held(RailsReason.SCALED_ELSEWHERE, f"{pool.scaled_by} sets {pool.name}'s replica count now")
        if pool.desired != start:
            return _held(RailsReason.STALE, f"approved as {pool.name} {start} -> {change.replicas}, but {pool.name} is "
                                            f"at {pool.desired} now")
        if not pool.min_replicas <= change.replicas <= pool.max_replicas:
            return _held(RailsReason.AT_LIMIT, f"{change.replicas} replicas is outside {pool.name}'s bounds now "
                                               f"({pool.min_replicas}..{pool.max_replicas})")
        return RailsDecision(RailsReason.ALLOWED, change, f"scale {pool.name} {start} -> {change.replicas}")
    return _shape(change, kind, pool, rails)


def _on_router(change: Change) -> bool:
    return isinstance(change, RollBack) and change.workload == "router"


def rests_on(change: Change, pool: PoolState, router_template: str | None) -> str | None:
    """The digest of the pod template a change rests on: the router's for a rollback of the router, else its pool's."""
    return router_template if _on_router(change) else pool.template


def _bears_on(other: PastAction, action: DueAction) -> bool:
    """Whether `other` is history the rails weigh for `action`, due now: not itself, nor the change it reverts (whose
    cooldown does not hold back its own undoing), nor one of its pool's actions not yet run unless that one is
    approved and due first (reverts first, then in the order they were created)."""
    other_id = getattr(other, "id", None)
    if other is action or (other_id is not None and other_id in (action.id, action.params.get("reverts"))):
        return False
    if other.pool != action.pool or other.state not in (ActionState.PROPOSED, ActionState.APPROVED):
        return True
    return other.state == ActionState.APPROVED and _due_order(other) < _due_order(action)


def _due_order(action: PastAction) -> tuple[bool, float, int]:
    """Which of a pool's approved actions runs first: reverts (the change they undo did not help), then the oldest."""
    params: Mapping[str, Any] = getattr(action, "params", {})
    return "reverts" not in params, action.created_at, int(getattr(action, "id", 0))


def revert_of(kind: ActionKind, change: Change, done: Mapping[str, Any]) -> tuple[ActionKind, Change] | None:
    """The change that undoes a finished one (`done`: what the actuator reported), or None when it is
    not undone automatically: scaling belongs to the autoscaler, and a rollback, a drain or a cordon
    undone would bring back the fault they removed."""
    if isinstance(change, Speculation) and isinstance(done.get("from"), int):
        return ActionKind.TUNE_SPECULATION, Speculation(num_speculative_tokens=done["from"])
    if isinstance(change, Eplb) and change.enabled:
        return ActionKind.DISABLE_EPLB, Eplb(False)
    return None
