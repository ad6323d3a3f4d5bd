"""The loop's audited path from a proposal to the actuator, on the in-memory store in virtual time.

Covers: a control plane taking over an action another one left started (applied: done, not
repeated; not applied: carried out once; waiting: resumed from the audit log; cannot tell:
unknown); the kill switch holding an action that would run; a finding that flaps getting no more
actions than the cooldown and the rate limit allow; a stale approval (the pool moved between
approval and run) is cancelled, not applied; an approval racing the execution of another control
plane starts the action once; a dry-run actuator's action ends `dry_run`, never `succeeded`; any
exception from an actuator is a failed action with its message and the loop goes on; undecided
proposals expire after the TTL; an approved action waits while the pool settles, and a pool that
does not settle (stalled) may still be scaled down.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from collectors.types import ScrapeResult, Target, TargetHealth
from controlplane.actions import ActionState as S
from controlplane.actuators.base import FleetView, Order, PoolReplicas
from controlplane.clock import VirtualClock
from controlplane.config import Mode, parse_config
from controlplane.errors import ActuationError, StoreConflict, StoreUnavailable
from controlplane.killswitch import StoreSwitch
from controlplane.loop import ControlLoop, _touched
from controlplane.observe import Observation
from controlplane.store.memory import MemoryStore
from controlplane.store.records import ActionRecord, NewAction, NewVerdict, Pause
from controlplane.telemetry import Telemetry
from policies.autoscale import PoolPlan
from policies.inputs import StaleInputs
from policies.settling import PoolStalled
from policies.types import (
    ActionKind,
    Cordon,
    Drain,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    PoolState,
    Proposal,
    RollBack,
    ScaleBy,
    ScaleTo,
    Severity,
    Speculation,
    change_as_dict,
)

FLEET = """
mode: {mode}
pools: [{{name: prefill, role: prefill, model: m, replicas: {{min: 1, max: 8}}}}]
rails: {{cooldown: 60s, proposal_ttl: 10m, verify_after: 5m}}
"""


class NoMetrics:
    """No signals; `down` makes the pool's one vLLM target fail its scrapes."""

    def __init__(self) -> None:
        self.down = 0  # consecutive failures so far

    async def observe(self, now: float) -> Observation:
        if not self.down:
            return Observation()
        target = Target(url="http://prefill-0:8000/metrics", pool="prefill", pod="prefill-0")
        self.down += 1
        return Observation(results=[ScrapeResult(target, now, ok=False, error="connection refused")],
                           health={target.key: TargetHealth(consecutive_failures=self.down - 1)})


class Asks:
    """A policy that, while `on`, keeps a finding open that asks for one more prefill replica."""

    kind = "test"
    reads = ("requests_waiting",)

    def __init__(self) -> None:
        self.on = False

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        key = FindingKey("test", "pool/prefill")
        if not self.on:
            return PolicyResult(resolved=[(key, "gone")] if key in inp.open_findings else [])
        proposal = Proposal(ActionKind.SCALE_POOL, "prefill", ScaleBy(1), "more prefill")
        return PolicyResult([FindingReport(key, Severity.WARNING, "needs more", "load", {}, "test", (proposal,))])


@dataclass
class Pools:
    """A fleet of one pool that a test can move under the loop's feet."""

    desired: int = 3
    ready: int = 3
    calls: list[int] = field(default_factory=list)
    carried: list[Order] = field(default_factory=list)  # the orders `carry_out` got
    name: str = "fake"
    dry_run: bool = False
    error: Exception | None = None
    kinds: frozenset[ActionKind] = frozenset({ActionKind.SCALE_POOL})
    already: Mapping[str, Any] | bool | None = None  # what `applied` answers
    waits: list[dict[str, Any]] = field(default_factory=list)  # the waits `resume` was called with
    resumed: list[Order] = field(default_factory=list)  # and the orders, with the loop's view of the engines
    hold: bool = False  # `resume` keeps waiting
    template: str | None = None  # the pod template's digest
    router_template: str | None = None
    rolling: bool = False  # a new pod template rolling out
    changed_at: dict[str, float] = field(default_factory=dict)  # when each workload last changed revision, as read

    async def observe(self) -> FleetView:
        return FleetView({"prefill": PoolReplicas(self.desired, self.ready, template=self.template,
                                                  rolling=self.rolling)}, dict(self.changed_at),
                         router_template=self.router_template)

    async def carry_out(self, order: Order) -> dict[str, Any]:
        assert isinstance(order.change, ScaleTo)
        self.calls.append(order.change.replicas)
        self.carried.append(order)
        if self.error is not None:
            raise self.error
        if not self.dry_run:
            self.desired = self.ready = order.change.replicas
        return {"replicas": order.change.replicas}

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        self.waits.append(wait)
        self.resumed.append(order)
        return {"wait": wait} if self.hold else {"drained": wait["pods"]}

    async def applied(self, order: Order) -> Mapping[str, Any] | bool | None:
        return self.already


def make_loop(mode: Mode, store: MemoryStore, pools: Pools, clock: VirtualClock, policy: Asks,
              source: NoMetrics | None = None) -> ControlLoop:
    cfg = parse_config(FLEET.format(mode=mode))
    return ControlLoop(config=cfg, source=source or NoMetrics(), store=store, policies=[policy, StaleInputs()],
                       actuator=pools, clock=clock, telemetry=Telemetry())


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


async def tick(loop: ControlLoop, clock: VirtualClock, seconds: float = 15.0) -> None:
    clock.advance(seconds)
    await loop.tick()


async def proposed(clock: VirtualClock, pools: Pools) -> tuple[MemoryStore, Pools, Asks, ControlLoop, ActionRecord]:
    """A propose-mode loop over `pools` whose policy asked for more replicas once: its store, pools, policy, loop and
    the proposal."""
    store, policy = MemoryStore(), Asks()
    loop = make_loop(Mode.PROPOSE, store, pools, clock, policy)
    policy.on = True
    await tick(loop, clock)
    [proposal] = await store.actions()
    return store, pools, policy, loop, proposal


async def test_a_stale_approval_is_cancelled_not_applied(clock: VirtualClock) -> None:
    store, pools, _, loop, proposal = await proposed(clock, Pools())
    assert (proposal.state, proposal.params["from_replicas"], proposal.params["replicas"]) == (S.PROPOSED, 3, 4)
    pools.desired = pools.ready = 4  # someone scaled by hand meanwhile
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    await tick(loop, clock)
    [action] = await store.actions(states=[S.CANCELLED])
    assert pools.calls == [] and pools.desired == 4, "a 3 -> 4 approval never becomes 4 -> 5"
    [event] = [e for e in store.action_events(action.id) if e.event == "cancelled"]
    assert event.detail["rails"] == "stale" and "at 4 now" in event.detail["why"]


