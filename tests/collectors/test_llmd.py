"""llm-d EPP mapping: GIE and llm-d-router spellings, pool and model entities, flow control, kv-cache index."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from collectors import families, llmd, sources
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Target
from tests.collectors.expositions import fmt, histogram

POOL = "pool-a"
MODEL = "llama"
LATENCY_BOUNDS = ("0.1", "0.5", "1", "5")
NTPOT_BOUNDS = ("0.01", "0.05", "0.1")
TOKEN_BOUNDS = ("128", "1024", "8192")
SCHEDULER_BOUNDS = ("0.001", "0.002", "0.005", "0.01")
RATIO_BOUNDS = ("0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0")

# The families each release exposes, with the label that names a queue's endpoint (reference §3.1).
GIE_V1_0 = {
    "requests": "inference_model_request_total", "errors": "inference_model_request_error_total",
    "latency": "inference_model_request_duration_seconds",
    "ntpot": "inference_model_normalized_time_per_output_token_seconds",
    "input": "inference_model_input_tokens", "output": "inference_model_output_tokens",
    "running": "inference_model_running_requests", "kv": "inference_pool_average_kv_cache_utilization",
    "queue": "inference_pool_average_queue_size", "ready": "inference_pool_ready_pods",
    "endpoint_queue": "inference_pool_per_pod_queue_size", "endpoint_label": "model_server_pod",
    "scheduler": "inference_extension_scheduler_e2e_duration_seconds",
    "prefix_size": "inference_extension_prefix_indexer_size", "prefix_ratio": "inference_extension_prefix_indexer_hit_ratio",
}
GIE_V1_1 = {k: v.replace("inference_model_", "inference_objective_") for k, v in GIE_V1_0.items()}
LLMD_V0_10 = {
    "requests": "llm_d_epp_request_total", "errors": "llm_d_epp_request_error_total",
    "latency": "llm_d_epp_request_duration_seconds", "ntpot": "llm_d_epp_request_ntpot_seconds",
    "input": "llm_d_epp_request_input_tokens", "output": "llm_d_epp_request_output_tokens",
    "running": "llm_d_epp_request_running", "kv": "llm_d_epp_average_kv_cache_utilization",
    "queue": "llm_d_epp_average_queue_size", "ready": "llm_d_epp_ready_endpoints",
    "endpoint_queue": "llm_d_epp_per_endpoint_queue_size", "endpoint_label": "model_server_endpoint",
    "scheduler": "llm_d_epp_scheduler_e2e_duration_seconds",
    "prefix_size": "llm_d_epp_prefix_indexer_size", "prefix_ratio": "llm_d_epp_prefix_indexer_hit_ratio",
}
ERAS = {"gie-v1.0": GIE_V1_0, "gie-v1.1": GIE_V1_1, "llm-d-router-v0.10": LLMD_V0_10}


@dataclass(frozen=True)
class Epp:
    """Cumulative EPP state; histograms are given as their observations."""

    requests: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    latency: tuple[float, ...] = ()
    ntpot: tuple[float, ...] = ()
    input_tokens: tuple[float, ...] = ()
    output_tokens: tuple[float, ...] = ()
    running: int = 0
    kv: float = 0.0
    queue: float = 0.0
    ready: int = 0
    endpoint_queues: Mapping[str, int] = field(default_factory=dict)
    scheduler: tuple[float, ...] = ()
    prefix_size: int = 0
    prefix_ratios: tuple[float, ...] = ()


def exposition(e: Epp, era: str = "llm-d-router-v0.10", pool: str | None = POOL) -> str:
    """The EPP's `/metrics` as the named release spells it."""
    n = ERAS[era]
    model = {"model_name": MODEL, "target_model_name": f"{MODEL}-v1"}
    if era.startswith("llm-d"):
        model |= {"fairness_id": "default", "priority": "0"}
    running_labels = model if era.startswith("llm-d") else {"model_name": MODEL}
    out = [f"# TYPE {n['requests']} counter\n{n['requests']}{{{fmt(model)}}} {e.requests}\n"]
    out += [f"{n['errors']}{{{fmt({**model, 'error_code': code})}}} {v}\n" for code, v in e.errors.items()]
    out.append(histogram(n["latency"], model, LATENCY_BOUNDS, e.latency))
    out.append(histogram(n["ntpot"], model, NTPOT_BOUNDS, e.ntpot))
    out.append(histogram(n["input"], model, TOKEN_BOUNDS, e.input_tokens))
    out.append(histogram(n["output"], model, TOKEN_BOUNDS, e.output_tokens))
    out.append(f"{n['running']}{{{fmt(running_labels)}}} {e.running}\n")
    if pool is not None:
        for key, value in (("kv", e.kv), ("queue", e.queue), ("ready", e.ready)):
            out.append(f'{n[key]}{{name="{pool}"}} {value}\n')
        out += [f'{n["endpoint_queue"]}{{name="{pool}",{n["endpoint_label"]}="{ep}"}} {q}\n'
                for ep, q in e.endpoint_queues.items()]
    out.append(histogram(n["scheduler"], {}, SCHEDULER_BOUNDS, e.scheduler))
    out.append(f"{n['prefix_size']} {e.prefix_size}\n")
    out.append(histogram(n["prefix_ratio"], {}, RATIO_BOUNDS, e.prefix_ratios))
    return "".join(out)


