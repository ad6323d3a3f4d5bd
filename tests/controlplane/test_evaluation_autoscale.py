"""`fleetctl autoscale eval` and `plan`: the oracle's schedule, minute judging, the report, and short real runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from catalog.fleet import Role
from collectors.types import Signal
from controlplane.autoscaling import plan_from_store
from controlplane.config import parse_config
from controlplane.evaluation_autoscale import (
    METRICS,
    TRACES,
    AutoscaleReport,
    CausalRule,
    MinuteMeter,
    OracleSchedule,
    StrategyRun,
    _held,
    best_configuration,
    causal_rule,
    peer_goal,
    replay,
    start_sizes,
    within_slo,
)
from controlplane.evaluation_chart import autoscale_chart
from controlplane.sim.engine import HISTOGRAMS
from controlplane.sim.fleet import FleetSpec, PoolSpec, SimFleet
from controlplane.sim.scenario import builtin_scenarios, load_scenario
from controlplane.sim.traces import Request
from controlplane.store import migrate
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from policies.autoscale import AutoscaleSettings

ROOT = Path(__file__).resolve().parents[2]


def test_every_trace_of_the_evaluation_is_a_fault_free_hour_with_slos_and_room_to_scale() -> None:
    for trace, name in TRACES.items():
        sc = load_scenario(name)
        sc.check()
        assert not sc.faults and sc.duration == 3600, trace
        assert all(p.max_replicas and p.max_replicas >= 2 * p.replicas and (p.slo.ttft_p95 or p.slo.tpot_p95)
                   for p in sc.fleet.pools), trace
    assert not any(n.startswith("autoscale") for n in builtin_scenarios()), "fleetctl eval runs them without a sizer"


def test_the_oracle_asks_for_the_largest_need_until_a_start_up_time_ahead() -> None:
    schedule = OracleSchedule({"chat": [2, 2, 2, 7, 3, 3, 1]}, {"chat": 135.0})
    assert schedule(0.0) == {"chat": 2}, "minute 3 is more than 135 s ahead"
    assert schedule(60.0) == {"chat": 7}, "from minute 1 the burst of minute 3 is within reach: start engines now"
    assert schedule(4 * 60.0) == {"chat": 3} and schedule(6 * 60.0) == {"chat": 1}
    assert schedule(99 * 60.0) == {"chat": 1}, "past the end: the last need"


def test_the_causal_rule_holds_the_most_its_window_of_finished_minutes_needed() -> None:
    rule = CausalRule({"chat": [3, 5, 2, 2, 4]}, window=2, extra=1, start={"chat": 6}, ceiling={"chat": 7})
    assert rule(59.0) == {"chat": 6}, "no minute has finished: the common start"
    assert rule(60.0) == {"chat": 4} and rule(2 * 60.0) == {"chat": 6}, "the most of minutes 0 and 1, plus one"
    assert rule(4 * 60.0) == {"chat": 3} and rule(5 * 60.0) == {"chat": 5}
    assert CausalRule({"chat": [7, 7]}, 1, 3, {"chat": 7}, {"chat": 8})(60.0) == {"chat": 8}, "never past the ceiling"


def test_the_causal_rule_is_the_cheapest_in_hindsight_that_keeps_the_goal() -> None:
    sc = load_scenario(TRACES["azure-conv"])  # one pool, 2 min start-up, 15 s scrapes
    flat = causal_rule(sc, {"chat": [3] * 60})
    assert (flat.window, flat.extra) == (1, 0), "a load that never moves needs no headroom"
    # Every fifth minute needs 6, the others 3. The rule sees a minute's need only once it ends, and a window that
    # lets the last 6 go removes those engines at once: only one that holds 6 all along keeps every minute. (Judged
    # by what it asked two minutes before, a window of 3 looked enough, and kept 49 minutes replayed.)
    spiky = causal_rule(sc, {"chat": [6 if m % 5 == 0 else 3 for m in range(60)]})
    assert (spiky.window, spiky.extra) == (5, 0)


def test_what_a_rule_holds_through_a_minute_is_its_fewest_ready_engines() -> None:
    """Asked for 4, down to 2 a minute later, up to 4 again: the two asked last are not ready for two minutes, and
    the two removed were the ready ones' count, not the ask of two minutes before."""
    sc = load_scenario(TRACES["azure-conv"]).model_copy(update={"duration": 360.0})  # 2 min start-up, 15 s scrapes

    def rule(t: float) -> dict[str, int]:
        return {"chat": 4 if t < 60 or t >= 90 else 2}

    held, cost = _held(sc, rule, 6)
    assert held == {"chat": [4, 2, 2, 2, 4, 4]}, "ready again at 210 s, within minute 3: whole from minute 4"
    assert cost == pytest.approx(4 * 60 + 2 * 30 + 4 * 270), "engine-seconds at one GPU each"


