"""`fleetctl eval --mode act`: breach minutes, the report's rows and goals, and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.evaluation_act import ActingReport, ActingRun, breach_minutes

ROOT = Path(__file__).resolve().parents[2]
SLOS = {("prefill", "ttft_p95"): 1.0}


def test_a_minute_breaches_when_most_of_its_intervals_do() -> None:
    minute = [(615.0, 2.0), (630.0, 2.0), (645.0, 0.5), (660.0, 2.0)]  # 10:00-11:00: three of four above
    spike = [(675.0, 9.0), (690.0, 0.5), (705.0, 0.5), (720.0, 0.5)]  # one slow interval: noise
    outside = [(1300.0, 5.0)]  # after the fault
    samples = {("prefill", "ttft_p95"): minute + spike + outside}
    assert breach_minutes(samples, SLOS, [(600.0, 1200.0)]) == 1


def run(name: str, mode: str, breach_min: float, actions: list[dict] | None = None, kinds: tuple = ("router_flip",)
        ) -> ActingRun:
    return ActingRun(name, mode, list(kinds), breach_min * 60, 600.0, actions or [])


def test_the_report_pairs_modes_by_fault_and_judges_the_ratio() -> None:
    rollback = {"kind": "rollback", "pool": "prefill", "at_s": 630, "state": "succeeded", "outcome": "recovered",
                "change": "roll the router back"}
    report = ActingReport([
        run("router-flip", "observe", 10), run("router-flip", "act", 3, [rollback]),
        run("kv-lag", "observe", 1, kinds=("kv_lag",)), run("kv-lag", "act", 1, kinds=("kv_lag",)),
        run("replay", "act", 0, [{**rollback, "state": "failed"}], kinds=()),
    ])
    rows = {r["fault"]: r for r in report.by_kind()}
    assert rows["router_flip"]["ratio"] == pytest.approx(0.3)
    assert rows["router_flip"]["actions"] == ["rollback prefill at 10:30 (succeeded, recovered)"]
    assert rows["kv_lag"]["ratio"] is None, "one breached minute cannot be halved: not judged"
    assert report.fault_free() == [{"scenario": "replay", "remedial_actions": 0, "actions": ["rollback prefill (failed)"]}]
    goals = {g.name: g.holds for g in report.goals()}
    assert goals == {"router_flip: SLO-breach minutes acting / observing": True,
                     "remedial actions on the fault-free replays": True}
    wrong = ActingReport([run("replay", "act", 0, [rollback], kinds=())])
    assert [g.holds for g in wrong.goals()] == [False], "a remedy on a healthy fleet fails the goal"


@pytest.mark.slow
def test_eval_act_runs_a_fault_both_ways(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "eval", "--mode", "act", "--scenario", "gpu-xid",
                          "--workdir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    [row] = data["faults"]
    assert row["fault"] == "gpu_xid" and row["observe_breach_min"] >= 2 and row["act_breach_min"] < row["observe_breach_min"]
    assert any(a.startswith("cordon_node chat") for a in row["actions"])
    assert [r["mode"] for r in data["runs"]] == ["observe", "act"]
    assert [g["name"] for g in data["goals"]] == ["gpu_xid: SLO-breach minutes acting / observing"]
