"""One simulated vLLM engine: the V1 scheduler's continuous batching over a block KV cache.

What it models, per scheduler iteration: admission of waiting requests while KV blocks last
(FCFS, up to `max_num_seqs`), prefix-cache lookups over the prompt's block hashes with LRU
eviction of cached blocks nobody holds, chunked prefill within a token budget beside the decode
batch, preemption (recompute) of the newest request when decode growth runs out of blocks,
speculative decoding (tokens per step from per-position acceptance of the traffic class) and the
MoE expert-parallel slowdown of the hottest rank. Step times come from the calibrated `PerfModel`.

Iterations with nothing but decode are run in bulk ("macro steps") up to the next event: the
first request to finish, the block budget, or the time asked for. That keeps a one-hour replay
of thousands of requests on dozens of engines to seconds, with per-token histograms exact in
count and step-time resolution.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from controlplane.sim.moe import ExpertParallel
from controlplane.sim.perf import PerfModel
from controlplane.sim.speculation import SpecConfig, step_gain

__all__ = ["BLOCK_TOKENS", "EngineConfig", "Hist", "RankStats", "SimEngine", "SimRequest"]

BLOCK_TOKENS = 16  # vLLM's default KV block size on GPUs


class Hist:
    """A cumulative histogram with fixed bounds, as prometheus_client keeps one."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0.0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float, n: float = 1.0) -> None:
        """Count `n` observations of `value`."""
        lo, hi = 0, len(self.bounds)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bounds[mid] < value:
                lo = mid + 1
            else:
                hi = mid
        self.counts[lo] += n
        self.sum += value * n


@dataclass(slots=True)
class SimRequest:
    """A request as an engine sees it; times are simulation seconds."""

    rid: int
    arrival: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = 0
    cls: str = "text"
    remote_kv: bool = False  # the prompt's KV arrives from a prefill engine (disaggregated decode)
    handoff_at: float | None = None  # when the KV landed on this decode engine
    rank: int = 0
    computed: int = 0  # tokens of `prefill_target` in the KV cache
    prefill_target: int = 0  # the prompt, plus generated tokens to recompute after a preemption
    generated: float = 0.0  # expected tokens so far (speculation makes per-step gains fractional)
    cached_tokens: int = 0
    admitted: float | None = None
    first_token: float | None = None
    blocks: int = 0
    error: bool = False

    @property
    def context(self) -> float:
        """Tokens the sequence attends over now."""
        return self.input_tokens + self.generated


@dataclass(slots=True)
class RankStats:
    """vLLM's counters and histograms for one data-parallel rank (the `engine` label)."""

    counters: dict[str, float] = field(default_factory=dict)
    hists: dict[str, Hist] = field(default_factory=dict)
    per_pos: list[float] = field(default_factory=list)  # accepted tokens per draft position
    finished: dict[str, float] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0

    def add(self, name: str, value: float) -> None:
        """Increase a counter."""
        self.counters[name] = self.counters.get(name, 0.0) + value


KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, bf16: 2 * 32 layers * 8 heads * 128 * 2 bytes


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a vLLM deployment's flags and hardware fix for one engine."""

    kv_blocks: int = 30_000
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192  # chunked prefill's token budget per iteration
    prefill_only: bool = False  # a prefill worker in a disaggregated pool: one token, then hand off
    ranks: int = 1
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN  # what a prompt's KV takes over the link


LATENCY_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                  240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0)
# vLLM's build_1_2_5_buckets up to the longest context the traces hold.
TOKEN_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
HISTOGRAMS = {
    "vllm:request_prompt_tokens": TOKEN_BOUNDS,
    "vllm:request_generation_tokens": TOKEN_BOUNDS,
    "vllm:time_to_first_token_seconds": TTFT_BOUNDS,
    "vllm:inter_token_latency_seconds": ITL_BOUNDS,
    "vllm:request_time_per_output_token_seconds": ITL_BOUNDS,
    "vllm:e2e_request_latency_seconds": LATENCY_BOUNDS,
    "vllm:request_queue_time_seconds": LATENCY_BOUNDS,
    "vllm:request_prefill_time_seconds": LATENCY_BOUNDS,
    "vllm:request_decode_time_seconds": LATENCY_BOUNDS,
}
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
            "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