def test_every_dynamic_strategy_starts_where_the_oracle_does() -> None:
    """Mooncake's first minute is light; the second needs twice the decode engines. A strategy that started at the
    first minute's need would pay the start-up time in missed minutes the oracle never risks."""
    sc = load_scenario(TRACES["mooncake-conversation"])  # 2 min start-up, 15 s scrapes: minutes 0 to 2 are in reach
    needs = {"prefill": [10, 9, 11, 6], "decode": [1, 2, 2, 1]}
    assert start_sizes(sc, needs) == {"prefill": 11, "decode": 2}


def test_a_decode_pools_wait_for_its_first_token_is_judged() -> None:
    """What a user waits beyond the prefill (a decode slot, the KV pulled) counts: one decode engine on Mooncake keeps
    its TPOT while requests queue for its KV room, and the minute is missed; two engines keep both."""
    sc = load_scenario(TRACES["mooncake-conversation"]).model_copy(update={"duration": 180.0})
    decode = next(p for p in sc.fleet.pools if p.role == "decode")
    assert decode.slo.tpot_p95 is not None and decode.slo.ttft_p95 is not None
    short, _ = replay(sc, {"prefill": 16, "decode": 1})
    assert all(short.p95("decode", "tpot", m) <= decode.slo.tpot_p95 for m in (1, 2))
    assert short.p95("decode", "ttft", 2) > 5 * decode.slo.ttft_p95 and not within_slo(short, decode, 2)
    enough, _ = replay(sc, {"prefill": 16, "decode": 2})
    assert all(within_slo(enough, decode, m) for m in range(3))


def test_a_minute_is_within_slo_when_every_objective_of_the_pool_is() -> None:
    pool = load_scenario("autoscale/azure-conv").fleet.pools[0]  # TTFT p95 2 s, TPOT p95 100 ms
    meter = MinuteMeter.__new__(MinuteMeter)
    meter.counts = {}
    ttft = np.zeros(len(HISTOGRAMS[METRICS["ttft"]]) + 1)
    tpot = np.zeros(len(HISTOGRAMS[METRICS["tpot"]]) + 1)
    ttft[HISTOGRAMS[METRICS["ttft"]].index(0.5)] = 100  # every first token within 0.5 s
    tpot[HISTOGRAMS[METRICS["tpot"]].index(0.05)] = 100
    meter.counts[(pool.name, "ttft", 0)] = ttft
    meter.counts[(pool.name, "tpot", 0)] = tpot
    assert meter.p95(pool.name, "ttft", 0) <= 0.5 and within_slo(meter, pool, 0)
    slow = tpot.copy()
    slow[HISTOGRAMS[METRICS["tpot"]].index(0.3)] = 100  # half the requests at 300 ms per token
    meter.counts[(pool.name, "tpot", 1)] = slow
    assert not within_slo(meter, pool, 1)
    assert within_slo(meter, pool, 2), "nothing finished: nothing missed"


def run(strategy: str, gpu_hours: float, within: int) -> StrategyRun:
    return StrategyRun("t", strategy, gpu_hours, 100, within, 3, 1.0)


