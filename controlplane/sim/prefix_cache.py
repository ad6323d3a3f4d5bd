"""Block-level prefix caching over prefix-block hashes, and replaying a trace through caches.

Owns the cache semantics the simulator uses: a request hits the longest prefix of its
`hash_ids` already cached; then every block of the request is touched in prompt order (inserted
if absent), and least-recently-used blocks are evicted beyond the capacity. The access sequence
does not depend on the capacity, so LRU's inclusion (stack) property holds: a larger cache holds
a superset of a smaller one's blocks, and hit ratios never fall as capacity grows. This is the
rule the published Mooncake LRU figures use (shared/reference/datasets.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from controlplane.sim.traces import Request

__all__ = ["CacheAware", "PrefixCache", "ReplayResult", "RoundRobin", "Router", "replay", "replay_capacities"]


class PrefixCache:
    """An LRU cache of prefix blocks with a capacity in blocks (None: unbounded)."""

    __slots__ = ("_blocks", "capacity", "evictions")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.evictions = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def blocks(self) -> list[int]:
        """Cached blocks, least recently used first."""
        return list(self._blocks)

    def match(self, hash_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `hash_ids`, in blocks; changes nothing."""
        cached = self._blocks
        n = 0
        for h in hash_ids:
            if h not in cached:
                break
            n += 1
        return n

    def insert(self, hash_ids: Sequence[int]) -> None:
        """Touch every block in order (inserting the missing ones), then evict down to the capacity."""
        cached = self._blocks
        for h in hash_ids:
            if h in cached:
                cached.move_to_end(h)
            else:
                cached[h] = None
        if self.capacity is not None:
            while len(cached) > self.capacity:
                cached.popitem(last=False)
                self.evictions += 1

    def access(self, hash_ids: Sequence[int]) -> int:
        """A request's lookup: its prefix hit in blocks, after which all its blocks are cached."""
        hit = self.match(hash_ids)
        self.insert(hash_ids)
        return hit


Router = Callable[[Request, Sequence[PrefixCache]], int]
"""Picks the index of the cache (engine) that serves a request."""


class RoundRobin:
    """Requests go to the caches in turn, ignoring their contents."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, request: Request, caches: Sequence[PrefixCache]) -> int:
        i = self._next % len(caches)
        self._next += 1
        return i


class CacheAware:
    """The cache holding the longest prefix of the request, among those not overloaded.

    A cache is a candidate while the requests sent to it exceed the least-loaded cache's by at
    most `max_imbalance` of the mean (and at least one request); ties go to the least loaded.
    Without the bound, a prefix every request shares (Mooncake's block 0) sends all to one cache.
    """

    def __init__(self, max_imbalance: float = 0.1) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance
        self._load: list[int] = []
        self._total = 0

    def __call__(self, request: Request, caches: Sequence[PrefixCache]) -> int:
        if len(self._load) != len(caches):
            self._load = [0] * len(caches)
        load = self._load
        limit = min(load) + max(1.0, self.max_imbalance * self._total / len(caches))
        best = max((i for i in range(len(caches)) if load[i] <= limit),
                   key=lambda i: (caches[i].match(request.hash_ids), -load[i], -i))
        load[best] += 1
        self._total += 1
        return best


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Totals of a replay; hit tokens are hit blocks times the block size, at most the input."""

    requests: int
    blocks: int
    hit_blocks: int
    input_tokens: int
    hit_tokens: int
    per_cache_requests: tuple[int, ...]
    first_arrival_s: float
    last_arrival_s: float

    @property
    def block_hit_ratio(self) -> float:
        """Hit blocks over block references."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Hit prompt tokens over all prompt tokens (requests without hashes count as misses)."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def replay(requests: Iterable[Request], capacity_blocks: int | None, *, caches: int = 1,
           route: Router | None = None) -> ReplayResult:
    """Replay requests in order through `caches` LRU caches of `capacity_blocks` each.

    `route` picks a cache per request (default: round robin); with one cache it is not called.
    """
    if caches < 1:
        raise ValueError(f"caches must be >= 1, got {caches}")
    pool = [PrefixCache(capacity_blocks) for _ in range(caches)]
    chooser: Router = route if route is not None else RoundRobin()
    served = [0] * caches
    n = blocks = hit_blocks = input_tokens = hit_tokens = 0
    first = last = 0.0
    for req in requests:
        if n == 0:
            first = req.arrival_s
        last = req.arrival_s
        n += 1
        i = 0 if caches == 1 else chooser(req, pool)
        served[i] += 1
        input_tokens += req.input_tokens
        hashes = req.hash_ids
        if not hashes:
            continue
        hit = pool[i].access(hashes)
        blocks += len(hashes)
        hit_blocks += hit
        hit_tokens += min(hit * req.block_tokens, req.input_tokens)
    return ReplayResult(n, blocks, hit_blocks, input_tokens, hit_tokens, tuple(served), first, last)


def replay_capacities(requests: Iterable[Request], capacities: Sequence[int | None]) -> dict[int | None, ReplayResult]:
    """One pass over the requests through one global LRU cache per capacity (None: unbounded)."""
    pool = {cap: PrefixCache(cap) for cap in capacities}
    hits = dict.fromkeys(pool, 0)
    hit_tokens = dict.fromkeys(pool, 0)
    n = blocks = input_tokens = 0
    first = last = 0.0
    for req in requests:
        if n == 0:
            first = req.arrival_s
        last = req.arrival_s
        n += 1
        input_tokens += req.input_tokens
        hashes = req.hash_ids
        if not hashes:
            continue
        blocks += len(hashes)
        for cap, cache in pool.items():
            hit = cache.access(hashes)
            hits[cap] += hit
            hit_tokens[cap] += min(hit * req.block_tokens, req.input_tokens)
    return {cap: ReplayResult(n, blocks, hits[cap], input_tokens, hit_tokens[cap], (n,), first, last) for cap in pool}
