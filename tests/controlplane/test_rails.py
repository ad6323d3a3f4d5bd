"""Safety rails for every kind of action: mode and kill switch, what the actuator supports, bounds and
step, in flight, settling, cooldown per kind, one disruptive change in the fleet at a time, blast
radius, rate limit; approved actions checked again when due."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from controlplane.actuators.base import ALL_KINDS
from controlplane.config import Mode, Rails
from controlplane.rails import WAIT_REASONS, RailsReason, check, recheck
from policies.types import (
    ActionKind,
    Change,
    Cordon,
    Drain,
    Eplb,
    PoolState,
    Proposal,
    RollBack,
    ScaleBy,
    ScaleTo,
    Speculation,
    change_as_dict,
)

NOW = 10_000.0
RAILS = Rails(cooldown=300, max_step=1, max_actions_per_hour=3, verify_after=600,
              cooldowns={ActionKind.ENABLE_EPLB: 3600})


@dataclass
class Past:
    pool: str
    state: str
    created_at: float
    finished_at: float | None
    kind: str = "scale_pool"
    finding_id: int | None = None
    outcome: str | None = None


def pool(desired: int = 3, ready: int | None = None, lo: int = 2, hi: int = 6, *, gang: int = 1,
         max_unavailable: int | None = None, name: str = "prefill") -> PoolState:
    return PoolState(name, "prefill", desired, desired if ready is None else ready, lo, hi,
                     gang=gang, max_unavailable=max_unavailable)


def up(delta: int = 1) -> Proposal:
    return Proposal(ActionKind.SCALE_POOL, "prefill", ScaleBy(delta), "test")


def ask(kind: ActionKind, change: Change) -> Proposal:
    return Proposal(kind, "prefill", change, "test")


def decide(proposal: Proposal, state: PoolState | None, *, mode: Mode = Mode.ACT, history: list | None = None,
           paused: str | None = None) -> tuple[RailsReason, Change | None]:
    d = check(proposal, state, mode=mode, rails=RAILS, history=history or [], now=NOW, supported=ALL_KINDS,
              paused=paused)
    return d.reason, d.change


@pytest.mark.parametrize(
    ("mode", "state", "history", "proposal", "reason", "target"),
    [
        pytest.param(Mode.ACT, pool(), [], up(), RailsReason.ALLOWED, 4, id="act-allows"),
        pytest.param(Mode.PROPOSE, pool(), [], up(), RailsReason.NEEDS_APPROVAL, 4, id="propose-waits"),
        pytest.param(Mode.OBSERVE, pool(), [], up(), RailsReason.OBSERVE_MODE, None, id="observe-never-acts"),
        pytest.param(Mode.ACT, None, [], up(), RailsReason.UNKNOWN_POOL, None, id="unknown-pool"),
        pytest.param(Mode.ACT, pool(desired=6), [], up(), RailsReason.AT_LIMIT, None, id="at-max"),
        pytest.param(Mode.ACT, pool(desired=2), [], up(-1), RailsReason.AT_LIMIT, None, id="at-min"),
        pytest.param(Mode.ACT, pool(), [], up(5), RailsReason.ALLOWED, 4, id="step-clamped"),
        pytest.param(Mode.ACT, pool(ready=2), [], up(), RailsReason.POOL_NOT_SETTLED, None, id="not-settled"),
        pytest.param(Mode.ACT, pool(desired=4, ready=2), [], up(-1), RailsReason.POOL_NOT_SETTLED, None,
                     id="settling-holds-a-scale-down"),
        pytest.param(Mode.ACT, replace(pool(desired=4, ready=2), stalled_for=960.0), [], up(-1), RailsReason.ALLOWED,
                     3, id="stalled-lets-a-scale-down-through"),
        pytest.param(Mode.ACT, replace(pool(desired=4, ready=2), stalled_for=960.0), [], up(), RailsReason.POOL_NOT_SETTLED,
                     None, id="stalled-holds-a-scale-up"),
        pytest.param(Mode.ACT, replace(pool(), unreadable="404"), [], up(), RailsReason.POOL_UNREADABLE, None,
                     id="unreadable"),
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
def test_scaling(mode: Mode, state: PoolState | None, history: list, proposal: Proposal, reason: RailsReason,
                 target: int | None) -> None:
    d = check(proposal, state, mode=mode, rails=RAILS, history=history, now=NOW)
    assert (d.reason, d.target_replicas) == (reason, target)
    assert (d.change == ScaleTo(target)) if target else d.change is None


def test_a_stalled_pool_ready_again_scales_as_any_other() -> None:
    # Its stall ends only once readiness has held for a few scrapes; meanwhile a scale-down below its ready count is
    # an ordinary one, not rewritten to the ready count (which is its count, and would be held at its limit).
    recovered = replace(pool(), stalled_for=960.0)
    for proposal in (up(-1), ask(ActionKind.SCALE_POOL, ScaleTo(2))):
        got = check(proposal, recovered, mode=Mode.ACT, rails=RAILS, history=[], now=NOW)
        plain = check(proposal, pool(), mode=Mode.ACT, rails=RAILS, history=[], now=NOW)
        assert (got.reason, got.change) == (plain.reason, plain.change) and got.reason is RailsReason.ALLOWED


def test_an_absolute_target_is_held_to_the_step_and_the_bounds() -> None:
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(9)), pool()) == (RailsReason.ALLOWED, ScaleTo(4))
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(1)), pool()) == (RailsReason.ALLOWED, ScaleTo(2))
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(3)), pool())[0] is RailsReason.AT_LIMIT


def test_a_pool_outside_its_bounds_is_never_moved_against_what_was_asked() -> None:
    # The fleet file's maximum was lowered to 6 under a pool of 8 (or its minimum raised to 2 over a pool of 1).
    assert decide(up(), pool(desired=8))[0] is RailsReason.AT_LIMIT
    assert decide(up(-3), pool(desired=8)) == (RailsReason.ALLOWED, ScaleTo(7))  # down, one step at a time
    assert decide(up(-1), pool(desired=1))[0] is RailsReason.AT_LIMIT
    assert decide(up(3), pool(desired=1)) == (RailsReason.ALLOWED, ScaleTo(2))


def test_a_gang_pool_scales_by_whole_groups() -> None:
    def lws(desired: int, lo: int = 4, hi: int = 16) -> PoolState:
        return pool(desired, lo=lo, hi=hi, gang=4)

    assert decide(up(), lws(8)) == (RailsReason.ALLOWED, ScaleTo(12))  # one engine more is one group more
    assert decide(up(-1), lws(8)) == (RailsReason.ALLOWED, ScaleTo(4))
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(20)), lws(8)) == (RailsReason.ALLOWED, ScaleTo(12))
    assert decide(up(), lws(12, hi=14))[0] is RailsReason.AT_LIMIT  # a 13th and 14th engine make no group
    assert decide(up(-1), lws(4, lo=2))[0] is RailsReason.AT_LIMIT  # the last group stays
    assert decide(up(), lws(4, lo=1, hi=3))[0] is RailsReason.AT_LIMIT  # no whole group fits the bounds
    # A target is a need met in whole groups: 7 engines are two groups, so a pool of 8 keeps them (rounding down
    # halved it to 4, and the next tick's 7 doubled it back), and 5 from 4 is 8.
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(7)), lws(8))[0] is RailsReason.AT_LIMIT
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(5)), lws(4)) == (RailsReason.ALLOWED, ScaleTo(8))
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(3)), lws(8)) == (RailsReason.ALLOWED, ScaleTo(4))


def test_the_rails_see_actions_as_far_back_as_the_longest_cooldown() -> None:
    rails = Rails(cooldown=60, cooldowns={ActionKind.SCALE_POOL: 7200}, proposal_ttl=600, revert_ttl=300,
                  verify_after=300)
    assert rails.history_s == 7200 + 600 + 300
    assert Rails(cooldown=60, proposal_ttl=600, revert_ttl=60, verify_after=300).history_s == 3600 + 600 + 300
    # A revert may run up to revert_ttl after its creation: its cooldown and the change it undoes stay in view.
    assert Rails(cooldown=60, proposal_ttl=600, verify_after=300).history_s == 3600 + 6 * 3600 + 300
    assert Rails().ttl_for({"reverts": 3})[1] == 6 * 3600 and Rails().ttl_for({})[1] == 3600


def test_kinds_the_actuator_cannot_carry_out_are_held_back() -> None:
    d = check(ask(ActionKind.ENABLE_EPLB, Eplb(True)), pool(), mode=Mode.ACT, rails=RAILS, history=[], now=NOW,
              supported={ActionKind.SCALE_POOL})
    assert d.reason is RailsReason.NOT_SUPPORTED and not d.may_record and d.change is None


@pytest.mark.parametrize(("kind", "change"), [
    (ActionKind.ENABLE_EPLB, Eplb(True, num_redundant_experts=4)), (ActionKind.DISABLE_SPECULATION, Speculation(0)),
    (ActionKind.TUNE_SPECULATION, Speculation(step=-1)), (ActionKind.ROLLBACK, RollBack("router")),
    (ActionKind.DRAIN_ENGINE, Drain("prefill-1")), (ActionKind.CORDON_NODE, Cordon("node-7")),
])
def test_every_kind_passes_the_same_rails(kind: ActionKind, change: Change) -> None:
    assert decide(ask(kind, change), pool()) == (RailsReason.ALLOWED, change)
    assert decide(ask(kind, change), pool(), mode=Mode.PROPOSE) == (RailsReason.NEEDS_APPROVAL, change)
    assert decide(ask(kind, change), pool(), mode=Mode.OBSERVE)[0] is RailsReason.OBSERVE_MODE
    assert decide(ask(kind, change), pool(), paused="paused by alice: incident 42")[0] is RailsReason.PAUSED
    assert decide(ask(kind, change), pool(ready=2))[0] is RailsReason.POOL_NOT_SETTLED
    busy = [Past("prefill", "started", NOW - 10, None, kind="scale_pool")]
    assert decide(ask(kind, change), pool(), history=busy)[0] is RailsReason.IN_FLIGHT


def test_cooldown_is_per_kind_and_a_kind_may_have_its_own() -> None:
    scaled = [Past("prefill", "succeeded", NOW - 200, NOW - 100, kind="scale_pool")]
    assert decide(ask(ActionKind.ROLLBACK, RollBack("router")), pool(), history=scaled)[0] is RailsReason.ALLOWED
    assert decide(up(), pool(), history=scaled)[0] is RailsReason.COOLDOWN
    eplb = [Past("prefill", "succeeded", NOW - 1300, NOW - 1200, kind="disable_eplb"),
            Past("prefill", "succeeded", NOW - 1300, NOW - 1200, kind="enable_eplb")]
    assert decide(ask(ActionKind.DISABLE_EPLB, Eplb(False)), pool(), history=eplb)[0] is RailsReason.ALLOWED
    assert decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), pool(), history=eplb)[0] is RailsReason.COOLDOWN


def test_one_disruptive_change_in_the_fleet_at_a_time() -> None:
    rolling = [Past("decode", "started", NOW - 30, None, kind="enable_eplb")]
    assert decide(ask(ActionKind.DISABLE_SPECULATION, Speculation(0)), pool(), history=rolling)[0] is \
        RailsReason.ROLLOUT_IN_FLIGHT
    assert decide(up(), pool(), history=rolling)[0] is RailsReason.ALLOWED  # scaling restarts nothing
    # The change was made, but the other pool's engines are still coming up.
    d = check(ask(ActionKind.ROLLBACK, RollBack("prefill")), pool(), mode=Mode.ACT, rails=RAILS, history=[], now=NOW,
              supported=ALL_KINDS, unsettled=["decode", "prefill"])
    assert d.reason is RailsReason.ROLLOUT_IN_FLIGHT and "decode is still changing" in d.note


def test_a_change_that_would_restart_a_whole_gang_is_refused() -> None:
    """A LeaderWorkerSet of groups of 4: a new pod template restarts 4 engines at once."""
    gang = pool(gang=4, max_unavailable=1)
    reason, _ = decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), gang)
    assert reason is RailsReason.BLAST_RADIUS
    d = check(ask(ActionKind.ENABLE_EPLB, Eplb(True)), gang, mode=Mode.ACT, rails=RAILS, history=[], now=NOW,
              supported=ALL_KINDS)
    assert "restarts 4 engines together" in d.note and "maxUnavailable of 1" in d.note
    assert decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), pool(gang=4, max_unavailable=4))[0] is RailsReason.ALLOWED
    assert decide(up(), gang)[0] is RailsReason.ALLOWED  # adding a group restarts none


def test_a_pool_rolling_out_a_new_template_holds_disruptive_changes_but_still_scales() -> None:
    rolling = replace(pool(), rolling=True)  # a maxSurge rollout: every replica ready, old ones among them
    assert decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), rolling)[0] is RailsReason.ROLLOUT_IN_FLIGHT
    assert decide(up(), rolling) == (RailsReason.ALLOWED, ScaleTo(4))
    d = check(ask(ActionKind.ENABLE_EPLB, Eplb(True)), pool(), mode=Mode.ACT, rails=RAILS, history=[], now=NOW,
              supported=ALL_KINDS, unsettled=["decode"])  # the loop lists a rolling pool as unsettled
    assert d.reason is RailsReason.ROLLOUT_IN_FLIGHT and "decode is still changing" in d.note


def test_the_last_engine_is_never_drained() -> None:
    assert decide(ask(ActionKind.DRAIN_ENGINE, Drain("prefill-0")), pool(desired=1, lo=1))[0] is RailsReason.AT_LIMIT


def test_one_engine_of_a_gang_is_never_drained_alone() -> None:
    reason, _ = decide(ask(ActionKind.DRAIN_ENGINE, Drain("prefill-0-1")), pool(desired=8, gang=4, max_unavailable=8))
    assert reason is RailsReason.BLAST_RADIUS


def test_a_pool_another_controller_scales_is_not_scaled() -> None:
    owned = replace(pool(), scaled_by="HorizontalPodAutoscaler llm/keda-hpa-vllm-prefill")
    assert decide(up(), owned)[0] is RailsReason.SCALED_ELSEWHERE
    assert decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), owned)[0] is RailsReason.ALLOWED


def test_reason_spellings_are_stable() -> None:
    # They are metric label values; dashboards and alerts depend on them.
    assert [r.value for r in RailsReason] == [
        "allowed", "needs_approval", "observe_mode", "unknown_pool", "at_limit", "in_flight", "cooldown",
        "rate_limited", "pool_not_settled", "not_supported", "stale", "paused", "rollout_in_flight", "blast_radius",
        "stale_inputs", "tried", "verifying", "pool_unreadable", "scaled_elsewhere", "made",
    ]


@dataclass
class Due:
    id: int
    kind: str
    pool: str
    state: str
    created_at: float
    finished_at: float | None
    params: dict = field(default_factory=dict)


def due(start: int = 3, target: int = 4, kind: str = "scale_pool", change: Change | None = None) -> Due:
    params = {"from_replicas": start, "change": change_as_dict(change or ScaleTo(target))}
    return Due(7, kind, "prefill", "approved", NOW - 600, None, params)


@pytest.mark.parametrize(
    ("mode", "state", "action", "history", "reason"),
    [
        pytest.param(Mode.PROPOSE, pool(), due(), [], RailsReason.ALLOWED, id="approved-runs"),
        pytest.param(Mode.PROPOSE, pool(desired=4), due(), [], RailsReason.STALE, id="stale-approval"),
        pytest.param(Mode.PROPOSE, pool(hi=3), due(), [], RailsReason.AT_LIMIT, id="bounds-shrank"),
        pytest.param(Mode.PROPOSE, replace(pool(), scaled_by="HorizontalPodAutoscaler llm/hpa"), due(), [],
                     RailsReason.SCALED_ELSEWHERE, id="an-hpa-came-after-the-approval"),
        pytest.param(Mode.OBSERVE, pool(), due(), [], RailsReason.OBSERVE_MODE, id="switched-to-observe"),
        pytest.param(Mode.ACT, None, due(), [], RailsReason.UNKNOWN_POOL, id="pool-removed"),
        pytest.param(Mode.ACT, pool(), due(kind="drain_engine", change=Drain("prefill-0")), [], RailsReason.ALLOWED,
                     id="a-drain-runs"),
        pytest.param(Mode.ACT, pool(ready=2), due(), [], RailsReason.POOL_NOT_SETTLED, id="waits-to-settle"),
        pytest.param(Mode.ACT, replace(pool(ready=2), stalled_for=960.0), due(target=2), [], RailsReason.ALLOWED,
                     id="stalled-runs-an-approved-scale-down"),
        pytest.param(Mode.ACT, replace(pool(ready=2), stalled_for=960.0), due(kind="enable_eplb", change=Eplb(True)),
                     [], RailsReason.POOL_NOT_SETTLED, id="stalled-holds-a-restart"),
        pytest.param(Mode.ACT, replace(pool(ready=2, lo=1), stalled_for=960.0), due(target=1), [],
                     RailsReason.POOL_NOT_SETTLED, id="stalled-holds-an-approved-cut-into-serving-engines"),
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
    decision = recheck(action, state, mode=mode, rails=RAILS, history=history, now=NOW, supported=ALL_KINDS)
    assert decision.reason is reason, decision.note
    if reason is RailsReason.STALE:
        assert decision.note == "approved as prefill 3 -> 4, but prefill is at 4 now"
    assert (reason in WAIT_REASONS) == (reason in (RailsReason.POOL_NOT_SETTLED, RailsReason.IN_FLIGHT,
                                                   RailsReason.COOLDOWN))


@pytest.mark.parametrize(
    ("kind", "change", "was", "now", "reason"),
    [
        pytest.param("tune_speculation", Speculation(step=-1), "t1", "t2", RailsReason.STALE, id="step-on-new-template"),
        pytest.param("tune_speculation", Speculation(step=-1), "t1", "t1", RailsReason.ALLOWED, id="same-template"),
        pytest.param("enable_eplb", Eplb(True), "t1", "t2", RailsReason.STALE, id="eplb-on-new-template"),
        pytest.param("rollback", RollBack("prefill"), "t1", "t2", RailsReason.STALE, id="rolled-by-hand"),
        # Unread when proposed (a timeout, a Rollout's Deployment unreadable): whether a person rolled it since
        # cannot be told, so it is proposed afresh on what runs now.
        pytest.param("tune_speculation", Speculation(step=-1), None, "t2", RailsReason.STALE, id="not-known-then"),
        pytest.param("rollback", RollBack("prefill"), None, "t2", RailsReason.STALE, id="rollback-not-known-then"),
        pytest.param("rollback", RollBack("prefill"), None, None, RailsReason.ALLOWED, id="never-known"),
        pytest.param("tune_speculation", Speculation(step=-1), "t1", None, RailsReason.ALLOWED, id="not-known-now"),
        pytest.param("drain_engine", Drain("prefill-0"), "t1", "t2", RailsReason.ALLOWED, id="a-drain-restarts-one"),
    ],
)
def test_an_approved_restart_on_a_template_changed_since_is_stale(kind: str, change: Change, was: str | None,
                                                                   now: str | None, reason: RailsReason) -> None:
    # A person approves "lower the drafts by one" an hour late, after someone lowered them by hand: the step would go
    # one further than anyone asked. Scaling is judged on its replica count instead.
    action = due(kind=kind, change=change)
    if was is not None:
        action.params["from_template"] = was

    decision = recheck(action, replace(pool(), template=now), mode=Mode.PROPOSE, rails=RAILS, history=[action],
                       now=NOW, supported=ALL_KINDS)
    assert decision.reason is reason, decision.note
    assert reason not in WAIT_REASONS


def test_a_revert_proposed_while_the_template_was_unread_still_runs() -> None:
    """Cancelled, nothing would propose it again, and the control plane's own change it undoes would stay."""
    action = due(kind="tune_speculation", change=Speculation(step=1))
    action.params["reverts"] = 3
    decision = recheck(action, replace(pool(), template="t2"), mode=Mode.ACT, rails=RAILS, history=[action], now=NOW,
                       supported=ALL_KINDS)
    assert decision.reason is RailsReason.ALLOWED, decision.note