def test_the_report_judges_ours_against_hpa_and_the_oracle() -> None:
    report = AutoscaleReport("t", [run("static", 20.0, 100), run("hpa", 16.0, 97), run("ours", 11.0, 99),
                                   run("oracle", 10.0, 98)], {"chat": [1]})
    rows = {r["strategy"]: r for r in report.rows()}
    assert rows["ours"]["vs_oracle"] == pytest.approx(1.1) and rows["static"]["vs_oracle"] == pytest.approx(2.0)
    goals = {g.name.split(": ", 1)[1]: g for g in report.goals()}
    assert goals["share of minutes within both SLOs"].holds
    assert goals["attainment against the HPA-style rule's"].value == pytest.approx(0.02)
    assert goals["GPU-hours over the HPA-style rule's"].value == pytest.approx(0.688) and goals[
        "GPU-hours over the HPA-style rule's"].holds
    assert goals["GPU-hours over the oracle's"].holds
    worse = AutoscaleReport("t", [run("static", 20.0, 100), run("hpa", 12.0, 99), run("ours", 11.0, 95),
                                  run("oracle", 10.0, 98)], {})
    assert [g.holds for g in worse.goals()] == [False, False, False, True]


def test_a_peer_is_reported_by_its_cheapest_configuration_that_keeps_the_goal_else_its_most_attaining() -> None:
    keeps = [run("dynamo:sla-arima", 14.0, 99), run("dynamo:sla-constant", 12.0, 100), run("dynamo:throughput", 6.0, 40)]
    assert best_configuration(keeps).strategy == "dynamo:sla-constant", "the cheapest of those at 99 % or more"
    misses = [run("dynamo:a", 9.0, 90), run("dynamo:b", 8.0, 95), run("dynamo:c", 7.0, 95)]
    assert best_configuration(misses).strategy == "dynamo:c", "none keeps it: the most attaining, then the cheapest"


def test_the_report_places_a_peer_beside_the_strategies_and_judges_ours_against_its_best() -> None:
    base = [run("static", 20.0, 100), run("hpa", 16.0, 97), run("ours", 11.0, 99), run("oracle", 10.0, 98)]
    peers = {"dynamo": [run("dynamo:sla-arima", 13.0, 99), run("dynamo:throughput", 6.0, 20)]}
    report = AutoscaleReport("t", base, {"chat": [1]}, peers)
    rows = report.rows()
    assert [r["strategy"] for r in rows] == ["static", "hpa", "dynamo", "ours", "oracle"]
    assert rows[2]["configuration"] == "sla-arima" and rows[2]["vs_oracle"] == pytest.approx(1.3)
    assert [r["configuration"] for r in report.peer_rows()] == ["sla-arima", "throughput"]
    goals = {g.name.split(": ", 1)[1]: g for g in report.goals()}
    assert goals["attainment against dynamo's best configuration"].holds
    assert goals["GPU-hours over dynamo's best configuration's"].value == pytest.approx(0.846)
    assert report.beats("dynamo")
    pricier = AutoscaleReport("u", [*base[:2], run("ours", 14.0, 99), base[3]], {}, peers)
    assert not pricier.beats("dynamo")
    assert not AutoscaleReport("v", [*base[:2], run("ours", 9.0, 98), base[3]], {}, peers).beats("dynamo"), (
        "fewer GPU-hours bought with attainment is no win")
    goal = peer_goal([report, pricier], "dynamo")
    assert goal.value == 1 and goal.goal == ">= 2" and not goal.holds, "three of four, or all when fewer traces ran"
    data = report.as_json()
    assert len(data["runs"]) == 6 and data["peer_configurations"][1]["attainment"] == 0.2


def test_the_chart_draws_a_peer_by_its_best_configuration_only() -> None:
    peers = {"dynamo": [run("dynamo:sla-arima", 13.0, 99), run("dynamo:throughput", 6.0, 20)]}
    report = AutoscaleReport("t", [run(s, 10.0, 99) for s in ("static", "hpa", "ours", "oracle")], {}, peers)
    for r in [*report.runs, *peers["dynamo"]]:
        r.replicas, r.within, r.arrivals = [(0.0, {"chat": 2})], [True, False], [5, 6]
    spec = autoscale_chart({"traces": [report.as_json()]}).to_dict()

    def rows(node: object) -> list[dict]:
        if isinstance(node, dict):
            return [*(node.get("values") or []), *(r for v in node.values() for r in rows(v))]
        return [r for v in node for r in rows(v)] if isinstance(node, list) else []

    drawn = {v["strategy"] for v in rows(spec) if isinstance(v, dict) and "engines" in v}
    assert drawn == {"static", "hpa", "dynamo", "ours", "oracle"}


