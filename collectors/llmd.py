"""llm-d endpoint picker (EPP) `/metrics` mapped to per-pool and per-model readings and signals.

Names follow llm-d-router v0.10 (`llm_d_epp_*`); the Gateway API Inference Extension names that
came before (`inference_objective_*` from v1.1, `inference_model_*` up to v1.0, `inference_pool_*`,
`inference_extension_*`, `llm_d_inference_scheduler_*`) and the standalone kv-cache indexer's
`kvcache_*` are read when the current ones are absent. Entities: the InferencePool (`<pool>`) for
pool gauges and EPP-wide series, and `<pool>/<model_name>` for per-model request series. Request
series carry no pool label, so they are attributed to the pool the same exposition names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from collectors.derive import histogram_quantile, ratio
from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Sample, Signal, Target

__all__ = ["DEFAULT_POOL", "FAMILIES", "POOL_LABELS", "SOURCE", "read_entities", "signals", "slug"]

FAMILIES = FamilyMap(
    counters={
        "requests": (
            "llm_d_epp_request_total",
            "inference_objective_request_total",
            "inference_model_request_total",
        ),
        "request_errors": (
            "llm_d_epp_request_error_total",
            "inference_objective_request_error_total",
            "inference_model_request_error_total",
        ),
        "slo_violations": ("llm_d_epp_request_slo_violation_total", "inference_objective_request_slo_violation_total"),
        "scheduler_attempts": ("llm_d_epp_scheduler_attempts_total", "inference_extension_scheduler_attempts_total"),
        "disagg_decisions": (
            "llm_d_epp_disagg_decision_total",
            "llm_d_inference_scheduler_disagg_decision_total",
            "llm_d_inference_scheduler_pd_decision_total",
        ),
        "flow_control_requests": ("llm_d_epp_flow_control_requests_total",),
        "kv_index_admissions": ("llm_d_epp_kv_cache_index_admissions_total", "kvcache_index_admissions_total"),
        "kv_index_evictions": ("llm_d_epp_kv_cache_index_evictions_total", "kvcache_index_evictions_total"),
        "kv_index_lookups": ("llm_d_epp_kv_cache_index_lookup_requests_total", "kvcache_index_lookup_requests_total"),
        "kv_index_lookup_hits": ("llm_d_epp_kv_cache_index_lookup_hits_total", "kvcache_index_lookup_hits_total"),
        "kv_index_max_pod_hits": (
            "llm_d_epp_kv_cache_index_max_pod_hit_count_total",
            "kvcache_index_max_pod_hit_count_total",
        ),
        "kv_events_dedup_suppressed": ("llm_d_epp_kv_cache_events_dedup_removed_hashes_suppressed_total",),
        "kv_events_dedup_forwarded": ("llm_d_epp_kv_cache_events_dedup_removed_hashes_forwarded_total",),
        "tokenized_tokens": ("kvcache_tokenization_tokenized_tokens_total",),
    },
    gauges={
        "running": (
            "llm_d_epp_request_running",
            "inference_objective_running_requests",
            "inference_model_running_requests",
        ),
        "kv_cache_utilization": ("llm_d_epp_average_kv_cache_utilization", "inference_pool_average_kv_cache_utilization"),
        "queue_size": ("llm_d_epp_average_queue_size", "inference_pool_average_queue_size"),
        "running_requests": ("llm_d_epp_average_running_requests",),
        "kv_cache_utilization_stddev": ("llm_d_epp_std_dev_kv_cache_utilization",),
        "queue_size_stddev": ("llm_d_epp_std_dev_queue_size",),
        "running_requests_stddev": ("llm_d_epp_std_dev_running_requests",),
        "ready_endpoints": ("llm_d_epp_ready_endpoints", "inference_pool_ready_pods"),
        "endpoint_queue": ("llm_d_epp_per_endpoint_queue_size", "inference_pool_per_pod_queue_size"),
        "prefix_indexer_size": ("llm_d_epp_prefix_indexer_size", "inference_extension_prefix_indexer_size"),
        "pool_saturation": ("llm_d_epp_flow_control_pool_saturation",),
        "stale_endpoints": ("llm_d_epp_flow_control_stale_endpoints",),
        "flow_control_queue_size": ("llm_d_epp_flow_control_queue_size", "inference_extension_flow_control_queue_size"),
        "flow_control_queue_bytes": ("llm_d_epp_flow_control_queue_bytes", "inference_extension_flow_control_queue_bytes"),
    },
    histograms={
        "request_latency": (
            "llm_d_epp_request_duration_seconds",
            "inference_objective_request_duration_seconds",
            "inference_model_request_duration_seconds",
        ),
        "ttft": ("llm_d_epp_request_ttft_seconds",),
        "tpot": ("llm_d_epp_request_streaming_tpot_seconds",),
        "itl": ("llm_d_epp_request_streaming_itl_seconds",),
        "ntpot": (
            "llm_d_epp_request_ntpot_seconds",
            "inference_objective_normalized_time_per_output_token_seconds",
            "inference_model_normalized_time_per_output_token_seconds",
        ),
        "input_tokens": (
            "llm_d_epp_request_input_tokens",
            "inference_objective_input_tokens",
            "inference_model_input_tokens",
        ),
        "output_tokens": (
            "llm_d_epp_request_output_tokens",
            "inference_objective_output_tokens",
            "inference_model_output_tokens",
        ),
        "cached_tokens": ("llm_d_epp_request_cached_tokens", "inference_objective_prompt_cached_tokens"),
        "flow_control_queue_time": (
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "inference_extension_flow_control_request_queue_duration_seconds",
        ),
        "scheduler_latency": (
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "inference_extension_scheduler_e2e_duration_seconds",
        ),
        "plugin_duration": (
            "llm_d_epp_plugin_duration_seconds",
            "inference_extension_plugin_duration_seconds",
            "inference_extension_scheduler_plugin_duration_seconds",
        ),
        "prefix_hit_ratio": ("llm_d_epp_prefix_indexer_hit_ratio", "inference_extension_prefix_indexer_hit_ratio"),
        "prefix_hit_bytes": ("llm_d_epp_prefix_indexer_hit_bytes", "inference_extension_prefix_indexer_hit_bytes"),
        "kv_index_lookup_latency": (
            "llm_d_epp_kv_cache_index_lookup_latency_seconds",
            "kvcache_index_lookup_latency_seconds",
        ),
        "tokenization_latency": ("kvcache_tokenization_tokenization_latency_seconds",),
        "chat_template_latency": ("kvcache_tokenization_render_chat_template_latency_seconds",),
    },
    split_by={
        "request_errors": "error_code",
        "slo_violations": "type",
        "scheduler_attempts": "status",
        "disagg_decisions": "decision_type",
        "flow_control_requests": "outcome",
        "endpoint_queue": "model_server_endpoint",
        "pool_saturation": "stage",
        "plugin_duration": "plugin_type",
    },
    expected=(
        "llm_d_epp_request_total",
        "llm_d_epp_request_error_total",
        "llm_d_epp_request_duration_seconds",
        "llm_d_epp_average_kv_cache_utilization",
        "llm_d_epp_average_queue_size",
        "llm_d_epp_ready_endpoints",
    ),
)
# Reading keys whose series describe one model (objective) rather than the whole pool.
_PER_MODEL = frozenset({
    "requests", "request_errors", "slo_violations", "running", "request_latency", "ttft", "tpot", "itl", "ntpot",
    "input_tokens", "output_tokens", "cached_tokens", "flow_control_queue_size", "flow_control_queue_bytes",
    "flow_control_queue_time",
})
POOL_LABELS = ("name", "inference_pool", "pool")
# Pool of EPP-wide and request series when the exposition names no pool, or several.
DEFAULT_POOL = "epp"
# The pre-rename per-pod queue gauge names its endpoint `model_server_pod`; renaming the label lets
# both spellings share one split key, so the current one wins per endpoint.
_LEGACY_QUEUE = "inference_pool_per_pod_queue_size"
_LEGACY_LABEL = "model_server_pod"
_ENDPOINT_LABEL = "model_server_endpoint"

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
_LATENCIES = (
    ("request_latency", "epp_request_latency"),
    ("ttft", "epp_ttft"),
    ("tpot", "epp_tpot"),
    ("itl", "epp_itl"),
    ("ntpot", "epp_ntpot"),
    ("flow_control_queue_time", "epp_flow_control_queue_time"),
    ("scheduler_latency", "epp_scheduler_latency"),
    ("kv_index_lookup_latency", "epp_kv_index_lookup_latency"),
    ("tokenization_latency", "epp_tokenization_latency"),
    ("chat_template_latency", "epp_chat_template_latency"),
)
_RATES = (
    ("requests", "epp_request_rate"),
    ("kv_index_admissions", "epp_kv_index_admission_rate"),
    ("kv_index_evictions", "epp_kv_index_eviction_rate"),
    ("kv_index_lookups", "epp_kv_index_lookup_rate"),
    ("kv_events_dedup_suppressed", "epp_kv_events_dedup_suppressed_rate"),
    ("kv_events_dedup_forwarded", "epp_kv_events_dedup_forwarded_rate"),
    ("tokenized_tokens", "epp_tokenized_tokens_rate"),
)
# Histograms whose observations are amounts: their sum per second is a throughput.
_AMOUNTS = (
    ("input_tokens", "epp_input_tokens_rate"),
    ("output_tokens", "epp_output_tokens_rate"),
    ("cached_tokens", "epp_cached_tokens_rate"),
)
_GAUGES = (
    ("running", "epp_requests_running"),
    ("kv_cache_utilization", "epp_kv_cache_utilization"),
    ("queue_size", "epp_queue_size"),
    ("running_requests", "epp_running_requests"),
    ("kv_cache_utilization_stddev", "epp_kv_cache_utilization_stddev"),
    ("queue_size_stddev", "epp_queue_size_stddev"),
    ("running_requests_stddev", "epp_running_requests_stddev"),
    ("ready_endpoints", "epp_ready_endpoints"),
    ("prefix_indexer_size", "epp_prefix_indexer_size"),
    ("stale_endpoints", "epp_flow_control_stale_endpoints"),
    ("flow_control_queue_size", "epp_flow_control_queue_size"),
    ("flow_control_queue_bytes", "epp_flow_control_queue_bytes"),
)


def _pool_of(labels: Mapping[str, str]) -> str | None:
    for key in POOL_LABELS:
        value = labels.get(key)
        if value:
            return value
    return None


def slug(value: str) -> str:
    """A label value as a signal-name fragment: `RejectedCapacity` -> `rejected_capacity`."""
    text = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", value)
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_").lower() or "unknown"


def read_entities(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A target's samples as readings per pool (`<pool>`) and per model (`<pool>/<model>`)."""
    mine: list[tuple[Sample, bool]] = []
    pools: set[str] = set()
    for s in samples:
        hit = FAMILIES.index().get(s.name)
        if hit is None:
            continue
        sample = s
        if s.name == _LEGACY_QUEUE and _LEGACY_LABEL in s.labels:
            # A copy: the parser shares one labels dict between scrapes of the same series.
            labels = {(_ENDPOINT_LABEL if k == _LEGACY_LABEL else k): v for k, v in s.labels.items()}
            sample = Sample(s.name, labels, s.value, s.timestamp)
        pool = _pool_of(sample.labels)
        if pool is not None:
            pools.add(pool)
        mine.append((sample, hit[1] in _PER_MODEL))
    default = next(iter(pools)) if len(pools) == 1 else DEFAULT_POOL

    def pool_entity(labels: Mapping[str, str]) -> str:
        return _pool_of(labels) or default

    def model_entity(labels: Mapping[str, str]) -> str:
        return f"{pool_entity(labels)}/{labels.get('model_name', '')}"

    def model_attrs(labels: Mapping[str, str]) -> dict[str, str]:
        return {"pool": pool_entity(labels), "model_name": labels.get("model_name", "")}

    def pool_attrs(labels: Mapping[str, str]) -> dict[str, str]:
        return {"pool": pool_entity(labels)}

    out = read((s for s, per_model in mine if not per_model), FAMILIES, pool_entity, pool_attrs)
    out.update(read((s for s, per_model in mine if per_model), FAMILIES, model_entity, model_attrs))
    return out


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn a pool or per-model delta into named `epp_*` signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    inc = d.increases
    per_s = 1.0 / d.seconds
    out.rates(_RATES, d)

    split: dict[str, dict[str, float]] = {}
    for key, value in inc.items():
        if ":" in key:
            base, _, label = key.partition(":")
            split.setdefault(base, {})[label] = value

    errors = split.get("request_errors", {})
    if errors or "requests" in inc:
        total_errors = sum(errors.values())
        emit("epp_request_error_rate", total_errors * per_s)
        emit("epp_request_error_ratio", ratio(total_errors, inc.get("requests")))
    for code, value in sorted(errors.items()):
        if value > 0:
            emit(f"epp_request_errors_{slug(code)}_rate", value * per_s)
    for kind, value in sorted(split.get("slo_violations", {}).items()):
        emit(f"epp_slo_violations_{slug(kind)}_rate", value * per_s)
    attempts = split.get("scheduler_attempts", {})
    if attempts:
        emit("epp_scheduler_attempt_rate", sum(attempts.values()) * per_s)
        for status, value in sorted(attempts.items()):
            emit(f"epp_scheduler_attempts_{slug(status)}_rate", value * per_s)
    decisions = split.get("disagg_decisions", {})
    if decisions:
        total = sum(decisions.values())
        emit("epp_disagg_decision_rate", total * per_s)
        for decision, value in sorted(decisions.items()):
            emit(f"epp_disagg_{slug(decision)}_rate", value * per_s)
            emit(f"epp_disagg_{slug(decision)}_share", ratio(value, total))
    for outcome, value in sorted(split.get("flow_control_requests", {}).items()):
        emit(f"epp_flow_control_{slug(outcome)}_rate", value * per_s)
    lookups = inc.get("kv_index_lookups")
    emit("epp_kv_index_hits_per_lookup", ratio(inc.get("kv_index_lookup_hits"), lookups))
    emit("epp_kv_index_max_pod_hits_per_lookup", ratio(inc.get("kv_index_max_pod_hits"), lookups))

    hists = d.histograms
    for key, prefix in _LATENCIES:
        hist = hists.get(key)
        if hist is None or hist.count <= 0:
            continue
        for label, q in QUANTILES:
            emit(f"{prefix}_{label}", histogram_quantile(q, hist.buckets))
        emit(f"{prefix}_mean", hist.sum / hist.count)
    for key, name in _AMOUNTS:
        hist = hists.get(key)
        if hist is not None:
            emit(name, hist.sum * per_s)
    cached, prompt = hists.get("cached_tokens"), hists.get("input_tokens")
    if cached is not None and prompt is not None:
        emit("epp_cached_token_ratio", ratio(cached.sum, prompt.sum))
    ratio_hist = hists.get("prefix_hit_ratio")
    if ratio_hist is not None and ratio_hist.count > 0:
        emit("epp_prefix_indexer_hit_ratio_mean", ratio_hist.sum / ratio_hist.count)
        emit("epp_prefix_indexer_hit_ratio_p50", histogram_quantile(0.5, ratio_hist.buckets))
    bytes_hist = hists.get("prefix_hit_bytes")
    if bytes_hist is not None and bytes_hist.count > 0:
        emit("epp_prefix_indexer_hit_bytes_mean", bytes_hist.sum / bytes_hist.count)
    for key, hist in sorted(hists.items()):
        if key.startswith("plugin_duration:") and hist.count > 0:
            emit(f"epp_plugin_{slug(key.split(':', 1)[1])}_duration_p95", histogram_quantile(0.95, hist.buckets))

    gauges = d.gauges
    for key, name in _GAUGES:
        values = gauges.get(key)
        if values:
            emit(name, float(sum(values)))
    endpoint_queues = [sum(v) for k, v in gauges.items() if k.startswith("endpoint_queue:") and v]
    if endpoint_queues:
        emit("epp_endpoint_queue_size_max", max(endpoint_queues))
    for key, values in sorted(gauges.items()):
        if key.startswith("pool_saturation:") and values:
            emit(f"epp_pool_saturation_{slug(key.split(':', 1)[1])}", float(sum(values)))
    return out


def _subject(target: Target, entity: str) -> str:
    """`router/<pool>` or `router/<pool>/<model>`."""
    return f"router/{entity}"


# The llm-d EPP source: entities are the pool and its models; there is no pool aggregate.
SOURCE = FamilySource("llmd", FAMILIES, aggregate=False, read=read_entities, signals=signals, subject_of=_subject)
