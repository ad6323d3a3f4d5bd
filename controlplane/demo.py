"""`fleetctl demo`: the shipped `demo` scenario through the real loop in accelerated time.

A disaggregated fleet replays Azure conversations; the prefill router flips from cache-aware to
round-robin a third of the way in and is repaired at three quarters. The loop scrapes the
simulated engines over loopback HTTP, stores signals in the given database, opens a finding,
acts through the rails (the demo's fleet file runs in `act` mode) and judges the outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from controlplane.autoscaling import build_sizer
from controlplane.config import FleetConfig, parse_config
from controlplane.loop import TickReport
from controlplane.sim.fleet import SimFleet
from controlplane.sim.run import ScenarioRun, Timeline, action_change, mmss, run_scenario
from controlplane.sim.scenario import Scenario, load_scenario
from controlplane.store.writer import SqlStore

__all__ = ["DemoSummary", "demo_config", "demo_fleet", "demo_scenario", "run_demo"]

SIM_SECONDS_PER_WALL_MINUTE = 3600.0  # one wall minute shows an hour of fleet time


def demo_config(db_url: str) -> FleetConfig:
    """The demo's fleet file with the store pointed at `db_url`."""
    text = resources.files("controlplane.sim").joinpath("demo_fleet.yaml").read_text(encoding="utf-8")
    cfg = parse_config(text, "demo_fleet.yaml")
    return cfg.model_copy(update={"store": cfg.store.model_copy(update={"url": db_url})})


def demo_scenario(sim_seconds: float | None = None) -> Scenario:
    """The `demo` scenario, its timeline stretched or shrunk to `sim_seconds` of fleet time."""
    scenario = load_scenario("demo")
    if sim_seconds is None:
        return scenario
    k = sim_seconds / scenario.duration
    faults = [f.model_copy(update={"at": f.at * k, "end": None if f.end is None else f.end * k})
              for f in scenario.faults]
    return scenario.model_copy(update={"duration": sim_seconds, "faults": faults})


def demo_fleet(now: float) -> SimFleet:
    """The demo scenario's fleet, fault-free, starting at `now` (for tests and benchmarks)."""
    scenario = demo_scenario()
    return SimFleet(scenario.fleet_spec(), scenario.requests(), now=now)


@dataclass(slots=True)
class DemoSummary:
    """What the demo did; printed as a table or JSON."""

    db_url: str
    sim_seconds: float
    ticks: int
    wall_seconds: float
    fault_at: float
    repaired_at: float
    findings: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The demo showed its point: at least one finding and one action."""
        return bool(self.findings) and bool(self.actions)


async def run_demo(minutes: float, db_url: str, console: Console, *, pace: bool = True) -> DemoSummary:
    """Run the demo for `minutes` of wall time (an hour of fleet time per minute)."""
    sim_seconds = minutes * SIM_SECONDS_PER_WALL_MINUTE
    scenario = demo_scenario(sim_seconds)
    fault = scenario.faults[0]
    ticks = int(sim_seconds // scenario.scrape_interval)
    start = time.time() // 60 * 60
    with Progress(
        TextColumn("[bold]fleet time[/] {task.fields[sim]}"), BarColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:
        task = progress.add_task("demo", total=ticks, sim="00:00", status="")
        timeline = Timeline()

        def show(run: ScenarioRun, report: TickReport) -> None:
            for line in timeline.lines(run, report):
                progress.console.print(line, highlight=False)
            now = mmss(run.elapsed)
            hit = run.loop.windows.latest("pool/prefill", "prefix_cache_hit_rate")
            ttft = run.loop.windows.latest("pool/prefill", "ttft_p95")
            status = (f"targets {report.targets_up}/{report.targets}  prefill hit "
                      f"{'-' if hit is None else f'{hit:.0%}'}  TTFT p95 {'-' if ttft is None else f'{ttft:.2f}s'}")
            progress.update(task, advance=1, sim=now, status=status)

        config = demo_config(db_url)
        run = await run_scenario(scenario, db_url, config=config, on_tick=show, start=start, sizer=build_sizer(config),
                                 speed=sim_seconds / (minutes * 60.0) if pace else None)
    summary = DemoSummary(db_url, sim_seconds, run.ticks, run.wall_s, fault.at, fault.end or sim_seconds)
    store = SqlStore.open(db_url)
    try:
        for f in store.findings_since(start):
            summary.findings.append({
                "id": f.id, "kind": f.kind, "subject": f.subject, "severity": f.severity, "state": f.state,
                "opened_at_s": round(f.opened_at - start), "resolved_at_s":
                    None if f.resolved_at is None else round(f.resolved_at - start),
                "summary": f.summary, "cause": f.evidence.get("cause"),
            })
        for a in store.actions(since=start):
            summary.actions.append({
                "id": a.id, "finding_id": a.finding_id, "kind": a.kind, "pool": a.pool, "state": a.state,
                "from_replicas": a.params.get("from_replicas"), "replicas": a.params.get("replicas"),
                "change": action_change(a.params),
                "at_s": round(a.created_at - start), "outcome": a.outcome,
            })
    finally:
        store.close()
    return summary

