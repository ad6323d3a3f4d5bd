"""NIXL's own Prometheus exporter (`prometheus` / `prometheus_mp` telemetry plugins) mapped to
per-agent readings and signals.

Family names follow the exporter's version drift: the beta plugin (NIXL 0.9.0..v1.0.1) exposed its
counters without `_total` and labelled them with `category`; v1.1 added `_total`; v1.4 added
`agent_errors_total{status}` and `agent_telemetry_events_dropped_total`; later releases added the
`agent_xfer_time_us` / `agent_xfer_post_time_us` histograms. Times are exposed in microseconds;
every signal here is in seconds. An entity is one agent: `<hostname>/<agent_name>`, plus
`/<local_rank>` (else `/<pid>`) under `prometheus_mp`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from collectors.derive import Histogram, histogram_quantile, ratio
from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Sample, Signal, Target

__all__ = ["FAMILIES", "SOURCE", "agent_entity", "read_agents", "signals"]

US_PER_S = 1e6

FAMILIES = FamilyMap(
    counters={
        "tx_bytes": ("agent_tx_bytes_total", "agent_tx_bytes"),
        "rx_bytes": ("agent_rx_bytes_total", "agent_rx_bytes"),
        "tx_requests": ("agent_tx_requests_num_total", "agent_tx_requests_num"),
        "rx_requests": ("agent_rx_requests_num_total", "agent_rx_requests_num"),
        "memory_registered": ("agent_memory_registered_total",),
        "memory_deregistered": ("agent_memory_deregistered_total",),
        "xfer_time_us": ("agent_xfer_time_total",),
        "post_time_us": ("agent_xfer_post_time_total",),
        "errors": ("agent_errors_total",),
        "events_dropped": ("agent_telemetry_events_dropped_total",),
    },
    histograms={
        "xfer_time": ("agent_xfer_time_us",),
        "post_time": ("agent_xfer_post_time_us",),
    },
    split_by={"errors": "status"},
    expected=(
        "agent_tx_bytes_total",
        "agent_rx_bytes_total",
        "agent_tx_requests_num_total",
        "agent_rx_requests_num_total",
        "agent_xfer_time_us",
        "agent_errors_total",
    ),
)
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
# Histogram key, the cumulative-µs counter that stands in for it on exporters without
# histograms (v1.1..v1.4), and the signal prefix.
_TIMES = (("xfer_time", "xfer_time_us", "nixl_xfer_time"), ("post_time", "post_time_us", "nixl_post_time"))
_RATES = (
    ("tx_bytes", "nixl_tx_bytes_rate"),
    ("rx_bytes", "nixl_rx_bytes_rate"),
    ("tx_requests", "nixl_tx_request_rate"),
    ("rx_requests", "nixl_rx_request_rate"),
    ("events_dropped", "nixl_telemetry_dropped_rate"),
)
_ATTR_LABELS = ("hostname", "agent_name", "local_rank", "pid")
# Net registered bytes is a level, not an increase, so it travels as a gauge.
_NET_REGISTERED = "memory_registered_net"


def agent_entity(labels: Mapping[str, str]) -> str | None:
    """`<hostname>/<agent_name>`, plus `/<local_rank>` or `/<pid>` under `prometheus_mp`.

    Several agents of one process with the same name (`agent_instance`) are summed, as the
    exporter's own guidance (`sum without (pid, agent_instance)`) does.
    """
    agent = labels.get("agent_name")
    if agent is None:
        return None
    entity = f"{labels.get('hostname', '')}/{agent}"
    # A restarted rank keeps its local_rank but gets a new pid: keying by the rank keeps the
    # entity stable; its counters are diffed series by series, so the old process's series
    # leaving the sum when it is reaped adds nothing and the new one's counts from zero.
    rank = labels.get("local_rank")
    if rank is not None:
        return f"{entity}/{rank}"
    pid = labels.get("pid")
    return f"{entity}/{pid}" if pid is not None else entity


def _attrs(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: labels[k] for k in _ATTR_LABELS if k in labels}


def read_agents(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A target's samples as readings per NIXL agent; `exposer_*` series are ignored."""
    readings = read(samples, FAMILIES, agent_entity, _attrs)
    for r in readings.values():
        registered = r.counters.get("memory_registered")
        if registered is not None:
            r.gauges[_NET_REGISTERED] = registered - r.counters.get("memory_deregistered", 0.0)
    return readings


def _seconds(hist: Histogram) -> Histogram:
    """The same histogram with µs bounds and sum expressed in seconds."""
    return Histogram(tuple((le / US_PER_S, c) for le, c in hist.buckets), hist.sum / US_PER_S, hist.count)


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn one agent's delta into named signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    inc = d.increases
    per_s = 1.0 / d.seconds
    out.rates(_RATES, d)

    requests = [inc[k] for k in ("tx_requests", "rx_requests") if k in inc]
    if requests:
        # NIXL counts a WRITE the agent posts as tx and a READ as rx: a decode worker that pulls its KV (vLLM's
        # connector) posts only READs, and its errors are a share of both.
        emit("nixl_request_rate", sum(requests) * per_s)
    for hist_key, total_key, prefix in _TIMES:
        hist = d.histograms.get(hist_key)
        if hist is not None:
            if hist.count <= 0:
                continue
            secs = _seconds(hist)
            for label, q in QUANTILES:
                emit(f"{prefix}_{label}", histogram_quantile(q, secs.buckets))
            emit(f"{prefix}_mean", secs.sum / secs.count)
        elif total_key in inc and requests:
            # Each transfer adds one tx or one rx request and its duration to the µs total.
            mean_us = ratio(inc[total_key], sum(requests))
            emit(f"{prefix}_mean", None if mean_us is None else mean_us / US_PER_S)

    # Per-transfer effective bandwidth: bytes moved over the summed transfer durations
    # (initiator side only; concurrent transfers overlap, so this is not link throughput).
    moved = [inc[k] for k in ("tx_bytes", "rx_bytes") if k in inc]
    busy_us = inc.get("xfer_time_us")
    if busy_us is None and "xfer_time" in d.histograms:
        busy_us = d.histograms["xfer_time"].sum
    if moved and busy_us:
        emit("nixl_xfer_bandwidth", sum(moved) / (busy_us / US_PER_S))

    errors = {k.split(":", 1)[1]: v for k, v in inc.items() if k.startswith("errors:")}
    if errors:
        emit("nixl_error_rate", sum(errors.values()) * per_s)
        for status, value in sorted(errors.items()):
            if value > 0:
                emit(f"nixl_errors_{status}_rate", value * per_s)

    net = d.gauges.get(_NET_REGISTERED)
    if net:
        emit("nixl_memory_registered_bytes", float(sum(net)))
    return out


def _subject(target: Target, entity: str) -> str:
    """`nixl/<hostname>/<agent_name>[/<rank or pid>]`."""
    return f"nixl/{entity}"


# The NIXL exporter source: entities are agents; there is no pool aggregate.
SOURCE = FamilySource("nixl", FAMILIES, aggregate=False, read=read_agents, signals=signals, subject_of=_subject)
