"""`fleetctl gate` against the store and `fleetctl gate eval`: short real runs of both."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from collectors.types import Signal
from controlplane.evaluation_gate import JUDGES, GateEvalReport, evaluate_gate
from controlplane.store import migrate
from controlplane.store.queries import ReadStore
from controlplane.store.writer import SqlStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_evaluation_fails_the_regression_and_not_the_same_version() -> None:
    report = evaluate_gate(seeds=1, aa_runs=1, sizes=(0.20,), shares=(0.05,), pools=("decode",), jobs=2)
    ours = [d for d in report.decisions if d.judge == "ours"]
    [regression] = [d for d in ours if d.size]
    assert regression.outcome == "fail" and regression.after_s <= 600
    aa = [d for d in ours if not d.size]
    assert len(aa) == 50 and not any(d.outcome == "fail" for d in aa)  # 40 engines and 10 blocks of four
    assert {d.judge for d in report.decisions} == set(JUDGES)
    data = report.as_json()
    names = [g["name"] for g in data["goals"]]
    assert names == ["+10% TPOT at a 5% canary share: failed within 10 minutes",
                     "A/A gates failed under continuous monitoring", "regressions of +10% and more passed"]
    assert data["goals"][1]["value"] == 0.0 and data["goals"][1]["holds"]
    assert data["goals"][2]["value"] == 0.0 and data["goals"][2]["holds"]
    assert data["goals"][0]["value"] is None and not data["goals"][0]["holds"]  # that case was not run


def test_the_table_counts_fails_within_ten_minutes_and_at_all() -> None:
    from controlplane.evaluation_gate import Decision

    ds = [Decision("ours", "decode", 0.10, 0.05, s, "fail", 120.0 + 300 * s) for s in range(4)]
    ds += [Decision("ours", "decode", 0.10, 0.05, 4, "pass", 400.0)]  # a regression let through
    ds += [Decision("ours", "decode", 0.0, 0.05, 9, "pass", 600.0), Decision("ours", "prefill", 0.0, 0.05, 9, "fail", 60.0)]
    r = GateEvalReport(ds, seeds=5, aa_runs=1)
    row = next(x for x in r.rows() if x["case"] == "tpot +10%" and x["share"] == 0.05)
    assert row["ours_fail_10m"] == 0.4 and row["ours_fail"] == 0.8 and row["ours_minutes"] == 9.5 and row["runs"] == 5
    assert row["ours_pass"] == 0.2 and r.goals()[2].value == 0.2 and not r.goals()[2].holds
    aa = next(x for x in r.rows() if x["case"] == "A/A" and x["share"] == 0.05)
    assert aa["ours_fail"] == 0.5
    goals = {g.name: g for g in r.goals()}
    assert goals["+10% TPOT at a 5% canary share: failed within 10 minutes"].value == 0.4
    assert not goals["A/A gates failed under continuous monitoring"].holds


def _seed(db: str, canary_tpot: float, now: float) -> None:
    migrate.upgrade(db)
    store = SqlStore.open(db)
    try:
        signals = []
        for i in range(80):
            ts = now - 1200 + i * 15
            wobble = 1 + 0.02 * ((i * 7) % 5 - 2)
            for pod, tpot in (("decode-0", 0.010), ("decode-1", 0.010), ("decode-2", 0.010),
                              ("decode-canary-0", canary_tpot)):
                subject = f"engine/decode/{pod}/0"
                signals += [Signal(ts, subject, "request_rate", 3.0), Signal(ts, subject, "tpot_mean", tpot * wobble),
                            Signal(ts, subject, "ttft_mean", 0.2), Signal(ts, subject, "e2e_mean", 2.0),
                            Signal(ts, subject, "request_error_rate", 0.0)]
        store.write_signals(signals)
    finally:
        store.close()


def _gate(db: str, now: float, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", "gate", "--pool", "decode", "--baseline",
                           "pod!~decode-canary-.*", "--canary", "pod=~decode-canary-.*", "--db", db,
                           "--start", str(now - 1200), "--max-window", "20m", *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_fleetctl_gate_judges_the_store_exits_by_verdict_and_records_it(tmp_path: Path) -> None:
    now = time.time()
    slow, same = f"sqlite:///{tmp_path / 'slow.db'}", f"sqlite:///{tmp_path / 'same.db'}"
    _seed(slow, 0.0115, now)
    _seed(same, 0.0100, now)
    junit = tmp_path / "gate.xml"
    res = _gate(slow, now, "--report", "junit", "--out", str(junit))
    assert res.returncode == 1, res.stderr
    suite = ET.parse(junit).getroot()
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["tpot", "verdict"] and "verdict #1 recorded" in res.stderr
    [verdict] = ReadStore.open(slow).verdicts()
    assert verdict["result"] == "fail" and verdict["pool"] == "decode"
    assert verdict["details"]["metrics"][1]["name"] == "tpot" and verdict["details"]["metrics"][1]["lower"] > 1
    ok = _gate(same, now, "--report", "json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["result"] == "pass"
    bad = _gate(same, now, "--canary", "pod=~a**")
    assert bad.returncode == 3 and "not a regular expression" in bad.stderr
    # A store that cannot take the verdict (an outage at the end, a read-only user) leaves the verdict's exit code.
    store = SqlStore.open(slow)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE verdicts")
    store.close()
    unrecorded = _gate(slow, now)
    assert unrecorded.returncode == 1 and "verdict not recorded" in unrecorded.stderr