def test_a_router_rollback_is_judged_on_the_routers_template_not_the_pools() -> None:
    action = due(kind="rollback", change=RollBack("router"))
    action.params["from_template"] = "r1"
    moved = replace(pool(), template="t2")

    def judge(router: str | None) -> RailsReason:
        return recheck(action, moved, mode=Mode.PROPOSE, rails=RAILS, history=[action], now=NOW, supported=ALL_KINDS,
                       router_template=router).reason

    # Someone rolled the router back by hand meanwhile: one more would put the bad revision back.
    assert judge("r2") is RailsReason.STALE
    assert judge("r1") is RailsReason.ALLOWED
    assert judge(None) is RailsReason.POOL_UNREADABLE in WAIT_REASONS, "unread now: it waits, it is not run blind"
    # Unread when it was proposed, readable now: a hand rollback meanwhile cannot be ruled out.
    del action.params["from_template"]
    assert judge("r2") is RailsReason.STALE


def test_approved_actions_of_one_pool_run_in_the_order_they_were_created() -> None:
    # Each sees the other approved: without an order, each would wait for the other until both expired.
    first = due(kind="enable_eplb", change=Eplb(True))
    later = Due(8, "tune_speculation", "prefill", "approved", NOW - 300, None,
                {"from_replicas": 3, "change": change_as_dict(Speculation(2))})
    both = [first, later]
    run = recheck(first, pool(), mode=Mode.ACT, rails=RAILS, history=both, now=NOW, supported=ALL_KINDS)
    wait = recheck(later, pool(), mode=Mode.ACT, rails=RAILS, history=both, now=NOW, supported=ALL_KINDS)
    assert (run.reason, wait.reason) == (RailsReason.ALLOWED, RailsReason.IN_FLIGHT)


