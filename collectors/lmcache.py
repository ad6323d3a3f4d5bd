"""LMCache's own `lmcache:*` metrics (`lmcache/observability.py`) mapped to per-worker readings
and signals.

LMCache declares its counters without `_total` and `prometheus_client` exposes them with it; both
spellings are read, the exposed one first. Every series carries `model_name`, `worker_id`, `role`
and `served_model_name`. An entity is one worker: `<worker_id>`, or `<worker_id>/<role>` for a
role other than the worker's own (the scheduler side records lookups under its own labels).
Remote-backend times are exposed in milliseconds; every time signal here is in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from collectors.derive import Histogram, histogram_quantile, ratio
from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Sample, Signal, Target

__all__ = ["FAMILIES", "SOURCE", "read_workers", "signals", "worker_entity"]


def _counter(name: str) -> tuple[str, str]:
    return (f"lmcache:{name}_total", f"lmcache:{name}")


FAMILIES = FamilyMap(
    counters={
        "retrieve_requests": _counter("num_retrieve_requests"),
        "store_requests": _counter("num_store_requests"),
        "lookup_requests": _counter("num_lookup_requests"),
        "requested_tokens": _counter("num_requested_tokens"),
        "hit_tokens": _counter("num_hit_tokens"),
        "stored_tokens": _counter("num_stored_tokens"),
        "lookup_tokens": _counter("num_lookup_tokens"),
        "lookup_hits": _counter("num_lookup_hits"),
        "remote_read_bytes": _counter("num_remote_read_bytes"),
        "remote_write_bytes": _counter("num_remote_write_bytes"),
        "local_cpu_evictions": _counter("local_cpu_evict_count"),
        "local_cpu_evict_failures": _counter("local_cpu_evict_failed_count"),
        "remote_ping_errors": _counter("remote_ping_errors"),
    },
    gauges={
        "retrieve_hit_rate": ("lmcache:retrieve_hit_rate",),
        "lookup_hit_rate": ("lmcache:lookup_hit_rate",),
        "local_cache_usage": ("lmcache:local_cache_usage",),
        "remote_cache_usage": ("lmcache:remote_cache_usage",),
        "local_storage_usage": ("lmcache:local_storage_usage",),
        "healthy": ("lmcache:lmcache_is_healthy",),
    },
    histograms={
        "retrieve_time": ("lmcache:time_to_retrieve",),
        "store_time": ("lmcache:time_to_store",),
        "lookup_time": ("lmcache:time_to_lookup",),
        "remote_get_time_ms": ("lmcache:remote_time_to_get",),
        "remote_put_time_ms": ("lmcache:remote_time_to_put",),
    },
    expected=(
        "lmcache:num_requested_tokens_total",
        "lmcache:num_hit_tokens_total",
        "lmcache:time_to_retrieve",
        "lmcache:time_to_store",
        "lmcache:local_cache_usage",
    ),
)
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
# Histogram key, signal prefix, seconds per exposed unit.
_TIMES = (
    ("retrieve_time", "lmcache_retrieve_time", 1.0),
    ("store_time", "lmcache_store_time", 1.0),
    ("lookup_time", "lmcache_lookup_time", 1.0),
    ("remote_get_time_ms", "lmcache_remote_get_time", 1e-3),
    ("remote_put_time_ms", "lmcache_remote_put_time", 1e-3),
)
_RATES = (
    ("retrieve_requests", "lmcache_retrieve_rate"),
    ("store_requests", "lmcache_store_rate"),
    ("lookup_requests", "lmcache_lookup_rate"),
    ("stored_tokens", "lmcache_stored_tokens_rate"),
    ("hit_tokens", "lmcache_hit_tokens_rate"),
    ("remote_read_bytes", "lmcache_remote_read_bytes_rate"),
    ("remote_write_bytes", "lmcache_remote_write_bytes_rate"),
    ("local_cpu_evictions", "lmcache_local_cpu_evict_rate"),
    ("local_cpu_evict_failures", "lmcache_local_cpu_evict_failed_rate"),
    ("remote_ping_errors", "lmcache_remote_ping_error_rate"),
)
_GAUGES = (
    ("local_cache_usage", "lmcache_local_cache_usage"),
    ("remote_cache_usage", "lmcache_remote_cache_usage"),
    ("local_storage_usage", "lmcache_local_storage_usage"),
    ("healthy", "lmcache_healthy"),
)
# Hit rate from token counters, or else from the gauge LMCache sets at each log interval.
_HIT_RATES = (
    ("lmcache_retrieve_hit_rate", "hit_tokens", "requested_tokens", "retrieve_hit_rate"),
    ("lmcache_lookup_hit_rate", "lookup_hits", "lookup_tokens", "lookup_hit_rate"),
)
_ATTR_LABELS = ("model_name", "served_model_name", "worker_id", "role")


def worker_entity(labels: Mapping[str, str]) -> str:
    """`<worker_id>`, or `<worker_id>/<role>` for a role other than `worker`."""
    worker = labels.get("worker_id") or "0"
    role = labels.get("role", "")
    return worker if role in ("", "worker") else f"{worker}/{role}"


def _attrs(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: labels[k] for k in _ATTR_LABELS if k in labels}


def read_workers(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A target's samples as readings per LMCache worker."""
    return read(samples, FAMILIES, worker_entity, _attrs)


def _scaled(hist: Histogram, factor: float) -> Histogram:
    return Histogram(tuple((le * factor, c) for le, c in hist.buckets), hist.sum * factor, hist.count)


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn one worker's delta into named `lmcache_*` signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    inc = d.increases
    out.rates(_RATES, d)
    for name, hits, total, gauge in _HIT_RATES:
        if hits in inc and total in inc:
            # An interval without requests has no hit rate; the gauge would only repeat a stale one.
            emit(name, ratio(inc[hits], inc[total]))
        elif d.gauges.get(gauge):
            values = d.gauges[gauge]
            emit(name, sum(values) / len(values))

    for key, prefix, factor in _TIMES:
        hist = d.histograms.get(key)
        if hist is None or hist.count <= 0:
            continue
        secs = hist if factor == 1.0 else _scaled(hist, factor)
        for label, q in QUANTILES:
            emit(f"{prefix}_{label}", histogram_quantile(q, secs.buckets))
        emit(f"{prefix}_mean", secs.sum / secs.count)

    for key, name in _GAUGES:
        gauge_values = d.gauges.get(key)
        if gauge_values:
            emit(name, float(sum(gauge_values)))
    return out


def _subject(target: Target, entity: str) -> str:
    """`lmcache/<pool>/<pod>/<worker>`: worker ids restart at 0 in every pod."""
    return f"lmcache/{target.pool}/{target.pod}/{entity}"


# The LMCache source: entities are workers; there is no pool aggregate.
SOURCE = FamilySource("lmcache", FAMILIES, aggregate=False, read=read_workers, signals=signals, subject_of=_subject)
