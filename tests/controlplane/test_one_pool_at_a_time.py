"""Never two pools disrupted at once, also when one pool's drain ends in the tick another's change is asked for.

In-memory store, virtual time, a fake fleet whose drains end (their pod deleted) on the tick after they start.
"""

from __future__ import annotations

from typing import Any

from controlplane.actions import ActionState as S
from controlplane.actuators.base import FleetView, Order, PoolReplicas
from controlplane.clock import VirtualClock
from controlplane.config import parse_config
from controlplane.errors import ActuationError
from controlplane.loop import ControlLoop, TickReport
from controlplane.observe import Observation
from controlplane.rails import RailsReason
from controlplane.store.memory import MemoryStore
from controlplane.store.records import NewAction
from controlplane.telemetry import Telemetry
from policies.types import (
    ActionKind,
    Drain,
    Eplb,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    Severity,
    change_as_dict,
)

FLEET = """
mode: act
pools:
  - {name: a, role: unified, model: m, replicas: {min: 1, max: 8}}
  - {name: b, role: unified, model: m, replicas: {min: 1, max: 8}}
rails: {cooldown: 60s, verify_after: 5m, max_actions_per_hour: 20}
"""


class Quiet:
    async def observe(self, now: float) -> Observation:
        return Observation(signals=[])


class Asks:
    """A finding per pool in `asks`, each asking for its proposal."""

    kind = "test"
    reads = ()

    def __init__(self) -> None:
        self.asks: dict[str, Proposal] = {}

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        return PolicyResult([FindingReport(FindingKey("test", f"pool/{p}"), Severity.WARNING, "x", "", {}, "test",
                                           (proposal,)) for p, proposal in self.asks.items()])


class Fleet:
    name = "fake"
    dry_run = False
    kinds = frozenset({ActionKind.DRAIN_ENGINE, ActionKind.ENABLE_EPLB})

    def __init__(self) -> None:
        self.replicas = {"a": [2, 2], "b": [2, 2]}  # desired, ready (as read at a tick's start)
        self.log: list[str] = []

    async def observe(self) -> FleetView:
        return FleetView({k: PoolReplicas(d, r) for k, (d, r) in self.replicas.items()})

    async def carry_out(self, order: Order) -> dict[str, Any]:
        self.log.append(f"{order.kind} {order.pool}")
        return {"wait": {"pods": ["a-1"]}} if isinstance(order.change, Drain) else {"done": True}

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        self.log.append(f"deleted {wait['pods']}")
        self.replicas[order.pool][1] -= 1  # its replacement starts: the pool is one engine down from now on
        return {"drained": wait["pods"]}

    async def applied(self, order: Order) -> bool | None:
        return None


class EvictsThenFails(Fleet):
    """A cordon's wait that evicts its pods and then fails (a PodDisruptionBudget refused the last one)."""

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        await super().resume(order, wait, now)
        raise ActuationError("a-2 could not be evicted within 120s")


async def drain_then_restart(fleet: Fleet) -> TickReport:
    """Pool a drains an engine; the tick its wait ends (its pod gone), pool b asks for a restart (EPLB)."""
    clock, store, asks = VirtualClock(), MemoryStore(), Asks()
    loop = ControlLoop(config=parse_config(FLEET), source=Quiet(), store=store, policies=[asks], actuator=fleet,
                       clock=clock, telemetry=Telemetry())
    asks.asks["a"] = Proposal(ActionKind.DRAIN_ENGINE, "a", Drain("a-1"), "a lagging worker")
    clock.advance(15)
    await loop.tick()
    asks.asks["b"] = Proposal(ActionKind.ENABLE_EPLB, "b", Eplb(True), "hot experts")
    clock.advance(15)
    return await loop.tick()


async def test_a_drain_that_ends_this_tick_holds_another_pools_restart() -> None:
    fleet = Fleet()
    report = await drain_then_restart(fleet)
    assert fleet.log == ["drain_engine a", "deleted ['a-1']"], "b's restart waits for a to settle"
    assert ("b", RailsReason.ROLLOUT_IN_FLIGHT) in [(p.pool, r) for p, r, _ in report.held]


async def test_a_wait_that_fails_this_tick_holds_another_pools_restart_too() -> None:
    fleet = EvictsThenFails()
    await drain_then_restart(fleet)
    assert "enable_eplb b" not in fleet.log


class LosesSightOfA(Fleet):
    """Pool a's workload cannot be read after its change: its engines may be restarting, which no read shows."""

    def __init__(self) -> None:
        super().__init__()
        self.blind = False

    async def observe(self) -> FleetView:
        view = await super().observe()
        if not self.blind:
            return view
        return FleetView({"b": view.pools["b"]}, unreadable={"a": "reading Deployment llm/a: timed out"})