def test_a_revert_goes_first_and_nothing_awaiting_a_person_holds_an_approval() -> None:
    older = due(kind="enable_eplb", change=Eplb(True))  # approved, created first
    revert = Due(9, "tune_speculation", "prefill", "approved", NOW - 60, None,
                 {"from_replicas": 3, "change": change_as_dict(Speculation(3)), "reverts": 4})
    asked = Due(10, "scale_pool", "prefill", "proposed", NOW - 900, None,
                {"from_replicas": 3, "change": change_as_dict(ScaleTo(4))})
    history = [older, revert, asked]

    def judge(action: Due) -> RailsReason:
        return recheck(action, pool(), mode=Mode.ACT, rails=RAILS, history=history, now=NOW, supported=ALL_KINDS).reason

    assert (judge(revert), judge(older)) == (RailsReason.ALLOWED, RailsReason.IN_FLIGHT)
    # A scale is not held by another kind's change that waits (it restarts no engine), only by one running.
    assert decide(up(), pool(), history=[revert])[0] is RailsReason.ALLOWED
    assert decide(up(), pool(), history=[replace(revert, state="started")])[0] is RailsReason.IN_FLIGHT
    assert decide(ask(ActionKind.ENABLE_EPLB, Eplb(True)), pool(), history=[revert])[0] is RailsReason.IN_FLIGHT


