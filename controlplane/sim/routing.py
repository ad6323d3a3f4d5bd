"""Routers that pick an engine for each request, as the gateways in front of vLLM pools do.

`cache_aware` scores every endpoint the way llm-d's endpoint picker weighs its scorers in the
shipped precise-prefix configuration: prefix-cache match 2.0, KV-cache utilization 1.0, queue
1.0, then the highest total wins. The prefix score is the share of the prompt's blocks found in
the engine's cache; KV utilization scores 1 - usage; the queue scorer (max - q) / (max - min),
1.0 for every endpoint when all queues are equal. Engines whose queue is more than `spill`
requests longer than the shortest are left out first, as AIBrix's prefix-cache router falls back to
the least-loaded engines when load is imbalanced: otherwise engines that hold every shared prefix
keep winning while engines added to the pool stand idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from controlplane.sim.engine import SimRequest
    from controlplane.sim.fleet import Member

__all__ = ["ROUTERS", "CacheAware", "LeastLoaded", "RoundRobin", "Router", "RouterKind"]


class RouterKind(StrEnum):
    """The routers a pool can run."""

    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


class Router(Protocol):
    """Picks the engine for one request."""

    def pick(self, req: SimRequest, members: Sequence[Member]) -> Member:
        """The chosen engine among `members` (never empty)."""
        ...


class RoundRobin:
    """Each request to the next engine in turn."""

    def __init__(self) -> None:
        self._i = 0

    def pick(self, req: SimRequest, members: Sequence[Member]) -> Member:
        self._i += 1
        return members[self._i % len(members)]


class LeastLoaded:
    """The engine with the fewest requests in it; ties go round the ring."""

    def __init__(self) -> None:
        self._i = 0

    def pick(self, req: SimRequest, members: Sequence[Member]) -> Member:
        self._i += 1
        n = len(members)
        return min((members[(self._i + j) % n] for j in range(n)), key=lambda m: m.load)


class CacheAware:
    """llm-d-style weighted scoring: prefix match, KV utilization and queue length."""

    def __init__(self, prefix_weight: float = 2.0, kv_weight: float = 1.0, queue_weight: float = 1.0,
                 spill: int = 8) -> None:
        self.weights = (prefix_weight, kv_weight, queue_weight)
        self.spill = spill
        self._i = 0

    def pick(self, req: SimRequest, members: Sequence[Member]) -> Member:
        self._i += 1
        wp, wk, wq = self.weights
        queues = [m.engine.queue_len for m in members]
        lo, hi = min(queues), max(queues)
        if hi - lo > self.spill:
            members = [m for m, q in zip(members, queues, strict=True) if q <= lo + self.spill]
            queues = [m.engine.queue_len for m in members]
            lo, hi = min(queues), max(queues)
        blocks = len(req.hash_ids)
        best, best_score = members[0], -1.0
        n = len(members)
        for j in range(n):
            k = (self._i + j) % n  # rotate the start so ties spread
            m = members[k]
            prefix = m.engine.prefix_match(req.hash_ids) / blocks if blocks else 0.0
            queue = 1.0 if hi == lo else (hi - queues[k]) / (hi - lo)
            score = wp * prefix + wk * (1.0 - m.engine.kv_usage) + wq * queue
            if score > best_score:
                best, best_score = m, score
        return best


ROUTERS: dict[RouterKind, Callable[[], Router]] = {
    RouterKind.ROUND_ROBIN: RoundRobin,
    RouterKind.LEAST_LOADED: LeastLoaded,
    RouterKind.CACHE_AWARE: CacheAware,
}