async def test_a_pool_unread_after_its_change_holds_another_pools_restart() -> None:
    fleet, clock, asks = LosesSightOfA(), VirtualClock(), Asks()
    loop = ControlLoop(config=parse_config(FLEET), source=Quiet(), store=MemoryStore(), policies=[asks],
                       actuator=fleet, clock=clock, telemetry=Telemetry())
    asks.asks["a"] = Proposal(ActionKind.ENABLE_EPLB, "a", Eplb(True), "hot experts on a")
    clock.advance(15)
    await loop.tick()
    assert fleet.log == ["enable_eplb a"]
    # The last read of a is from before its new template: it looks settled, and cannot be read now.
    fleet.blind, asks.asks = True, {"b": Proposal(ActionKind.ENABLE_EPLB, "b", Eplb(True), "hot experts on b")}
    clock.advance(15)
    report = await loop.tick()
    assert fleet.log == ["enable_eplb a"] and ("b", RailsReason.ROLLOUT_IN_FLIGHT) in [
        (p.pool, r) for p, r, _ in report.held]
    # Long after its change (past `rails.settle_timeout`), an unreadable pool no longer holds the others.
    clock.advance(parse_config(FLEET).rails.settle_timeout)
    await loop.tick()
    assert fleet.log == ["enable_eplb a", "enable_eplb b"]


async def test_an_unreadable_pool_holds_others_only_after_a_change_that_ran() -> None:
    from controlplane.loop import _unsettled
    from controlplane.store.records import ActionRecord
    from policies.types import PoolState

    def record(state: str, kind: str = "enable_eplb", pool: str = "a") -> ActionRecord:
        return ActionRecord(id=1, finding_id=None, kind=kind, pool=pool, params={}, mode="act", state=S(state),
                            reason="", created_at=0.0, started_at=None, finished_at=100.0, outcome=None)

    pools = {"a": PoolState("a", "unified", 2, 2, 1, 8, unreadable="timed out"),
             "b": PoolState("b", "unified", 2, 2, 1, 8),
             "c": PoolState("c", "unified", 2, 2, 1, 8, unreadable="timed out")}
    assert _unsettled(pools, [record("rejected")], 200.0, 900.0) == [], "a proposal that never ran changed nothing"
    assert _unsettled(pools, [record("succeeded")], 200.0, 900.0) == ["a"]
    assert _unsettled(pools, [record("succeeded")], 2000.0, 900.0) == [], "long settled"
    # A cordon moves any pool's engines off its node: every unreadable pool may be restarting.
    assert _unsettled(pools, [record("succeeded", "cordon_node", "b")], 200.0, 900.0) == ["a", "c"]


async def test_a_take_over_forgets_the_pools_its_last_leadership_saw_settling() -> None:
    """Pool a's drain ended in the last tick this replica led; leadership lost and won back long after, a's settled:
    b's change, started by the other leader and never applied, is redone, not held behind a's old drain."""
    fleet, clock, store, asks = Fleet(), VirtualClock(), MemoryStore(), Asks()
    loop = ControlLoop(config=parse_config(FLEET), source=Quiet(), store=store, policies=[asks], actuator=fleet,
                       clock=clock, telemetry=Telemetry())
    asks.asks["a"] = Proposal(ActionKind.DRAIN_ENGINE, "a", Drain("a-1"), "a lagging worker")
    for _ in range(2):
        clock.advance(15)
        await loop.tick()
    assert fleet.log == ["drain_engine a", "deleted ['a-1']"]
    asks.asks = {}
    fleet.replicas["a"] = [2, 2]  # its replacement is up
    clock.advance(3600)
    eplb = await store.create_action(NewAction(None, "enable_eplb", "b", {"change": change_as_dict(Eplb(True))}, "act",
                                               "hot experts"), clock.now())
    await store.transition(eplb.id, S.PROPOSED, S.APPROVED, clock.now(), {"by": "rails"})
    await store.transition(eplb.id, S.APPROVED, S.STARTED, clock.now(), {"actuator": "fake"})
    fleet.applied = lambda order: _false()  # type: ignore[method-assign,assignment]
    await loop.start()
    assert fleet.log[-1] == "enable_eplb b"


async def _false() -> bool:
    return False


class NotApplied(Fleet):
    """A fleet that never saw the action it is asked about: a take-over redoes it."""

    async def applied(self, order: Order) -> bool | None:
        return False


async def test_a_change_a_take_over_redoes_mid_tick_holds_another_pools_restart() -> None:
    """Pool a's restart was recorded started, but the tick failed before it ran: the next tick takes it over and
    redoes it, and pool b's restart, asked for in that tick, waits for it, though the pools were read before it."""
    fleet, clock, store, asks = NotApplied(), VirtualClock(), MemoryStore(), Asks()
    loop = ControlLoop(config=parse_config(FLEET), source=Quiet(), store=store, policies=[asks], actuator=fleet,
                       clock=clock, telemetry=Telemetry())
    stray = await store.create_action(NewAction(None, "enable_eplb", "a", {"change": change_as_dict(Eplb(True)),
                                                                           "from_replicas": 2}, "act", "hot experts on a"),
                                      clock.now())
    await store.transition(stray.id, S.PROPOSED, S.APPROVED, clock.now(), {}, approved_by="rails")
    await store.transition(stray.id, S.APPROVED, S.STARTED, clock.now(), {})
    asks.asks["b"] = Proposal(ActionKind.ENABLE_EPLB, "b", Eplb(True), "hot experts on b")
    clock.advance(30)
    report = await loop.tick()
    assert fleet.log == ["enable_eplb a"], "b's restart waits for a's"
    assert ("b", RailsReason.ROLLOUT_IN_FLIGHT) in [(p.pool, r) for p, r, _ in report.held]
    assert [a.state for a in await store.actions() if a.id == stray.id] == [S.SUCCEEDED]
