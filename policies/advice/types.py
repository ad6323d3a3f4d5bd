"""What the advisor reads and what it says: a pool's facts and its observed load in, recommendations out.

Pure values: the control plane fills `AdvisorInput` from the fleet file and the store (or the
evaluation from a simulated run); every recommendation carries its evidence, the effect it predicts
as one measurable metric before and after, and how sure it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import Field

from catalog.settings import Settings
from policies.autoscale import EngineCurves

__all__ = ["AdviceKind", "AdviceSettings", "AdvisorInput", "BusyTtftMinute", "Effect", "GpuType", "PoolFacts",
           "PoolObserved", "Recommendation", "SpecFacts"]


class AdviceKind(StrEnum):
    """The questions the advisor answers; each is a runbook section (`fleetctl runbook advice`)."""

    DISAGGREGATION = "disaggregation"
    POOL_RATIO = "pool_ratio"
    KV_TIERING = "kv_tiering"
    KV_PRECISION = "kv_precision"
    SPECULATION = "speculation"
    PARALLEL_LAYOUT = "parallel_layout"


class GpuType(Settings):
    """A kind of GPU the fleet may run on: what an hour costs, and how fast it runs the pool's profile: prefill
    (compute-bound) and decode (memory-bound) apart, since GPU classes differ in exactly that."""

    price_per_hour: float = Field(gt=0)
    speed: float = Field(1.0, gt=0)  # prefill, relative to the hardware the pool's profile was measured on
    decode_speed: float | None = Field(None, gt=0)  # decode steps; default `speed`
    memory_gib: float | None = Field(None, gt=0)  # HBM per GPU: with both types', a move takes the KV cache with it

    @property
    def decode(self) -> float:
        return self.speed if self.decode_speed is None else self.decode_speed

    def relative_to(self, other: GpuType) -> tuple[float, float]:
        """(prefill, decode) speed of this type over `other`'s."""
        return self.speed / other.speed, self.decode / other.decode

    def kv_tokens_from(self, other: GpuType, tokens: float, bytes_per_token: float, gpus: int,
                       utilization: float) -> float | None:
        """The KV tokens an engine of `gpus` of these GPUs holds where it holds `tokens` on `other`'s: the weights and
        activations take the same on each GPU, so the memory vLLM is given of the difference is all KV's (0: the model
        leaves none); None where either type's memory is not given."""
        if self.memory_gib is None or other.memory_gib is None:
            return None
        moved = utilization * (self.memory_gib - other.memory_gib) * 2**30 * max(1, gpus)
        return max(0.0, tokens + moved / bytes_per_token)


