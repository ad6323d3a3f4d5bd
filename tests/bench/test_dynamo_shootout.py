"""The Dynamo shoot-out harness: the fleet in the planner's terms, its seeds and config, and Dynamo's planner
itself in the loop of a short replay (the real planner, from `scripts/setup-dynamo-bench.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.dynamo_shootout import (
    CONFIGURATIONS,
    DynamoError,
    DynamoPeer,
    FleetObserver,
    PlannerProcess,
    benchmark_fpms,
    capabilities,
    default_python,
    planner_config,
)
from controlplane.evaluation_autoscale import resized
from controlplane.sim.fleet import SimFleet
from controlplane.sim.perf import load_model
from controlplane.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup-dynamo-bench.sh"


def test_the_planner_is_seeded_on_dynamo_s_benchmark_grid_timed_by_the_pool_s_engine() -> None:
    pool = load_scenario("autoscale/azure-conv").fleet.pools[0]
    fast, slow = (benchmark_fpms(load_model(speed=s), pool) for s in (1.0, 0.5))
    tokens = [f["sum_prefill_tokens"] for f in fast["prefill"]]
    assert tokens[0] == 100 and tokens[-1] <= pool.max_batched_tokens and len(tokens) >= 8
    assert all(a["wall_time"] < b["wall_time"] for a, b in zip(fast["prefill"], fast["prefill"][1:], strict=False))
    assert all(f["sum_decode_kv_tokens"] <= pool.kv_blocks * 16 for f in fast["decode"])
    assert {f["sum_decode_kv_tokens"] // f["num_decode_requests"] for f in fast["decode"]} == {500, 2000, 4000, 8000}
    assert slow["prefill"][-1]["wall_time"] == pytest.approx(2 * fast["prefill"][-1]["wall_time"], rel=0.01), (
        "a pool at half an H200's speed is benchmarked at half the speed")
    assert capabilities(pool)["max_kv_tokens"] == pool.kv_blocks * 16
    fp8 = pool.model_copy(update={"kv_cache_dtype": "fp8"})  # twice the blocks in the same memory, as the engine has
    assert capabilities(fp8)["max_kv_tokens"] == 2 * pool.kv_blocks * 16
    assert capabilities(fp8)["context_length"] >= 126_195, "Mooncake's longest prompt"
    model = load_model(speed=1.0)
    mixed = fast["mixed"][0]
    assert mixed["num_prefill_requests"] == 1 and mixed["num_decode_requests"] >= 1, "an aggregated engine's iteration"
    assert mixed["wall_time"] == pytest.approx(
        model.prefill_batch_seconds([(mixed["sum_prefill_tokens"], 0)])
        + model.decode_step_seconds(mixed["num_decode_requests"], mixed["sum_decode_kv_tokens"] // mixed["num_decode_requests"]))


def test_dynamo_gets_the_same_slos_budget_and_floor_as_ours() -> None:
    conv = planner_config(load_scenario("autoscale/azure-conv"), CONFIGURATIONS["sla-kalman"])
    assert conv["mode"] == "agg" and conv["ttft_ms"] == 2000 and conv["itl_ms"] == pytest.approx(100)
    assert conv["max_gpu_budget"] == 16 and conv["min_endpoint"] == 1 and conv["load_predictor"] == "kalman"
    pd = planner_config(load_scenario("autoscale/mooncake-conversation"), CONFIGURATIONS["load"])
    assert pd["mode"] == "disagg" and pd["ttft_ms"] == 4000 and pd["itl_ms"] == pytest.approx(80)
    assert pd["max_gpu_budget"] == 32 and pd["prefill_engine_num_gpu"] == pd["decode_engine_num_gpu"] == 1
    tight = planner_config(load_scenario("autoscale/azure-conv"), CONFIGURATIONS["sla-prophet-tight"])
    assert tight["ttft_ms"] == 1000 and tight["itl_ms"] == pytest.approx(50), "half our objectives, for a p95"
    assert "slo_scale" not in tight, "not a field of Dynamo's PlannerConfig"


def test_the_observer_reports_serving_engines_their_iterations_and_the_traffic_window() -> None:
    sc = resized(load_scenario("autoscale/mooncake-conversation"), {"prefill": 1, "decode": 2})
    fleet = SimFleet(sc.fleet_spec(), sc.requests(), now=0.0)
    observer = FleetObserver("prefill", "decode")
    fleet.advance_to(60.0)
    first = observer.result(fleet)
    assert first["active_prefill_count"] == len(first["prefill_fpm_snapshots"]) == 1
    assert first["active_decode_count"] == len(first["decode_fpm_snapshots"]) == 2, "Dynamo checks FPMs against counts"
    busy = first["prefill_fpm_snapshots"][0]
    assert busy["wall_time"] > 0 and busy["num_prefill_requests"] >= 1 and busy["sum_queued_prefill_tokens"] > 0, (
        "one prefill engine for this load: working and queueing")
    t = first["traffic"]
    assert t["duration_s"] == 60.0 and t["num_req"] > 0 and t["avg_isl"] > 1000 and t["avg_ttft_ms"] > 0
    fleet.scale("decode", 1)
    fleet.scale("prefill", 2)
    fleet.advance_to(75.0)
    second = observer.result(fleet)
    assert second["active_decode_count"] == len(second["decode_fpm_snapshots"]) == 1, (
        "a drained engine has left the inventory")
    assert len(second["starting_prefill_ids"]) == 1 and second["active_prefill_count"] == 1
    assert second["traffic"]["duration_s"] == 15.0 and second["tick_ordinal"] == 1
    assert second["active_prefill_ids"] == first["active_prefill_ids"], "worker ids are stable"


def test_a_missing_dynamo_environment_is_named_with_the_way_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(DynamoError, match="make bench-dynamo-venv"):
        PlannerProcess(tmp_path / "nope" / "python")


@pytest.fixture(scope="module")
def dynamo_python() -> Path:
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1500, check=False)
    python = default_python()
    if proc.returncode != 0 or not python.exists():
        pytest.fail(f"{SETUP} could not install Dynamo's planner (exit {proc.returncode}):\n"
                    + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    return python


@pytest.mark.slow
def test_dynamo_s_planner_scales_the_simulated_pools_it_ticks_on(dynamo_python: Path) -> None:
    sc = load_scenario("autoscale/azure-conv").model_copy(update={"duration": 300.0})
    [sla, load] = DynamoPeer(dynamo_python, ("sla-constant", "load")).runs("azure-conv", sc, {"chat": [1] * 5})
    for run in (sla, load):
        result = run()
        assert result.minutes == 5 and result.gpu_hours > 0
        assert result.scale_events >= 1 and max(n["chat"] for _, n in result.replicas) > 1, (
            f"{result.strategy}: one engine cannot take this load; the planner asks for more")
    pd = load_scenario("autoscale/mooncake-conversation").model_copy(update={"duration": 300.0})
    [run] = DynamoPeer(dynamo_python, ("sla-arima+load",)).runs("mooncake", pd, {"prefill": [2] * 5, "decode": [2] * 5})
    result = run()
    assert result.strategy == "dynamo:sla-arima+load" and result.minutes == 5


@pytest.mark.slow
def test_a_planner_failure_is_reported_with_the_request(dynamo_python: Path) -> None:
    planner = PlannerProcess(dynamo_python)
    try:
        with pytest.raises(DynamoError, match="(?s)failed on start.*mode"):
            planner.ask({"op": "start", "config": {"namespace": "x", "mode": "sideways"}})
        with pytest.raises(DynamoError, match="tick before start"):
            planner.ask({"op": "tick", "result": {}})
    finally:
        planner.close()


@pytest.mark.slow
def test_autoscale_eval_adds_dynamo_s_rows(dynamo_python: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "eval", "--trace", "azure-conv",
                          "--minutes", "3", "--jobs", "2", "--peers", "dynamo", "--dynamo-python", str(dynamo_python),
                          "--dynamo-config", "sla-constant", "--dynamo-config", "throughput", "--json"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    [trace] = data["traces"]
    assert [r["strategy"] for r in trace["strategies"]] == ["static", "hpa", "dynamo", "ours", "causal", "oracle"]
    assert {r["configuration"] for r in trace["peer_configurations"]} == {"sla-constant", "throughput"}
    assert data["goals"][-1]["name"] == "traces where ours beats dynamo's best configuration"
    bad = subprocess.run([sys.executable, "-m", "controlplane.cli", "autoscale", "eval", "--peers", "dynamo",
                          "--dynamo-config", "psychic"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 3 and "psychic: not one of" in bad.stderr


def test_a_target_over_the_pools_ceiling_is_capped_and_the_planner_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every strategy's pools stop at one ceiling. Dynamo's replay adapter waits for the count it asked before it
    decides again (in disaggregated mode for both pools): not told, it would wait for ever and decide nothing more."""
    import bench.dynamo_shootout as shootout

    asked: list[dict[str, object]] = []

    class Planner:
        def __init__(self, python: Path) -> None:
            self.ticks = 0

        def ask(self, msg: dict[str, object]) -> dict[str, object]:
            asked.append(msg)
            if msg["op"] == "start":
                return {"first_tick_s": 5.0}
            if msg["op"] == "tick":
                self.ticks += 1
                return {"target_prefill": 99, "target_decode": 3, "next_tick_s": 5.0 * (self.ticks + 1)}
            return {}

        def close(self) -> None:
            pass

    monkeypatch.setattr(shootout, "PlannerProcess", Planner)
    sc = load_scenario("autoscale/mooncake-conversation").model_copy(update={"duration": 30.0})
    [run] = DynamoPeer(Path("python"), ("load",)).runs("mooncake", sc, {"prefill": [2], "decode": [2]})
    result = run()
    ceiling = {p.role: shootout.pool_ceiling(p) for p in sc.fleet.pools}
    assert {"op": "capped", "prefill": ceiling["prefill"]} in asked
    assert not any(m["op"] == "capped" and "decode" in m for m in asked), "3 decode engines fit"
    assert max(n["prefill"] for _, n in result.replicas) == ceiling["prefill"]


