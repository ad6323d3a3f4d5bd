"""The HPA/KEDA-style rule the autoscaler is measured against, as production-stack and llm-d ship it.

Per pool, the Kubernetes HPA formula over two metrics averaged over the pool's engines: KV-cache
usage against 0.8 (llm-d's saturation threshold) and waiting requests per replica against 5
(production-stack's KEDA trigger on `vllm:num_requests_waiting`): `ceil(replicas * metric / target)`,
the larger of the two, nothing done within a 10 % tolerance, scale-up at once and scale-down held to
the highest recommendation of the last five minutes (HPA's default stabilisation windows).
"""

from __future__ import annotations

import math

from pydantic import Field

from catalog.settings import Seconds, Settings
from policies.autoscale import PoolPlan, Unplanned, stabilised
from policies.types import PolicyInput, PoolState

__all__ = ["HpaRule", "HpaSettings"]


class HpaSettings(Settings):
    """The rule's targets and windows, HPA's and the shipped charts' defaults."""

    kv_usage: float = Field(0.8, gt=0, le=1)
    waiting_per_replica: float = Field(5.0, gt=0)
    tolerance: float = Field(0.1, ge=0, lt=1)
    scale_down_stabilization: Seconds = 300.0


class HpaRule:
    """Replica counts from KV usage and queue length per replica, as an HPA or KEDA object sets them."""

    name = "hpa"

    def __init__(self, settings: HpaSettings | None = None) -> None:
        self.settings = settings or HpaSettings()

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan | Unplanned:
        """The replicas the rule sets the pool to, or why not: before it reports KV usage and a queue."""
        s, subject = self.settings, f"pool/{pool.name}"
        kv = inp.windows.latest(subject, "kv_cache_usage")
        waiting = inp.windows.latest(subject, "requests_waiting")
        if pool.desired <= 0:
            return Unplanned(pool.name, "scaled to zero: the rule starts no pool from nothing")
        if kv is None or waiting is None:
            return Unplanned(pool.name, "no KV usage or queue reported yet")
        engines = max(1.0, inp.windows.latest(subject, "engines_reporting") or pool.ready)
        ratio = max(kv / s.kv_usage, waiting / engines / s.waiting_per_replica)
        # Never below one: an HPA's minReplicas is at least 1, and from zero the rule could not start the pool again.
        recommended = pool.desired if abs(ratio - 1.0) <= s.tolerance else max(1, math.ceil(pool.desired * ratio))
        target = stabilised(inp.windows, subject, inp.now, s.scale_down_stabilization, recommended, pool.desired)
        target = max(pool.min_replicas, min(pool.max_replicas, int(target)))
        reason = (f"{pool.name}: KV usage {kv:.0%} (target {s.kv_usage:.0%}), {waiting / engines:.1f} waiting per "
                  f"replica (target {s.waiting_per_replica:g}): {recommended} replicas")
        return PoolPlan(pool.name, pool.desired, pool.ready, target, recommended, reason,
                        {"kv_usage": round(kv, 3), "waiting_per_replica": round(waiting / engines, 2)})
