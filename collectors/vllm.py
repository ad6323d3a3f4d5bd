"""vLLM V1 `/metrics` families mapped to per-engine readings and signals.

Names follow vLLM 0.33 (`vllm:*`, counters exposed with `_total`); older names (`gpu_cache_usage_perc`,
`gpu_prefix_cache_*`, `time_per_output_token_seconds`) are read when the current ones are absent.
An entity is one engine: the `engine` label, i.e. the data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from collectors.derive import Histogram, histogram_quantile, ratio, share_above
from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Objectives, Sample, Signal, Target, engine_subject

__all__ = ["FAMILIES", "SOURCE", "objective_signals", "read_engines", "signals"]

FAMILIES = FamilyMap(
    counters={
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generation_tokens": ("vllm:generation_tokens_total",),
        "preemptions": ("vllm:num_preemptions_total",),
        "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "ext_prefix_queries": ("vllm:external_prefix_cache_queries_total",),
        "ext_prefix_hits": ("vllm:external_prefix_cache_hits_total",),
        "spec_drafts": ("vllm:spec_decode_num_drafts_total",),
        "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
        "spec_accepted": ("vllm:spec_decode_num_accepted_tokens_total",),
        "spec_accepted_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos_total",),
        "finished": ("vllm:request_success_total",),
        "nixl_failed_transfers": ("vllm:nixl_num_failed_transfers_total",),
        "nixl_failed_notifications": ("vllm:nixl_num_failed_notifications_total",),
        "nixl_kv_expired": ("vllm:nixl_num_kv_expired_reqs_total",),
    },
    gauges={
        "requests_running": ("vllm:num_requests_running",),
        "requests_waiting": ("vllm:num_requests_waiting",),
        "waiting_by_reason": ("vllm:num_requests_waiting_by_reason",),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    },
    histograms={
        "ttft": ("vllm:time_to_first_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "tpot": ("vllm:request_time_per_output_token_seconds",),
        "e2e": ("vllm:e2e_request_latency_seconds",),
        "queue_time": ("vllm:request_queue_time_seconds",),
        "nixl_xfer_time": ("vllm:nixl_xfer_time_seconds",),
        "nixl_post_time": ("vllm:nixl_post_time_seconds",),
        "nixl_bytes": ("vllm:nixl_bytes_transferred",),
        "prompt_len": ("vllm:request_prompt_tokens",),
        "output_len": ("vllm:request_generation_tokens",),
    },
    split_by={"spec_accepted_pos": "position", "finished": "finished_reason", "waiting_by_reason": "reason"},
    expected=(
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
    ),
)
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
# Histograms whose quantiles are signals (the byte-size one only needs its throughput).
_QUANTILED = ("ttft", "itl", "tpot", "e2e", "queue_time", "nixl_xfer_time", "nixl_post_time", "prompt_len",
              "output_len")


def _engine(labels: Mapping[str, str]) -> str:
    return labels.get("engine", "0")


def read_engines(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A target's samples as readings per engine (data-parallel rank)."""
    return read(samples, FAMILIES, _engine)


