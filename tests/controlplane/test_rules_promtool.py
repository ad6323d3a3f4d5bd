"""The static rules against the real `promtool`: the export is valid, and Prometheus fires what we fire.

`promtool check rules` validates the exported groups (with and without per-pool SLOs). The
agreement test runs one 25-minute scenario twice: as raw series through `promtool test rules`
(Prometheus' own rule engine) and as expositions through our collectors into
`StaticRulePolicy`'s evaluation. At every 15-second evaluation both must fire the same alerts
with the same labels. Windows of range rules match Prometheus 2.x exactly (a closed range holds
the samples on its edge); Prometheus 3's left-open ranges hold one interval less. Quantile rules
are compared where the approximation must agree: never before `for` after the change, firing by
our first firing evaluation. The scenario: the prefill router loses cache affinity, TTFT jumps,
requests queue; on decode one rank slows, KV fills, transfers fail, drafts stop being accepted,
requests error; one GPU overheats and reports an XID, another a double-bit ECC error and a row
remap failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Target
from controlplane.config import parse_config
from controlplane.rules_export import build_manifest, rule_groups
from controlplane.telemetry import Telemetry
from policies.static_rules import STATIC_RULES, StaticRule, rule_states
from policies.types import PolicyInput, PoolState
from policies.windows import SignalWindows
from tests.real.prometheus import PrometheusNotAvailable, prometheus_binary

ENSURE_PROMETHEUS = Path(__file__).resolve().parents[2] / "scripts" / "ensure-prometheus.sh"
SELF_ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "base" / "controlplane-alerts.yaml"
STEP = 15
STEPS = 100
T0 = 1_767_225_600.0
FLEET = """
pools:
  - {name: prefill, role: prefill, model: m, replicas: {max: 4}, slo: {ttft_p95: 1s}}
  - {name: decode, role: decode, model: m, replicas: {max: 4}}