async def test_an_order_carries_what_its_action_was_approved_from(clock: VirtualClock) -> None:
    # The actuator checks it again on the object it writes: a change made by hand within the tick is not undone.
    store, pools, _, loop, proposal = await proposed(clock, Pools(template="t1"))
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    await tick(loop, clock)
    [order] = pools.carried
    assert (order.change, order.from_replicas, order.from_template) == (ScaleTo(4), 3, "t1")


class AsksFewerDrafts(Asks):
    """Asks for one draft token fewer (acceptance per position unknown: a step, not a number)."""

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        proposal = Proposal(ActionKind.TUNE_SPECULATION, "prefill", Speculation(step=-1), "fewer drafts")
        return PolicyResult([FindingReport(FindingKey("test", "pool/prefill"), Severity.WARNING, "collapse", "", {},
                                           "test", (proposal,))])


async def test_an_approval_for_a_template_changed_since_is_cancelled(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools(template="t1", kinds=frozenset({ActionKind.TUNE_SPECULATION}))
    loop = make_loop(Mode.PROPOSE, store, pools, clock, AsksFewerDrafts())
    await tick(loop, clock)
    [proposal] = await store.actions()
    assert proposal.params["from_template"] == "t1"
    pools.template = "t2"  # someone lowered the drafts by hand meanwhile
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    await tick(loop, clock)
    [action] = await store.actions(states=[S.CANCELLED])
    [event] = [e for e in store.action_events(action.id) if e.event == "cancelled"]
    assert event.detail["rails"] == "stale" and "pod template changed" in event.detail["why"]


class AsksRouterBack(Asks):
    """Asks for the router's previous revision."""

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        proposal = Proposal(ActionKind.ROLLBACK, "prefill", RollBack("router"), "bad router push")
        return PolicyResult([FindingReport(FindingKey("test", "pool/prefill"), Severity.WARNING, "drop", "", {},
                                           "test", (proposal,))])


async def test_a_router_rollback_approved_after_a_hand_rollback_is_cancelled(clock: VirtualClock) -> None:
    store = MemoryStore()
    pools = Pools(template="t1", router_template="r1", kinds=frozenset({ActionKind.ROLLBACK}))
    loop = make_loop(Mode.PROPOSE, store, pools, clock, AsksRouterBack())
    await tick(loop, clock)
    [proposal] = await store.actions()
    assert proposal.params["from_template"] == "r1", "the router's template, not the pool's"
    pools.router_template = "r0"  # someone ran `kubectl rollout undo` on the router meanwhile
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    await tick(loop, clock)
    [action] = await store.actions(states=[S.CANCELLED])
    [event] = [e for e in store.action_events(action.id) if e.event == "cancelled"]
    assert event.detail["rails"] == "stale" and "the router's pod template changed" in event.detail["why"]


async def test_an_approved_action_waits_while_the_pool_settles(clock: VirtualClock) -> None:
    store, pools, _, loop, proposal = await proposed(clock, Pools())
    pools.ready = 2  # an engine restarts
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.APPROVED and pools.calls == []
    pools.ready = 3
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.SUCCEEDED and pools.calls == [4]


async def test_two_control_planes_start_an_approved_action_once(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    first = make_loop(Mode.PROPOSE, store, pools, clock, policy)
    second = make_loop(Mode.PROPOSE, store, pools, clock, Asks())  # a second replica that proposes nothing itself
    policy.on = True
    await tick(first, clock)
    [proposal] = await store.actions()
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="dashboard")
    clock.advance(15.0)
    await asyncio.gather(first.tick(), second.tick())
    assert pools.calls == [4], "the actuator ran exactly once"
    events = [e.event for e in store.action_events(proposal.id)]
    assert events == ["proposed", "approved", "started", "succeeded"]


async def test_a_dry_run_never_reads_as_succeeded(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(name="dry_run", dry_run=True), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    policy.on = True
    await tick(loop, clock)
    [action] = await store.actions()
    assert (action.state, action.actuator, action.dry_run) == (S.DRY_RUN, "dry_run", True)
    assert pools.calls == [4] and pools.desired == 3
    await tick(loop, clock, 600.0)
    assert (await store.actions())[0].outcome is None  # nothing was changed, so nothing is judged


@pytest.mark.parametrize(("error", "message"), [
    (ActuationError("the API refused: 422 replicas must be >= 0"), "the API refused: 422 replicas must be >= 0"),
    (KeyError("spec"), "KeyError: 'spec'"),
    (TimeoutError("read timed out"), "TimeoutError: read timed out"),
])
async def test_any_actuator_exception_is_a_failed_action(clock: VirtualClock, error: Exception, message: str) -> None:
    store, pools, policy = MemoryStore(), Pools(error=error), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    policy.on = True
    await tick(loop, clock)
    [action] = await store.actions()
    assert (action.state, action.error) == (S.FAILED, message)
    pools.error = None
    await tick(loop, clock, 120.0)  # the loop went on: after the cooldown it tries again
    assert [a.state for a in await store.actions()] == [S.FAILED, S.SUCCEEDED]


async def test_undecided_proposals_expire_after_the_ttl(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    loop = make_loop(Mode.PROPOSE, store, pools, clock, policy)
    policy.on = True
    await tick(loop, clock)
    await tick(loop, clock, 9 * 60.0)
    assert [a.state for a in await store.actions()] == [S.PROPOSED]
    await tick(loop, clock, 61.0)
    states = [a.state for a in await store.actions()]
    assert states[0] is S.EXPIRED and states[1:] == [S.PROPOSED], "expired, then asked again with fresh numbers"
    [event] = [e for e in store.action_events(1) if e.event == "expired"]
    assert "proposal_ttl" in event.detail["why"]


async def test_an_act_mode_proposal_cut_off_before_its_approval_runs(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    # The rails allowed it and it was recorded; the store failed before the approval was (or the process died).
    orphan = await store.create_action(NewAction(None, "scale_pool", "prefill", {"change": change_as_dict(ScaleTo(4)),
                                                                                 "from_replicas": 3},
                                                 "act", "more prefill; rails: scale prefill 3 -> 4"), clock.now())
    person = await store.create_action(NewAction(None, "rollback", "prefill", {"change": change_as_dict(RollBack("router"))},
                                                 "propose", "proposed before act was switched on"), clock.now())
    await tick(make_loop(Mode.ACT, store, pools, clock, policy), clock)
    assert pools.calls == [4], "run once, not held until proposal_ttl"
    states = {a.id: a.state for a in await store.actions()}
    assert (states[orphan.id], states[person.id]) == (S.SUCCEEDED, S.PROPOSED), "a person's proposal stays theirs"


@pytest.mark.parametrize("mode", [Mode.OBSERVE, Mode.PROPOSE, Mode.ACT])
async def test_an_observe_mode_record_cut_off_before_it_became_an_advisory_becomes_one(
        clock: VirtualClock, mode: Mode) -> None:
    store, pools = MemoryStore(), Pools()
    orphan = await store.create_action(NewAction(None, "scale_pool", "prefill", {"change": change_as_dict(ScaleTo(4)),
                                                                                 "from_replicas": 3},
                                                 "observe", "more prefill; rails: scale prefill 3 -> 4"), clock.now())
    await tick(make_loop(mode, store, pools, clock, Asks()), clock)
    [advisory] = [a for a in await store.actions() if a.id == orphan.id]
    assert advisory.state is S.ADVISORY, "never run, never a person's to decide, never expired as one"
    assert "resumed" in next(e for e in store.action_events(orphan.id) if e.event == "advisory").detail


async def approved_then_gone(store: MemoryStore, clock: VirtualClock) -> tuple[ControlLoop, Pools]:
    """A person approved a finding's proposal while its pool settles; then the finding's policy no longer reports it."""
    pools, policy = Pools(ready=2), Asks()
    loop = make_loop(Mode.PROPOSE, store, pools, clock, policy)
    policy.on = True
    pools.ready = 3
    await tick(loop, clock)
    [proposal] = await store.actions()
    pools.ready = 2  # settling: the approval waits
    await store.decide(proposal.id, approve=True, by="alice", now=clock.now(), via="api")
    policy.on = False
    return loop, pools


async def test_a_proposal_approved_while_its_finding_resolves_expires_and_does_not_run(clock: VirtualClock) -> None:
    store, pools, policy, loop, proposal = await proposed(clock, Pools())
    policy.on = False  # the problem is gone: this tick resolves the finding and expires its proposal
    expire = store.transition

    async def approved_meanwhile(action_id: int, expected: Any, to: S, now: float, *args: Any, **kwargs: Any) -> Any:
        if to is S.EXPIRED and (await store.actions())[0].state is S.PROPOSED:
            await store.decide(action_id, approve=True, by="alice", now=now, via="api")
        return await expire(action_id, expected, to, now, *args, **kwargs)

    store.transition = approved_meanwhile  # type: ignore[method-assign]
    await tick(loop, clock)
    await tick(loop, clock)
    [action] = await store.actions()
    assert action.id == proposal.id and action.state is S.EXPIRED and pools.calls == []


async def test_a_resolved_finding_expires_its_waiting_actions(clock: VirtualClock) -> None:
    store = MemoryStore()
    loop, pools = await approved_then_gone(store, clock)
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.EXPIRED and pools.calls == []


async def test_an_action_created_a_little_ahead_of_the_clock_is_kept(clock: VirtualClock) -> None:
    """A clock corrected back by a few seconds is no reason to drop what was asked: a revert expired is asked no more."""
    store, pools = MemoryStore(), Pools()
    loop = make_loop(Mode.PROPOSE, store, pools, clock, Asks())
    action = await store.create_action(NewAction(None, "scale_pool", "prefill", {"change": change_as_dict(ScaleTo(4)),
                                                                                 "from_replicas": 3},
                                                 "propose", "more prefill"), clock.now() + 20)
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.PROPOSED, action


class RefusesAnExpiry(MemoryStore):
    """Fails the first expiry it is asked to write (an outage at that moment)."""

    refuse = 1

    async def transition(self, action_id, expected, to, now, detail=None, **fields):  # type: ignore[no-untyped-def]
        if self.refuse and to is S.EXPIRED:
            self.refuse -= 1
            raise StoreUnavailable("transition: connection reset")
        return await super().transition(action_id, expected, to, now, detail, **fields)


async def test_a_finding_resolves_only_once_its_waiting_actions_expired(clock: VirtualClock) -> None:
    """Resolved first, with the expiry then refused, the finding would not be reported resolved again: its approved
    action would run for a problem that is gone."""
    store = RefusesAnExpiry()
    loop, pools = await approved_then_gone(store, clock)
    with pytest.raises(StoreUnavailable):
        await tick(loop, clock)
    assert [f.state for f in store.findings.values()] == ["open"]
    await tick(loop, clock)
    pools.ready = 3
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.EXPIRED and pools.calls == []
    assert [f.state for f in store.findings.values()] == ["resolved"]


async def test_an_action_created_ahead_of_the_clock_expires(clock: VirtualClock) -> None:
    """Created before a clock stepped back, its age reads negative: it would live for the step and its time to live,
    and run on numbers far older than that."""
    store, pools = MemoryStore(), Pools()
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    action = await store.create_action(NewAction(None, "scale_pool", "prefill", {"change": change_as_dict(ScaleTo(4))},
                                                 "act", "more prefill"), clock.now() + 3600)
    await store.transition(action.id, S.PROPOSED, S.APPROVED, clock.now() + 3600, {"by": "rails"})
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.EXPIRED and pools.calls == []


async def started_elsewhere(store: MemoryStore, now: float, reason: str = "more prefill", **params: Any) -> int:
    """An action another control plane started before it was killed (`params`: more of its parameters)."""
    action = await store.create_action(NewAction(None, "scale_pool", "prefill",
                                                 {"change": change_as_dict(ScaleTo(4)), "from_replicas": 3, **params},
                                                 "act", reason), now)
    await store.transition(action.id, S.PROPOSED, S.APPROVED, now, {"by": "rails"})
    await store.transition(action.id, S.APPROVED, S.STARTED, now, {"actuator": "fake"})
    return action.id


@pytest.mark.parametrize(("already", "state", "calls"), [
    (True, S.SUCCEEDED, []),  # its write landed before the kill: not made again
    ({"from_replicas": 3}, S.SUCCEEDED, []),  # and what it reported then is kept
    (False, S.SUCCEEDED, [4]),  # it never reached the fleet: made now, once
    (None, S.UNKNOWN, []),  # the actuator cannot tell: left for a person, never guessed
])
async def test_a_take_over_neither_repeats_nor_loses_an_action(clock: VirtualClock, already: bool | None,
                                                               state: S, calls: list[int]) -> None:
    store, pools = MemoryStore(), Pools(already=already)
    action_id = await started_elsewhere(store, clock.now())
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    await loop.start()
    [action] = await store.actions()
    assert (action.id, action.state, pools.calls) == (action_id, state, calls)
    events = [e.event for e in store.action_events(action_id)]
    assert events.count("started") == 1, "started once, by the control plane that was killed"
    if isinstance(already, dict):  # what the actuator kept of the change: a revert is derived from it
        [succeeded] = [e for e in store.action_events(action_id) if e.event == "succeeded"]
        assert succeeded.detail["from_replicas"] == 3 and "taken_over" in succeeded.detail


async def test_a_started_action_nothing_carries_out_is_taken_over(clock: VirtualClock) -> None:
    """Its start was written though the tick that wrote it failed (the store's answer lost): the leader, ticking on,
    finds it started with nothing carrying it out, and takes it over rather than leave it holding its pool."""
    store, pools = MemoryStore(), Pools(already=False)
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    await tick(loop, clock)
    action_id = await started_elsewhere(store, clock.now())
    await tick(loop, clock)
    [action] = await store.actions()
    assert (action.id, action.state, pools.calls) == (action_id, S.SUCCEEDED, [4])
    assert "taken_over" in [e.event for e in store.action_events(action_id)]


async def test_a_take_over_redoes_an_action_created_a_little_ahead_of_its_clock(clock: VirtualClock) -> None:
    """The last leader's clock ran a few seconds ahead: its started, never applied action is still new, not stale."""
    store, pools = MemoryStore(), Pools(already=False)
    action_id = await started_elsewhere(store, clock.now() + 20)
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    await loop.start()
    [action] = await store.actions()
    assert (action.id, action.state, pools.calls) == (action_id, S.SUCCEEDED, [4])


async def test_a_take_over_redoes_nothing_on_numbers_it_cannot_trust_now(clock: VirtualClock) -> None:
    store, pools, source = MemoryStore(), Pools(already=False), NoMetrics()
    action = await store.create_action(NewAction(None, "scale_pool", "prefill",
                                                 {"change": change_as_dict(ScaleTo(4)), "from_replicas": 3,
                                                  "inputs": ["requests_waiting"]}, "act", "more prefill"), clock.now())
    await store.transition(action.id, S.PROPOSED, S.APPROVED, clock.now(), {"by": "rails"})
    await store.transition(action.id, S.APPROVED, S.STARTED, clock.now(), {"actuator": "fake"})
    source.down = 3  # the pool's vLLM target has been down since before the take-over
    await make_loop(Mode.ACT, store, pools, clock, Asks(), source).start()
    [taken] = await store.actions()
    assert pools.calls == [] and taken.state is S.CANCELLED
    assert "prefill/prefill-0/vllm is down" in cancelled_why(store, taken.id)


def cancelled_why(store: MemoryStore, action_id: int) -> str:
    [event] = [e for e in store.action_events(action_id) if e.event == "cancelled"]
    return str(event.detail["why"])


async def test_a_revert_a_take_over_cannot_redo_now_waits_afresh(clock: VirtualClock) -> None:
    """Nothing proposes a revert again: cancelled with the rest, its undoing would be lost. It is recorded to wait as
    an approval waits, and runs once the rails allow it, with no cooldown from the one that never ran."""
    store, pools, source = MemoryStore(), Pools(already=False), NoMetrics()
    await started_elsewhere(store, clock.now(), "revert action 99", inputs=["requests_waiting"], reverts=99)
    source.down = 3
    loop = make_loop(Mode.ACT, store, pools, clock, Asks(), source)
    await loop.start()
    first, again = await store.actions()
    assert first.state is S.CANCELLED and (again.state, again.params["reverts"]) == (S.APPROVED, 99)
    assert again.reason.startswith("revert action 99; rails: waits: ")
    source.down = 0
    await tick(loop, clock)
    assert pools.calls == [4] and (await store.actions())[1].state is S.SUCCEEDED


@pytest.mark.parametrize(("mode", "desired", "after_s", "why"), [
    (Mode.OBSERVE, 3, 60.0, "observe mode never acts"),
    (Mode.ACT, 6, 60.0, "approved as prefill 3 -> 4, but prefill is at 6 now"),  # someone scaled it meanwhile
    (Mode.ACT, 3, 7200.0, "past proposal_ttl"),
])
async def test_a_take_over_redoes_only_what_the_rails_allow_now(clock: VirtualClock, mode: Mode, desired: int,
                                                                 after_s: float, why: str) -> None:
    store, pools = MemoryStore(), Pools(desired=desired, ready=desired, already=False)
    action_id = await started_elsewhere(store, clock.now())
    clock.advance(after_s)
    await make_loop(mode, store, pools, clock, Asks()).start()
    [action] = await store.actions()
    assert (action.id, action.state, pools.calls) == (action_id, S.CANCELLED, [])
    assert why in cancelled_why(store, action_id) and "not applied before the stop" in cancelled_why(store, action_id)


async def test_a_replica_that_does_not_lead_takes_nothing_over(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools(already=False)
    action_id = await started_elsewhere(store, clock.now())
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    loop.leading = lambda: False  # the Lease was lost while it read the history
    await loop.start()
    [action] = await store.actions()
    assert (action.id, action.state, pools.calls) == (action_id, S.STARTED, []), "left for the leader"


async def taken_over_while_paused(pools: Pools, clock: VirtualClock) -> tuple[MemoryStore, int]:
    """An action another control plane left started, taken over by a new leader while acting is paused."""
    store = MemoryStore()
    action_id = await started_elsewhere(store, clock.now())
    store.pause = Pause(by="oncall", reason="incident", at=clock.now())
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Asks()], actuator=pools, clock=clock, telemetry=Telemetry(), switch=StoreSwitch(store))
    await loop.start()
    return store, action_id


async def test_a_take_over_while_paused_redoes_nothing(clock: VirtualClock) -> None:
    pools = Pools(already=False)
    store, action_id = await taken_over_while_paused(pools, clock)
    [action] = await store.actions()
    # Known not to have happened: cancelled, as an approval the kill switch stops; nothing redone while paused.
    assert (action.id, action.state, pools.calls) == (action_id, S.CANCELLED, [])
    assert "acting is paused (paused by oncall: incident)" in cancelled_why(store, action_id)


@dataclass
class Releasing(Pools):
    """An actuator whose changes begin before they are made (engines out of routing): what was begun can be undone."""

    released: list[int] = field(default_factory=list)

    async def release(self, order: Order) -> str:
        self.released.append(order.action_id)
        return "the drained engines are routed again (prefill-2)"


@pytest.mark.parametrize(("already", "state"), [(False, S.CANCELLED), (None, S.UNKNOWN)])
async def test_a_take_over_that_carries_a_change_no_further_undoes_what_was_begun_of_it(
        clock: VirtualClock, already: bool | None, state: S) -> None:
    # The stopped leader took an engine out of routing to drain it, and stopped before its wait was noted: not redone
    # now (paused), or not known, the engine must not stay out of routing, running and serving nothing.
    pools = Releasing(already=already)
    store, action_id = await taken_over_while_paused(pools, clock)
    [action] = await store.actions()
    assert (action.state, pools.calls, pools.released) == (state, [], [action_id])
    events = [e.event for e in store.action_events(action_id)]
    assert events.index(str(state)) < events.index("released"), "undone once it is ended, not before"
    [released] = [e for e in store.action_events(action_id) if e.event == "released"]
    assert released.detail == {"released": "the drained engines are routed again (prefill-2)"}


@pytest.mark.parametrize(("then", "state"), [("scale", S.CANCELLED), ("verify", S.SUCCEEDED)])
async def test_observe_mode_carries_no_taken_over_wait_further(clock: VirtualClock, then: str, state: S) -> None:
    """Restarted in observe mode to stop acting, a replica that took over a drain another leader left waiting scaled
    the pool when the engine was idle: the wait went on with no rails asked. One that only checks its pods are gone is
    watched to its end."""
    store, pools = MemoryStore(), Releasing()
    action_id = await started_elsewhere(store, clock.now())
    wait = {"phase": "draining", "pods": ["prefill-2"], "then": then, "deadline": clock.now() + 120}
    await store.note(action_id, "waiting", clock.now(), {"wait": wait})
    loop = make_loop(Mode.OBSERVE, store, pools, clock, Asks())
    await loop.start()
    await tick(loop, clock)
    [action] = await store.actions()
    assert action.state is state
    if then == "scale":
        assert (pools.waits, pools.released) == ([], [action_id])
        assert "observe mode" in cancelled_why(store, action_id)


class RefusesACreation(MemoryStore):
    """Fails the first action it is asked to create (an outage at that moment)."""

    refuse = 1

    async def create_action(self, action, now):  # type: ignore[no-untyped-def]
        if self.refuse:
            self.refuse -= 1
            raise StoreUnavailable("create_action: connection reset")
        return await super().create_action(action, now)


async def test_a_revert_cancelled_at_take_over_and_not_recorded_again_is_recovered(clock: VirtualClock) -> None:
    """The store failed between the cancel and the new record: nothing else would propose the revert again."""
    store, pools, source = RefusesACreation(), Pools(already=False), NoMetrics()
    store.refuse = 0
    await started_elsewhere(store, clock.now(), "revert action 99", inputs=["requests_waiting"], reverts=99)
    source.down = 3
    loop = make_loop(Mode.ACT, store, pools, clock, Asks(), source)
    store.refuse = 1
    with pytest.raises(StoreUnavailable):
        await loop.start()
    assert [a.state for a in await store.actions()] == [S.CANCELLED]
    source.down = 0
    await tick(loop, clock)
    first, again = await store.actions()
    assert first.state is S.CANCELLED and (again.params["reverts"], again.state, pools.calls) == (99, S.SUCCEEDED, [4])
    await tick(loop, clock)
    assert len(await store.actions()) == 2, "recorded again once"


async def test_a_revert_another_leader_cancelled_and_lost_is_recovered_when_leadership_comes_back(
        clock: VirtualClock) -> None:
    """Replica A led (and found nothing to recover); B took over, cancelled a revert it could not redo, and stopped
    before recording it again; A leads again: the revert must not be lost with B."""
    store, pools, source = RefusesACreation(), Pools(already=False), NoMetrics()
    store.refuse = 0
    a = make_loop(Mode.ACT, store, pools, clock, Asks(), source)
    await a.start()
    await tick(a, clock)
    await started_elsewhere(store, clock.now(), "revert action 99", inputs=["requests_waiting"], reverts=99)
    source.down, store.refuse = 3, 1
    with pytest.raises(StoreUnavailable):
        await make_loop(Mode.ACT, store, pools, clock, Asks(), source).start()
    source.down = 0
    await a.start()
    await tick(a, clock)
    first, again = await store.actions()
    assert first.state is S.CANCELLED and (again.params["reverts"], again.state, pools.calls) == (99, S.SUCCEEDED, [4])


@dataclass
class EndedMeanwhile(Pools):
    """While the new leader asks, the old leader's last tick (which always finishes) records the action's end."""

    store: MemoryStore | None = None

    async def applied(self, order: Order) -> Mapping[str, Any] | bool | None:
        assert self.store is not None
        await self.store.transition(order.action_id, S.STARTED, S.SUCCEEDED, 0.0, {"by": "the old leader"})
        return True


async def test_an_action_that_ends_elsewhere_while_taken_over_is_left_as_it_ended(clock: VirtualClock) -> None:
    store = MemoryStore()
    pools = EndedMeanwhile(already=True, store=store)
    first = await started_elsewhere(store, clock.now())
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    await loop.start()  # no ActionConflict out of it: the new leader goes on
    [action] = await store.actions()
    assert action.id == first and action.state is S.SUCCEEDED
    assert [e.detail for e in store.action_events(first) if e.event == "succeeded"] == [{"by": "the old leader"}]


async def test_a_revert_taken_over_while_paused_waits_for_the_switch(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools(already=False)
    await started_elsewhere(store, clock.now(), "revert action 99", reverts=99)
    store.pause = Pause(by="oncall", reason="incident", at=clock.now())
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Asks()], actuator=pools, clock=clock, telemetry=Telemetry(), switch=StoreSwitch(store))
    await loop.start()
    first, again = await store.actions()
    assert first.state is S.CANCELLED and (again.state, again.params["reverts"]) == (S.APPROVED, 99)
    await tick(loop, clock)
    assert pools.calls == [], "paused"
    store.pause = None
    await tick(loop, clock)
    assert pools.calls == [4]


async def test_a_take_over_resumes_a_wait_from_the_audit_log(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools()
    action_id = await started_elsewhere(store, clock.now())
    wait = {"phase": "draining", "pods": ["prefill-2"], "then": "scale", "deadline": clock.now() + 120}
    await store.note(action_id, "waiting", clock.now(), {"wait": wait})
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    await loop.start()
    assert (await store.actions())[0].state is S.STARTED and pools.calls == []
    await tick(loop, clock)
    assert pools.waits == [wait] and pools.calls == [], "resumed where it was, not started again"
    [action] = await store.actions()
    assert action.state is S.SUCCEEDED
    assert [e.event for e in store.action_events(action_id)][-3:] == ["waiting", "taken_over", "succeeded"]


async def test_a_wait_is_resumed_knowing_which_engines_still_answer(clock: VirtualClock) -> None:
    store, pools, source = MemoryStore(), Pools(hold=True), NoMetrics()
    action_id = await started_elsewhere(store, clock.now())
    wait = {"phase": "draining", "pods": ["prefill-0"], "then": "scale", "deadline": clock.now() + 120}
    await store.note(action_id, "waiting", clock.now(), {"wait": wait})
    loop = make_loop(Mode.ACT, store, pools, clock, Asks(), source)
    await loop.start()
    await tick(loop, clock)  # nothing scraped here this tick: the loop cannot tell
    source.down = 1
    await tick(loop, clock)  # one failed scrape is noise: still answering, its count only late
    await tick(loop, clock)  # down twice in a row: it stopped answering
    assert [o.answering for o in pools.resumed] == [None, frozenset({"prefill-0"}), frozenset()]
    assert [o.idle("prefill-0") for o in pools.resumed] == [False, False, True]
    assert (await store.actions())[0].state is S.STARTED


async def test_the_kill_switch_holds_a_waiting_change_too(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools()
    action_id = await started_elsewhere(store, clock.now())
    wait = {"phase": "draining", "pods": ["prefill-2"], "then": "scale", "deadline": clock.now() + 120}
    await store.note(action_id, "waiting", clock.now(), {"wait": wait})
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Asks()], actuator=pools, clock=clock, telemetry=Telemetry(), switch=StoreSwitch(store))
    await loop.start()
    store.pause = Pause(by="oncall", reason="incident", at=clock.now())
    await tick(loop, clock)
    assert pools.waits == [] and (await store.actions())[0].state is S.STARTED
    store.pause = None
    await tick(loop, clock)
    assert pools.waits == [wait] and (await store.actions())[0].state is S.SUCCEEDED


async def test_a_follower_acts_on_nothing(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    loop.leading = lambda: False
    policy.on = True
    await tick(loop, clock)
    assert pools.calls == [] and [a.state for a in await store.actions()] == [S.APPROVED]
    loop.leading = lambda: True
    await tick(loop, clock)
    assert pools.calls == [4]


async def test_leadership_lost_and_won_back_is_taken_over_again_not_carried_on(clock: VirtualClock) -> None:
    """While this replica was cut off, another took the Lease, finished its drain and stepped down: the loop of the
    earlier term must not resume the drain it remembers."""
    store, pools = MemoryStore(), Pools(hold=True)
    action_id = await started_elsewhere(store, clock.now())
    wait = {"phase": "draining", "pods": ["prefill-2"], "then": "scale", "deadline": clock.now() + 120}
    await store.note(action_id, "waiting", clock.now(), {"wait": wait})
    term = [1]
    loop = make_loop(Mode.ACT, store, pools, clock, Asks())
    loop.term = lambda: term[0]
    await loop.start()
    other = make_loop(Mode.ACT, store, Pools(), clock, Asks())
    await other.start()
    await tick(other, clock)
    assert (await store.actions())[0].state is S.SUCCEEDED, "the other leader finished it"
    term[0] = 2  # the Lease is ours again, in a new term
    stop = asyncio.Event()
    await asyncio.wait_for(loop.run(stop), 5)  # returns at once: its caller takes over again
    await tick(loop, clock)
    assert pools.waits == [], "nothing of the earlier term is acted on before a take-over"
    await loop.start()
    await tick(loop, clock)
    assert pools.waits == [] and pools.calls == [], "the take-over finds the drain ended"


class SlowStart(MemoryStore):
    """A store whose write that starts an action outlasts the leader's lease."""

    def __init__(self, lead: list[bool]) -> None:
        super().__init__()
        self.lead = lead

    async def transition(self, action_id: int, expected: S, to: S, now: float, detail: Mapping[str, Any],
                         **kw: Any) -> ActionRecord:
        if to is S.STARTED:
            self.lead[0] = False
        return await super().transition(action_id, expected, to, now, detail, **kw)


async def test_an_action_started_while_the_lease_lapsed_is_left_to_the_next_leader(clock: VirtualClock) -> None:
    lead = [True]
    store, pools, policy = SlowStart(lead), Pools(already=False), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    loop.leading = lambda: lead[0]
    policy.on = True
    await tick(loop, clock)
    assert pools.calls == [], "another leader may be acting by now"
    [action] = await store.actions()
    assert action.state is S.STARTED
    lead[0] = True
    await loop.start()  # this replica leads again: its take-over finds it not made and makes it
    assert pools.calls == [4]


async def test_nothing_acts_on_a_pool_whose_target_is_down(clock: VirtualClock) -> None:
    store, pools, policy, source = MemoryStore(), Pools(), Asks(), NoMetrics()
    loop = make_loop(Mode.ACT, store, pools, clock, policy, source)
    source.down = 1
    await tick(loop, clock)  # one failed scrape is noise
    assert [f.kind for f in await store.open_findings()] == []
    await tick(loop, clock)
    [stale] = await store.open_findings()
    assert stale.kind == "stale_inputs" and "prefill/prefill-0/vllm is down (connection refused)" in stale.cause
    policy.on = True  # the pool seems to need more replicas, but its numbers cannot be trusted
    report = await loop.tick()
    assert pools.calls == [] and await store.actions() == []
    assert [reason for _, reason, _ in report.held] == ["stale_inputs"]
    source.down = 0
    await tick(loop, clock)
    assert pools.calls == [4]
    assert [f.kind for f in await store.open_findings()] == ["test"], "the stale finding resolved"


async def test_the_kill_switch_stops_an_action_that_would_otherwise_run(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    cfg = parse_config(FLEET.format(mode=Mode.ACT))
    loop = ControlLoop(config=cfg, source=NoMetrics(), store=store, policies=[policy], actuator=pools, clock=clock,
                       telemetry=Telemetry(), switch=StoreSwitch(store))
    store.pause = Pause(by="oncall", reason="GPU maintenance", at=clock.now())
    policy.on = True
    for _ in range(8):
        report = await loop.tick()
        clock.advance(15.0)
    assert pools.calls == [] and await store.actions() == [], "paused: nothing recorded as run, nothing run"
    assert {reason for _, reason, _ in report.held} == {"paused"}
    store.pause = None
    await tick(loop, clock)
    assert pools.calls == [4]


async def test_a_flapping_signal_gets_no_more_actions_than_the_rails_allow(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    loop.config = parse_config(FLEET.format(mode=Mode.ACT).replace("cooldown: 60s", "cooldown: 60s, max_step: 1, "
                                                                     "max_actions_per_hour: 4"))
    pools.desired, pools.ready = 3, 3
    starts = []
    for i in range(4 * 60):  # an hour: the finding opens and resolves every other tick
        policy.on = i % 2 == 0
        clock.advance(15.0)
        await loop.tick()
        pools.desired = pools.ready = 3  # the load keeps bringing the pool back: every scale-up looks needed again
        starts += [a.started_at for a in await store.actions(states=[S.SUCCEEDED]) if a.started_at not in starts]
    assert len(pools.calls) == len(starts) == 4, "as many as the hourly rate limit allows, no more"
    assert all(b - a >= 60 for a, b in itertools.pairwise(starts)), "never inside the cooldown"


async def test_a_fleet_that_cannot_be_read_stops_acting_not_detecting(clock: VirtualClock) -> None:
    store, pools, policy = MemoryStore(), Pools(), Asks()
    loop = make_loop(Mode.ACT, store, pools, clock, policy)
    await tick(loop, clock)  # read once: 3 replicas
    broken = ActuationError("reading LeaderWorkerSet llm/vllm-prefill: 404 not found")

    async def unreadable() -> FleetView:
        raise broken

    pools.observe = unreadable  # type: ignore[method-assign]
    policy.on = True
    clock.advance(15.0)
    report = await loop.tick()
    assert [f.kind for f in await store.open_findings()] == ["test"], "detection goes on"
    assert pools.calls == [] and await store.actions() == []
    assert [reason for _, reason, _ in report.held] == ["pool_unreadable"]
    assert "404 not found" in report.errors["pool prefill"]
    del pools.observe  # readable again: the same finding acts at once
    await tick(loop, clock)
    assert pools.calls == [4]


class Sheds:
    """A policy that keeps a finding open that asks for one prefill replica fewer."""

    kind = "test"
    reads = ("requests_waiting",)

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        proposal = Proposal(ActionKind.SCALE_POOL, "prefill", ScaleBy(-1), "fewer prefill")
        return PolicyResult([FindingReport(FindingKey("test", "pool/prefill"), Severity.WARNING, "too many", "load", {},
                                           "test", (proposal,))])


async def test_a_pool_that_never_settles_is_stalled_and_may_still_shrink(clock: VirtualClock) -> None:
    # Asked for 8 engines, the cluster has GPUs for 6: the pool would settle never, and its size could not be
    # lowered again. After `rails.settle_timeout` it is stalled: a finding says so and a scale-down runs.
    store, pools = MemoryStore(), Pools(desired=8, ready=6)
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Sheds(), PoolStalled()], actuator=pools, clock=clock, telemetry=Telemetry())
    held = []
    for _ in range(60):  # 15 minutes less one tick
        held += [note for _, _, note in (await loop.tick()).held]
        clock.advance(15)
    assert pools.calls == [] and held[-1] == "prefill has 6 of 8 replicas ready"
    assert [f.kind for f in await store.open_findings()] == ["test"]
    await loop.tick()
    assert pools.calls == [7], "the scale-down passes the settling check"
    assert sorted(f.kind for f in await store.open_findings()) == ["pool_stalled", "test"]
    for _ in range(4):  # 7 of 7 ready, but not yet for long: an engine that flaps Ready would look the same
        await tick(loop, clock)
        assert sorted(f.kind for f in await store.open_findings()) == ["pool_stalled", "test"]
    await tick(loop, clock)
    assert [f.kind for f in await store.open_findings()] == ["test"], "7 of 7 ready for four scrapes: not stalled"


@pytest.mark.parametrize("slow", ["rolling", "long-start-up"])
async def test_a_pool_that_is_only_slow_is_not_stalled(clock: VirtualClock, slow: str) -> None:
    # A rollout one engine at a time, or engines that take 10 minutes to load: short for 16 minutes, and still on
    # their way.
    store, pools = MemoryStore(), Pools(desired=8, ready=6, rolling=slow == "rolling")
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Sheds(), PoolStalled()], actuator=pools, clock=clock, telemetry=Telemetry())
    if slow == "long-start-up":
        loop.windows.add(clock.now(), "pool/prefill", "autoscale_startup_seconds", 600.0)
    for _ in range(65):
        await tick(loop, clock)
    assert pools.calls == [] and [f.kind for f in await store.open_findings()] == ["test"]


async def test_a_cordon_sees_every_pools_engines_a_drain_its_own(clock: VirtualClock) -> None:
    two = """
mode: act
pools:
  - {name: prefill, role: prefill, model: m, replicas: {min: 1, max: 8}}
  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 8}}
"""
    loop = ControlLoop(config=parse_config(two), source=NoMetrics(), store=MemoryStore(), policies=[],
                       actuator=Pools(), clock=clock, telemetry=Telemetry())
    now = clock.now()
    loop.windows.extend([(now, "engine/prefill/prefill-0/0", "requests_running", 2.0),
                         (now, "engine/decode/decode-0/0", "requests_running", 0.0)])
    loop._answering = {"prefill": {"prefill-0"}, "decode": {"decode-0"}}
    cordon = loop._with_engines(Order(1, ActionKind.CORDON_NODE, "decode", Cordon("gpu-1"), "gpu 3 failed"))
    assert (cordon.busy, cordon.answering) == ({"prefill-0": 2.0, "decode-0": 0.0}, {"prefill-0", "decode-0"})
    assert not cordon.idle("prefill-0"), "another pool's busy engine on the node is waited for"
    drain = loop._with_engines(Order(2, ActionKind.DRAIN_ENGINE, "decode", Drain("decode-0"), "lagging"))
    assert (drain.busy, drain.answering) == ({"decode-0": 0.0}, {"decode-0"})
    # A pool with engines that is not scraped here (another namespace, a partial static list): its engines would read
    # as down and be evicted busy, so no engine counts as idle for not answering.
    loop._answering = {"decode": {"decode-0"}}
    loop._last_replicas = {"prefill": PoolReplicas(2, 2), "decode": PoolReplicas(1, 1)}
    assert loop._with_engines(Order(3, ActionKind.CORDON_NODE, "decode", Cordon("gpu-1"), "")).answering is None
    loop._last_replicas["prefill"] = PoolReplicas(0, 0)  # scaled to zero: nothing of it to move
    assert loop._with_engines(Order(4, ActionKind.CORDON_NODE, "decode", Cordon("gpu-1"), "")).answering == {"decode-0"}


def test_a_cordon_that_ends_counts_every_pool_it_evicted_from_as_settling() -> None:
    cordon = Order(1, ActionKind.CORDON_NODE, "decode", Cordon("gpu-1"), "gpu 3 failed")
    waited = (cordon, {"pods": ["d-0", "p-0"], "pools": {"d-0": "decode", "p-0": "prefill"}})
    assert _touched(cordon, waited) == ["decode", "prefill"], "no other pool's disruptive change starts beside it"
    assert _touched(cordon, None) == [], "it never waited: nothing was evicted"


class Plans:
    """A sizer that plans the prefill pool at `target`."""

    name = "plans"

    def __init__(self, target: int) -> None:
        self.target = target

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan:
        return PoolPlan(pool.name, pool.desired, pool.ready, self.target, self.target, f"load asks {self.target}")


async def test_a_waiting_scale_the_sizers_plan_moved_past_is_cancelled_not_run(clock: VirtualClock) -> None:
    store, pools = MemoryStore(), Pools(ready=2)  # a rollout in progress: the pool does not settle yet
    # Approved by the rails minutes ago at the load then, held since (another action ran on the pool first).
    old = await store.create_action(NewAction(None, "scale_pool", "prefill",
                                              {"change": change_as_dict(ScaleTo(4)), "from_replicas": 3,
                                               "asked_replicas": 4}, "act", "load asks 4"), clock.now())
    await store.transition(old.id, S.PROPOSED, S.APPROVED, clock.now(), {"by": "rails"}, approved_by="rails")
    sizer = Plans(6)  # the load grew since
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[], actuator=pools, clock=clock, telemetry=Telemetry(), sizer=sizer)
    await tick(loop, clock)
    assert (await store.actions())[0].state is S.CANCELLED
    assert "superseded: the sizer plans 6 now, not 4" in store.action_events(old.id)[-1].detail["why"]
    pools.ready = 3  # settled: the plan of now runs, not the one of then
    await tick(loop, clock)
    ran = [(a.state, a.params.get("asked_replicas")) for a in await store.actions()]
    assert ran == [(S.CANCELLED, 4), (S.SUCCEEDED, 6)], "towards 6, as far as one step goes"


