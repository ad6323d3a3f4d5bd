"""Every signal the control plane knows: its name, unit, the subjects it describes and what produces it.

Collectors produce these names, policies declare which they read, the static rules and the
dashboard refer to them; tests check that every name produced is listed here and that every
name a policy reads is produced by some collector or the simulator. A name may hold one
`{placeholder}` for a family of signals (`ttft_{q}`: `ttft_p50`, `ttft_p95`, ...); placeholders
match lower-case words, digits and underscores.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["SIGNALS", "STALE_S", "Producer", "SignalSpec", "Subject", "lookup", "subject_kind"]

STALE_S = 300.0  # a series not read for longer is gone, and one that comes back is new (Prometheus' lookback)


class Subject(StrEnum):
    """What a signal is about: the first part of its subject (`engine/<pool>/<pod>/<rank>`, ...)."""

    ENGINE = "engine"  # one data-parallel engine of a pod
    POD = "pod"  # a pod's engines together
    POOL = "pool"  # a pool's engines together
    TARGET = "target"  # one scrape endpoint
    GPU = "gpu"  # one GPU (or MIG instance) of a node
    NIXL = "nixl"  # one NIXL agent
    KVPATH = "kvpath"  # one prefill -> decode KV-transfer path of the probe
    ROUTER = "router"  # llm-d's endpoint picker for a pool (or one model of it)
    LMCACHE = "lmcache"  # one LMCache worker


class Producer(StrEnum):
    """Where a signal comes from."""

    VLLM = "vllm"  # collectors/vllm.py (and the Prometheus API source, from the same families)
    DCGM = "dcgm"  # collectors/dcgm.py
    NVML = "nvml"  # collectors/nvml.py
    NIXL = "nixl"  # collectors/nixl.py
    KVPROBE = "kvprobe"  # collectors/kvprobe.py
    LLMD = "llmd"  # collectors/llmd.py
    LMCACHE = "lmcache"  # collectors/lmcache.py
    SCRAPER = "scraper"  # collectors/pipeline.py, about the scrape itself
    ACTUATOR = "actuator"  # the loop, from the actuator's view of each pool
    SIZER = "sizer"  # the loop, from the sizer's plan for each pool (policies/autoscale.py)


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One signal (or family of signals, when `name` holds a placeholder)."""

    name: str
    unit: str  # s, 1/s, B, B/s, ratio (0..1), count, W, J/s, °C, MHz, tokens/s, ...
    subjects: frozenset[Subject]
    producers: frozenset[Producer]
    help: str

    @property
    def pattern(self) -> re.Pattern[str]:
        """The names this spec covers."""
        return _pattern(self.name)


_E = frozenset({Subject.ENGINE, Subject.POD, Subject.POOL})  # a vLLM signal: per engine, per pod, per pool
_V = frozenset({Producer.VLLM})
Q = "{q}"  # p50 | p95 | p99 | mean, from a histogram's bucket deltas over the interval


def _s(name: str, unit: str, subjects: frozenset[Subject] | Subject, producers: frozenset[Producer] | Producer,
       text: str) -> SignalSpec:
    subs = subjects if isinstance(subjects, frozenset) else frozenset({subjects})
    prods = producers if isinstance(producers, frozenset) else frozenset({producers})
    return SignalSpec(name, unit, subs, prods, text)


_GPU = frozenset({Producer.DCGM, Producer.NVML})