"""
POOLS = {"prefill": PoolState("prefill", "prefill", 2, 2, 1, 4, ttft_p95_slo=1.0),
         "decode": PoolState("decode", "decode", 1, 1, 1, 4)}
# Quantile rules: ours averages per-interval quantiles, Prometheus merges buckets first.
APPROXIMATE = {"VLLMTimeToFirstTokenHigh"}
TTFT_CHANGE = 20


def _find_promtool() -> str | None:
    configured = os.environ.get("PROMTOOL_BIN")
    if configured and os.access(configured, os.X_OK):
        return configured
    found = shutil.which("promtool")
    if found:
        return found
    try:
        beside = Path(prometheus_binary()).with_name("promtool")
    except PrometheusNotAvailable:
        return None
    return str(beside) if os.access(beside, os.X_OK) else None


@pytest.fixture(scope="module")
def promtool() -> str:
    """The promtool binary (PROMTOOL_BIN, PATH, or beside prometheus); installed with Prometheus when missing."""
    found = _find_promtool()
    if found is None:
        done = subprocess.run([str(ENSURE_PROMETHEUS)], capture_output=True, text=True, timeout=600, check=False)
        found = _find_promtool()
        if found is None:
            pytest.fail(f"no promtool binary (PROMTOOL_BIN, PATH, or beside prometheus); {ENSURE_PROMETHEUS.name} "
                        f"exited {done.returncode}:\n{done.stderr[-2000:]}")
    return found


def _run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


@pytest.mark.parametrize("with_slos", [False, True], ids=["defaults", "per-pool-slos"])
def test_exported_groups_pass_promtool_check_rules(promtool: str, tmp_path: Path, with_slos: bool) -> None:
    config = parse_config(FLEET) if with_slos else None
    manifest = build_manifest(namespace="monitoring", config=config)
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}, sort_keys=False))
    done = _run(promtool, "check", "rules", str(rules_file), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = len(STATIC_RULES) + (1 if with_slos else 0)  # TTFT: a copy for the pool with its own objective
    assert f"SUCCESS: {expected} rules found" in done.stdout + done.stderr


def test_the_control_planes_own_alerts_pass_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    manifest = yaml.safe_load(SELF_ALERTS.read_text())
    rules_file = tmp_path / "self.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}, sort_keys=False))
    done = _run(promtool, "check", "rules", str(rules_file), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = sum(len(g["rules"]) for g in manifest["spec"]["groups"])
    assert f"SUCCESS: {rules} rules found" in done.stdout + done.stderr


def test_three_breached_scales_after_a_restart_fire_the_alert_on_the_control_planes_own_series(
        promtool: str, tmp_path: Path) -> None:
    """The outcome counter as a fresh process exposes it, three scales breaching in its first hour: the alert fires.
    A series born at its first count would read two to `increase()`, and need a fourth."""
    telemetry, values = Telemetry(), []
    breached = {"kind": "scale_pool", "outcome": "breached"}
    for minute in range(41):
        if minute in (10, 20, 30):
            telemetry.outcomes.labels(**breached).inc()
        value = telemetry.registry.get_sample_value("fleet_controlplane_action_outcomes_total", breached)
        values.append("_" if value is None else f"{value:g}")
    manifest = yaml.safe_load(SELF_ALERTS.read_text())
    (tmp_path / "self.yaml").write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}, sort_keys=False))
    [rule] = [r for g in manifest["spec"]["groups"] for r in g["rules"] if r.get("alert") == "FleetControlPlaneScalesBreaching"]
    expected = {"exp_labels": {"severity": "warning", "kind": "scale_pool"},
                "exp_annotations": {"summary": rule["annotations"]["summary"].replace('{{ $value | printf "%.0f" }}', "3"),
                                    "description": rule["annotations"]["description"]}}
    tests = {"rule_files": ["self.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'fleet_controlplane_action_outcomes_total{kind="scale_pool",outcome="breached"}',
                          "values": " ".join(values)}],
        "alert_rule_test": [{"eval_time": "29m", "alertname": "FleetControlPlaneScalesBreaching", "exp_alerts": []},
                            {"eval_time": "40m", "alertname": "FleetControlPlaneScalesBreaching",
                             "exp_alerts": [expected]}]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = _run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


# the scenario ---------------------------------------------------------------------------------

Sample = tuple[str, str, str, dict[str, str], float]  # (type, family, series name, labels, value)
TARGETS = {"p0": ("prefill", "vllm"), "p1": ("prefill", "vllm"), "d0": ("decode", "vllm"), "node-a": ("decode", "dcgm")}


class Scenario:
    """Cumulative counters and histograms of every target, one step at a time."""

    def __init__(self) -> None:
        self.totals: dict[tuple[Any, ...], float] = defaultdict(float)

    def step(self, i: int) -> dict[str, list[Sample]]:
        out: dict[str, list[Sample]] = defaultdict(list)

        def counter(pod: str, name: str, labels: dict[str, str], inc: float) -> None:
            key = (pod, name, tuple(sorted(labels.items())))
            self.totals[key] += inc if i > 0 else 0.0
            out[pod].append(("counter", name, name, labels, self.totals[key]))

        def gauge(pod: str, name: str, labels: dict[str, str], value: float) -> None:
            out[pod].append(("gauge", name, name, labels, value))

        def histogram(pod: str, name: str, labels: dict[str, str], bounds: list[float], le: float, n: float,
                      value: float) -> None:
            """`n` new observations of `value`, all in the bucket bounded by `le`."""
            for bound in [*bounds, float("inf")]:
                key = (pod, name, "bucket", bound, tuple(sorted(labels.items())))
                self.totals[key] += n if i > 0 and bound >= le else 0.0
                text = "+Inf" if bound == float("inf") else f"{bound:g}"
                out[pod].append(("histogram", name, f"{name}_bucket", {**labels, "le": text}, self.totals[key]))
            for suffix, inc in (("sum", n * value), ("count", n)):
                key = (pod, name, suffix, tuple(sorted(labels.items())))
                self.totals[key] += inc if i > 0 else 0.0
                out[pod].append(("histogram", name, f"{name}_{suffix}", labels, self.totals[key]))

        ttft_bounds = [0.25, 0.5, 1.0, 2.5, 5.0]
        itl_bounds = [0.025, 0.05, 0.075, 0.1]
        for pod in ("p0", "p1"):
            e = {"engine": "0", "model_name": "m"}
            routed_badly = 30 <= i < 70
            counter(pod, "vllm:prefix_cache_queries_total", e, 150)
            counter(pod, "vllm:prefix_cache_hits_total", e, 15 if routed_badly else 120)
            counter(pod, "vllm:request_success_total", {**e, "finished_reason": "stop"}, 10)
            counter(pod, "vllm:request_success_total", {**e, "finished_reason": "error"}, 0)
            counter(pod, "vllm:generation_tokens_total", e, 10)
            slow = i >= TTFT_CHANGE
            histogram(pod, "vllm:time_to_first_token_seconds", e, ttft_bounds, 5.0 if slow else 0.5, 10,
                      4.0 if slow else 0.4)
            gauge(pod, "vllm:kv_cache_usage_perc", e, 0.3)
            gauge(pod, "vllm:num_requests_running", e, 4)
            gauge(pod, "vllm:num_requests_waiting", e, 8 if 40 <= i < 90 else 0)
        for engine in ("0", "1"):
            e = {"engine": engine, "model_name": "m"}
            counter("d0", "vllm:prefix_cache_queries_total", e, 50)
            counter("d0", "vllm:prefix_cache_hits_total", e, 40)
            counter("d0", "vllm:request_success_total", {**e, "finished_reason": "stop"}, 10)
            counter("d0", "vllm:request_success_total", {**e, "finished_reason": "error"}, 1 if 10 <= i < 45 else 0)
            counter("d0", "vllm:generation_tokens_total", e, 100)
            hot = engine == "1" and 15 <= i < 55
            histogram("d0", "vllm:inter_token_latency_seconds", e, itl_bounds, 0.075 if hot else 0.05, 100,
                      0.065 if hot else 0.03)
            counter("d0", "vllm:spec_decode_num_drafts_total", e, 20)
            counter("d0", "vllm:spec_decode_num_draft_tokens_total", e, 60)
            counter("d0", "vllm:spec_decode_num_accepted_tokens_total", e, 40 if i < 50 else 6)
            counter("d0", "vllm:nixl_num_failed_transfers_total", e, 1 if engine == "0" and 30 <= i < 50 else 0)
            gauge("d0", "vllm:kv_cache_usage_perc", e, 0.97 if engine == "1" and 20 <= i < 60 else 0.5)
            gauge("d0", "vllm:num_requests_running", e, 8)
            gauge("d0", "vllm:num_requests_waiting", e, 0)
        for gpu in ("0", "1"):
            g = {"gpu": gpu, "hostname": "node-a"}
            hot = gpu == "1" and 10 <= i < 50
            gauge("node-a", "DCGM_FI_DEV_GPU_TEMP", g, 90 if hot else 65)
            gauge("node-a", "DCGM_FI_DEV_XID_ERRORS", g, 79 if gpu == "1" and 40 <= i < 60 else 0)
            counter("node-a", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", g, 1 if gpu == "0" and i == 50 else 0)
            gauge("node-a", "DCGM_FI_DEV_ROW_REMAP_FAILURE", g, 1 if gpu == "0" and i >= 80 else 0)
        return out


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def exposition(samples: list[Sample]) -> str:
    lines, typed = [], set()
    for kind, family, name, labels, value in samples:
        if family not in typed:
            typed.add(family)
            lines.append(f"# TYPE {family} {kind}")
        lines.append(f"{name}{_labels(labels)} {value:.10g}")
    return "\n".join(lines) + "\n"


def _prom_labels(pod: str, labels: dict[str, str]) -> dict[str, str]:
    pool, source = TARGETS[pod]
    # Prometheus attaches the target's pool and pod to what it scrapes from vLLM (as the fleet's relabeling does).
    return {**labels, "pool": pool, "pod": pod} if source == "vllm" else dict(labels)


def _alert_labels(rule: StaticRule, subject: str) -> dict[str, str]:
    kind, _, rest = subject.partition("/")
    parts = rest.split("/")
    if kind == "pool":
        labels = {"pool": parts[0]}
    elif kind == "engine":
        labels = {"pool": parts[0], "pod": parts[1], "engine": parts[2]}
    else:
        labels = {"hostname": parts[0], "gpu": parts[1]}
    return {**labels, "severity": str(rule.severity), "kind": rule.kind}


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[dict[str, list[float]], dict[str, list[list[dict[str, str]]]]]]:
    """The scenario's raw series for Prometheus, and the alerts our evaluation fires at every step."""
    scenario, deriver, windows = Scenario(), SignalDeriver(), SignalWindows(3 * 3600)
    series: dict[str, list[float]] = defaultdict(list)
    firing: dict[str, list[list[dict[str, str]]]] = {r.alert: [] for r in STATIC_RULES}
    for i in range(STEPS):
        ts = T0 + i * STEP
        samples = scenario.step(i)
        results = []
        for pod, (pool, source) in TARGETS.items():
            for _, _, name, labels, value in samples[pod]:
                series[name + _labels(_prom_labels(pod, labels))].append(value)
            target = Target(url=f"http://{pod}:8000/metrics", pool=pool, pod=pod, source=source)
            results.append(ScrapeResult(target, ts, ok=True, body=exposition(samples[pod])))
        out = deriver.derive(results, ts)
        windows.extend((s.ts, s.subject, s.name, s.value) for s in out.signals)
        inp = PolicyInput(now=ts, windows=windows, pools=POOLS, open_findings={})
        for rule in STATIC_RULES:
            states = sorted((s for s in rule_states(rule, inp) if s.firing), key=lambda s: s.subject)
            firing[rule.alert].append([_alert_labels(rule, s.subject) for s in states])
    yield series, firing


