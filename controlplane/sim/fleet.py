"""The simulated fleet: engines with prefix caches, queueing and KV usage, advanced in steps.

Requests enter the prefill pool through a router (cache-aware or round-robin), hand their KV
to the decode pool, and every engine keeps vLLM's counters and histograms. Deterministic for
a given seed. Time is whatever the caller passes to `advance_to`.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from collectors.types import Role
from controlplane.sim.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS

__all__ = ["FleetSpec", "PoolSpec", "Router", "SimEngine", "SimFleet", "Traffic"]

BLOCK_TOKENS = 16


class Router(StrEnum):
    """How the prefill router picks an engine."""

    CACHE_AWARE = "cache_aware"  # requests sharing a prefix go to the same engine
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Traffic:
    """The workload: Zipf-popular shared prefixes (system prompts, conversations)."""

    rate: float = 24.0  # requests per second into the fleet
    prefix_groups: int = 96
    zipf_s: float = 0.6
    prefix_tokens: int = 2048
    unique_tokens: int = 512
    output_tokens: int = 256


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One simulated pool."""

    name: str
    role: Role
    replicas: int
    kv_blocks: int = 4096
    prefill_tokens_per_s: float = 16_000.0
    base_tpot_s: float = 0.02
    startup_s: float = 120.0  # from scale-up to serving, as a pod pulling weights would


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The whole simulated fleet."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    pools: tuple[PoolSpec, ...] = (
        PoolSpec("prefill", Role.PREFILL, 3, kv_blocks=4096),
        PoolSpec("decode", Role.DECODE, 3, kv_blocks=16_384),
    )
    traffic: Traffic = Traffic()
    seed: int = 7


class _Hist:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0.0] * (len(self.bounds) + 1)  # last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float, n: float = 1.0) -> None:
        lo, hi = 0, len(self.bounds)
        while lo < hi:  # first bound >= value
            mid = (lo + hi) // 2
            if self.bounds[mid] < value:
                lo = mid + 1
            else:
                hi = mid
        self.counts[lo] += n
        self.sum += value * n