class FailsTheGate:
    """A canary gate's failed verdict behind a finding, open while it lasts."""

    kind = "canary_regression"
    reads = ("tpot_p95",)

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        verdict = {"gate": "tpot", "baseline": "v1", "canary": "v2", "started_at": 0.0, "ended_at": inp.now,
                   "result": "fail", "score": 0.2}
        return PolicyResult([FindingReport(FindingKey("canary_regression", "pool/prefill"), Severity.WARNING,
                                           "canary fails", "TPOT +21 %", {}, "canary_regression", verdict=verdict)])


class RefusesAVerdict(MemoryStore):
    refuse = 1

    async def record_verdict(self, verdict):  # type: ignore[no-untyped-def]
        if self.refuse:
            self.refuse -= 1
            raise StoreUnavailable("record_verdict: connection reset")
        return await super().record_verdict(verdict)


async def test_a_verdict_the_store_refused_is_written_next_tick(clock: VirtualClock) -> None:
    """Its finding opened before it: the policy will not report it as new again, so it is kept, not lost."""
    store = RefusesAVerdict()
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.OBSERVE)), source=NoMetrics(), store=store,
                       policies=[FailsTheGate()], actuator=Pools(), clock=clock, telemetry=Telemetry())
    with pytest.raises(StoreUnavailable):
        await tick(loop, clock)
    assert [f.kind for f in await store.open_findings()] == ["canary_regression"] and store.verdicts == []
    await tick(loop, clock)
    await tick(loop, clock)
    assert [(v.gate, v.result) for v in store.verdicts] == [("tpot", "fail")], "written once"


