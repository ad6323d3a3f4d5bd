"""The block-level LRU prefix cache: hit semantics, capacity, LRU's inclusion property under
random workloads, routing over several caches, and a slice of the real Mooncake trace."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim.prefix_cache import PrefixCache, replay, replay_capacities
from controlplane.sim.traces import Request, load_trace


def req(hashes: list[int] | tuple[int, ...], tokens: int | None = None, block: int = 4) -> Request:
    return Request(0.0, tokens if tokens is not None else len(hashes) * block, 1, tuple(hashes), block if hashes else 0)


def test_hit_is_the_longest_cached_prefix() -> None:
    cache = PrefixCache(10)
    assert cache.access([1, 2, 3]) == 0
    assert cache.access([1, 2, 4]) == 2
    assert cache.access([5, 2, 3]) == 0  # 2 and 3 are cached but not as a prefix
    assert cache.access([1, 2, 3, 9]) == 3
    assert len(cache) == 6


def test_lru_evicts_least_recently_touched() -> None:
    cache = PrefixCache(3)
    cache.access([1, 2])
    cache.access([3])
    cache.access([1])  # 1 is now the most recent, 2 the least
    cache.access([4])
    assert cache.blocks() == [3, 1, 4] and 2 not in cache and cache.evictions == 1


def test_request_longer_than_the_cache_keeps_its_tail() -> None:
    cache = PrefixCache(2)
    assert cache.access([1, 2, 3]) == 0
    assert cache.blocks() == [2, 3]
    assert cache.access([1, 2, 3]) == 0  # its head was evicted by its own tail


def test_zero_and_unbounded_capacity() -> None:
    zero = PrefixCache(0)
    assert zero.access([1]) == 0 and zero.access([1]) == 0 and len(zero) == 0
    big = PrefixCache(None)
    big.access(list(range(10_000)))
    assert len(big) == 10_000 and big.access([0, 1, 2]) == 3
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_match_changes_nothing() -> None:
    cache = PrefixCache(2)
    cache.access([1, 2])
    assert cache.match([1, 2, 3]) == 2
    assert cache.blocks() == [1, 2]


def test_replay_counts_blocks_and_caps_tokens_at_the_input() -> None:
    requests = [req([1, 2], tokens=7), req([1, 2], tokens=7), req([], tokens=100)]
    r = replay(requests, 10)
    assert (r.requests, r.blocks, r.hit_blocks, r.input_tokens, r.hit_tokens) == (3, 4, 2, 114, 7)
    assert r.block_hit_ratio == 0.5 and r.token_hit_ratio == pytest.approx(7 / 114)


def test_empty_replay() -> None:
    r = replay([], 10)
    assert r.requests == 0 and r.block_hit_ratio == 0.0 and r.token_hit_ratio == 0.0


def test_replay_capacities_equals_one_cache_each() -> None:
    requests = [req([i % 5, i % 7, i % 11]) for i in range(300)]
    together = replay_capacities(requests, [1, 4, 16, None])
    for cap, result in together.items():
        cache = PrefixCache(cap)
        hits = [cache.access(r.hash_ids) for r in requests]
        assert (result.requests, result.blocks) == (300, 900)
        assert result.hit_blocks == sum(hits)
        assert result.hit_tokens == sum(min(h * 4, r.input_tokens) for h, r in zip(hits, requests, strict=True))


# properties -------------------------------------------------------------------------------------

workloads = st.lists(st.lists(st.integers(0, 30), min_size=0, max_size=8), min_size=1, max_size=60)


def naive_lru(requests: list[list[int]], capacity: int) -> list[int]:
    """A list-based reference: front is least recent."""
    order: list[int] = []
    hits = []
    for hashes in requests:
        n = 0
        for h in hashes:
            if h not in order:
                break
            n += 1
        hits.append(n)
        for h in hashes:
            if h in order:
                order.remove(h)
            order.append(h)
        del order[: max(0, len(order) - capacity)]
    return hits


@settings(max_examples=300, deadline=None)
@given(workloads, st.integers(0, 40))
def test_matches_a_naive_lru_and_respects_capacity(requests: list[list[int]], capacity: int) -> None:
    cache = PrefixCache(capacity)
    hits = []
    for hashes in requests:
        hit = cache.access(hashes)
        assert 0 <= hit <= len(hashes)
        assert len(cache) <= capacity
        hits.append(hit)
    assert hits == naive_lru(requests, capacity)
    total = sum(len(h) for h in requests)
    assert sum(hits) <= total


@settings(max_examples=300, deadline=None)
@given(workloads, st.integers(0, 20), st.integers(0, 20))
def test_stack_property_and_monotone_hit_ratio(requests: list[list[int]], small: int, extra: int) -> None:
    a, b = PrefixCache(small), PrefixCache(small + extra)
    hits_a = hits_b = 0
    for hashes in requests:
        ha, hb = a.access(hashes), b.access(hashes)
        assert ha <= hb  # per request, not only in total
        hits_a += ha
        hits_b += hb
        assert set(a.blocks()) <= set(b.blocks())  # inclusion: the smaller cache is a subset
    ra = replay([req(h) for h in requests], small)
    rb = replay([req(h) for h in requests], small + extra)
    assert (ra.hit_blocks, rb.hit_blocks) == (hits_a, hits_b)
    assert ra.block_hit_ratio <= rb.block_hit_ratio and ra.token_hit_ratio <= rb.token_hit_ratio


@settings(max_examples=200, deadline=None)
@given(workloads)
def test_capacity_of_every_distinct_block_equals_unbounded(requests: list[list[int]]) -> None:
    distinct = len({h for hashes in requests for h in hashes})
    wrapped = [req(h) for h in requests]
    assert replay(wrapped, distinct) == replay(wrapped, None)


# real data ------------------------------------------------------------------------------------


def test_mooncake_slice_hit_ratio_grows_with_capacity() -> None:
    requests = list(itertools.islice(load_trace("mooncake/conversation"), 2000))
    results = replay_capacities(requests, [100, 1000, 5000, None])
    ratios = [results[c].token_hit_ratio for c in (100, 1000, 5000, None)]
    assert ratios == sorted(ratios)
    assert 0.0 < ratios[0] < ratios[-1] < 1.0
    assert all(r.blocks == results[None].blocks for r in results.values())