def read(text: str) -> dict[str, families.Reading]:
    return llmd.SOURCE.read(parse(text))


def signal_map(prev_text: str, cur_text: str, entity: str, seconds: float = 10.0) -> dict[str, float]:
    d = families.delta(read(prev_text)[entity], read(cur_text)[entity], seconds)
    assert d is not None
    return {s.name: s.value for s in llmd.signals(d, 100.0, f"router/{entity}")}


# 10 s apart: 30 requests (20 at 0.3 s, 10 at 2 s), 3 of them Internal errors.
PREV = Epp(requests=100, errors={"Internal": 1, "ResourceExhausted": 2}, latency=(0.2,) * 100, ntpot=(0.02,) * 100,
           input_tokens=(1000.0,) * 100, output_tokens=(100.0,) * 100, running=4, kv=0.5, queue=2.0, ready=3,
           endpoint_queues={"10.0.0.1:8000": 1, "10.0.0.2:8000": 5}, scheduler=(0.001,) * 100, prefix_size=1000,
           prefix_ratios=(0.5,) * 100)
CUR = dataclasses.replace(
    PREV, requests=130, errors={"Internal": 4, "ResourceExhausted": 2},
    latency=PREV.latency + (0.3,) * 20 + (2.0,) * 10, ntpot=PREV.ntpot + (0.03,) * 30,
    input_tokens=PREV.input_tokens + (1000.0,) * 30, output_tokens=PREV.output_tokens + (200.0,) * 30, running=6,
    kv=0.75, queue=1.5, ready=4, endpoint_queues={"10.0.0.1:8000": 2, "10.0.0.2:8000": 7},
    scheduler=PREV.scheduler + (0.004,) * 30, prefix_size=1200, prefix_ratios=PREV.prefix_ratios + (0.8,) * 30,
)
MODEL_SIGNALS = {
    "epp_request_rate": 3.0,
    "epp_request_error_rate": 0.3,
    "epp_request_error_ratio": 0.1,
    "epp_request_errors_internal_rate": 0.3,
    # 20 in (0.1, 0.5], 10 in (1, 5]: rank 15 -> 0.1 + 0.4 * 15/20; rank 28.5 -> 1 + 4 * 8.5/10.
    "epp_request_latency_p50": 0.4,
    "epp_request_latency_p95": 4.4,
    "epp_request_latency_p99": 4.88,
    "epp_request_latency_mean": 26 / 30,
    # 30 in (0.01, 0.05]: rank 15 is halfway.
    "epp_ntpot_p50": 0.03,
    "epp_ntpot_p95": 0.01 + 0.04 * 28.5 / 30,
    "epp_ntpot_p99": 0.01 + 0.04 * 29.7 / 30,
    "epp_ntpot_mean": 0.03,
    "epp_input_tokens_rate": 3000.0,
    "epp_output_tokens_rate": 600.0,
    "epp_requests_running": 6.0,
}
POOL_SIGNALS = {
    "epp_kv_cache_utilization": 0.75,
    "epp_queue_size": 1.5,
    "epp_ready_endpoints": 4.0,
    "epp_endpoint_queue_size_max": 7.0,
    # 30 in (0.002, 0.005]: rank 15 -> 0.0035.
    "epp_scheduler_latency_p50": 0.0035,
    "epp_scheduler_latency_p95": 0.002 + 0.003 * 28.5 / 30,
    "epp_scheduler_latency_p99": 0.002 + 0.003 * 29.7 / 30,
    "epp_scheduler_latency_mean": 0.004,
    "epp_prefix_indexer_size": 1200.0,
    "epp_prefix_indexer_hit_ratio_mean": 0.8,
    "epp_prefix_indexer_hit_ratio_p50": 0.75,
}


