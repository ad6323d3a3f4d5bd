"""`fleetctl demo`: a simulated fleet, the real loop in accelerated time, one injected fault.

The prefill router flips from cache-aware to round-robin a third of the way in and is repaired
at three quarters. The loop scrapes the simulated engines over loopback HTTP, stores signals in
the given database, opens a finding, acts through the rails and judges the outcome.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from controlplane.clock import VirtualClock
from controlplane.config import FleetConfig, parse_config
from controlplane.runtime import build_loop, scrape_client
from controlplane.sim.fleet import FleetSpec, Router, SimFleet
from controlplane.sim.server import SimActuator, SimServer, SimTargets
from controlplane.store import migrate
from controlplane.store.writer import SqlStore

__all__ = ["DemoSummary", "demo_config", "run_demo"]

SIM_SECONDS_PER_WALL_MINUTE = 3600.0  # one wall minute shows an hour of fleet time


def demo_config(db_url: str) -> FleetConfig:
    """The demo's fleet file with the store pointed at `db_url`."""
    text = resources.files("controlplane.sim").joinpath("demo_fleet.yaml").read_text(encoding="utf-8")
    cfg = parse_config(text, "demo_fleet.yaml")
    return cfg.model_copy(update={"store": cfg.store.model_copy(update={"url": db_url})})


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
    config = demo_config(db_url)
    migrate.upgrade(db_url)
    store = SqlStore.open(db_url)
    clock = VirtualClock(start=time.time() // 60 * 60)
    start = clock.now()
    sim_seconds = minutes * SIM_SECONDS_PER_WALL_MINUTE
    fault_at, repaired_at = start + sim_seconds / 3, start + sim_seconds * 0.75
    interval = config.scrape.interval
    ticks = int(sim_seconds // interval)
    wall_per_tick = (minutes * 60.0) / max(1, ticks) if pace else 0.0
    fleet = SimFleet(FleetSpec(), now=start)
    server = SimServer(fleet)
    wall0 = time.perf_counter()
    try:
        async with scrape_client(config) as client:
            loop = build_loop(config, store, client, targets=SimTargets(server), actuator=SimActuator(fleet),
                              clock=clock)
            await loop.start()
            with Progress(
                TextColumn("[bold]fleet time[/] {task.fields[sim]}"), BarColumn(), TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(), console=console, transient=True,
            ) as progress:
                task = progress.add_task("demo", total=ticks, sim="00:00", status="")
                for _ in range(ticks):
                    tick_wall = time.perf_counter()
                    clock.advance(interval)
                    now = clock.now()
                    if fleet.router is Router.CACHE_AWARE and fault_at <= now < repaired_at:
                        fleet.set_router(Router.ROUND_ROBIN)
                        progress.console.print(f"[yellow]{_t(now - start)} fault injected: prefill router flipped to round-robin")
                    elif fleet.router is Router.ROUND_ROBIN and now >= repaired_at:
                        fleet.set_router(Router.CACHE_AWARE)
                        progress.console.print(f"[green]{_t(now - start)} router repaired: cache-aware again")
                    fleet.advance_to(now)
                    server.sync()
                    report = await loop.tick()
                    for f in report.opened:
                        progress.console.print(f"[red]{_t(now - start)} finding opened[/] #{f.id} {f.kind} {f.subject} "
                                               f"({f.severity}): {f.summary}")
                        progress.console.print(f"           cause: {f.cause}")
                    for a in report.actions:
                        progress.console.print(f"[cyan]{_t(now - start)} action[/] #{a.id} {a.kind} {a.pool} "
                                               f"{a.params.get('from_replicas')} -> {a.params.get('replicas')}: {a.reason}")
                    for action_id, outcome in report.outcomes:
                        progress.console.print(f"[cyan]{_t(now - start)} outcome[/] of action #{action_id}: {outcome}")
                    for f in report.resolved:
                        progress.console.print(f"[green]{_t(now - start)} finding resolved[/] #{f.id} {f.kind} {f.subject}")
                    hit = loop.windows.latest("pool/prefill", "prefix_cache_hit_rate")
                    ttft = loop.windows.latest("pool/prefill", "ttft_p95")
                    status = (f"targets {report.targets_up}/{report.targets}  prefill hit "
                              f"{'-' if hit is None else f'{hit:.0%}'}  TTFT p95 {'-' if ttft is None else f'{ttft:.2f}s'}")
                    progress.update(task, advance=1, sim=_t(now - start), status=status)
                    if wall_per_tick:
                        await asyncio.sleep(max(0.0, wall_per_tick - (time.perf_counter() - tick_wall)))
        summary = DemoSummary(db_url, sim_seconds, ticks, time.perf_counter() - wall0, fault_at - start,
                              repaired_at - start)
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
                "at_s": round(a.created_at - start), "outcome": a.outcome,
            })
        return summary
    finally:
        server.close()
        store.close()


def _t(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m:02d}:{s:02d}"
