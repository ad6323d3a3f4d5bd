"""Dry-run actuator: records what it would do and changes nothing.

Used by `fleetctl run` until a Kubernetes actuator is configured; replicas are read from the
number of targets each pool has.
"""

from __future__ import annotations

from collections import Counter

from controlplane.actuators.base import PoolReplicas, TargetSource

__all__ = ["DryRunActuator"]


class DryRunActuator:
    """Observes replicas from the target list; `scale` only remembers the request."""

    name = "dry_run"
    dry_run = True

    def __init__(self, targets: TargetSource, pools: list[str]) -> None:
        self._targets = targets
        self._pools = pools
        self.requested: list[tuple[str, int]] = []

    async def observe(self) -> dict[str, PoolReplicas]:
        counts = Counter(t.pool for t in await self._targets.targets())
        return {p: PoolReplicas(counts.get(p, 0), counts.get(p, 0)) for p in self._pools}

    async def scale(self, pool: str, replicas: int) -> None:
        self.requested.append((pool, replicas))