class AdviceSettings(Settings):
    """`advisor` in the fleet file: prices, the layouts it may propose, and when a gain is worth a change."""

    gpu_types: dict[str, GpuType] = Field(default_factory=lambda: {"h200": GpuType(price_per_hour=3.5)})
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # vLLM's share of a GPU's memory (its default)
    prefill_gpu: str | None = None  # the GPU a split-off prefill pool runs on (default: the pool's own)
    decode_gpu: str | None = None  # ... and a decode pool
    # Size for p95s at this share of the SLOs: 1.0 is the fewest engines that meet them (the autoscaler adds headroom).
    margin: float = Field(1.0, gt=0.1, le=1.0)
    load_quantile: float = Field(0.95, ge=0.5, le=1.0)  # of the per-minute arrivals: the load a static size must carry
    # The share of the KV cache the mean batch may fill: vLLM admits until the blocks run out and preempts past
    # that, so a little room is left for the batch's swings, not a planning margin (that is `margin`'s).
    kv_usage_max: float = Field(0.95, gt=0.1, le=1.0)
    # The busiest an engine's prefill may be at the sized load: past this the p95 wait grows faster than an M/G/1
    # queue predicts under bursty arrivals.
    max_utilization: float = Field(0.8, gt=0.1, lt=1.0)
    # The router weighs engines' queues (llm-d's queue scorer, a least-loaded pick): a new prompt goes to an engine
    # with nothing decoding while there is one, so on a lightly loaded unified pool fewer decodes are stalled.
    load_aware_routing: bool = True
    min_saving: float = Field(0.10, ge=0, lt=1)  # a layout change must save this share of the fleet's cost
    tier_factors: tuple[float, ...] = (2.0, 5.0, 10.0)  # cache sizes (times HBM) a KV tier is judged at
    min_hit_gain: float = Field(0.05, gt=0, lt=1)  # hit-rate points a tier must add to be worth running
    kv_bound_usage: float = Field(0.8, gt=0, le=1)  # KV usage from which a pool counts as KV-bound
    draft_cost: float = Field(0.10, ge=0)  # a draft token's step cost in plain decode steps when ITL can't tell
    verify_cost: float = Field(0.03, ge=0)
    spec_pays: float = Field(1.05, ge=1)  # speculation pays while its speed-up is at least this
    imbalance: float = Field(1.3, gt=1)  # max over mean rank load from which EPLB is worth its overhead
    chat_ratio: tuple[float, float] = (3.0, 5.0)  # the field's first cut: 1:3 to 1:5 prefill to decode for chat
    link_gbps: float = Field(400.0, gt=0)  # the KV-transfer link a split fleet would move prompts' KV over

    def price(self, gpu_type: str) -> float:
        """Dollars per GPU-hour; an unknown type names the ones configured."""
        try:
            return self.gpu_types[gpu_type].price_per_hour
        except KeyError:
            raise KeyError(f"GPU type {gpu_type!r} has no price in advisor.gpu_types "
                           f"({', '.join(sorted(self.gpu_types))})") from None


@dataclass(frozen=True, slots=True)
class SpecFacts:
    """A pool's `--speculative-config`."""

    method: str = "none"  # none | ngram | eagle | eagle3 | mtp | medusa
    num_speculative_tokens: int = 0
    native_mtp: bool = False  # the model ships MTP heads

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """A pool as configured: its engines, what they run on, and its SLOs."""

    name: str
    role: str  # unified | prefill | decode
    replicas: int
    curves: EngineCurves  # the profile at the pool's speed: what one engine does
    gpu_type: str = "h200"
    ttft_p95_slo: float | None = None
    tpot_p95_slo: float | None = None
    spec: SpecFacts = SpecFacts()
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8
    kv_bytes_per_token: float = 131072.0  # across all layers, at the model's dtype (Llama-3.1-8B in BF16)
    tensor_parallel: int = 1
    kv_heads: int = 8
    expert_parallel: int = 1
    eplb: bool = False

    @property
    def gpus(self) -> int:
        return self.curves.gpus

    @property
    def cache_bytes_per_token(self) -> float:
        """Bytes a token's KV takes in the cache, and over the link: FP8 halves the model's dtype."""
        return self.kv_bytes_per_token / (2.0 if self.kv_cache_dtype == "fp8" else 1.0)


@dataclass(frozen=True, slots=True)
class BusyTtftMinute:
    """The minute whose TTFT p95 sits at the load quantile of the window's minutes (a minute that happened), with its
    own arrivals and request shape: a cluster of long prompts sets TTFT there without raising the arrival count that
    the busy-minute load is sized for."""

    arrivals: float  # requests per second
    prompt_tokens: float  # per request
    hit_rate: float
    ttft_p95: float
    prompt_p50: float | None = None
    prompt_p95: float | None = None
    engines: float | None = None  # engines reporting in that minute (one restarting, an autoscaled pool)


