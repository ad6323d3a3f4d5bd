"""vLLM V1 `/metrics` families mapped to engine readings and signals.

Names follow vLLM 0.33 (`vllm:*`, counters exposed with `_total`); older names (`gpu_cache_usage_perc`,
`gpu_prefix_cache_*`, `time_per_output_token_seconds`) are read when the current ones are absent.
Every function here is pure: the caller supplies previous readings and the time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from collectors.derive import (
    Histogram,
    counter_increase,
    histogram_increase,
    histogram_quantile,
    ratio,
)
from collectors.types import Sample, Signal

__all__ = ["EXPECTED_FAMILIES", "EngineDelta", "EngineReading", "delta", "read_engines", "signals"]

# reading key -> exposed family names, preferred first (older spellings after).
COUNTERS: dict[str, tuple[str, ...]] = {
    "requests": ("vllm:request_success_total",),
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
}
GAUGES: dict[str, tuple[str, ...]] = {
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
}
# Families whose absence would silently blind a policy; reported per target.
EXPECTED_FAMILIES: tuple[str, ...] = (
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))

_COUNTER_INDEX = {fam: (key, rank) for key, fams in COUNTERS.items() for rank, fam in enumerate(fams)}
_GAUGE_INDEX = {fam: (key, rank) for key, fams in GAUGES.items() for rank, fam in enumerate(fams)}
_HIST_INDEX = {
    fam + suffix: (key, rank, suffix)
    for key, fams in HISTOGRAMS.items()
    for rank, fam in enumerate(fams)
    for suffix in ("_bucket", "_sum", "_count")
}


@dataclass(slots=True)
class EngineReading:
    """One engine's cumulative counters, gauges and histograms at one scrape."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)


@dataclass(slots=True)
class EngineDelta:
    """What happened on an engine (or a pool) between two scrapes."""

    seconds: float
    increases: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    gauges: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: EngineDelta) -> EngineDelta:
        """Pool aggregation: sum increases and buckets (as `sum by (le)`), pool gauge values."""
        out = EngineDelta(max(self.seconds, other.seconds))
        for key in self.increases.keys() | other.increases.keys():
            out.increases[key] = self.increases.get(key, 0.0) + other.increases.get(key, 0.0)
        for key in self.histograms.keys() | other.histograms.keys():
            a = self.histograms.get(key)
            b = other.histograms.get(key)
            out.histograms[key] = a + b if a is not None and b is not None else (a or b)  # type: ignore[assignment]
        for key in self.gauges.keys() | other.gauges.keys():
            out.gauges[key] = self.gauges.get(key, []) + other.gauges.get(key, [])
        return out


class _HistogramBuilder:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets: dict[float, float] = {}
        self.sum = 0.0
        self.count = 0.0

    def build(self) -> Histogram:
        return Histogram(tuple(sorted(self.buckets.items())), self.sum, self.count)


def _preferred(parts: dict[tuple[str, str, int], object]) -> dict[tuple[str, str], int]:
    """For each (engine, key) the lowest spelling rank seen: current names beat old ones."""
    best: dict[tuple[str, str], int] = {}
    for engine, key, rank in parts:
        if rank < best.get((engine, key), rank + 1):
            best[(engine, key)] = rank
    return best


def read_engines(samples: Iterable[Sample]) -> dict[str, EngineReading]:
    """Group a target's samples by the `engine` label (data-parallel rank) into readings.

    Counters are summed over their extra labels (`finished_reason`, ...) to the family total.
    """
    engines: dict[str, EngineReading] = {}
    counters: dict[tuple[str, str, int], float] = {}
    gauges: dict[tuple[str, str, int], float] = {}
    hists: dict[tuple[str, str, int], _HistogramBuilder] = {}

    for s in samples:
        name = s.name
        engine = s.labels.get("engine", "0")
        if (c := _COUNTER_INDEX.get(name)) is not None:
            key, rank = c
            counters[(engine, key, rank)] = counters.get((engine, key, rank), 0.0) + s.value
            if key == "requests" and s.labels.get("finished_reason") == "error":
                slot = (engine, "request_errors", rank)
                counters[slot] = counters.get(slot, 0.0) + s.value
            family = name
        elif (g := _GAUGE_INDEX.get(name)) is not None:
            key, rank = g
            gauges[(engine, key, rank)] = s.value
            family = name
        elif (h := _HIST_INDEX.get(name)) is not None:
            key, rank, suffix = h
            family = name[: -len(suffix)]
            b = hists.get((engine, key, rank))
            if b is None:
                b = hists[(engine, key, rank)] = _HistogramBuilder()
            if suffix == "_bucket":
                le = s.labels.get("le")
                if le is None:
                    continue
                bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
                b.buckets[bound] = b.buckets.get(bound, 0.0) + s.value
            elif suffix == "_sum":
                b.sum += s.value
            else:
                b.count += s.value
        else:
            continue
        r = engines.get(engine)
        if r is None:
            r = engines[engine] = EngineReading()
        r.families.add(family)

    for parts, store in ((counters, "counters"), (gauges, "gauges")):
        best = _preferred(parts)  # type: ignore[arg-type]
        for (engine, key, rank), value in parts.items():
            if best[(engine, key)] == rank:
                getattr(engines[engine], store)[key] = value
    best = _preferred(hists)  # type: ignore[arg-type]
    for (engine, key, rank), builder in hists.items():
        if best[(engine, key)] == rank and builder.buckets:
            engines[engine].histograms[key] = builder.build()
    return engines


