"""Run a scenario: the simulated fleet served over loopback, the real control loop on its clock.

Each tick: the simulated clock moves one scrape interval, due faults start or end, the fleet
advances, every engine's exporters publish, and the loop scrapes, stores, evaluates and acts
exactly as it does on a live fleet. `speed` paces the run (simulated seconds per wall second);
without it the run goes as fast as the machine allows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.clock import VirtualClock
from controlplane.config import FleetConfig
from controlplane.loop import ControlLoop, TickReport
from controlplane.runtime import build_loop, scrape_client
from controlplane.sim.actuator import SimActuator
from controlplane.sim.fleet import SimFleet
from controlplane.sim.scenario import Fault, FaultTimeline, Scenario
from controlplane.sim.server import SimServer, SimTargets
from controlplane.store import migrate
from controlplane.store.threaded import ThreadedStore
from policies.autoscale import Sizer
from policies.types import Policy, change_from_dict, describe

__all__ = ["ScenarioRun", "TickHook", "Timeline", "mmss", "run_scenario"]

TickHook = Callable[["ScenarioRun", TickReport], Awaitable[None] | None]


@dataclass(slots=True)
class ScenarioRun:
    """A scenario in progress: what the hooks may look at."""

    scenario: Scenario
    fleet: SimFleet
    loop: ControlLoop
    start: float
    ticks: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds from start, what happened)
    wall_s: float = 0.0

    @property
    def elapsed(self) -> float:
        """Simulated seconds since the start."""
        return self.fleet.now - self.start

    def engine_hours(self) -> float:
        """Engine-hours simulated so far (engines counted at their current number)."""
        return len(self.fleet.serving()) * self.elapsed / 3600.0


def mmss(seconds: float) -> str:
    """Seconds of fleet time as MM:SS (minutes grow past 59)."""
    m, s = divmod(int(seconds), 60)
    return f"{m:02d}:{s:02d}"


def action_change(params: dict[str, Any]) -> str:
    """An action's change in words: `3 -> 4` for a scale, its description otherwise."""
    if "replicas" in params and "from_replicas" in params:
        return f"{params['from_replicas']} -> {params['replicas']}"
    return describe(change_from_dict(params["change"])) if "change" in params else "?"


class Timeline:
    """A run told tick by tick for a console, in rich markup: faults, findings, actions and outcomes."""

    def __init__(self) -> None:
        self._events = 0

    def lines(self, run: ScenarioRun, report: TickReport) -> list[str]:
        """What happened since the last call."""
        out = [f"[yellow]{mmss(at)} {what}[/]" for at, what in run.events[self._events:]]
        self._events = len(run.events)
        now = mmss(run.elapsed)
        for f in report.opened:
            out.append(f"[red]{now} finding opened[/] #{f.id} {f.kind} {f.subject} ({f.severity}): {f.summary}")
            out.append(f"           cause: {f.cause}")
        for a in report.actions:
            # A scale's step is not in its reason; every other change's reason says what it does.
            step = f" {action_change(a.params)}" if "replicas" in a.params else ""
            out.append(f"[cyan]{now} action[/] #{a.id} {a.kind} {a.pool}{step}: {a.reason}")
        # One left unjudged (another change came too soon, its numbers unfit) says nothing worth a line.
        out += [f"[cyan]{now} outcome[/] of action #{action_id}: {outcome}" for action_id, outcome in report.outcomes
                if outcome != "unmeasured"]
        out += [f"[green]{now} finding resolved[/] #{f.id} {f.kind} {f.subject}" for f in report.resolved]
        return out


async def run_scenario(scenario: Scenario, db_url: str, *, mode: str = "observe", speed: float | None = None,
                       policies: Sequence[Policy] | None = None, on_tick: TickHook | None = None,
                       start: float | None = None, config: FleetConfig | None = None,
                       sizer: Sizer | None = None) -> ScenarioRun:
    """Replay `scenario` through the full loop, storing into `db_url`; returns the finished run.

    `config` replaces the fleet file derived from the scenario (its store URL is set to `db_url`);
    `sizer` sets replica counts (the autoscaler, or a baseline to compare it with).
    """
    if config is None:
        config = scenario.controlplane_config(db_url, mode)
    else:
        config = config.model_copy(update={"store": config.store.model_copy(update={"url": db_url})})
    migrate.upgrade(db_url)
    store = ThreadedStore.open(db_url)
    clock = VirtualClock(start=start if start is not None else time.time() // 60 * 60)
    t0 = clock.now()
    fleet = SimFleet(scenario.fleet_spec(), scenario.requests(), now=t0)
    server = SimServer(fleet)
    interval = scenario.scrape_interval
    faults = FaultTimeline(scenario.faults, t0)
    wall0 = time.perf_counter()
    try:
        async with scrape_client(config) as client:
            loop = build_loop(config, store, client, targets=SimTargets(server), actuator=SimActuator(fleet),
                              clock=clock, policies=policies, sizer=sizer)
            run = ScenarioRun(scenario, fleet, loop, t0)
            await loop.start()
            for _ in range(int(scenario.duration // interval)):
                tick_wall = time.perf_counter()
                clock.advance(interval)
                now = clock.now()
                for at, fault, started in faults.advance(fleet, now):
                    run.events.append((at, f"fault {fault.kind} {'starts' if started else 'ends'}" + _where(fault)))
                fleet.advance_to(now)
                server.sync()
                report = await loop.tick()
                run.ticks += 1
                if on_tick is not None:
                    maybe = on_tick(run, report)
                    if maybe is not None:
                        await maybe
                if speed:
                    await asyncio.sleep(max(0.0, interval / speed - (time.perf_counter() - tick_wall)))
            run.wall_s = time.perf_counter() - wall0
            return run
    finally:
        server.close()
        store.close()


def _where(fault: Fault) -> str:
    if fault.pod:
        return f" on {fault.pod}"
    return f" on pool {fault.pool}" if fault.pool else ""