@pytest.mark.parametrize("state", [pool(ready=2), replace(pool(), rolling=True)], ids=["not-settled", "rolling"])
def test_a_revert_is_not_held_by_its_own_pools_rollout(state: PoolState) -> None:
    # A change whose pods crash-loop keeps the pool from settling: only its revert can settle it.
    change = Speculation(3)
    plain = due(kind="tune_speculation", change=change)
    revert = due(kind="tune_speculation", change=change)
    revert.params["reverts"] = 5
    held = recheck(plain, state, mode=Mode.ACT, rails=RAILS, history=[plain], now=NOW, supported=ALL_KINDS)
    assert held.reason in (RailsReason.POOL_NOT_SETTLED, RailsReason.ROLLOUT_IN_FLIGHT)
    assert recheck(revert, state, mode=Mode.ACT, rails=RAILS, history=[revert], now=NOW,
                   supported=ALL_KINDS).reason is RailsReason.ALLOWED
    # Another pool's rollout still holds it: one pool at a time.
    assert recheck(revert, pool(), mode=Mode.ACT, rails=RAILS, history=[revert], now=NOW, supported=ALL_KINDS,
                   unsettled=["decode"]).reason is RailsReason.ROLLOUT_IN_FLIGHT


@pytest.mark.parametrize("state", [replace(pool(), rolling=True), replace(pool(ready=4), rolling=True), pool(ready=2)],
                         ids=["canary-paused", "surging", "new-pods-crash-looping"])