def test_prometheus_fires_the_alerts_our_evaluation_fires(promtool: str, tmp_path: Path, run: tuple) -> None:
    series, firing = run
    # The scenario must exercise the rules, or agreement proves nothing.
    fired = {alert for alert, steps in firing.items() if any(steps)}
    assert fired >= {"VLLMPrefixCacheHitRateLow", "VLLMNixlTransferFailures", "VLLMExpertParallelRankSkew",
                     "VLLMSpecDecodeAcceptanceLow", "VLLMTimeToFirstTokenHigh", "VLLMRequestErrorRatioHigh",
                     "VLLMKVCacheNearlyFull", "VLLMRequestsQueued", "DCGMXidError", "DCGMDoubleBitEccErrors",
                     "DCGMRowRemapFailure", "DCGMGpuTemperatureHigh"}, fired
    groups = rule_groups(config=parse_config(FLEET))
    for group in groups:
        for r in group["rules"]:
            del r["annotations"]  # compared: what fires, with which labels
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))

    checks: list[dict[str, Any]] = []
    for alert, steps in firing.items():
        if alert in APPROXIMATE:
            first = next(i for i, s in enumerate(steps) if s)
            earliest = TTFT_CHANGE + 300 // STEP  # nothing can fire before `for` has passed since the change
            assert earliest <= first <= earliest + 4, "the approximation stays within a minute of Prometheus"
            picks = [(earliest - 1, []), (first, steps[first]), (STEPS - 5, steps[STEPS - 5])]
        else:
            picks = [(i, steps[i]) for i in range(1, STEPS)]
        checks += [{"eval_time": f"{i * STEP}s", "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in exp]}
                   for i, exp in picks]
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": f"{STEP}s",
        "tests": [{
            "interval": f"{STEP}s",
            "input_series": [{"series": name, "values": " ".join(f"{v:.10g}" for v in values)}
                             for name, values in sorted(series.items())],
            "alert_rule_test": checks,
        }],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False, width=10_000))
    done = _run(promtool, "test", "rules", "test.yaml", cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