# --- old and new names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("era", list(ERAS))
def test_every_release_gives_the_same_signals(era: str) -> None:
    prev, cur = exposition(PREV, era), exposition(CUR, era)
    assert set(read(cur)) == {POOL, f"{POOL}/{MODEL}"}
    assert signal_map(prev, cur, f"{POOL}/{MODEL}") == pytest.approx(MODEL_SIGNALS)
    assert signal_map(prev, cur, POOL) == pytest.approx(POOL_SIGNALS)


def test_current_name_wins_when_both_are_emitted() -> None:
    text = exposition(CUR) + (
        f'inference_objective_request_total{{model_name="{MODEL}",target_model_name="x"}} 999\n'
        f'inference_pool_average_kv_cache_utilization{{name="{POOL}"}} 0.01\n'
    )
    readings = read(text)
    assert readings[f"{POOL}/{MODEL}"].counters["requests"] == 130
    assert readings[POOL].gauges["kv_cache_utilization"] == 0.75


def test_legacy_per_pod_queue_label_is_read_as_the_endpoint() -> None:
    text = exposition(CUR, "gie-v1.1") + (
        f'llm_d_epp_per_endpoint_queue_size{{name="{POOL}",model_server_endpoint="10.0.0.2:8000"}} 3\n'
    )
    gauges = read(text)[POOL].gauges
    # One key per endpoint whichever spelling named it; the current spelling wins for 10.0.0.2.
    assert gauges["endpoint_queue:10.0.0.1:8000"] == 2 and gauges["endpoint_queue:10.0.0.2:8000"] == 3


# --- entities -----------------------------------------------------------------------------------------------


def test_request_series_take_the_pool_the_exposition_names() -> None:
    readings = read(exposition(CUR, "gie-v1.0"))
    assert readings[f"{POOL}/{MODEL}"].attrs == {"pool": POOL, "model_name": MODEL}
    assert readings[POOL].attrs == {"pool": POOL}


@pytest.mark.parametrize(
    ("extra", "entities"),
    [
        pytest.param("", {llmd.DEFAULT_POOL, f"{llmd.DEFAULT_POOL}/{MODEL}"}, id="no-pool-named"),
        pytest.param('inference_pool_ready_pods{name="a"} 1\ninference_pool_ready_pods{name="b"} 1\n',
                     {"a", "b", llmd.DEFAULT_POOL, f"{llmd.DEFAULT_POOL}/{MODEL}"}, id="two-pools-named"),
    ],
)
def test_unattributable_series_fall_back_to_the_default_pool(extra: str, entities: set[str]) -> None:
    assert set(read(exposition(CUR, pool=None) + extra)) == entities


def test_flow_control_series_carry_their_own_pool() -> None:
    text = exposition(CUR) + (
        f'llm_d_epp_flow_control_queue_size{{fairness_id="t1",priority="0",inference_pool="{POOL}",model_name="{MODEL}",'
        f'target_model_name="x"}} 2\n'
        f'llm_d_epp_flow_control_queue_size{{fairness_id="t2",priority="1",inference_pool="{POOL}",model_name="{MODEL}",'
        f'target_model_name="x"}} 5\n'
        'llm_d_epp_flow_control_queue_size{fairness_id="t1",priority="0",inference_pool="pool-b",model_name="m2",'
        'target_model_name="x"} 1\n'
    )
    readings = read(text)
    assert readings[f"{POOL}/{MODEL}"].gauges["flow_control_queue_size"] == 7
    assert readings["pool-b/m2"].gauges["flow_control_queue_size"] == 1


# --- llm-d-only families ------------------------------------------------------------------------------------


