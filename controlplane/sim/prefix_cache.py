"""Block-level prefix caching over prefix-block hashes, and replaying a trace through caches.

Owns the cache semantics the simulator uses: a request hits the longest prefix of its
`hash_ids` already cached; then every block of the request is touched in prompt order (inserted
if absent), and least-recently-used blocks are evicted beyond the capacity. The access sequence
does not depend on the capacity, so LRU's inclusion (stack) property holds: a larger cache holds
a superset of a smaller one's blocks, and hit ratios never fall as capacity grows. This is the
rule behind the Mooncake LRU hit ratios published with the traces, against which
`fleetctl sim validate` checks the traces. The engines keep their own cache (`engine.py`): vLLM's,
where blocks that running requests hold cannot be evicted; routing lives in `routing.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.sim.traces import Request

__all__ = ["PrefixCache", "ReplayResult", "replay", "replay_capacities"]


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


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Totals of a replay; hit tokens are hit blocks times the block size, at most the input."""

    requests: int
    blocks: int
    hit_blocks: int
    input_tokens: int
    hit_tokens: int
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


def replay(requests: Iterable[Request], capacity_blocks: int | None) -> ReplayResult:
    """Replay requests in order through one LRU cache of `capacity_blocks` (None: unbounded)."""
    return replay_capacities(requests, [capacity_blocks])[capacity_blocks]


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
    return {cap: ReplayResult(n, blocks, hits[cap], input_tokens, hit_tokens[cap], first, last) for cap in pool}
