"""Render a simulated engine's state as a vLLM-format exposition via prometheus_client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controlplane.sim.fleet import SimEngine

__all__ = ["ITL_BUCKETS", "LATENCY_BUCKETS", "TTFT_BUCKETS", "render"]

# Bucket boundaries exactly as vLLM's defaults (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

COUNTER_DOCS = {
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
    "vllm:external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
}
HIST_DOCS = {
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
}


class _EngineCollector(Collector):
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        labels = ["engine", "model_name"]
        values = ["0", e.model]
        for name, value in (
            ("vllm:num_requests_running", e.running),
            ("vllm:num_requests_waiting", e.waiting),
            ("vllm:kv_cache_usage_perc", e.kv_usage),
        ):
            g = GaugeMetricFamily(name, name.split(":")[1].replace("_", " ").capitalize() + ".", labels=labels)
            g.add_metric(values, value)
            yield g
        success = CounterMetricFamily("vllm:request_success", COUNTER_DOCS["vllm:request_success"],
                                      labels=["engine", "finished_reason", "model_name"])
        for reason in ("abort", "error", "length", "repetition", "stop"):
            success.add_metric(["0", reason, e.model], e.finished.get(reason, 0.0), created=e.started_at)
        yield success
        for name, doc in COUNTER_DOCS.items():
            if name == "vllm:request_success":
                continue
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, e.counters[name], created=e.started_at)
            yield c
        for name, doc in HIST_DOCS.items():
            hist = e.histograms[name]
            h = HistogramMetricFamily(name, doc, labels=labels)
            cumulative = 0.0
            buckets = []
            for bound, count in zip(hist.bounds, hist.counts, strict=False):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            buckets.append(("+Inf", cumulative + hist.counts[-1]))
            h.add_metric(values, buckets, hist.sum)
            yield h


def _le(bound: float) -> str:
    return repr(float(bound))


def render(engine: SimEngine) -> bytes:
    """The engine's exposition, text format 0.0.4."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return generate_latest(registry)