def _with_tpot(d: Delta) -> dict[str, Histogram]:
    """The delta's histograms, TPOT taken from the inter-token latency on older engines (the closest they have)."""
    hists = dict(d.histograms)
    if "tpot" not in hists and "itl" in hists:
        hists["tpot"] = hists["itl"]
    return hists


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn an engine or pool delta into named signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    inc = d.increases
    per_s = 1.0 / d.seconds
    finished = [v for k, v in inc.items() if k.startswith("finished:")]
    if finished:
        emit("request_rate", sum(finished) * per_s)
    for key, name in (
        ("prompt_tokens", "prompt_tokens_rate"),
        ("generation_tokens", "generation_tokens_rate"),
        ("preemptions", "preemption_rate"),
        ("prefix_queries", "prefix_cache_query_rate"),
        ("spec_drafts", "spec_draft_rate"),
        ("nixl_failed_transfers", "nixl_failed_transfer_rate"),
        ("nixl_failed_notifications", "nixl_failed_notification_rate"),
        ("nixl_kv_expired", "nixl_kv_expired_rate"),
    ):
        if key in inc:
            emit(name, inc[key] * per_s)
    if "finished:error" in inc:
        emit("request_error_rate", inc["finished:error"] * per_s)
    emit("prefix_cache_hit_rate", ratio(inc.get("prefix_hits"), inc.get("prefix_queries")))
    emit("external_prefix_cache_hit_rate", ratio(inc.get("ext_prefix_hits"), inc.get("ext_prefix_queries")))
    emit("spec_acceptance_rate", ratio(inc.get("spec_accepted"), inc.get("spec_draft_tokens")))
    per_draft = ratio(inc.get("spec_accepted"), inc.get("spec_drafts"))
    emit("spec_mean_acceptance_length", None if per_draft is None else 1.0 + per_draft)
    # Yield: how much of the output the drafts produced. With the ngram drafter a collapse shows
    # as drafts vanishing, where the acceptance rate is undefined; the yield still falls.
    emit("spec_yield", ratio(inc.get("spec_accepted"), inc.get("generation_tokens")))
    for key, value in inc.items():
        if key.startswith("spec_accepted_pos:"):
            emit(f"spec_acceptance_pos_{key.split(':', 1)[1]}", ratio(value, inc.get("spec_drafts")))

    hists = _with_tpot(d)
    for key in _QUANTILED:
        hist = hists.get(key)
        if hist is None or hist.count <= 0:
            continue
        for label, q in QUANTILES:
            emit(f"{key}_{label}", histogram_quantile(q, hist.buckets))
        emit(f"{key}_mean", hist.sum / hist.count)
        if key == "tpot":
            # Which TPOT it is: the per-request one, or the inter-token latency an older engine has instead. A canary
            # judge compares arms on one of them only (`policies.canary.tpot_reading`).
            emit("tpot_per_request", 1.0 if "tpot" in d.histograms else 0.0)
    nixl_bytes = hists.get("nixl_bytes")
    if nixl_bytes is not None and nixl_bytes.count > 0:
        emit("nixl_bytes_rate", nixl_bytes.sum * per_s)
        emit("nixl_transfer_rate", nixl_bytes.count * per_s)
        xfer = hists.get("nixl_xfer_time")
        if xfer is not None and xfer.sum > 0:
            # Bytes per second of transfer time: unlike the time itself, blind to prompt length.
            emit("nixl_xfer_bandwidth", nixl_bytes.sum / xfer.sum)

    for key, values in d.gauges.items():
        if not values:
            continue
        if key == "kv_cache_usage":
            emit("kv_cache_usage", sum(values) / len(values))
            emit("kv_cache_usage_max", max(values))
        elif key.startswith("waiting_by_reason:"):
            emit(f"requests_waiting_{key.split(':', 1)[1]}", float(sum(values)))
        else:
            emit(key, float(sum(values)))
    return out


def objective_signals(d: Delta, ts: float, subject: str, objectives: Objectives) -> list[Signal]:
    """The share of the interval's requests whose TTFT and TPOT went over the objectives (`ttft_over_slo`,
    `tpot_over_slo`): exact where an objective sits on a bucket bound, where the p95 read from the same buckets is
    an interpolation."""
    out = SignalList(ts, subject)
    hists = _with_tpot(d)  # keyed like the objectives: ttft, tpot
    for objective, seconds in objectives.given():
        hist = hists.get(objective)
        if hist is not None and hist.count > 0:
            out.emit(Objectives.signal(objective), share_above(seconds, hist.buckets))
    return out


def _subject(target: Target, entity: str) -> str:
    return engine_subject(target.pool, target.pod, entity)


# The vLLM engine source: entities are engines, pools aggregate their deltas.
SOURCE = FamilySource("vllm", FAMILIES, aggregate=True, read=read_engines, signals=signals, subject_of=_subject,
                      objective_signals=objective_signals)