def test_a_pool_rolls_back_its_own_rollout(state: PoolState) -> None:
    # A canary is judged only while its pool is mid-rollout: that rollout must not hold the rollback it calls for.
    rollback = ask(ActionKind.ROLLBACK, RollBack("prefill"))
    assert decide(rollback, state) == (RailsReason.ALLOWED, RollBack("prefill"))
    approved = due(kind="rollback", change=RollBack("prefill"))
    assert recheck(approved, state, mode=Mode.ACT, rails=RAILS, history=[approved], now=NOW,
                   supported=ALL_KINDS).reason is RailsReason.ALLOWED
    # Another pool changing still holds it (one pool at a time), and so does the pool's own rollout a rollback of
    # another workload (the router) would not undo.
    assert check(rollback, state, mode=Mode.ACT, rails=RAILS, history=[], now=NOW, supported=ALL_KINDS,
                 unsettled=["decode"]).reason is RailsReason.ROLLOUT_IN_FLIGHT
    assert decide(ask(ActionKind.ROLLBACK, RollBack("router")), state)[0] in (
        RailsReason.ROLLOUT_IN_FLIGHT, RailsReason.POOL_NOT_SETTLED)


def test_no_pool_sheds_engines_while_another_pools_cordon_moves_engines_off_a_node() -> None:
    # The cordon has taken this pool's engines on the node out of routing too, and waits for them to go idle: a
    # scale-down would take those idle ones as its own.
    cordoning = [Past("decode", "started", NOW - 30, None, kind="cordon_node")]
    d = check(ask(ActionKind.SCALE_POOL, ScaleTo(2)), pool(), mode=Mode.ACT, rails=RAILS, history=cordoning, now=NOW,
              supported=ALL_KINDS)
    assert d.reason is RailsReason.IN_FLIGHT and "cordon asked by decode" in d.note
    assert recheck(due(target=2), pool(), mode=Mode.ACT, rails=RAILS, history=cordoning, now=NOW,
                   supported=ALL_KINDS).reason is RailsReason.IN_FLIGHT
    # A scale-up replaces what the cordon evicts; once it ended, the scale-down runs.
    assert decide(up(), pool(), history=cordoning)[0] is RailsReason.ALLOWED
    ended = [Past("decode", "succeeded", NOW - 300, NOW - 30, kind="cordon_node")]
    assert decide(ask(ActionKind.SCALE_POOL, ScaleTo(2)), pool(), history=ended)[0] is RailsReason.ALLOWED


