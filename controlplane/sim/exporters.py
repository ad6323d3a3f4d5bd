"""What a simulated engine serves: vLLM's `/metrics`, dcgm-exporter's and NIXL's exporter's.

Each rendering uses prometheus_client, with the real families' names, types, labels and bucket
bounds (vLLM 0.32's defaults, dcgm-exporter's default counters, NIXL's telemetry exporter), so
the collectors read a simulated fleet exactly as they read a real one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.sim.engine import Hist

if TYPE_CHECKING:
    from controlplane.sim.fleet import Member

__all__ = ["node_of", "render_dcgm", "render_nixl", "render_vllm"]

DOCS = {
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance cache "
                                          "sharing, in terms of number of queried tokens.",
    "vllm:external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache sharing, "
                                       "in terms of number of cached tokens.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
}
DRIVER = "570.124.06"
GPU_MODEL = "NVIDIA H200"
FB_TOTAL_MIB = 143_771
WEIGHTS_MIB = 9_000


def _hist(name: str, doc: str, labels: Sequence[str], rows: Sequence[tuple[Sequence[str], Hist]]) -> Metric:
    h = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, hist in rows:
        cumulative, buckets = 0.0, []
        for bound, n in zip(hist.bounds, hist.counts, strict=False):
            cumulative += n
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", cumulative + hist.counts[-1]))
        h.add_metric(list(values), buckets, hist.sum)
    return h


class _Vllm(Collector):
    def __init__(self, m: Member, model: str) -> None:
        self.m, self.model = m, model

    def collect(self) -> Iterator[Metric]:
        e = self.m.engine
        e.refresh_gauges()
        labels = ["engine", "model_name"]
        ranks = [(str(i), s) for i, s in enumerate(e.ranks)]
        usage = e.kv_usage
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            for rank, s in ranks:
                g.add_metric([rank, self.model], float(value(s)))
            yield g
        # The API server's process collector, as every prometheus_client process exports it.
        yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                                value=e.started_at)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["engine", "finished_reason", "model_name"])
        for rank, s in ranks:
            for reason in ("abort", "error", "length", "repetition", "stop"):
                success.add_metric([rank, reason, self.model], s.finished.get(reason, 0.0), created=e.started_at)
        yield success
        spec = e.spec.enabled
        for name in ranks[0][1].counters:
            if name.startswith("vllm:spec_decode") and not spec:
                continue  # vLLM registers these only with a speculative config
            c = CounterMetricFamily(name, DOCS[name], labels=labels)
            for rank, s in ranks:
                c.add_metric([rank, self.model], s.counters[name], created=e.started_at)
            yield c
        if spec:
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["engine", "model_name", "position"])
            for rank, s in ranks:
                for pos in range(e.spec.num_speculative_tokens):
                    c.add_metric([rank, self.model, str(pos)], s.per_pos[pos], created=e.started_at)
            yield c
        for name in ranks[0][1].hists:
            yield _hist(name, DOCS[name], labels, [([rank, self.model], s.hists[name]) for rank, s in ranks])
        if self.m.role == "decode":
            yield from self._nixl()

    def _nixl(self) -> Iterator[Metric]:
        tr, labels, values = self.m.transfer, ["engine", "model_name"], ["0", self.model]
        yield _hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                    labels, [(values, tr.xfer)])
        yield _hist("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.",
                    labels, [(values, tr.post)])
        yield _hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                    labels, [(values, tr.sizes)])
        for name, doc, value in (
            ("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", tr.failed),
            ("vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications.", 0.0),
            ("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.", 0.0),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c


def _registry(collector: Collector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def render_vllm(m: Member, model: str) -> bytes:
    """The engine's vLLM `/metrics`, text format 0.0.4."""
    return _registry(_Vllm(m, model))


