"""The simulator as an actuator: every kind it supports changes the simulated fleet as the real one
would change, and what it cannot do is an ActuationError that names the action."""

from __future__ import annotations

import pytest

from controlplane.actuators.base import Order
from controlplane.errors import ActuationError
from controlplane.sim.actuator import SimActuator
from controlplane.sim.fleet import SimFleet
from controlplane.sim.routing import RouterKind
from controlplane.sim.scenario import load_scenario
from policies.types import ActionKind, Change, Cordon, Drain, Eplb, RollBack, ScaleTo, Speculation


def fleet(name: str) -> SimFleet:
    sc = load_scenario(name)
    return SimFleet(sc.fleet_spec(), sc.requests(), now=1000.0)


async def do(act: SimActuator, kind: ActionKind, pool: str, change: Change) -> dict:
    return await act.carry_out(Order(1, kind, pool, change, "test"))


async def test_scale_and_what_observe_sees() -> None:
    f = fleet("router-flip")
    act = SimActuator(f)
    assert ActionKind.ADMISSION_CONTROL not in act.kinds and ActionKind.ROLLBACK in act.kinds
    view = await act.observe()
    assert (view.pools["prefill"].desired, view.pools["prefill"].ready) == (3, 3)
    assert await do(act, ActionKind.SCALE_POOL, "prefill", ScaleTo(4)) == {"replicas": 4, "from_replicas": 3}
    view = await act.observe()
    assert (view.pools["prefill"].desired, view.pools["prefill"].ready) == (4, 3)  # the new engine is starting
    f.advance_to(1000.0 + 121.0)
    assert (await act.observe()).pools["prefill"].ready == 4


async def test_the_router_rolls_back_to_its_previous_revision() -> None:
    f = fleet("router-flip")
    act = SimActuator(f)
    with pytest.raises(ActuationError, match="rollback on prefill: the router has no previous revision"):
        await do(act, ActionKind.ROLLBACK, "prefill", RollBack("router"))
    f.advance_to(1500.0)
    f.set_router(RouterKind.ROUND_ROBIN)  # a bad config push
    assert (await act.observe()).changed_at["router"] == 1500.0
    assert await do(act, ActionKind.ROLLBACK, "prefill", RollBack("router")) == {"router": "cache_aware"}
    assert f.router_kind is RouterKind.CACHE_AWARE


async def test_speculation_off_and_back_on_with_its_method() -> None:
    f = fleet("json-surge")
    act = SimActuator(f)
    pool = next(p for p, s in f.pool_specs.items() if s.spec.method != "none")
    before = f.pool_specs[pool].spec
    done = await do(act, ActionKind.TUNE_SPECULATION, pool, Speculation(step=-1))
    assert done["num_speculative_tokens"] == before.num_speculative_tokens - 1
    await do(act, ActionKind.DISABLE_SPECULATION, pool, Speculation(0))
    assert f.pool_specs[pool].spec.method == "none"
    await do(act, ActionKind.TUNE_SPECULATION, pool, Speculation(before.num_speculative_tokens))  # a revert
    assert f.pool_specs[pool].spec == before.__class__(before.method, before.num_speculative_tokens)


async def test_eplb_on_and_off() -> None:
    f = fleet("hot-expert")
    act = SimActuator(f)
    pool = next(p for p, s in f.pool_specs.items() if s.moe is not None)
    await do(act, ActionKind.ENABLE_EPLB, pool, Eplb(True, 1000, 3000, 4))
    assert f.pool_specs[pool].eplb is not None and f.pool_specs[pool].eplb.num_redundant_experts == 4
    await do(act, ActionKind.DISABLE_EPLB, pool, Eplb(False))
    assert f.pool_specs[pool].eplb is None


async def test_drain_and_cordon_replace_the_engines() -> None:
    f = fleet("gpu-xid")
    act = SimActuator(f)
    pool = next(iter(f.members))
    pod = f.members[pool][0].pod
    f.members[pool][0].gpu.xid = 79
    done = await do(act, ActionKind.CORDON_NODE, pool, Cordon(f"node-{pod}"))
    assert done["evicted"] == [pod] and len(done["replacements"]) == 1
    old = f.member(pod)
    assert old.draining and pod not in [m.pod for m in f.ready(pool)]
    new = f.member(done["replacements"][0])
    assert new.gpu.xid == 0 and not new.draining
    other = f.members[pool][1].pod
    assert (await do(act, ActionKind.DRAIN_ENGINE, pool, Drain(other)))["drained"] == other
    with pytest.raises(ActuationError, match="is draining already"):
        await do(act, ActionKind.DRAIN_ENGINE, pool, Drain(other))
    with pytest.raises(ActuationError, match="no engine runs on node node-nowhere"):
        await do(act, ActionKind.CORDON_NODE, pool, Cordon("node-nowhere"))