@dataclass(eq=False)
class SimEngine:
    """One simulated vLLM engine (a pod with one data-parallel rank)."""

    pool: str
    pod: str
    role: Role
    model: str
    kv_blocks: int
    started_at: float
    ready_at: float
    draining: bool = False
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, _Hist] = field(default_factory=dict)
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # prefix group -> blocks (LRU order)
    cached_blocks: int = 0
    url: str | None = None

    def __post_init__(self) -> None:
        for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                     "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits"):
            self.counters.setdefault(name, 0.0)
        self.histograms = {
            "vllm:time_to_first_token_seconds": _Hist(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": _Hist(ITL_BUCKETS),
            "vllm:request_time_per_output_token_seconds": _Hist(ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": _Hist(LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": _Hist(LATENCY_BUCKETS),
        }

    def lookup(self, group: int, blocks: int) -> bool:
        """Prefix-cache lookup of a group's blocks; inserts on a miss, evicting LRU groups."""
        if group in self.cache:
            self.cache.move_to_end(group)
            return True
        self.cache[group] = blocks
        self.cached_blocks += blocks
        return False

    def evict_to(self, capacity_blocks: int) -> None:
        """Evict least-recently-used prefixes until they fit in the free KV blocks."""
        while self.cached_blocks > capacity_blocks and self.cache:
            _, blocks = self.cache.popitem(last=False)
            self.cached_blocks -= blocks


@dataclass(slots=True)
class _Request:
    group: int
    prompt: int
    output: int
    hit_tokens: int = 0
    ttft: float = 0.0


class SimFleet:
    """Engines grouped in pools; `advance_to(t)` moves the whole fleet forward to time t."""

    def __init__(self, spec: FleetSpec, now: float) -> None:
        self.spec = spec
        self.now = now
        self.rng = random.Random(spec.seed)
        self.router = Router.CACHE_AWARE
        self.desired: dict[str, int] = {}
        self.engines: dict[str, list[SimEngine]] = {}
        self._serial: dict[str, int] = {}
        self._rr: dict[str, int] = {}
        t = spec.traffic
        weights = [1.0 / (k + 1) ** t.zipf_s for k in range(t.prefix_groups)]
        total = sum(weights)
        self._cum: list[float] = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self._cum.append(acc)
        for pool in spec.pools:
            self.desired[pool.name] = pool.replicas
            self.engines[pool.name] = []
            for _ in range(pool.replicas):
                self._add_engine(pool, ready_at=now)

    # shape ------------------------------------------------------------------------------------

    def pool_spec(self, name: str) -> PoolSpec:
        """The spec of pool `name`."""
        return next(p for p in self.spec.pools if p.name == name)

    def _add_engine(self, pool: PoolSpec, ready_at: float) -> SimEngine:
        n = self._serial.get(pool.name, 0)
        self._serial[pool.name] = n + 1
        engine = SimEngine(pool.name, f"{pool.name}-{n}", pool.role, self.spec.model, pool.kv_blocks,
                           started_at=self.now, ready_at=ready_at)
        self.engines[pool.name].append(engine)
        return engine

    def scale(self, pool: str, replicas: int) -> None:
        """Set a pool's desired replicas: new engines start after the pool's startup time."""
        spec = self.pool_spec(pool)
        self.desired[pool] = replicas
        live = [e for e in self.engines[pool] if not e.draining]
        for _ in range(replicas - len(live)):
            self._add_engine(spec, ready_at=self.now + spec.startup_s)
        for engine in live[replicas:] if replicas < len(live) else []:
            engine.draining = True

    def ready(self, pool: str) -> list[SimEngine]:
        """Engines of a pool that serve traffic now."""
        return [e for e in self.engines[pool] if e.ready_at <= self.now and not e.draining]

    def set_router(self, router: Router) -> None:
        """Switch the prefill router (a fault when it leaves cache-aware)."""
        self.router = router

    # time -------------------------------------------------------------------------------------

    def advance_to(self, t: float, step_s: float = 5.0) -> None:
        """Simulate traffic up to time `t` in steps of at most `step_s`."""
        while self.now < t - 1e-9:
            dt = min(step_s, t - self.now)
            self.now += dt
            for pool in self.engines:
                self.engines[pool] = [e for e in self.engines[pool] if not (e.draining and e.running < 0.5)]
            self._step(dt)

    def _arrivals(self, dt: float) -> list[_Request]:
        t = self.spec.traffic
        n = _poisson(self.rng, t.rate * dt)
        out = []
        for _ in range(n):
            group = min(bisect_left(self._cum, self.rng.random()), len(self._cum) - 1)
            out.append(_Request(group, t.prefix_tokens + t.unique_tokens, t.output_tokens))
        return out

    def _pick(self, pool: str, engines: list[SimEngine], req: _Request, cache_aware: bool) -> SimEngine:
        if cache_aware:
            return engines[req.group % len(engines)]
        i = self._rr.get(pool, 0)
        self._rr[pool] = i + 1
        return engines[i % len(engines)]

    def _step(self, dt: float) -> None:
        requests = self._arrivals(dt)
        prefill = [p for p in self.spec.pools if p.role is Role.PREFILL]
        decode = [p for p in self.spec.pools if p.role is Role.DECODE]
        if prefill:
            self._prefill(prefill[0], requests, dt)
        if decode:
            self._decode(decode[0], requests, dt, kv_from_remote=bool(prefill))

    def _prefill(self, spec: PoolSpec, requests: list[_Request], dt: float) -> None:
        engines = self.ready(spec.name)
        if not engines:
            return
        per_engine: dict[int, list[_Request]] = {id(e): [] for e in engines}
        prefix_blocks = self.spec.traffic.prefix_tokens // BLOCK_TOKENS
        for req in requests:
            e = self._pick(spec.name, engines, req, self.router is Router.CACHE_AWARE)
            per_engine[id(e)].append(req)
        for e in engines:
            batch = per_engine[id(e)]
            # Prefixes live in KV blocks that running requests do not hold.
            e.evict_to(max(0, int(e.kv_blocks * (1.0 - e.kv_usage))))
            computed = 0
            for req in batch:
                if e.lookup(req.group, prefix_blocks):
                    req.hit_tokens = prefix_blocks * BLOCK_TOKENS
                computed += req.prompt - req.hit_tokens
            e.evict_to(max(0, int(e.kv_blocks * (1.0 - e.kv_usage))))
            rho = min(0.98, computed / (spec.prefill_tokens_per_s * dt)) if dt > 0 else 0.0
            mean_service = computed / max(1, len(batch)) / spec.prefill_tokens_per_s
            wait = rho / (1.0 - rho) * mean_service  # M/M/1 queueing delay
            rate = len(batch) / dt
            e.running = rate * mean_service
            e.waiting = rate * wait
            e.kv_usage = min(1.0, e.running * self._req_blocks() / e.kv_blocks)
            for req in batch:
                service = (req.prompt - req.hit_tokens) / spec.prefill_tokens_per_s
                req.ttft = (service + wait) * self.rng.lognormvariate(0.0, 0.15)
                e.histograms["vllm:time_to_first_token_seconds"].observe(req.ttft)
                e.histograms["vllm:request_queue_time_seconds"].observe(wait)
                e.histograms["vllm:e2e_request_latency_seconds"].observe(req.ttft)
                e.finished["length"] = e.finished.get("length", 0.0) + 1
                e.counters["vllm:prompt_tokens"] += req.prompt
                e.counters["vllm:generation_tokens"] += 1
                e.counters["vllm:prefix_cache_queries"] += req.prompt
                e.counters["vllm:prefix_cache_hits"] += req.hit_tokens

    def _decode(self, spec: PoolSpec, requests: list[_Request], dt: float, kv_from_remote: bool) -> None:
        engines = self.ready(spec.name)
        if not engines:
            return
        per_engine: dict[int, list[_Request]] = {id(e): [] for e in engines}
        for req in requests:
            per_engine[id(self._pick(spec.name, engines, req, cache_aware=False))].append(req)
        blocks = self._req_blocks() + self.spec.traffic.output_tokens // (2 * BLOCK_TOKENS)
        for e in engines:
            batch = per_engine[id(e)]
            tpot = spec.base_tpot_s * (1.0 + 0.6 * e.kv_usage)
            rate = len(batch) / dt
            e.running = rate * tpot * self.spec.traffic.output_tokens
            demand = e.running * blocks / e.kv_blocks
            e.kv_usage = min(1.0, demand)
            e.waiting = max(0.0, (demand - 1.0) * e.kv_blocks / blocks)
            if demand > 1.0:
                e.counters["vllm:num_preemptions"] += (demand - 1.0) * e.kv_blocks / blocks * dt / 10.0
            for req in batch:
                jitter = self.rng.lognormvariate(0.0, 0.1)
                per_token = tpot * jitter
                decode_time = per_token * (req.output - 1)
                e.histograms["vllm:inter_token_latency_seconds"].observe(per_token, req.output - 1)
                e.histograms["vllm:request_time_per_output_token_seconds"].observe(per_token)
                e.histograms["vllm:time_to_first_token_seconds"].observe(req.ttft + 0.005)
                e.histograms["vllm:e2e_request_latency_seconds"].observe(req.ttft + decode_time)
                e.histograms["vllm:request_queue_time_seconds"].observe(0.0)
                e.finished["stop"] = e.finished.get("stop", 0.0) + 1
                e.counters["vllm:prompt_tokens"] += req.prompt
                e.counters["vllm:generation_tokens"] += req.output
                # The prompt's KV arrives from the prefill engine over NIXL; a decode engine
                # without a prefill pool would look up its local prefix cache instead.
                if kv_from_remote:
                    e.counters["vllm:external_prefix_cache_queries"] += req.prompt
                    e.counters["vllm:external_prefix_cache_hits"] += req.prompt

    def _req_blocks(self) -> int:
        t = self.spec.traffic
        return math.ceil((t.prefix_tokens + t.unique_tokens) / BLOCK_TOKENS)


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 50:  # normal approximation keeps big steps cheap
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