def test_a_due_action_waits_while_paused_and_runs_once_resumed() -> None:
    action = due()
    held = recheck(action, pool(), mode=Mode.ACT, rails=RAILS, history=[action], now=NOW, supported=ALL_KINDS,
                   paused="paused by bob: maintenance")
    assert held.reason is RailsReason.PAUSED and held.reason in WAIT_REASONS and "maintenance" in held.note
    ran = recheck(action, pool(), mode=Mode.ACT, rails=RAILS, history=[action], now=NOW, supported=ALL_KINDS)
    assert ran.reason is RailsReason.ALLOWED


@pytest.mark.parametrize(("state", "cools", "counts"), [
    ("unknown", True, True), ("dry_run", True, True), ("failed", True, True), ("succeeded", True, True),
    ("rejected", True, False), ("expired", False, False), ("cancelled", False, False),
    ("advisory", False, False)])
def test_unknown_and_finished_actions_in_the_history(state: str, cools: bool, counts: bool) -> None:
    """An action that may have touched the fleet (unknown included) starts the cooldown and counts
    against the rate limit; a rejection only starts the cooldown; expired and cancelled do neither, nor, once acting,
    does observe mode's advice (the hour before a switch to act spent its budget)."""
    history = [Past("prefill", state, NOW - 120, NOW - 60)]
    decision = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=history, now=NOW)
    assert decision.reason is (RailsReason.COOLDOWN if cools else RailsReason.ALLOWED)
    elsewhere = [Past("decode", state, NOW - 120 * i, NOW - 60 * i) for i in range(1, 4)]
    decision = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=elsewhere, now=NOW)
    assert decision.reason is (RailsReason.RATE_LIMITED if counts else RailsReason.ALLOWED)


