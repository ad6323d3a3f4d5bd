"""`fleetctl eval --mode act`: what acting achieves, against observing only, on the same replays.

Every scenario runs twice through the full loop on the same seed and trace window: in `observe`
mode (the fleet is left as it is, as a team with alerts only would) and in `act` mode (the
simulator's actuator carries out what the rails allow). The measure is the SLO-breach time of the
fault: minutes, from the fault's onset to its end, in which a pool with an SLO had its pool-wide
TTFT p95 or TPOT p95 above it in most of the minute's scrape intervals (the median of the minute's
p95s: one slow interval in an otherwise healthy minute is noise every fleet has, with or without
acting). Fault-free replays run in `act` mode only and count the remedial actions (rollback, EPLB,
speculation, drain, cordon) taken on a healthy fleet; any is a wrong action.

Goals: for each remedied fault kind, at most half the breach minutes of observing alone; a kind
whose faults breached the SLO for less than `MIN_JUDGED_MIN` minutes without acting is listed
without a goal, since one minute can only halve to zero or not at all; no remedial action on the
fault-free replays.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controlplane.autoscaling import build_sizer
from controlplane.evaluation import run_all, variant
from controlplane.goals import Goal, at_most, goals_json
from controlplane.loop import TickReport
from controlplane.sim.run import ScenarioRun, run_scenario
from controlplane.sim.scenario import Scenario, load_scenario
from controlplane.store.writer import SqlStore
from policies.types import ActionKind

__all__ = ["REMEDIAL", "REMEDIED_SCENARIOS", "ActingReport", "ActingRun", "evaluate_acting"]

# Actions that change how a healthy fleet serves; scaling for load is the autoscaler's and not counted.
REMEDIAL = frozenset({ActionKind.ROLLBACK, ActionKind.ENABLE_EPLB, ActionKind.TUNE_SPECULATION,
                      ActionKind.DISABLE_SPECULATION, ActionKind.DRAIN_ENGINE, ActionKind.CORDON_NODE})
# One scenario per fault kind with an automatic remedy, and the fault-free replays of a day's traffic.
REMEDIED_SCENARIOS = ("demo", "router-flip", "json-surge", "hot-expert", "kv-pressure", "gpu-xid", "gpu-thermal",
                      "kv-lagging-decode-worker")
FAULT_FREE_SCENARIOS = ("replay-azure-conv", "replay-azure-code", "replay-mooncake-conversation",
                        "replay-mooncake-synthetic", "replay-servegen-diurnal", "replay-moe")
BREACH_RATIO_GOAL = 0.5
MIN_JUDGED_MIN = 2.0


@dataclass(slots=True)
class ActingRun:
    """One run of one scenario in one mode: SLO-breach time within its faults, and what it did."""

    scenario: str
    mode: str
    fault_kinds: list[str]
    breach_s: float  # within the faults' windows (the whole run when fault-free)
    window_s: float
    actions: list[dict[str, Any]] = field(default_factory=list)  # kind, pool, at_s, state, outcome, change
    wall_s: float = 0.0

    @property
    def remedial(self) -> int:
        """Remedial actions carried out (dry runs and held proposals are not)."""
        return sum(1 for a in self.actions if a["kind"] in REMEDIAL and a["state"] == "succeeded")


def breach_minutes(samples: Mapping[tuple[str, str], list[tuple[float, float]]], slos: Mapping[tuple[str, str], float],
                   windows: Sequence[tuple[float, float]]) -> int:
    """Minutes within `windows` (seconds from the start) in which some (pool, signal) had the median of
    its p95 samples above its SLO."""
    breached = set()
    for key, points in samples.items():
        by_minute: dict[int, list[float]] = {}
        for t, v in points:
            if any(start < t <= end for start, end in windows):
                by_minute.setdefault(int((t - 1e-9) // 60), []).append(v)
        breached |= {m for m, values in by_minute.items() if statistics.median(values) > slos[key]}
    return len(breached)


async def run_once(scenario: Scenario, db_url: str, mode: str) -> ActingRun:
    """Run `scenario` in `mode`; count the breached minutes inside its fault windows."""
    interval = scenario.scrape_interval
    windows = [(f.at, f.end or scenario.duration) for f in scenario.faults] or [(0.0, scenario.duration)]
    slos = {(p.name, signal): slo for p in scenario.fleet.pools
            for signal, slo in (("ttft_p95", p.slo.ttft_p95), ("tpot_p95", p.slo.tpot_p95)) if slo is not None}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in slos}

    def hook(run: ScenarioRun, report: TickReport) -> None:
        for pool, signal in slos:
            points = run.loop.windows.series(f"pool/{pool}", signal, since=run.fleet.now - interval)
            if points:
                samples[pool, signal].append((run.elapsed, points[-1][1]))

    # The control plane as a team runs it: the autoscaler on (advisory when observing), beside the remedies.
    config = scenario.controlplane_config(db_url, mode)
    config = config.model_copy(update={"autoscaling": config.autoscaling.model_copy(update={"enabled": True})})
    run = await run_scenario(scenario, db_url, mode=mode, on_tick=hook, config=config, sizer=build_sizer(config))
    store = SqlStore.open(db_url)
    try:
        actions = [{"kind": a.kind, "pool": a.pool, "at_s": round(a.created_at - run.start), "state": str(a.state),
                    "outcome": a.outcome, "change": a.reason.split("; rails:")[0]}
                   for a in store.actions() if a.created_at >= run.start - 1]
    finally:
        store.close()
    return ActingRun(scenario.name, mode, sorted({str(f.kind) for f in scenario.faults}),
                     60.0 * breach_minutes(samples, slos, windows),
                     sum(end - start for start, end in windows), actions, run.wall_s)


def _run_file(scenario: Scenario, db: Path, mode: str) -> ActingRun:
    db.unlink(missing_ok=True)
    return asyncio.run(run_once(scenario, f"sqlite:///{db}", mode))


@dataclass(slots=True)
class ActingReport:
    """Every run, paired by scenario, with the goals."""

    runs: list[ActingRun]

    def by_kind(self) -> list[dict[str, Any]]:
        """Per fault kind: breach minutes observing and acting (summed over its scenarios), the ratio, the actions."""
        kinds: dict[str, dict[str, Any]] = {}
        for r in self.runs:
            if not r.fault_kinds:
                continue
            row = kinds.setdefault("+".join(r.fault_kinds), {"fault": "+".join(r.fault_kinds), "scenarios": [],
                                                             "observe_breach_min": 0.0, "act_breach_min": 0.0,
                                                             "fault_min": 0.0, "actions": []})
            row[f"{r.mode}_breach_min"] += r.breach_s / 60
            if r.mode == "act":
                row["scenarios"].append(r.scenario)
                row["fault_min"] += r.window_s / 60
                row["actions"] += [f"{a['kind']} {a['pool']} at {a['at_s'] // 60}:{a['at_s'] % 60:02d} ({a['state']}"
                                   + (f", {a['outcome']})" if a["outcome"] else ")") for a in r.actions]
        for row in kinds.values():
            before = row["observe_breach_min"]
            row["ratio"] = row["act_breach_min"] / before if before >= MIN_JUDGED_MIN else None
        return list(kinds.values())

    def fault_free(self) -> list[dict[str, Any]]:
        """Per fault-free replay: the remedial actions taken on a healthy fleet."""
        return [{"scenario": r.scenario, "remedial_actions": r.remedial,
                 "actions": [f"{a['kind']} {a['pool']} ({a['state']})" for a in r.actions]}
                for r in self.runs if not r.fault_kinds]

    def goals(self) -> list[Goal]:
        """Half the breach minutes or fewer for each remedied kind that breached at all; no wrong remedy."""
        out = [at_most(f"{row['fault']}: SLO-breach minutes acting / observing", row["ratio"], BREACH_RATIO_GOAL)
               for row in self.by_kind() if row["ratio"] is not None]
        free = self.fault_free()
        if free:
            out.append(at_most("remedial actions on the fault-free replays", sum(f["remedial_actions"] for f in free), 0))
        return out

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return {"goals": goals_json(self.goals()), "mode": "act", "faults": self.by_kind(),
                "fault_free": self.fault_free(), "runs": [asdict(r) for r in self.runs]}


def evaluate_acting(names: Sequence[str] | None, workdir: Path,
                    progress: Callable[[str, ActingRun | None], None] | None = None, jobs: int = 1,
                    repeats: int = 1) -> ActingReport:
    """Run the named scenarios (the remedied faults and the fault-free replays by default) observing and acting."""
    scenarios = [variant(load_scenario(n), k) for n in names or (*REMEDIED_SCENARIOS, *FAULT_FREE_SCENARIOS)
                 for k in range(repeats)]
    for sc in scenarios:
        sc.check()
    runs = [(f"{sc.name} ({mode})", functools.partial(_run_file, sc, workdir / f"eval-{mode}-{sc.name}.db", mode))
            for sc in scenarios for mode in (("observe", "act") if sc.faults else ("act",))]
    return ActingReport(run_all(runs, jobs, progress))