class _Nixl(Collector):
    """NIXL's telemetry exporter in the decode worker's process: one agent, times in microseconds."""

    def __init__(self, m: Member) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        tr = self.m.transfer
        labels, values = ["agent_name", "hostname"], [self.m.pod, node_of(self.m.pod)]
        for name, doc, value in (
            ("agent_tx_bytes", "Number of bytes sent by the agent", 0.0),
            ("agent_rx_bytes", "Number of bytes received by the agent", tr.bytes),
            ("agent_tx_requests_num", "Number of requests sent by the agent", 0.0),
            ("agent_rx_requests_num", "Number of requests received by the agent", tr.count),
            ("agent_xfer_time", "Cumulative transfer time in microseconds", tr.xfer_us.sum),
            ("agent_xfer_post_time", "Cumulative transfer post time in microseconds", tr.post_us.sum),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        errors = CounterMetricFamily("agent_errors", "Number of failed transfers by status",
                                     labels=[*labels, "status"])
        errors.add_metric([*values, "NIXL_ERR_REMOTE_DISCONNECT"], tr.failed)
        yield errors
        yield _hist("agent_xfer_time_us", "Distribution of transfer time from start to completion, in microseconds",
                    labels, [(values, tr.xfer_us)])
        yield _hist("agent_xfer_post_time_us", "Distribution of transfer post time, in microseconds",
                    labels, [(values, tr.post_us)])


def render_nixl(m: Member) -> bytes:
    """The decode worker's NIXL exporter `/metrics`."""
    return _registry(_Nixl(m))


def node_of(pod: str) -> str:
    """The node a simulated engine runs on (one engine per node)."""
    return f"node-{pod}"


class _Dcgm(Collector):
    """dcgm-exporter on the engine's node: one row per GPU (one per EP rank), pod attributed."""

    def __init__(self, m: Member) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m, g, e = self.m, self.m.gpu, self.m.engine
        util = g.utilization
        activity = m.rank_activity()
        clock = 1980.0 * (0.7 if g.throttled else 1.0)
        host = node_of(m.pod)
        labels = ["gpu", "UUID", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION", "container",
                  "namespace", "pod"]
        rows = [[str(i), f"GPU-{abs(hash((m.pod, i))) % 16**8:08x}-sim", f"nvidia{i}", GPU_MODEL, host, DRIVER,
                 "vllm", "llm", m.pod] for i in range(len(activity))]
        kv_mib = e.kv_usage * (FB_TOTAL_MIB - WEIGHTS_MIB) * 0.9
        temp = 38.0 + 40.0 * util + (25.0 if g.throttled else 0.0)
        gauges = (
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda a: round(100 * util)),
            ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", lambda a: util),
            ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.",
             lambda a: 0.55 * util * a),
            ("DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the device memory interface is active.",
             lambda a: 0.65 * util * a),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda a: round(WEIGHTS_MIB + kv_mib)),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).",
             lambda a: round(FB_TOTAL_MIB - WEIGHTS_MIB - kv_mib)),
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda a: round(temp)),
            ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", lambda a: round(temp + 6)),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", g.power_w),
            ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda a: clock),
            ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", lambda a: g.xid),
        )
        for name, doc, fn in gauges:
            f = GaugeMetricFamily(name, doc, labels=labels)
            for row, a in zip(rows, activity, strict=True):
                f.add_metric(row, float(fn(a)))
            yield f
        counters = (
            ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).",
             g.energy_j * 1000 / len(rows)),
            ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", g.ecc_sbe),
            ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", g.ecc_dbe),
            # DCGM counts violation time in nanoseconds, whatever the exporter's help text says.
            ("DCGM_FI_DEV_THERMAL_VIOLATION", "Throttling duration due to thermal constraints (in us).",
             g.thermal_violation_s * 1e9),
            ("DCGM_FI_DEV_POWER_VIOLATION", "Throttling duration due to power constraints (in us).", 0.0),
        )
        for name, doc, value in counters:
            # dcgm-exporter declares these as counters but prints them without a _total suffix.
            f = GaugeMetricFamily(name, doc, labels=labels)
            f.type = "counter"
            for row in rows:
                f.add_metric(row, float(value))
            yield f


def render_dcgm(m: Member) -> bytes:
    """dcgm-exporter's `/metrics` for the engine's GPUs, as the fleet last sampled them."""
    return _registry(_Dcgm(m))