@pytest.mark.parametrize(
    ("stale", "inputs", "held"),
    [
        pytest.param({"vllm": "target prefill/p-1/vllm is down"}, ("requests_waiting",), True, id="producer-down"),
        pytest.param({"requests_waiting": "p-1 has been 7 for 16 min"}, ("requests_waiting",), True, id="frozen"),
        pytest.param({"ttft_p95": "no series match"}, ("ttft_{q}", "requests_waiting"), False,
                     id="a-family-name-is-not-its-member"),
        pytest.param({"vllm": "target prefill/p-1/vllm is down"}, ("gpu_xid_last",), False,
                     id="dcgm-signals-go-on-while-vllm-is-down"),
        pytest.param({"dcgm": "target prefill/node-1/dcgm is down"}, ("gpu_xid_last",), True, id="dcgm-down"),
        pytest.param({}, ("requests_waiting",), False, id="fresh"),
    ],
)
def test_stale_inputs_hold_what_rests_on_them(stale: dict[str, str], inputs: tuple[str, ...], held: bool) -> None:
    state = PoolState("prefill", "prefill", 3, 3, 2, 6, stale_inputs=stale)
    proposal = Proposal(ActionKind.SCALE_POOL, "prefill", ScaleBy(1), "test", inputs=inputs)
    reason, change = decide(proposal, state)
    assert (reason is RailsReason.STALE_INPUTS) is held
    if held:
        assert change is None and RailsReason.STALE_INPUTS in WAIT_REASONS
        due = Due(1, "scale_pool", "prefill", "approved", NOW - 10, None,
                  {"change": change_as_dict(ScaleTo(4)), "from_replicas": 3, "inputs": list(inputs)})
        again = recheck(due, state, mode=Mode.ACT, rails=RAILS, history=[], now=NOW, supported=ALL_KINDS)
        assert again.reason is RailsReason.STALE_INPUTS and "stale" in again.note, "an approved action waits too"