SIGNALS: tuple[SignalSpec, ...] = (
    # vLLM engines, pods and pools --------------------------------------------------------------
    _s("request_rate", "1/s", _E, _V, "finished requests per second, any reason"),
    _s("request_error_rate", "1/s", _E, _V, "requests finished with an error (finished_reason=error) per second"),
    _s("prompt_tokens_rate", "tokens/s", _E, _V, "prompt tokens per second"),
    _s("generation_tokens_rate", "tokens/s", _E, _V, "generated tokens per second"),
    _s("preemption_rate", "1/s", _E, _V, "preemptions per second (KV blocks ran out during decode)"),
    _s("prefix_cache_query_rate", "tokens/s", _E, _V, "prompt tokens looked up in the prefix cache per second"),
    _s("prefix_cache_hit_rate", "ratio", _E, _V, "share of looked-up prompt tokens found in the prefix cache"),
    _s("external_prefix_cache_hit_rate", "ratio", _E, _V, "prefix-cache hit rate of the external (connector) cache"),
    _s("spec_draft_rate", "1/s", _E, _V, "speculative drafts proposed per second"),
    _s("spec_acceptance_rate", "ratio", _E, _V, "accepted share of proposed draft tokens"),
    _s("spec_mean_acceptance_length", "tokens", _E, _V, "tokens per verification step: 1 + accepted per draft"),
    _s("spec_yield", "ratio", _E, _V, "accepted draft tokens per generated token: what speculation contributes"),
    _s("spec_acceptance_pos_{n}", "ratio", _E, _V, "acceptance of the draft token at position n, per draft"),
    _s(f"ttft_{Q}", "s", _E, _V, "time to first token"),
    _s(f"tpot_{Q}", "s", _E, _V, "time per output token of a request (the inter-token latency where vLLM has no TPOT)"),
    _s("tpot_per_request", "0/1", _E, _V, "1 where tpot_* is vLLM's per-request TPOT, 0 where it is the inter-token "
       "latency of an engine without it"),
    _s("ttft_over_slo", "ratio", Subject.POOL, _V, "share of requests whose TTFT exceeded the pool's objective (exact on a "
       "bucket bound)"),
    _s("tpot_over_slo", "ratio", Subject.POOL, _V, "share of requests whose TPOT exceeded the pool's objective (exact on a "
       "bucket bound)"),
    _s(f"itl_{Q}", "s", _E, _V, "inter-token latency"),
    _s(f"e2e_{Q}", "s", _E, _V, "end-to-end request latency"),
    _s(f"queue_time_{Q}", "s", _E, _V, "time waiting in the scheduler queue"),
    _s(f"prompt_len_{Q}", "tokens", _E, _V, "prompt length of finished requests (the distribution prefill cost depends on)"),
    _s(f"output_len_{Q}", "tokens", _E, _V, "output length of finished requests"),
    _s("kv_cache_usage", "ratio", _E, _V, "KV-cache blocks in use, mean over engines"),
    _s("kv_cache_usage_max", "ratio", _E, _V, "KV-cache blocks in use, fullest engine"),
    _s("requests_running", "count", _E, _V, "requests in the running batch"),
    _s("requests_waiting", "count", _E, _V, "requests waiting to be scheduled"),
    _s("requests_waiting_{reason}", "count", _E, _V, "waiting requests by reason (capacity, deferred)"),
    _s(f"nixl_xfer_time_{Q}", "s", frozenset({*_E, Subject.NIXL}), frozenset({Producer.VLLM, Producer.NIXL}),
       "NIXL KV-transfer time (vLLM's NIXL connector, or NIXL's own exporter)"),
    _s(f"nixl_post_time_{Q}", "s", frozenset({*_E, Subject.NIXL}), frozenset({Producer.VLLM, Producer.NIXL}),
       "NIXL transfer post time"),
    _s("nixl_xfer_bandwidth", "B/s", frozenset({*_E, Subject.NIXL}), frozenset({Producer.VLLM, Producer.NIXL}),
       "bytes moved per second of transfer time"),
    _s("nixl_bytes_rate", "B/s", _E, _V, "KV bytes transferred per second by vLLM's NIXL connector"),
    _s("nixl_transfer_rate", "1/s", _E, _V, "KV transfers per second"),
    _s("nixl_failed_transfer_rate", "1/s", _E, _V, "failed KV transfers per second"),
    _s("nixl_failed_notification_rate", "1/s", _E, _V, "failed transfer notifications per second"),
    _s("nixl_kv_expired_rate", "1/s", _E, _V, "KV blocks that expired before the decode side fetched them, per second"),
    # pools, from the scrape ---------------------------------------------------------------------
    _s("engines_reporting", "count", Subject.POOL, Producer.SCRAPER, "engines of the pool that reported this interval"),
    _s("pods_reporting", "count", Subject.POOL, Producer.SCRAPER,
       "pods whose engines reported this interval (fewer than the engines where a pod serves several ranks)"),
    _s("targets", "count", Subject.POOL, Producer.SCRAPER, "scrape targets of the pool"),
    _s("targets_up", "count", Subject.POOL, Producer.SCRAPER, "scrape targets of the pool that answered"),
    _s("up", "0/1", Subject.TARGET, Producer.SCRAPER, "1 when the target answered its scrape"),
    _s("scrape_duration_seconds", "s", Subject.TARGET, Producer.SCRAPER, "how long the scrape took"),
    _s("scrape_samples", "count", Subject.TARGET, Producer.SCRAPER, "samples in the exposition"),
    _s("scrape_body_bytes", "B", Subject.TARGET, Producer.SCRAPER, "size of the exposition"),
    _s("restarts", "count", Subject.TARGET, Producer.SCRAPER,
       "1 at the first scrape of a new vLLM process in the target's pod (its process_start_time_seconds moved on)"),
    _s("replicas_desired", "count", Subject.POOL, Producer.ACTUATOR, "replicas the pool's workload asks for"),
    _s("replicas_ready", "count", Subject.POOL, Producer.ACTUATOR, "replicas ready to take requests"),
    _s("autoscale_target_replicas", "count", Subject.POOL, Producer.SIZER,
       "replicas the sizer recommends for the forecast load, before the scale-down hold"),
    _s("autoscale_forecast_rate", "1/s", Subject.POOL, Producer.SIZER, "arrivals per second the sizer plans for"),
    _s("autoscale_startup_seconds", "s", Subject.POOL, Producer.SIZER,
       "the pool's start-up time last measured (a raised replica count until it was ready)"),
    _s("replicas_gang", "count", Subject.POOL, Producer.ACTUATOR,
       "engines that come and go together (a LeaderWorkerSet group's size; 1 for other workloads)"),
    _s("replicas_rolling", "0/1", Subject.POOL, Producer.ACTUATOR, "1 while a new pod template rolls out"),
    # GPUs ---------------------------------------------------------------------------------------
    _s("gpu_utilization", "ratio", Subject.GPU, _GPU, "GPU busy share"),
    _s("gpu_engine_active", "ratio", Subject.GPU, Producer.DCGM, "graphics/compute engine active share"),
    _s("gpu_tensor_active", "ratio", Subject.GPU, Producer.DCGM, "tensor-core active share"),
    _s("gpu_dram_active", "ratio", Subject.GPU, Producer.DCGM, "memory-interface active share"),
    _s("gpu_memory_used_bytes", "B", Subject.GPU, _GPU, "framebuffer memory used"),
    _s("gpu_memory_free_bytes", "B", Subject.GPU, _GPU, "framebuffer memory free"),
    _s("gpu_temperature_celsius", "°C", Subject.GPU, _GPU, "GPU temperature"),
    _s("gpu_memory_temperature_celsius", "°C", Subject.GPU, Producer.DCGM, "HBM temperature"),
    _s("gpu_power_watts", "W", Subject.GPU, _GPU, "power draw"),
    _s("gpu_sm_clock_mhz", "MHz", Subject.GPU, _GPU, "SM clock"),
    _s("gpu_energy_joules_rate", "J/s", Subject.GPU, _GPU, "energy used per second"),
    _s("gpu_pcie_{direction}_bytes_rate", "B/s", Subject.GPU, _GPU, "PCIe traffic, tx or rx"),
    _s("gpu_nvlink_bytes_rate", "B/s", Subject.GPU, Producer.DCGM, "NVLink traffic"),
    _s("gpu_pcie_replay_rate", "1/s", Subject.GPU, _GPU, "PCIe replays per second"),
    _s("gpu_xid_last", "code", Subject.GPU, _GPU, "the last XID error code seen (only while one was seen)"),
    _s("gpu_xid_errors", "count", Subject.GPU, _GPU, "XID errors this interval"),
    _s("gpu_xid_errors_window", "count", Subject.GPU, Producer.DCGM, "XID errors in dcgm-exporter's own window"),
    _s("gpu_ecc_sbe_rate", "1/s", Subject.GPU, _GPU, "single-bit ECC errors per second"),
    _s("gpu_ecc_dbe_rate", "1/s", Subject.GPU, _GPU, "double-bit (uncorrectable) ECC errors per second"),
    _s("gpu_remapped_rows_uncorrectable", "count", Subject.GPU, _GPU, "rows remapped for uncorrectable errors this interval"),
    _s("gpu_row_remap_failure", "0/1", Subject.GPU, _GPU, "1 when a row remap failed: the GPU needs service"),
    _s("gpu_thermal_violation_seconds_rate", "ratio", Subject.GPU, _GPU, "share of time clocks were held for heat"),
    _s("gpu_power_violation_seconds_rate", "ratio", Subject.GPU, _GPU, "share of time clocks were held for power"),
    # NIXL agents ----------------------------------------------------------------------------------
    _s("nixl_{direction}_bytes_rate", "B/s", Subject.NIXL, Producer.NIXL, "bytes sent (tx) or received (rx) per second"),
    _s("nixl_{direction}_request_rate", "1/s", Subject.NIXL, Producer.NIXL, "transfer requests sent or received per second"),
    _s("nixl_request_rate", "1/s", Subject.NIXL, Producer.NIXL,
       "transfer requests the agent posted per second, WRITEs (tx) and READs (rx) together"),
    _s("nixl_telemetry_dropped_rate", "1/s", Subject.NIXL, Producer.NIXL, "telemetry events the agent dropped per second"),
    _s("nixl_error_rate", "1/s", Subject.NIXL, Producer.NIXL, "transfer errors per second"),
    _s("nixl_errors_{status}_rate", "1/s", Subject.NIXL, Producer.NIXL, "transfer errors per second by status"),
    _s("nixl_memory_registered_bytes", "B", Subject.NIXL, Producer.NIXL, "memory registered with the agent"),
    # the KV-transfer probe ------------------------------------------------------------------------
    _s("kv_up", "0/1", Subject.KVPATH, Producer.KVPROBE, "1 when the path's last exchange succeeded"),
    _s("kv_transfer_rate", "1/s", Subject.KVPATH, Producer.KVPROBE, "probe transfers per second"),
    _s("kv_throughput_bytes_per_s", "B/s", Subject.KVPATH, Producer.KVPROBE, "probe bytes moved per second"),
    _s("kv_failure_rate", "1/s", Subject.KVPATH, Producer.KVPROBE, "failed probe transfers per second"),
    _s("kv_failure_ratio", "ratio", Subject.KVPATH, Producer.KVPROBE, "failed share of probe transfers"),
    _s("kv_failure_{reason}_rate", "1/s", Subject.KVPATH, Producer.KVPROBE, "failed probe transfers per second by reason"),
    _s("kv_transfer_{q}", "s", Subject.KVPATH, Producer.KVPROBE, "probe transfer time (p50, p99, mean)"),
    _s("kv_transfer_{q}_seconds_{size}", "s", Subject.KVPATH, Producer.KVPROBE, "probe transfer time by block size"),
    _s("kv_post_p99", "s", Subject.KVPATH, Producer.KVPROBE, "probe transfer post time, p99"),
    _s("kv_transfer_wall_p99", "s", Subject.KVPATH, Producer.KVPROBE,
       "wall time from posting a probe WRITE to seeing it done, p99"),
    # llm-d's endpoint picker ----------------------------------------------------------------------
    _s("epp_request_rate", "1/s", Subject.ROUTER, Producer.LLMD, "requests the picker routed per second"),
    _s("epp_request_error_rate", "1/s", Subject.ROUTER, Producer.LLMD, "request errors per second"),
    _s("epp_request_error_ratio", "ratio", Subject.ROUTER, Producer.LLMD, "errored share of requests"),
    _s("epp_request_errors_{code}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "request errors per second by code"),
    _s("epp_slo_violations_{kind}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "SLO violations per second by kind"),
    _s("epp_scheduler_attempt_rate", "1/s", Subject.ROUTER, Producer.LLMD, "scheduling attempts per second"),
    _s("epp_scheduler_attempts_{status}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "scheduling attempts by status"),
    _s("epp_disagg_decision_rate", "1/s", Subject.ROUTER, Producer.LLMD, "P/D disaggregation decisions per second"),
    _s("epp_disagg_{decision}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "disaggregation decisions by outcome"),
    _s("epp_disagg_{decision}_share", "ratio", Subject.ROUTER, Producer.LLMD, "share of each disaggregation decision"),
    _s("epp_flow_control_{outcome}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "flow-control requests by outcome"),
    _s("epp_kv_index_{event}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "KV-index lookups, admissions, evictions"),
    _s("epp_kv_events_dedup_{outcome}_rate", "1/s", Subject.ROUTER, Producer.LLMD, "KV events deduplicated or forwarded"),
    _s("epp_kv_index_hits_per_lookup", "blocks", Subject.ROUTER, Producer.LLMD, "KV-index hits per lookup"),
    _s("epp_kv_index_max_pod_hits_per_lookup", "blocks", Subject.ROUTER, Producer.LLMD, "best pod's hits per lookup"),
    _s("epp_tokenized_tokens_rate", "tokens/s", Subject.ROUTER, Producer.LLMD, "tokens the picker tokenized per second"),
    _s(f"epp_{{stage}}_{Q}", "s", Subject.ROUTER, Producer.LLMD,
       "latencies the picker sees: request_latency, ttft, tpot, itl, ntpot, flow_control_queue_time, scheduler_latency, "
       "kv_index_lookup_latency, tokenization_latency, chat_template_latency"),
    _s("epp_{kind}_tokens_rate", "tokens/s", Subject.ROUTER, Producer.LLMD, "input, output and cached tokens per second"),
    _s("epp_cached_token_ratio", "ratio", Subject.ROUTER, Producer.LLMD, "cached share of prompt tokens"),
    _s("epp_prefix_indexer_hit_ratio_{q}", "ratio", Subject.ROUTER, Producer.LLMD, "prefix-indexer hit ratio"),
    _s("epp_prefix_indexer_hit_bytes_mean", "B", Subject.ROUTER, Producer.LLMD, "prefix-indexer hit bytes per lookup"),
    _s("epp_plugin_{plugin}_duration_p95", "s", Subject.ROUTER, Producer.LLMD, "a scheduler plugin's duration, p95"),
    _s("epp_requests_running", "count", Subject.ROUTER, Producer.LLMD, "requests in flight through the picker"),
    _s("epp_running_requests", "count", Subject.ROUTER, Producer.LLMD, "running requests over the pool's endpoints"),
    _s("epp_running_requests_stddev", "count", Subject.ROUTER, Producer.LLMD, "spread of running requests over endpoints"),
    _s("epp_kv_cache_utilization", "ratio", Subject.ROUTER, Producer.LLMD, "the pool's KV-cache utilization"),
    _s("epp_kv_cache_utilization_stddev", "ratio", Subject.ROUTER, Producer.LLMD, "spread of KV-cache use over endpoints"),
    _s("epp_queue_size", "count", Subject.ROUTER, Producer.LLMD, "requests queued over the pool's endpoints"),
    _s("epp_queue_size_stddev", "count", Subject.ROUTER, Producer.LLMD, "spread of queues over endpoints"),
    _s("epp_endpoint_queue_size_max", "count", Subject.ROUTER, Producer.LLMD, "longest endpoint queue"),
    _s("epp_ready_endpoints", "count", Subject.ROUTER, Producer.LLMD, "endpoints ready to take requests"),
    _s("epp_prefix_indexer_size", "count", Subject.ROUTER, Producer.LLMD, "entries in the prefix indexer"),
    _s("epp_flow_control_stale_endpoints", "count", Subject.ROUTER, Producer.LLMD, "endpoints with stale metrics"),
    _s("epp_flow_control_queue_size", "count", Subject.ROUTER, Producer.LLMD, "requests in flow-control queues"),
    _s("epp_flow_control_queue_bytes", "B", Subject.ROUTER, Producer.LLMD, "bytes in flow-control queues"),
    _s("epp_pool_saturation_{kind}", "ratio", Subject.ROUTER, Producer.LLMD, "the picker's saturation estimate"),
    # LMCache --------------------------------------------------------------------------------------
    _s("lmcache_{op}_rate", "1/s", Subject.LMCACHE, Producer.LMCACHE, "retrieve, store and lookup requests per second"),
    _s("lmcache_{kind}_tokens_rate", "tokens/s", Subject.LMCACHE, Producer.LMCACHE, "stored and hit tokens per second"),
    _s("lmcache_remote_{direction}_bytes_rate", "B/s", Subject.LMCACHE, Producer.LMCACHE, "remote-backend traffic"),
    _s("lmcache_local_cpu_evict_rate", "1/s", Subject.LMCACHE, Producer.LMCACHE, "local CPU-cache evictions per second"),
    _s("lmcache_local_cpu_evict_failed_rate", "1/s", Subject.LMCACHE, Producer.LMCACHE, "failed evictions per second"),
    _s("lmcache_remote_ping_error_rate", "1/s", Subject.LMCACHE, Producer.LMCACHE, "remote-backend ping errors"),
    _s("lmcache_{op}_hit_rate", "ratio", Subject.LMCACHE, Producer.LMCACHE, "retrieve and lookup token hit rates"),
    _s(f"lmcache_{{op}}_time_{Q}", "s", Subject.LMCACHE, Producer.LMCACHE, "retrieve, store, lookup, remote get/put time"),
    _s("lmcache_{tier}_usage", "B", Subject.LMCACHE, Producer.LMCACHE, "local cache, remote cache and local storage use"),
    _s("lmcache_healthy", "0/1", Subject.LMCACHE, Producer.LMCACHE, "1 while the worker reports itself healthy"),
)


# What a placeholder matches: statistics of a histogram are known; other parts are label values.
_PLACEHOLDERS = {"q": "(?:p50|p95|p99|mean)", "n": "[0-9]+"}


@functools.cache
def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", name)
    regex = "".join(re.escape(p) if i % 2 == 0 else _PLACEHOLDERS.get(p, "[a-z0-9_]+") for i, p in enumerate(parts))
    return re.compile(f"^{regex}$")


@functools.cache
def _exact() -> dict[str, SignalSpec]:
    return {s.name: s for s in SIGNALS if "{" not in s.name}


@functools.cache
def lookup(name: str) -> SignalSpec | None:
    """The spec that covers `name`: an exact entry first, else the first family whose pattern matches."""
    spec = _exact().get(name)
    if spec is not None:
        return spec
    return next((s for s in SIGNALS if "{" in s.name and s.pattern.match(name)), None)


def subject_kind(subject: str) -> Subject | None:
    """The kind of a subject string (`engine/prefill/pod-0/0` -> ENGINE), or None if unknown."""
    head = subject.split("/", 1)[0]
    return Subject(head) if head in Subject._value2member_map_ else None