@dataclass(frozen=True, slots=True)
class PoolObserved:
    """What a pool did over the window, from its stored signals (means unless named otherwise)."""

    arrivals: float  # requests per second, mean
    arrivals_peak: float  # the load quantile of per-minute arrivals
    prompt_tokens: float  # per request
    output_tokens: float  # per request
    hit_rate: float
    engines: float  # engines reporting, mean
    running: float = 0.0  # requests in the batch per engine
    # Engines reporting in the minute whose arrivals are `arrivals_peak`: an autoscaled pool serves its busy minutes
    # with more than its mean, and the model is calibrated at the engines that served that load.
    engines_peak: float | None = None
    kv_usage: float = 0.0
    kv_usage_max: float = 0.0
    preemptions: float = 0.0  # per second, the pool
    ttft_p95: float | None = None
    tpot_p95: float | None = None
    itl_mean: float | None = None
    spec_acceptance: float | None = None
    spec_length: float | None = None  # mean acceptance length: tokens per verification step
    spec_yield: float | None = None
    spec_positions: tuple[float, ...] = ()  # acceptance of each draft position, per draft
    rank_imbalance: float | None = None  # the slowest rank's ITL over the median rank's (the most skewed EP group)
    ttft_p95_peak: float | None = None  # the load quantile of per-minute TTFT p95s: the busy minutes
    tpot_p95_peak: float | None = None
    # TPOT's mean over the busy minutes: exact, where a histogram's p95 is an interpolation within a bucket (vLLM's
    # TPOT buckets are 10, 25, 50 ms: a p95 of 12 ms can read as 19).
    tpot_mean_peak: float | None = None
    # The share of requests over the pool's TPOT objective in the busy minutes: exact where the objective sits on a
    # bucket bound, and what the p95 against the objective turns on.
    tpot_over_slo_peak: float | None = None
    prompt_p50: float | None = None  # prompt length quantiles (`vllm:request_prompt_tokens`)
    prompt_p95: float | None = None
    output_p50: float | None = None  # output length quantiles (`vllm:request_generation_tokens`)
    output_p95: float | None = None
    minutes: float = 0.0  # how much history this rests on
    ttft_minute: BusyTtftMinute | None = None


@dataclass(frozen=True, slots=True)
class AdvisorInput:
    """Everything the advisor may look at: the pools, what they did since `since`, and the time."""

    now: float
    since: float
    pools: Mapping[str, PoolFacts]
    observed: Mapping[str, PoolObserved]
    # Per pool, the prompts' prefix-block hashes in arrival order, where the fleet records them
    # (llm-d's KV events, LMCache, the simulator): an LRU replay then answers the tiering question exactly.
    prefix_blocks: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    # Per pool of a disaggregated model, the fleet's other prefill and decode pools serving it (asked of or not): its KV
    # moves between them over NIXL, which takes caches of one dtype only.
    kv_peers: Mapping[str, Sequence[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Effect:
    """A predicted change of one metric the fleet reports, and what it saves per day."""

    metric: str  # e.g. gpu_hours_per_day, prefix_cache_hit_rate, engines_needed
    before: float
    after: float
    saving_per_day: float | None = None  # dollars; negative: the change would cost this much
    gpu_hours_per_day: float | None = None  # GPU-hours saved per day (negative: more)

    @property
    def change(self) -> float:
        """Relative change of the metric (after over before, less one)."""
        return self.after / self.before - 1.0 if self.before else 0.0


@dataclass(frozen=True, slots=True)
class Recommendation:
    """One piece of advice: what to change on which pool, why, what it would do, and how sure that is."""

    kind: AdviceKind
    pool: str  # a pool, or the pools it concerns joined by "+"
    advice: str  # one line a person reads
    change: Mapping[str, Any]  # the layout it recommends, in fleet-file terms (how it is later recognised)
    effect: Effect
    confidence: float  # 0..1: how much evidence it rests on and how well the model fits it
    evidence: Mapping[str, Any] = field(default_factory=dict)
    act: bool = True  # False: keep things as they are (the answer is "no"), said with its effect

    @property
    def runbook(self) -> str:
        return f"advice#{self.kind.value.replace('_', '-')}"