def missing_families(readings: dict[str, EngineReading]) -> list[str]:
    """Expected families that none of a target's engines exposed, old spellings counting."""
    present: set[str] = set()
    for r in readings.values():
        present |= r.families
    aliases = {**COUNTERS, **GAUGES, **HISTOGRAMS}
    missing = []
    for fam in EXPECTED_FAMILIES:
        group = next((fams for fams in aliases.values() if fam in fams), (fam,))
        if not present.intersection(group):
            missing.append(fam)
    return missing


def delta(prev: EngineReading | None, cur: EngineReading, seconds: float) -> EngineDelta | None:
    """The change between two readings of one engine; None without a previous one."""
    if prev is None or seconds <= 0:
        return None
    out = EngineDelta(seconds)
    for key, value in cur.counters.items():
        inc = counter_increase(prev.counters.get(key), value)
        if inc is not None:
            out.increases[key] = inc
    for key, hist in cur.histograms.items():
        inc_h = histogram_increase(prev.histograms.get(key), hist)
        if inc_h is not None:
            out.histograms[key] = inc_h
    for key, value in cur.gauges.items():
        out.gauges[key] = [value]
    return out


def signals(d: EngineDelta, ts: float, subject: str) -> list[Signal]:
    """Turn an engine or pool delta into named signals for `subject` at time `ts`."""
    out: list[Signal] = []

    def emit(name: str, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            out.append(Signal(ts, subject, name, value))

    inc = d.increases
    per_s = 1.0 / d.seconds
    for key, name in (
        ("requests", "request_rate"),
        ("request_errors", "request_error_rate"),
        ("prompt_tokens", "prompt_tokens_rate"),
        ("generation_tokens", "generation_tokens_rate"),
        ("preemptions", "preemption_rate"),
        ("prefix_queries", "prefix_cache_query_rate"),
        ("spec_drafts", "spec_draft_rate"),
    ):
        if key in inc:
            emit(name, inc[key] * per_s)
    emit("prefix_cache_hit_rate", ratio(inc.get("prefix_hits"), inc.get("prefix_queries")))
    emit("external_prefix_cache_hit_rate", ratio(inc.get("ext_prefix_hits"), inc.get("ext_prefix_queries")))
    emit("spec_acceptance_rate", ratio(inc.get("spec_accepted"), inc.get("spec_draft_tokens")))
    accepted_per_draft = ratio(inc.get("spec_accepted"), inc.get("spec_drafts"))
    emit("spec_mean_acceptance_length", None if accepted_per_draft is None else 1.0 + accepted_per_draft)
    emit("spec_yield", ratio(inc.get("spec_accepted"), inc.get("generation_tokens")))

    hists = dict(d.histograms)
    if "tpot" not in hists and "itl" in hists:
        hists["tpot"] = hists["itl"]  # older engines: per-token latency is the closest TPOT
    for key, hist in hists.items():
        if hist.count <= 0:
            continue
        for label, q in QUANTILES:
            emit(f"{key}_{label}", histogram_quantile(q, hist.buckets))
        emit(f"{key}_mean", hist.sum / hist.count)

    for key, values in d.gauges.items():
        if not values:
            continue
        if key == "kv_cache_usage":
            emit("kv_cache_usage", sum(values) / len(values))
            emit("kv_cache_usage_max", max(values))
        else:
            emit(key, float(sum(values)))
    return out