def test_streaming_latencies_sum_over_the_streaming_label() -> None:
    model = f'model_name="{MODEL}",target_model_name="x",fairness_id="d",priority="0"'

    def text(n_stream: int, n_plain: int) -> str:
        return (
            histogram("llm_d_epp_request_ttft_seconds", {"model_name": MODEL, "target_model_name": "x", "fairness_id": "d",
                                                         "priority": "0", "streaming": "true"}, LATENCY_BOUNDS,
                      (0.3,) * n_stream)
            + histogram("llm_d_epp_request_ttft_seconds", {"model_name": MODEL, "target_model_name": "x", "fairness_id": "d",
                                                           "priority": "0", "streaming": "false"}, LATENCY_BOUNDS,
                        (2.0,) * n_plain)
            + histogram("llm_d_epp_request_streaming_tpot_seconds", {"model_name": MODEL, "target_model_name": "x",
                                                                     "fairness_id": "d", "priority": "0"},
                        NTPOT_BOUNDS, (0.03,) * n_stream)
            + f'llm_d_epp_average_queue_size{{name="{POOL}"}} 0\n'
            + f"llm_d_epp_request_total{{{model}}} {n_stream + n_plain}\n"
        )

    sig = signal_map(text(0, 0), text(20, 10), f"{POOL}/{MODEL}")
    assert sig["epp_ttft_p50"] == pytest.approx(0.4)
    assert sig["epp_ttft_p95"] == pytest.approx(4.4)
    assert sig["epp_tpot_p50"] == pytest.approx(0.03)
    assert "epp_itl_p50" not in sig  # not exported: no signal, not a zero


def flow_control(dispatched: int, rejected: int, saturation: Mapping[str, float], stale: int) -> str:
    out = [f'llm_d_epp_flow_control_requests_total{{outcome="Dispatched",priority="0",inference_pool="{POOL}"}} {dispatched}\n',
           f'llm_d_epp_flow_control_requests_total{{outcome="RejectedCapacity",priority="0",inference_pool="{POOL}"}} '
           f'{rejected}\n',
           f'llm_d_epp_flow_control_stale_endpoints{{detector="utilization"}} {stale}\n']
    out += [f'llm_d_epp_flow_control_pool_saturation{{inference_pool="{POOL}",stage="{stage}"}} {v}\n'
            for stage, v in saturation.items()]
    return "".join(out)


def test_flow_control_outcomes_and_saturation_by_stage() -> None:
    before = flow_control(100, 0, {"prefill": 0.5, "decode": 0.9, "effective": 0.9}, 0)
    after = flow_control(180, 20, {"prefill": 0.7, "decode": 1.25, "effective": 1.25}, 1)
    sig = signal_map(before, after, POOL)
    assert sig["epp_flow_control_dispatched_rate"] == pytest.approx(8.0)
    assert sig["epp_flow_control_rejected_capacity_rate"] == pytest.approx(2.0)
    assert sig["epp_pool_saturation_decode"] == 1.25 and sig["epp_pool_saturation_effective"] == 1.25
    assert sig["epp_pool_saturation_prefill"] == 0.7
    assert sig["epp_flow_control_stale_endpoints"] == 1


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("llm_d_epp_disagg_decision_total", id="llm-d-router"),
        pytest.param("llm_d_inference_scheduler_disagg_decision_total", id="inference-scheduler"),
        pytest.param("llm_d_inference_scheduler_pd_decision_total", id="inference-scheduler-pd"),
    ],
)
def test_disaggregation_decisions_share(name: str) -> None:
    def text(decode_only: int, pd: int) -> str:
        labels = f'plugin_name="disagg",plugin_type="disagg-profile-handler",model_name="{MODEL}"'
        return (f'{name}{{{labels},decision_type="decode-only"}} {decode_only}\n'
                f'{name}{{{labels},decision_type="prefill-decode"}} {pd}\n'
                f'llm_d_epp_ready_endpoints{{name="{POOL}"}} 2\n')

    sig = signal_map(text(10, 10), text(40, 20), POOL)  # decisions are the pool's, not the model's
    assert sig["epp_disagg_decision_rate"] == pytest.approx(4.0)
    assert sig["epp_disagg_prefill_decode_share"] == pytest.approx(0.25)
    assert sig["epp_disagg_decode_only_rate"] == pytest.approx(3.0)


@pytest.mark.parametrize("prefix", [pytest.param("llm_d_epp_kv_cache_", id="embedded-in-epp"),
                                    pytest.param("kvcache_", id="kv-cache-manager")])