@pytest.mark.slow
def test_autoscale_eval_runs_every_strategy_on_a_short_replay(tmp_path: Path) -> None:
    chart = tmp_path / "autoscale.svg"
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "eval", "--trace", "azure-conv",
                          "--minutes", "6", "--jobs", "2", "--plot", str(chart), "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    [trace] = data["traces"]
    assert [r["strategy"] for r in trace["strategies"]] == ["static", "hpa", "ours", "causal", "oracle"]
    assert all(r["minutes"] == 6 and r["gpu_hours"] > 0 for r in trace["strategies"])
    assert len(trace["oracle_needs"]["chat"]) == 6
    static = next(r for r in trace["strategies"] if r["strategy"] == "static")
    assert static["gpu_hours"] == pytest.approx(max(trace["oracle_needs"]["chat"]) * 0.1, rel=0.01), (
        "static holds the oracle's peak for all 6 minutes")
    assert len(data["goals"]) == 4 and all("azure-conv: " in g["name"] for g in data["goals"])
    assert chart.stat().st_size > 0


def test_autoscale_eval_judges_a_fleet_files_own_settings_and_refuses_ones_its_replay_cannot_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours with the fleet file's `autoscaling` (a shorter scale-down hold, say), not the defaults; a hold the replay's
    scrapes cannot cover is refused naming it, before an hour of replays."""
    from click.testing import CliRunner

    from controlplane import evaluation_autoscale
    from controlplane.cli import cli

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pools:\n  - {name: chat, role: unified, model: m, replicas: {max: 8}}\n"
                     "autoscaling: {scale_down_after: 300s, headroom_quantile: 0.8}\n")
    judged: list[AutoscaleSettings] = []

    class Report:
        def as_json(self) -> dict:
            return {"goals": []}

    def evaluate(trace: str, **kwargs: object) -> Report:
        judged.append(kwargs["settings"])  # type: ignore[arg-type]
        return Report()

    monkeypatch.setattr(evaluation_autoscale, "evaluate_autoscaling", evaluate)
    out = CliRunner().invoke(cli, ["autoscale", "eval", "--trace", "azure-conv", "--config", str(fleet), "--json"])
    assert out.exit_code == 0, out.output
    [settings] = judged
    assert settings.enabled and settings.scale_down_after == 300.0 and settings.headroom_quantile == 0.8
    monkeypatch.undo()
    # Six of its own scrapes, two of the replay's.
    fleet.write_text("pools:\n  - {name: chat, role: unified, model: m, replicas: {max: 8}}\n"
                     "scrape: {interval: 5s, timeout: 1s, spread: 0s}\nautoscaling: {scale_down_after: 30s}\n")
    started = time.monotonic()
    out = CliRunner().invoke(cli, ["autoscale", "eval", "--trace", "azure-conv", "--config", str(fleet)])
    assert out.exit_code == 2 and "azure-conv is scraped every 15s" in out.output
    assert "autoscaling.scale_down_after" in out.output and time.monotonic() - started < 30


def test_autoscale_plan_explains_the_target_from_the_store(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'plan.db'}"
    config = tmp_path / "fleet.yaml"
    config.write_text(f"""
store: {{url: "{db}"}}
autoscaling: {{enabled: true}}
pools:
  - name: chat
    role: unified
    model: m
    replicas: {{min: 1, max: 20}}
    slo: {{ttft_p95: 2s, tpot_p95: 100ms}}
    engine: {{profile: dynamo/h200/llama3.1-8b-fp8, speed: 1.0}}
  - name: batch
    role: unified
    model: m
    replicas: {{min: 1, max: 4}}