async def test_a_revision_not_dated_for_a_tick_keeps_its_last_date(clock: VirtualClock) -> None:
    """A ReplicaSet list that fails once must not end the rollout the canary policy judges."""
    pools = Pools(changed_at={"prefill": 1_000.0})
    loop = make_loop(Mode.ACT, MemoryStore(), pools, clock, Asks())
    await tick(loop, clock)
    pools.changed_at = {}
    await tick(loop, clock)
    assert loop.changed_at == {"prefill": 1_000.0}
    pools.changed_at = {"prefill": 2_000.0}
    await tick(loop, clock)
    assert loop.changed_at == {"prefill": 2_000.0}


class Judges(Asks):
    """A policy whose finding carries a canary gate's verdict."""

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        verdict = {"gate": "rollout", "baseline": "a,b", "canary": "c", "started_at": 0.0, "ended_at": 60.0,
                   "result": "fail", "score": 0.0}
        return PolicyResult([FindingReport(FindingKey("test", "pool/prefill"), Severity.WARNING, "canary fails", "slow",
                                           {}, "test", verdict=verdict)])


class RefusesVerdicts(MemoryStore):
    async def record_verdict(self, verdict: NewVerdict) -> int:
        raise StoreConflict("record_verdict: value too long for type character varying(255)")


async def test_a_verdict_the_store_refuses_as_a_row_is_dropped_not_written_before_every_tick(clock: VirtualClock) -> None:
    """Kept to write again first thing every tick, a verdict refused as a row (not a store that is down) failed every
    tick after it: detection, acting and outcomes stopped until a restart."""
    store = RefusesVerdicts()
    loop = ControlLoop(config=parse_config(FLEET.format(mode=Mode.ACT)), source=NoMetrics(), store=store,
                       policies=[Judges()], actuator=Pools(), clock=clock, telemetry=Telemetry())
    await loop.start()
    for _ in range(3):
        report = await loop.tick()
        assert not report.errors, report.errors
        clock.advance(15)
    assert [f.summary for f in await store.open_findings()] == ["canary fails"]
