"""Dry-run actuator: records what it would do and changes nothing.

Used by `fleetctl run` when no actuator is configured; replicas are read from the number of
targets each pool has. Every action it carries out ends `dry_run` in the audit log.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from controlplane.actuators.base import ALL_KINDS, FleetView, Order, PoolReplicas, TargetSource
from policies.types import change_as_dict

__all__ = ["DryRunActuator"]


class DryRunActuator:
    """Observes replicas from the target list; `carry_out` only remembers the order."""

    name = "dry_run"
    dry_run = True
    kinds = ALL_KINDS

    def __init__(self, targets: TargetSource, pools: list[str]) -> None:
        self._targets = targets
        self._pools = pools
        self.orders: list[Order] = []

    async def observe(self) -> FleetView:
        counts = Counter(t.pool for t in await self._targets.targets())
        return FleetView({p: PoolReplicas(counts.get(p, 0), counts.get(p, 0)) for p in self._pools})

    async def carry_out(self, order: Order) -> dict[str, Any]:
        self.orders.append(order)
        return {"would": change_as_dict(order.change)}

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        return {}  # it never waits

    async def applied(self, order: Order) -> bool | None:
        return None  # it changes nothing, so there is nothing to find