""")
    migrate.upgrade(db)
    store = SqlStore.open(db)
    try:
        now = time.time()
        signals = []
        for i in range(120):
            ts = now - 1800 + i * 15
            for name, value in (("request_rate", 80.0), ("prompt_tokens_rate", 80_000.0),
                                ("generation_tokens_rate", 16_000.0), ("requests_running", 200.0),
                                ("requests_waiting", 0.0), ("ttft_p95", 0.3), ("tpot_p95", 0.03),
                                ("engines_reporting", 2.0), ("replicas_desired", 2.0), ("replicas_ready", 2.0)):
                signals.append(Signal(ts, "pool/chat", name, value))
        store.write_signals(signals)
    finally:
        store.close()
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "plan", "--config", str(config), "--db", db,
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    [plan], failed = data["plans"], data["failed"]
    assert failed == {} and "objective" in data["unplanned"]["batch"]
    assert plan["pool"] == "chat" and plan["desired"] == 2 and plan["target"] > 2, "80 req/s is more than two engines take"
    assert {"ttft_curve", "tpot_curve", "forecast", "per_engine_rate"} <= set(plan["evidence"])
    table = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "plan", "--config", str(config), "--db",
                            db], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert table.returncode == 0 and "chat" in table.stdout and "batch keeps its size" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "plan", "--config", str(config), "--db",
                          db, "--pool", "nope"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 3 and "nope is not a pool" in bad.stderr


def test_the_meter_charges_an_engine_from_its_ask_and_counts_what_a_drained_engine_served() -> None:
    # Asked for in a tick, an engine was charged from the sample before; reaped between two samples, an engine's
    # last requests reached no minute's p95 and its last seconds no GPU-hour.
    fleet = SimFleet(FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 2, startup_s=60.0),)),
                     [Request(1.0 + 0.01 * i, 1000, 600) for i in range(40)])
    meter = MinuteMeter(fleet, 0.0, {"u": 1})
    members = list(fleet.members["u"])
    engines = [m.engine for m in members]
    fleet.advance_to(2.0)
    meter.sample(fleet)
    fleet.scale("u", 1)
    for t in range(15, 121, 15):
        fleet.advance_to(float(t))
        if t == 30:
            fleet.scale("u", 2)  # asked for at 30 s, sampled at once
        meter.sample(fleet)
    [gone] = [m for m in members if m not in fleet.members["u"]]
    assert gone.gone_at is not None and gone.gone_at < 120
    served = sum(int(np.sum(e.ranks[0].hists["vllm:request_time_per_output_token_seconds"].counts)) for e in engines)
    assert served == 40
    assert sum(int(np.sum(c)) for (_, metric, _), c in meter.counts.items() if metric == "tpot") == served
    assert meter.gpu_s == pytest.approx(120.0 + gone.gone_at + 90.0)


def test_autoscale_plan_sizes_no_pool_from_series_that_stopped(tmp_path: Path) -> None:
    # The loop leaves such a pool unplanned (its sums read as a lull); the command once sized it from scrapes 20 min old.
    db = f"sqlite:///{tmp_path / 'plan.db'}"
    migrate.upgrade(db)
    store = SqlStore.open(db)
    now = time.time()
    try:
        store.write_signals([Signal(now - 3000 + i * 15, "pool/chat", name, value) for i in range(120)
                             for name, value in (("request_rate", 80.0), ("prompt_tokens_rate", 80_000.0),
                                                 ("generation_tokens_rate", 16_000.0), ("requests_running", 200.0),
                                                 ("requests_waiting", 0.0), ("ttft_p95", 0.3), ("tpot_p95", 0.03),
                                                 ("engines_reporting", 2.0), ("replicas_desired", 2.0),
                                                 ("replicas_ready", 2.0))])
    finally:
        store.close()
    config = parse_config(f"""
store: {{url: "{db}"}}
pools:
  - {{name: chat, role: unified, model: m, replicas: {{min: 1, max: 20}}, slo: {{ttft_p95: 2s, tpot_p95: 100ms}},
     engine: {{profile: dynamo/h200/llama3.1-8b-fp8}}}}
""")
    threaded = ThreadedStore.open(db)
    try:
        run = asyncio.run(plan_from_store(config, threaded, now))
    finally:
        threaded.close()
    assert run.plans == [] and "stale" in run.unplanned["chat"]