@pytest.mark.slow
def test_dynamo_s_adapter_takes_the_capped_count_and_goes_on_deciding(dynamo_python: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.dynamo_shootout as shootout

    sent: list[dict[str, object]] = []
    replies: list[dict[str, object]] = []

    class Recorded(shootout.PlannerProcess):
        def ask(self, msg: Mapping[str, Any]) -> dict[str, Any]:
            sent.append(dict(msg))
            replies.append(reply := super().ask(msg))
            return reply

    monkeypatch.setattr(shootout, "PlannerProcess", Recorded)
    sc = load_scenario("autoscale/mooncake-conversation")
    pools = [p.model_copy(update={"max_replicas": 2}) if p.role == "prefill" else p for p in sc.fleet.pools]
    sc = sc.model_copy(update={"duration": 600.0, "fleet": sc.fleet.model_copy(update={"pools": pools})})
    [run] = DynamoPeer(dynamo_python, ("load",)).runs("mooncake", sc, {"prefill": [2] * 10, "decode": [1] * 10})
    run()
    capped = [i for i, m in enumerate(sent) if m["op"] == "capped"]
    assert capped, "two prefill engines cannot take Mooncake's prompts: the planner asks for more"
    later = [r for r in replies[capped[0] + 1:] if r.get("target_prefill") or r.get("target_decode")]
    assert later, "told the count it got, the planner decides again"
