"""Safety rails: mode, bounds, step, in-flight, cooldown, settle and rate limit; approved actions checked again when due."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from controlplane.config import Mode, Rails
from controlplane.rails import WAIT_REASONS, RailsReason, check, recheck
from policies.types import ActionKind, PoolState, Proposal

NOW = 10_000.0
RAILS = Rails(cooldown=300, max_step=1, max_actions_per_hour=3, verify_after=600)


@dataclass
class Past:
    pool: str
    state: str
    created_at: float
    finished_at: float | None


def pool(desired: int = 3, ready: int | None = None, lo: int = 2, hi: int = 6) -> PoolState:
    return PoolState("prefill", "prefill", desired, desired if ready is None else ready, lo, hi)


def up(delta: int = 1) -> Proposal:
    return Proposal(ActionKind.SCALE_POOL, "prefill", delta, "test")


@pytest.mark.parametrize(
    ("mode", "state", "history", "proposal", "reason", "target"),
    [
        pytest.param(Mode.ACT, pool(), [], up(), RailsReason.ALLOWED, 4, id="act-allows"),
        pytest.param(Mode.PROPOSE, pool(), [], up(), RailsReason.NEEDS_APPROVAL, 4, id="propose-waits"),
        pytest.param(Mode.OBSERVE, pool(), [], up(), RailsReason.OBSERVE_MODE, None, id="observe-never-acts"),
        pytest.param(Mode.ACT, None, [], up(), RailsReason.UNKNOWN_POOL, None, id="unknown-pool"),
        pytest.param(Mode.ACT, pool(), [], Proposal(ActionKind.DRAIN_ENGINE, "prefill", 0, "x"),
                     RailsReason.NOT_SUPPORTED, None, id="no-actuator-for-drain"),
        pytest.param(Mode.ACT, pool(desired=6), [], up(), RailsReason.AT_LIMIT, None, id="at-max"),
        pytest.param(Mode.ACT, pool(desired=2), [], up(-1), RailsReason.AT_LIMIT, None, id="at-min"),
        pytest.param(Mode.ACT, pool(), [], up(5), RailsReason.ALLOWED, 4, id="step-clamped"),
        pytest.param(Mode.ACT, pool(ready=2), [], up(), RailsReason.POOL_NOT_SETTLED, None, id="not-settled"),
        pytest.param(Mode.ACT, pool(), [Past("prefill", "started", NOW - 10, None)], up(), RailsReason.IN_FLIGHT,
                     None, id="in-flight"),
        pytest.param(Mode.ACT, pool(), [Past("prefill", "succeeded", NOW - 200, NOW - 100)], up(),
                     RailsReason.COOLDOWN, None, id="cooldown"),
        pytest.param(Mode.ACT, pool(), [Past("prefill", "succeeded", NOW - 900, NOW - 800)], up(),
                     RailsReason.ALLOWED, 4, id="cooldown-over"),
        pytest.param(Mode.ACT, pool(), [Past("decode", "succeeded", NOW - 60 * i, NOW - 60 * i) for i in range(1, 4)],
                     up(), RailsReason.RATE_LIMITED, None, id="rate-limited"),
        pytest.param(Mode.ACT, pool(), [Past("decode", "rejected", NOW - 60 * i, NOW - 60 * i) for i in range(1, 4)],
                     up(), RailsReason.ALLOWED, 4, id="rejected-do-not-count"),
    ],
)
def test_rails(mode: Mode, state: PoolState | None, history: list, proposal: Proposal, reason: RailsReason,
               target: int | None) -> None:
    decision = check(proposal, state, mode=mode, rails=RAILS, history=history, now=NOW)
    assert (decision.reason, decision.target_replicas) == (reason, target)


def test_reason_spellings_are_stable() -> None:
    # They are metric label values; dashboards and alerts depend on them.
    assert [r.value for r in RailsReason] == [
        "allowed", "needs_approval", "observe_mode", "unknown_pool", "at_limit", "in_flight", "cooldown",
        "rate_limited", "pool_not_settled", "not_supported", "stale",
    ]


@dataclass
class Due:
    id: int
    kind: str
    pool: str
    state: str
    created_at: float
    finished_at: float | None
    params: dict


def due(start: int = 3, target: int = 4, kind: str = "scale_pool") -> Due:
    return Due(7, kind, "prefill", "approved", NOW - 600, None, {"from_replicas": start, "replicas": target})


@pytest.mark.parametrize(
    ("mode", "state", "action", "history", "reason"),
    [
        pytest.param(Mode.PROPOSE, pool(), due(), [], RailsReason.ALLOWED, id="approved-runs"),
        pytest.param(Mode.PROPOSE, pool(desired=4), due(), [], RailsReason.STALE, id="stale-approval"),
        pytest.param(Mode.PROPOSE, pool(hi=3), due(), [], RailsReason.AT_LIMIT, id="bounds-shrank"),
        pytest.param(Mode.OBSERVE, pool(), due(), [], RailsReason.OBSERVE_MODE, id="switched-to-observe"),
        pytest.param(Mode.ACT, None, due(), [], RailsReason.UNKNOWN_POOL, id="pool-removed"),
        pytest.param(Mode.ACT, pool(), due(kind="drain_engine"), [], RailsReason.NOT_SUPPORTED, id="unsupported"),
        pytest.param(Mode.ACT, pool(ready=2), due(), [], RailsReason.POOL_NOT_SETTLED, id="waits-to-settle"),
        pytest.param(Mode.ACT, pool(), due(), [Past("prefill", "started", NOW - 10, None)], RailsReason.IN_FLIGHT,
                     id="waits-for-another"),
        pytest.param(Mode.ACT, pool(), due(), [Past("prefill", "unknown", NOW - 200, NOW - 100)], RailsReason.COOLDOWN,
                     id="unknown-cools-down"),
        pytest.param(Mode.ACT, pool(), due(), [Past("decode", "succeeded", NOW - 60 * i, NOW - 60 * i)
                                              for i in range(1, 4)], RailsReason.ALLOWED, id="rate-admitted-once"),
    ],
)
def test_recheck_when_an_approved_action_is_due(mode: Mode, state: PoolState | None, action: Due, history: list,
                                                reason: RailsReason) -> None:
    history = [*history, action]  # the due action is in the history it is judged against
    decision = recheck(action, state, mode=mode, rails=RAILS, history=history, now=NOW)
    assert decision.reason is reason, decision.note
    assert (decision.target_replicas == action.params["replicas"]) == (reason is RailsReason.ALLOWED)
    if reason is RailsReason.STALE:
        assert decision.note == "approved as prefill 3 -> 4, but prefill is at 4 now"
    assert (reason in WAIT_REASONS) == (reason in (RailsReason.POOL_NOT_SETTLED, RailsReason.IN_FLIGHT,
                                                   RailsReason.COOLDOWN))


@pytest.mark.parametrize(("state", "cools", "counts"), [
    ("unknown", True, True), ("dry_run", True, True), ("failed", True, True), ("succeeded", True, True),
    ("rejected", True, False), ("expired", False, False), ("cancelled", False, False)])
def test_unknown_and_finished_actions_in_the_history(state: str, cools: bool, counts: bool) -> None:
    """An action that may have touched the fleet (unknown included) starts the cooldown and counts
    against the rate limit; a rejection only starts the cooldown; expired and cancelled do neither."""
    history = [Past("prefill", state, NOW - 120, NOW - 60)]
    decision = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=history, now=NOW)
    assert decision.reason is (RailsReason.COOLDOWN if cools else RailsReason.ALLOWED)
    elsewhere = [Past("decode", state, NOW - 120 * i, NOW - 60 * i) for i in range(1, 4)]
    decision = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=elsewhere, now=NOW)
    assert decision.reason is (RailsReason.RATE_LIMITED if counts else RailsReason.ALLOWED)
