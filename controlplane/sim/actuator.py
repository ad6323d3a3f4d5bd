"""The simulator as an actuator: every kind of action the simulated fleet can take, as the
Kubernetes actuator would carry it out on a real one, so an evaluation measures what acting achieves.

Scaling adds engines that serve after the pool's start-up time and drains removed ones; a
speculative or EPLB change applies to the pool's engines (vLLM restarts them with new arguments);
a rollback returns the router or a pool to its previous revision; a drain takes an engine out of
routing, lets it finish and starts a replacement; a cordon does the same for every engine on the
node (one engine per node here). Admission control is not modelled.
"""

from __future__ import annotations

from typing import Any

from controlplane.actuators.base import FleetView, Order, PoolReplicas
from controlplane.errors import ActuationError
from controlplane.sim.exporters import node_of
from controlplane.sim.fleet import SimFleet
from controlplane.sim.moe import EplbConfig
from controlplane.sim.speculation import SpecConfig
from policies.types import ActionKind, Cordon, Drain, Eplb, RollBack, ScaleTo, Speculation

__all__ = ["SimActuator"]


class SimActuator:
    """Carries out actions on the simulated fleet."""

    name = "simulator"
    dry_run = False
    kinds = frozenset(set(ActionKind) - {ActionKind.ADMISSION_CONTROL})

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        # The method each pool speculated with, so speculation switched off can come back as it was.
        self._methods = {name: spec.spec.method for name, spec in fleet.pool_specs.items() if spec.spec.method != "none"}

    async def observe(self) -> FleetView:
        f = self.fleet
        # Ready as a workload counts them: old and new revisions alike, draining ones not.
        pools = {pool: PoolReplicas(f.desired[pool], len(f.ready(pool))) for pool in f.members}
        return FleetView(pools, dict(f.changed_at))

    async def carry_out(self, order: Order) -> dict[str, Any]:
        try:
            return self._apply(order)
        except (KeyError, ValueError) as exc:
            raise ActuationError(f"{order.kind} on {order.pool}: {exc}") from None

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        return {}  # the simulated fleet drains on its own; nothing here waits

    async def applied(self, order: Order) -> bool | None:
        return None  # a simulation restarts with its fleet, so it never takes over mid-action

    def _apply(self, order: Order) -> dict[str, Any]:
        f, change, pool = self.fleet, order.change, order.pool
        if isinstance(change, ScaleTo):
            before = f.desired[pool]
            f.scale(pool, change.replicas)
            return {"replicas": change.replicas, "from_replicas": before}
        if isinstance(change, Speculation):
            current = f.pool_specs[pool].spec
            n = change.resolve(current.num_speculative_tokens)
            method = current.method if current.method != "none" else self._methods.get(pool)
            if n > 0 and method is None:
                raise ValueError(f"{pool} never speculated: no method to turn back on")
            f.set_speculation(pool, SpecConfig(method or "none", n) if n > 0 else SpecConfig())
            return {"num_speculative_tokens": n, "from": current.num_speculative_tokens, "method": method}
        if isinstance(change, Eplb):
            config = EplbConfig(change.window_size, change.step_interval, change.num_redundant_experts)
            f.set_eplb(pool, config if change.enabled else None)
            return {"eplb": change.enabled}
        if isinstance(change, RollBack):
            if change.workload == "router":
                return {"router": str(f.rollback_router())}
            f.rollback(change.workload)
            return {"rolled_back": change.workload}
        if isinstance(change, Drain):
            return {"drained": change.pod, "replacement": f.replace(change.pod)}
        if isinstance(change, Cordon):
            on_node = [m.pod for ms in f.members.values() for m in ms if node_of(m.pod) == change.node and not m.draining]
            if not on_node:
                raise ValueError(f"no engine runs on node {change.node}")
            return {"cordoned": change.node, "evicted": on_node, "replacements": [f.replace(p) for p in on_node]}
        raise ValueError(f"the simulator cannot carry out {type(change).__name__}")