def test_kv_cache_index_metrics_either_spelling(prefix: str) -> None:
    def text(lookups: int, hits: int, best: int, admissions: int, latencies: tuple[float, ...]) -> str:
        return (f"{prefix}index_lookup_requests_total {lookups}\n{prefix}index_lookup_hits_total {hits}\n"
                f"{prefix}index_max_pod_hit_count_total {best}\n{prefix}index_admissions_total {admissions}\n"
                f"{prefix}index_evictions_total 0\n"
                + histogram(f"{prefix}index_lookup_latency_seconds", {}, SCHEDULER_BOUNDS, latencies)
                + f'llm_d_epp_ready_endpoints{{name="{POOL}"}} 2\n')

    sig = signal_map(text(100, 400, 300, 1000, ()), text(150, 1000, 700, 3000, (0.0015,) * 10), POOL)
    assert sig["epp_kv_index_lookup_rate"] == pytest.approx(5.0)
    assert sig["epp_kv_index_hits_per_lookup"] == pytest.approx(12.0)
    assert sig["epp_kv_index_max_pod_hits_per_lookup"] == pytest.approx(8.0)
    assert sig["epp_kv_index_admission_rate"] == pytest.approx(200.0)
    assert sig["epp_kv_index_eviction_rate"] == 0
    assert sig["epp_kv_index_lookup_latency_p50"] == pytest.approx(0.0015)


def test_plugin_durations_per_plugin_type() -> None:
    def text(n: int) -> str:
        return "".join(
            histogram("llm_d_epp_plugin_duration_seconds", {"extension_point": "Score", "plugin_type": ptype,
                                                            "plugin_name": f"{ptype}-1"}, SCHEDULER_BOUNDS, (value,) * n)
            for ptype, value in (("prefix-cache-scorer", 0.0015), ("queue-scorer", 0.0004))
        )

    sig = signal_map(text(0), text(10), llmd.DEFAULT_POOL)
    assert sig["epp_plugin_prefix_cache_scorer_duration_p95"] == pytest.approx(0.001 + 0.001 * 9.5 / 10)
    assert sig["epp_plugin_queue_scorer_duration_p95"] == pytest.approx(0.001 * 9.5 / 10)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("RejectedCapacity", "rejected_capacity", id="camel-case"),
        pytest.param("prefill-decode", "prefill_decode", id="dashes"),
        pytest.param("429", "429", id="digits"),
        pytest.param("--", "unknown", id="nothing-left"),
    ],
)
def test_slug(value: str, expected: str) -> None:
    assert llmd.slug(value) == expected


# --- missing families ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("era", "missing"),
    [
        pytest.param("gie-v1.0", ["llm_d_epp_request_ttft_seconds"], id="gie-v1.0"),
        pytest.param("gie-v1.1", ["llm_d_epp_request_ttft_seconds"], id="gie-v1.1"),
        pytest.param("llm-d-router-v0.10", [], id="llm-d-router-v0.10"),
    ],
)
def test_missing_families_for_an_slo_policy(era: str, missing: list[str]) -> None:
    policy = dataclasses.replace(llmd.FAMILIES, expected=(
        "llm_d_epp_request_total", "llm_d_epp_request_duration_seconds", "llm_d_epp_average_kv_cache_utilization",
        "llm_d_epp_request_ttft_seconds"))
    text = exposition(CUR, era)
    if era.startswith("llm-d"):
        text += histogram("llm_d_epp_request_ttft_seconds", {"model_name": MODEL}, LATENCY_BOUNDS, ())
    assert families.missing_families(read(text), policy) == missing


def test_default_expected_families_are_current_names() -> None:
    groups = (*llmd.FAMILIES.counters.values(), *llmd.FAMILIES.gauges.values(), *llmd.FAMILIES.histograms.values())
    assert all(any(group[0] == name for group in groups) for name in llmd.FAMILIES.expected)
    assert families.missing_families(read(exposition(CUR, "gie-v1.0")), llmd.FAMILIES) == []


# --- through the pipeline -----------------------------------------------------------------------------------


def test_pipeline_derives_pool_and_model_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCES, llmd.SOURCE.name, llmd.SOURCE)
    target = Target("http://epp:9090/metrics", "router", "epp-0", source="llmd")
    deriver = SignalDeriver()
    deriver.derive([ScrapeResult(target, 0.0, ok=True, body=exposition(PREV, "gie-v1.1"))], 0.0)
    out = deriver.derive([ScrapeResult(target, 10.0, ok=True, body=exposition(CUR, "gie-v1.1"))], 10.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[(f"router/{POOL}/{MODEL}", "epp_request_rate")] == pytest.approx(3.0)
    assert sig[(f"router/{POOL}", "epp_kv_cache_utilization")] == 0.75
    assert out.missing_families == {}
