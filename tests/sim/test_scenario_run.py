"""Scenarios end to end: the simulated fleet served over loopback, the real loop finding the fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.sim.run import run_scenario
from controlplane.sim.scenario import load_scenario

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


async def test_a_lagging_decode_worker_is_named_within_two_intervals(tmp_path: Path) -> None:
    scenario = load_scenario("kv-lagging-decode-worker").model_copy(update={"duration": 1500.0})
    run = await run_scenario(scenario, f"sqlite:///{tmp_path / 'sim.db'}")
    from controlplane.store.writer import SqlStore

    store = SqlStore.open(f"sqlite:///{tmp_path / 'sim.db'}")
    try:
        found = [f for f in store.findings_since(run.start) if f.kind == "kv_transfer_lag"]
    finally:
        store.close()
    assert found, "the lagging worker was not found"
    assert all("decode-1" in f.subject for f in found), [f.subject for f in found]
    first = min(f.opened_at for f in found) - run.start
    assert 600 < first <= 600 + 2 * scenario.scrape_interval
    assert any(f.resolved_at is not None and f.resolved_at - run.start > 1200 for f in found)


def test_sim_run_cli_replays_a_scenario_and_reports_its_timeline(tmp_path: Path) -> None:
    text = (ROOT / "controlplane/sim/scenarios/router-flip.yaml").read_text()
    path = tmp_path / "short.yaml"
    path.write_text(text.replace("duration: 30m", "duration: 12m"))
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "sim", "run", str(path), "--db",
                          f"sqlite:///{tmp_path / 'run.db'}", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=280)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ticks"] == 48 and out["engines"] == 6
    assert out["events"] == [[600.0, "fault router_flip starts"]]
    assert "fault router_flip starts" in res.stderr


def test_an_fp8_cache_moves_half_the_bytes_over_the_link() -> None:
    """What the advisor prices a split's transfers at: the simulator that scores its advice moves the same."""
    scenario = load_scenario("kv-lagging-decode-worker")
    fp8 = scenario.model_copy(update={"fleet": scenario.fleet.model_copy(update={"pools": [
        p.model_copy(update={"kv_cache_dtype": "fp8"}) for p in scenario.fleet.pools]})})
    before = {p.name: p.engine.kv_bytes_per_token for p in scenario.fleet_spec().pools}
    after = {p.name: p.engine.kv_bytes_per_token for p in fp8.fleet_spec().pools}
    assert before and all(after[name] * 2 == before[name] == 131_072 for name in before)
