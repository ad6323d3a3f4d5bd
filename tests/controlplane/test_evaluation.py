"""`fleetctl eval`: how findings are scored against a scenario's ground truth, and one real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.evaluation import EvalReport, Finding, ScenarioResult, score, variant
from controlplane.evaluation_chart import eval_chart, save_eval_chart
from controlplane.sim.scenario import Truth, load_scenario

ROOT = Path(__file__).resolve().parents[2]


def result(findings: list[Finding], truths: list[tuple[float, float, Truth]], hours: float = 2.0) -> ScenarioResult:
    return ScenarioResult("s", truths, findings, hours, 15.0, 1.0, fault_free=not truths)


def test_a_finding_on_the_faulty_pod_in_the_fault_window_is_a_detection_with_its_delay() -> None:
    truth = Truth(kind="kv_transfer_lag", pool="decode", pod="decode-1")
    r = result([Finding("policies", "kv_transfer_lag", "engine/decode/decode-1/0", 630.0, 1230.0),
                Finding("policies", "kv_transfer_lag", "nixl/node-decode-1/decode-1", 645.0, None),
                Finding("policies", "kv_transfer_lag", "engine/decode/decode-2/0", 700.0, None),
                Finding("static rules", "kv_transfer_lag", "engine/decode/decode-1/0", 300.0, None)],
               [(600.0, 1200.0, truth)])
    [smart, static] = [s for s in score([r]) if s.kind == "kv_transfer_lag"]
    assert (smart.detector, smart.detected, smart.truths, smart.delays_s) == ("policies", 1, 1, [30.0])
    assert (smart.findings, smart.matched, smart.false_alarms) == (3, 2, 1)  # decode-2 is not the faulty pod
    # Already firing before the fault: no credit for it, and a false alarm.
    assert (static.detector, static.detected, static.false_alarms) == ("static rules", 0, 1)


def test_optional_truths_excuse_findings_without_counting_as_misses() -> None:
    truths = [(600.0, 1200.0, Truth(kind="prefix_cache_hit_drop", pool="prefill")),
              (600.0, 1200.0, Truth(kind="slo_burn", pool="prefill", required=False))]
    r = result([Finding("policies", "prefix_cache_hit_drop", "pool/prefill", 630.0, None),
                Finding("policies", "slo_burn", "pool/prefill", 700.0, None)], truths)
    scores = {(s.detector, s.kind): s for s in score([r])}
    assert scores[("policies", "slo_burn")].truths == 0 and scores[("policies", "slo_burn")].false_alarms == 0
    assert scores[("policies", "prefix_cache_hit_drop")].recall == 1.0


def test_false_alarms_on_fault_free_replays_are_rated_per_engine_hour() -> None:
    replay = result([Finding("policies", "saturation", "pool/chat", 100.0, None)], [], hours=4.0)
    faulty = result([], [(600.0, 1200.0, Truth(kind="saturation", pool="chat"))], hours=1.0)
    report = EvalReport([replay, faulty], score([replay, faulty]))
    [sat] = [k for k in report.as_dict()["scores"] if k["kind"] == "saturation" and k["detector"] == "policies"]
    assert sat["false_alarms_fault_free_per_1000_engine_hours"] == pytest.approx(250.0)
    assert sat["false_alarms_per_1000_engine_hours"] == pytest.approx(200.0)
    assert sat["recall"] == 0.0 and report.summary()["policies"]["false_alarms_fault_free"] == 1
    goals = {g["name"]: g for g in report.as_dict()["goals"]}
    # Nothing was detected, so there is no delay or speed-up to judge, only a false-alarm rate that misses.
    fa = goals["policies' false alarms per 1,000 fault-free engine-hours"]
    assert (fa["value"], fa["goal"], fa["holds"]) == (pytest.approx(250.0), "<= 1", False)
    delay = goals["policies' median detection delay, scrape intervals"]
    assert delay["value"] is None and delay["holds"] is False


@pytest.mark.slow
def test_eval_finds_both_faults_sooner_than_the_static_rules(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "eval", "--scenario", "gpu-xid", "--scenario",
                          "system-prompt-change", "--workdir", str(tmp_path), "--jobs", "2", "--plot",
                          str(tmp_path / "eval.png"), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(res.stdout)
    smart = data["summary"]["policies"]
    assert smart["detected"] == smart["truths"] == 2
    assert smart["delay_median_intervals"] <= 2 and smart["false_alarms"] == 0
    goals = {g["name"]: g["holds"] for g in data["goals"]}
    assert goals["policies' median detection delay, scrape intervals"] is True
    scores = {(k["detector"], k["kind"]): k for k in data["scores"]}
    ours, theirs = scores[("policies", "prefix_cache_hit_drop")], scores[("static rules", "prefix_cache_hit_drop")]
    # A static threshold either misses a per-workload drop or waits out its `for: 5m`.
    assert theirs["delay_median_s"] is None or theirs["delay_median_s"] >= 5 * ours["delay_median_s"]
    # An XID needs no `for`: both see it at the first scrape after it.
    assert scores[("static rules", "gpu_health")]["detected"] == 1


def test_the_chart_has_a_delay_and_a_false_alarm_panel_and_names_misses(tmp_path: Path) -> None:
    truth = Truth(kind="kv_transfer_lag", pool="decode", pod="decode-1")
    r = result([Finding("policies", "kv_transfer_lag", "engine/decode/decode-1/0", 630.0, None),
                Finding("static rules", "kv_transfer_lag", "engine/decode/decode-3/0", 700.0, None)],
               [(600.0, 1200.0, truth)])
    report = EvalReport([r], score([r])).as_dict()
    spec = eval_chart(report).to_dict()
    assert len(spec["vconcat"]) == 2
    rows = spec["data"]["values"]  # altair lifts the shared data to the top
    values = {(v["detector"], v["kind"]): v for v in rows}
    assert values[("policies", "kv_transfer_lag")]["median"] == 2.0
    assert values[("static rules", "kv_transfer_lag")]["missed"] == "not detected (0/1)"
    with pytest.raises(ValueError, match="png, .svg or .html"):
        save_eval_chart(report, tmp_path / "eval.pdf")
    assert save_eval_chart(report, tmp_path / "eval.svg").read_text().startswith("<svg")


def test_variants_move_the_seed_and_the_trace_window_and_keep_the_faults() -> None:
    base = load_scenario("hot-expert")
    assert variant(base, 0) is base
    v = variant(base, 3)
    assert (v.name, v.seed, v.trace.start) == ("hot-expert-v3", base.seed + 3, base.trace.start + 900.0)
    assert v.faults == base.faults and v.fleet == base.fleet
    assert [r.arrival_s for r in v.requests()][:50] != [r.arrival_s for r in base.requests()][:50]