@pytest.mark.parametrize(
    ("earlier", "reason"),
    [
        pytest.param(Past("prefill", "succeeded", NOW - 900, NOW - 800, finding_id=5), RailsReason.VERIFYING,
                     id="still-being-judged"),
        pytest.param(Past("prefill", "succeeded", NOW - 900, NOW - 800, finding_id=5, outcome="not_recovered"),
                     RailsReason.TRIED, id="did-not-help"),
        pytest.param(Past("prefill", "succeeded", NOW - 900, NOW - 800, finding_id=5, outcome="recovered"),
                     RailsReason.ALLOWED, id="helped-then-came-back"),
        # Left to expire, it changed nothing: the problem persisting says nothing of the change.
        pytest.param(Past("prefill", "expired", NOW - 4500, NOW - 900, finding_id=5, outcome="not_recovered"),
                     RailsReason.ALLOWED, id="expired-is-not-tried"),
        pytest.param(Past("prefill", "succeeded", NOW - 900, NOW - 800, finding_id=6), RailsReason.ALLOWED,
                     id="another-finding"),
    ],
)
def test_one_change_per_finding_until_it_is_judged(earlier: Past, reason: RailsReason) -> None:
    d = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=[earlier], now=NOW, supported=ALL_KINDS, finding_id=5)
    assert d.reason is reason


@pytest.mark.parametrize(("observing", "reason"), [(True, RailsReason.VERIFYING), (False, RailsReason.ALLOWED)])
def test_an_advisory_holds_the_next_one_only_while_observing(observing: bool, reason: RailsReason) -> None:
    # Observing, the next advice waits for this one's judging as a change would; acting, advice changed nothing.
    advised = Past("prefill", "advisory", NOW - 900, NOW - 800, finding_id=5)
    d = check(up(), pool(), mode=Mode.ACT, rails=RAILS, history=[advised], now=NOW, supported=ALL_KINDS, finding_id=5,
              observing=observing)
    assert d.reason is reason


@pytest.mark.parametrize(("state", "finding_id", "observing", "reason"), [
    ("succeeded", 5, False, RailsReason.MADE),  # judged held, and the fault's finding still open
    ("advisory", 5, True, RailsReason.MADE),  # observing: advised once, not every verify window
    ("advisory", 5, False, RailsReason.ALLOWED),  # acting now: advice given while observing cordoned nothing
    ("failed", 5, False, RailsReason.ALLOWED),  # not made: asked again
    ("succeeded", 6, False, RailsReason.ALLOWED),  # an earlier fault, resolved (the card replaced, the node uncordoned)
])
def test_a_cordon_made_for_a_finding_is_not_made_again(state: str, finding_id: int, observing: bool,
                                                       reason: RailsReason) -> None:
    outcome = "held" if state in ("succeeded", "advisory") else None
    earlier = Past("prefill", state, NOW - 9000, NOW - 8900, kind="cordon_node", finding_id=finding_id, outcome=outcome)
    d = check(ask(ActionKind.CORDON_NODE, Cordon("node-a")), pool(), mode=Mode.ACT, rails=RAILS, history=[earlier],
              now=NOW, supported=ALL_KINDS, finding_id=5, observing=observing)
    assert d.reason is reason, d.note


@pytest.mark.parametrize(("kind", "change", "reason"), [
    # Speculation switched down did not help finding 6, which then went away; finding 5 came back with the revert.
    ("tune_speculation", Speculation(step=-2), RailsReason.TRIED),
    ("drain_engine", Drain("prefill-2"), RailsReason.ALLOWED),  # another engine's drain is another change
])
def test_an_engine_setting_that_did_not_help_is_not_tried_again_on_the_pool(kind: str, change: Change,
                                                                             reason: RailsReason) -> None:
    earlier = Past("prefill", "succeeded", NOW - 900, NOW - 800, kind=kind, finding_id=6, outcome="not_recovered")
    d = check(ask(ActionKind(kind), change), pool(), mode=Mode.ACT, rails=RAILS, history=[earlier], now=NOW,
              supported=ALL_KINDS, finding_id=5)
    assert d.reason is reason, d.note


def test_a_stalled_pool_gives_up_the_engines_it_waits_for_first() -> None:
    # 6 asked for, 2 ready for 16 minutes: asked to go to 1, it goes to its 2 ready engines this time.
    stalled = replace(pool(desired=6, ready=2, lo=1), stalled_for=960.0)
    wide = RAILS.model_copy(update={"max_step": 8})
    d = check(ask(ActionKind.SCALE_POOL, ScaleTo(1)), stalled, mode=Mode.ACT, rails=wide, history=[], now=NOW,
              supported=ALL_KINDS)
    assert d.reason is RailsReason.ALLOWED and d.change == ScaleTo(2), d.note