class SimEngine:
    """One engine (a pod; its data-parallel ranks share one scheduler model here)."""

    def __init__(self, pool: str, pod: str, model: PerfModel, config: EngineConfig, *, now: float,
                 spec: SpecConfig | None = None, moe: ExpertParallel | None = None,
                 on_prefilled: Callable[[SimEngine, SimRequest, float], None] | None = None) -> None:
        self.pool, self.pod, self.model, self.config = pool, pod, model, config
        self.spec = spec or SpecConfig()
        self.moe = moe
        self.on_prefilled = on_prefilled
        self.t = now
        self.started_at = now
        self.slowdown = 1.0  # faults and regressions multiply step times
        self.error_share = 0.0  # share of requests that fail (a broken GPU)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.used_blocks = 0
        self.cache: OrderedDict[int, int] = OrderedDict()  # block hash -> KV blocks it holds, LRU first
        self.cached_blocks = 0
        self.busy_s = 0.0  # time spent in forward passes: the GPU's activity
        self.steps = 0
        self.ranks = [self._fresh_stats() for _ in range(config.ranks)]

    def restart(self, now: float) -> None:
        """A process restart: requests in flight are lost, counters and the prefix cache start from zero."""
        self.t = self.started_at = now
        self.waiting.clear()
        self.running.clear()
        self.used_blocks = 0
        self.drop_cache()
        self.ranks = [self._fresh_stats() for _ in self.ranks]

    def drop_cache(self) -> None:
        """Forget the prefix cache: an engine gone from the fleet is kept for its counters only."""
        self.cache.clear()
        self.cached_blocks = 0

    def _fresh_stats(self) -> RankStats:
        stats = RankStats()
        stats.counters = dict.fromkeys(COUNTERS, 0.0)
        stats.hists = {name: Hist(bounds) for name, bounds in HISTOGRAMS.items()}
        stats.per_pos = [0.0] * max(1, self.spec.num_speculative_tokens)
        return stats

    # load, as routers and the exporters read it ----------------------------------------------

    @property
    def kv_usage(self) -> float:
        """Share of KV blocks held by requests (cached-but-free blocks count as free, as vLLM reports)."""
        return min(1.0, self.used_blocks / self.config.kv_blocks)

    @property
    def queue_len(self) -> int:
        """Requests waiting for admission."""
        return len(self.waiting)

    @property
    def load(self) -> int:
        """Requests in the engine."""
        return len(self.waiting) + len(self.running)

    def idle(self) -> bool:
        """Nothing running or waiting."""
        return not self.waiting and not self.running

    def prefix_match(self, hash_ids: Sequence[int]) -> int:
        """Leading blocks of a prompt found in this engine's prefix cache."""
        n = 0
        for h in hash_ids:
            if h not in self.cache:
                break
            n += 1
        return n

    # the scheduler -----------------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Enqueue a request; the engine must have been advanced to its arrival."""
        req.rank = req.rid % len(self.ranks)
        self.waiting.append(req)

    def run_until(self, t: float) -> None:
        """Run scheduler iterations until the engine's clock reaches `t` (the last may pass it)."""
        while self.t < t:
            if not self.waiting and not self.running:
                self.t = t
                return
            self._iterate(t)

    def _blocks_for(self, tokens: float) -> int:
        return math.ceil(tokens / BLOCK_TOKENS)

    def _free_blocks(self) -> int:
        return self.config.kv_blocks - self.used_blocks

    def _evict_for(self, blocks: int) -> None:
        """Drop least-recently-used cached blocks until `blocks` more can be held."""
        room = self.config.kv_blocks - self.used_blocks - blocks
        while self.cached_blocks > room and self.cache:
            _, n = self.cache.popitem(last=False)
            self.cached_blocks -= n

    def _admit(self, budget: int) -> None:
        """Admit waiting requests FCFS while this iteration's token budget and the KV blocks last.

        As vLLM V1's scheduler does, a request is only taken in when it can start computing now;
        admitting more would hold blocks for prompts nobody works on and evict the prefix cache.
        """
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_for(req.input_tokens + max(1.0, req.generated))
            if need > self._free_blocks():
                if not self.running and need > cfg.kv_blocks:
                    self.waiting.popleft()  # can never fit: vLLM rejects it at the API
                    self._finish(req, "error")
                    continue
                return
            self.waiting.popleft()
            stats = self.ranks[req.rank]
            if req.admitted is None:
                req.admitted = self.t
                stats.hists["vllm:request_queue_time_seconds"].observe(self.t - (req.handoff_at or req.arrival))
                req.prefill_target = req.input_tokens
                if req.remote_kv:
                    stats.add("vllm:external_prefix_cache_queries", req.input_tokens)
                    stats.add("vllm:external_prefix_cache_hits", req.input_tokens)
                    req.computed = req.input_tokens
                else:
                    matched = self.prefix_match(req.hash_ids) * req.block_tokens
                    req.cached_tokens = min(matched, req.input_tokens - 1) if req.input_tokens else 0
                    stats.add("vllm:prefix_cache_queries", req.input_tokens)
                    stats.add("vllm:prefix_cache_hits", req.cached_tokens)
                    req.computed = req.cached_tokens
                for h in req.hash_ids[: self.prefix_match(req.hash_ids)]:
                    self.cache.move_to_end(h)
            self._evict_for(need)
            req.blocks = need
            self.used_blocks += need
            self.running.append(req)
            budget -= max(1, req.prefill_target - req.computed)

    def _cache_prompt(self, req: SimRequest) -> None:
        """A computed prompt's full blocks become reusable prefix-cache entries."""
        if not req.hash_ids or not req.block_tokens:
            return
        per = self._blocks_for(req.block_tokens)
        for h in req.hash_ids:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = per
                self.cached_blocks += per
        self._evict_for(0)

    def _preempt_newest(self) -> SimRequest:
        victim = max(self.running, key=lambda r: r.admitted or 0.0)
        self.running.remove(victim)
        self.used_blocks -= victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.prefill_target = victim.input_tokens + int(victim.generated)
        self.waiting.appendleft(victim)
        self.ranks[victim.rank].add("vllm:num_preemptions", 1)
        return victim

    def step_seconds(self, chunks: Sequence[tuple[int, int]], decoders: Sequence[SimRequest]) -> float:
        """How long one iteration of these prefill chunks (tokens, tokens already cached) and decoders takes."""
        seconds = self.model.prefill_batch_seconds(chunks) if chunks else 0.0
        if decoders:
            ctx = sum(r.context for r in decoders) / len(decoders)
            seconds += self.model.decode_step_seconds(len(decoders), ctx) * self.spec.step_cost()
        if self.moe is not None:
            seconds *= self.moe.step_factor()
        return seconds * self.slowdown

    def next_iteration(self) -> tuple[list[SimRequest], list[SimRequest], list[tuple[int, int]]]:
        """What the next iteration runs, as vLLM's scheduler takes it: every decoding request, then the running
        prompts in order, each a chunk (tokens, tokens already computed) of what the token budget leaves.
        Returns (decoders, prefilling requests, their chunks); changes nothing."""
        decoders = [r for r in self.running if r.computed >= r.prefill_target]
        budget = self.config.max_batched_tokens - len(decoders)
        prefills: list[SimRequest] = []
        chunks: list[tuple[int, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.computed >= r.prefill_target:
                continue
            take = min(budget, r.prefill_target - r.computed)
            prefills.append(r)
            chunks.append((take, r.computed))
            budget -= take
        return decoders, prefills, chunks

    def _iterate(self, until: float) -> None:
        decoding = sum(1 for r in self.running if r.computed >= r.prefill_target)
        pending = sum(r.prefill_target - r.computed for r in self.running if r.computed < r.prefill_target)
        self._admit(self.config.max_batched_tokens - decoding - pending)
        decoders, prefills, chunks = self.next_iteration()
        done_prefill: list[SimRequest] = []
        for r, (take, _) in zip(prefills, chunks, strict=True):
            r.computed += take
            if r.computed >= r.prefill_target:
                done_prefill.append(r)
        gain = step_gain(self.spec, [r.cls for r in decoders]) if decoders else None
        per_seq = 1.0 + (gain.mean_accepted if gain else 0.0)
        k = 1
        if not chunks and decoders:
            # Bulk decode up to the next thing that changes the batch: a request finishing, the
            # blocks running out, or the time asked for. Waiting requests could not be admitted
            # above, and only a completion frees what they wait for.
            step = self.step_seconds(chunks, decoders)
            left = min(r.output_tokens - r.generated for r in decoders)
            growth = len(decoders) * per_seq / BLOCK_TOKENS
            k = max(1, min(math.ceil(left / per_seq), math.floor((until - self.t) / step) if step > 0 else 1,
                           math.floor(self._free_blocks() / growth)))
        # Decode growth past the free blocks evicts cached prefixes, then preempts the newest
        # request (vLLM's recompute preemption).
        need = self._growth(decoders, k, per_seq)
        self._evict_for(need)
        while decoders and need > self._free_blocks():
            if k > 1:
                k = 1
            else:
                victim = self._preempt_newest()
                if victim in decoders:
                    decoders.remove(victim)
            need = self._growth(decoders, k, per_seq)
        # A prompt whose blocks went to decode growth is back in the queue with nothing computed: it has no first
        # token. (vLLM's scheduler admits nothing in a step that preempts; here the step keeps its time.)
        done_prefill = [r for r in done_prefill if r in self.running]
        if not chunks and not decoders:
            if not self.running:  # everything waits for blocks nobody holds: a stall until `until`
                self.t = until
            return
        step = self.step_seconds(chunks, decoders)
        elapsed = step * k
        self.t += elapsed
        self.busy_s += elapsed
        self.steps += k
        if self.moe is not None:
            self.moe.advance(k, self.t)
            if self.moe.stall_s:  # an EPLB rearrangement holds the whole group
                self.t += self.moe.stall_s
                self.busy_s += self.moe.stall_s
                self.moe.stall_s = 0.0
        for r in done_prefill:
            self._cache_prompt(r)
            self._first_token(r)
        for r in decoders:
            self._decode(r, k, per_seq, step, gain)

    def _growth(self, decoders: list[SimRequest], k: int, per_seq: float) -> int:
        return sum(self._blocks_for(r.context + k * per_seq) - r.blocks for r in decoders)

    def _first_token(self, r: SimRequest) -> None:
        """The iteration that finished a prompt also samples its first token."""
        stats = self.ranks[r.rank]
        if r.first_token is None:
            r.first_token = self.t
            stats.hists["vllm:time_to_first_token_seconds"].observe(self.t - r.arrival)
            stats.hists["vllm:request_prefill_time_seconds"].observe(self.t - (r.admitted or self.t))
            stats.add("vllm:prompt_tokens", r.input_tokens)
            stats.add("vllm:generation_tokens", 1)
        r.generated = max(r.generated, 1.0)
        if self.config.prefill_only or r.generated >= r.output_tokens:
            self._complete(r, "length" if self.config.prefill_only else "stop")

    def _decode(self, r: SimRequest, k: int, per_seq: float, step: float, gain: object) -> None:
        stats = self.ranks[r.rank]
        before = r.generated
        if r.first_token is None:  # remote KV: the first decode iteration is the first token
            # The first of the `k` steps run at once, not the last: stamped at the end of a bulk run, a decode
            # worker's TTFT read as up to the whole run (the simulator's refresh window), not one step.
            r.first_token = self.t - (k - 1) * step
            # A decode worker counts from when the request reached it, after the KV handoff.
            stats.hists["vllm:time_to_first_token_seconds"].observe(r.first_token - (r.handoff_at or r.arrival))
            stats.add("vllm:prompt_tokens", r.input_tokens)
        r.generated = min(float(r.output_tokens), r.generated + k * per_seq)
        tokens = r.generated - before
        grown = max(0, self._blocks_for(r.context) - r.blocks)
        r.blocks += grown
        self.used_blocks += grown
        stats.add("vllm:generation_tokens", tokens)
        stats.hists["vllm:inter_token_latency_seconds"].observe(step, k)
        if gain is not None:
            self.spec.count(stats, gain, k)  # type: ignore[arg-type]
        if r.generated >= r.output_tokens:
            self._complete(r, "length" if r.output_tokens > 1 else "stop")

    def _complete(self, r: SimRequest, reason: str) -> None:
        self.running.remove(r)
        self.used_blocks -= r.blocks
        r.blocks = 0
        if self.config.prefill_only and self.on_prefilled is not None:
            self.on_prefilled(self, r, self.t)
        self._finish(r, reason)

    def _finish(self, r: SimRequest, reason: str) -> None:
        stats = self.ranks[r.rank]
        if reason != "error" and self.error_share and (r.rid * 2654435761 % 1000) / 1000 < self.error_share:
            reason = "error"
        stats.finished[reason] = stats.finished.get(reason, 0.0) + 1
        stats.hists["vllm:request_prompt_tokens"].observe(r.input_tokens)
        stats.hists["vllm:request_generation_tokens"].observe(r.generated)
        start = r.handoff_at if r.remote_kv and r.handoff_at is not None else r.arrival
        stats.hists["vllm:e2e_request_latency_seconds"].observe(self.t - start)
        if r.first_token is not None and r.generated > 1:
            decode = self.t - r.first_token
            stats.hists["vllm:request_decode_time_seconds"].observe(decode)
            stats.hists["vllm:request_time_per_output_token_seconds"].observe(decode / (r.generated - 1))

    # the exporters' view -------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        """Per-rank running and waiting counts, as the scheduler stats report them."""
        for stats in self.ranks:
            stats.running = stats.waiting = 0
        for r in self.running:
            self.ranks[r.rank].running += 1
        for r in self.waiting:
            self.ranks[r.rank].waiting += 1
