"""`fleetctl eval`: the detection policies against static alert rules, on the simulator's scenarios.

Each scenario runs through the full loop (simulated fleet over loopback, scrape, store, the
policies, observe mode). At every tick the static rules (threshold plus `for: 5m`, as teams write
them; `policies/static_rules.py`) are evaluated on the same signal windows, with their own
open/resolve bookkeeping, so both judge exactly the same data.

Scoring, per finding kind:
- a fault's truth is detected when a finding of its kind on its pool (and pod) opens between the
  fault's onset and its end; the delay is from onset to that opening;
- recall counts required truths; precision counts findings that match any truth (optional ones
  included) against all findings of the kind;
- a false alarm is a finding that matches no truth; rates are per 1,000 engine-hours simulated.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from controlplane.goals import Goal, at_least, at_most, goals_json
from controlplane.loop import TickReport
from controlplane.sim.run import ScenarioRun, run_scenario
from controlplane.sim.scenario import Scenario, Truth, builtin_scenarios, load_scenario
from controlplane.sim.traces import trace_span
from controlplane.store.writer import SqlStore
from policies.static_rules import static_policies
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState

__all__ = ["EvalReport", "Finding", "KindScore", "ScenarioResult", "evaluate", "run_all", "score", "variant"]

SMART, STATIC = "policies", "static rules"
R = TypeVar("R")
_PROGRESS_FROM_S = 2 * 3600.0  # scenarios this long (soaks) report their progress
_VARIANT_SHIFT_S = 300.0  # trace seconds between the windows of a scenario's variants


# The detection goals: faults found within two scrape intervals (median), five times faster than
# threshold-plus-`for: 5m` rules at no more false alarms, and at most one false alarm per 1,000
# engine-hours of fault-free traffic.
DELAY_GOAL_INTERVALS = 2.0
SPEEDUP_GOAL = 5.0
FALSE_ALARM_GOAL = 1.0

@dataclass(frozen=True, slots=True)
class Finding:
    """One finding as the evaluation sees it: who raised it, what, where, when (seconds from start)."""

    detector: str
    kind: str
    subject: str
    opened_s: float
    resolved_s: float | None


@dataclass(slots=True)
class ScenarioResult:
    """One scenario's run: its truths, what each detector found, and its size."""

    name: str
    truths: list[tuple[float, float, Truth]]
    findings: list[Finding]
    engine_hours: float
    interval_s: float
    wall_s: float
    fault_free: bool


@dataclass(slots=True)
class KindScore:
    """Detection figures of one detector for one finding kind."""

    detector: str
    kind: str
    truths: int = 0
    detected: int = 0
    findings: int = 0
    matched: int = 0
    false_alarms: int = 0
    false_alarms_fault_free: int = 0
    delays_s: list[float] = field(default_factory=list)
    interval_s: float = 15.0

    @property
    def recall(self) -> float | None:
        """Share of required truths detected."""
        return self.detected / self.truths if self.truths else None

    @property
    def precision(self) -> float | None:
        """Share of findings that match a truth."""
        return self.matched / self.findings if self.findings else None

    def delay(self, q: float) -> float | None:
        """A quantile of the detection delay in seconds (nearest rank)."""
        if not self.delays_s:
            return None
        ordered = sorted(self.delays_s)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    def as_dict(self, engine_hours: float, fault_free_hours: float) -> dict[str, Any]:
        """The figures as JSON-ready values."""
        med, p90 = self.delay(0.5), self.delay(0.9)
        return {
            "detector": self.detector, "kind": self.kind, "truths": self.truths, "detected": self.detected,
            "recall": self.recall, "findings": self.findings, "precision": self.precision,
            "delay_median_s": med, "delay_p90_s": p90,
            "delay_median_intervals": None if med is None else med / self.interval_s,
            "delay_p90_intervals": None if p90 is None else p90 / self.interval_s,
            "false_alarms": self.false_alarms,
            "false_alarms_per_1000_engine_hours": 1000 * self.false_alarms / engine_hours if engine_hours else None,
            "false_alarms_fault_free": self.false_alarms_fault_free,
            "false_alarms_fault_free_per_1000_engine_hours":
                1000 * self.false_alarms_fault_free / fault_free_hours if fault_free_hours else None,
        }


@dataclass(slots=True)
class EvalReport:
    """Everything `fleetctl eval` prints."""

    scenarios: list[ScenarioResult]
    scores: list[KindScore]

    @property
    def engine_hours(self) -> float:
        """Engine-hours simulated over all scenarios."""
        return sum(s.engine_hours for s in self.scenarios)

    @property
    def fault_free_hours(self) -> float:
        """Engine-hours of the fault-free replays."""
        return sum(s.engine_hours for s in self.scenarios if s.fault_free)

    def summary(self) -> dict[str, Any]:
        """The goals: pooled delays, the speed-up over the static rules, false-alarm rates."""
        out: dict[str, Any] = {}
        for detector in (SMART, STATIC):
            mine = [k for k in self.scores if k.detector == detector]
            delays = sorted(d for k in mine for d in k.delays_s)
            truths = sum(k.truths for k in mine)
            fa = sum(k.false_alarms for k in mine)
            fa_free = sum(k.false_alarms_fault_free for k in mine)
            med = delays[len(delays) // 2] if delays else None
            out[detector] = {
                "truths": truths, "detected": sum(k.detected for k in mine),
                "delay_median_s": med,
                "delay_median_intervals": None if med is None else med / (mine[0].interval_s if mine else 15.0),
                "false_alarms": fa,
                "false_alarms_per_1000_engine_hours": 1000 * fa / self.engine_hours if self.engine_hours else None,
                "false_alarms_fault_free": fa_free,
                "false_alarms_fault_free_per_1000_engine_hours":
                    1000 * fa_free / self.fault_free_hours if self.fault_free_hours else None,
            }
        smart, static = out[SMART]["delay_median_s"], out[STATIC]["delay_median_s"]
        out["speedup_median"] = static / smart if smart and static else None
        return out

    def goals(self) -> list[Goal]:
        """The detection goals that this set of scenarios can judge (a delay needs faults, a false-alarm
        rate fault-free replays): median delay, speed-up over the static rules, false alarms."""
        summary = self.summary()
        smart, static = summary[SMART], summary[STATIC]
        out: list[Goal] = []
        if smart["truths"]:
            out.append(at_most("policies' median detection delay, scrape intervals", smart["delay_median_intervals"],
                               DELAY_GOAL_INTERVALS))
        if smart["delay_median_s"] is not None and static["delay_median_s"] is not None:
            out.append(at_least("median speed-up over the static rules", summary["speedup_median"], SPEEDUP_GOAL))
            out.append(at_most("policies' false alarms per 1,000 engine-hours, against the static rules'",
                               smart["false_alarms_per_1000_engine_hours"], static["false_alarms_per_1000_engine_hours"]))
        if self.fault_free_hours:
            out.append(at_most("policies' false alarms per 1,000 fault-free engine-hours",
                               smart["false_alarms_fault_free_per_1000_engine_hours"], FALSE_ALARM_GOAL))
        return out

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return {
            "goals": goals_json(self.goals()),
            "summary": self.summary(),
            "engine_hours": self.engine_hours,
            "fault_free_engine_hours": self.fault_free_hours,
            "scenarios": [{"name": s.name, "engine_hours": s.engine_hours, "wall_s": s.wall_s,
                           "fault_free": s.fault_free, "findings": [asdict(f) for f in s.findings]}
                          for s in self.scenarios],
            "scores": [k.as_dict(self.engine_hours, self.fault_free_hours) for k in self.scores],
        }


def _matches(truth: Truth, subject: str) -> bool:
    """A subject names the truth's pool (and pod): `pool/p`, `engine/p/pod/r`, `gpu/node-pod/0`, ..."""
    parts = subject.split("/")[1:]
    if truth.pod is not None:
        return any(p == truth.pod or p.startswith(truth.pod) or p.endswith(truth.pod) for p in parts)
    if truth.pool is None:
        return True
    return any(p == truth.pool or p.startswith(f"{truth.pool}-") or p.startswith(f"node-{truth.pool}-")
               for p in parts)


def score(results: Sequence[ScenarioResult]) -> list[KindScore]:
    """Per detector and kind: recall, precision, delays and false alarms over all scenarios."""
    scores: dict[tuple[str, str], KindScore] = {}

    def get(detector: str, kind: str, interval: float) -> KindScore:
        key = (detector, kind)
        if key not in scores:
            scores[key] = KindScore(detector, kind, interval_s=interval)
        return scores[key]

    for res in results:
        for detector in (SMART, STATIC):
            found = [f for f in res.findings if f.detector == detector]
            for onset, end, truth in res.truths:
                hits = [f for f in found if f.kind == truth.kind and _matches(truth, f.subject)
                        and onset <= f.opened_s <= end]
                if truth.required:
                    s = get(detector, truth.kind, res.interval_s)
                    s.truths += 1
                    if hits:
                        s.detected += 1
                        s.delays_s.append(min(f.opened_s for f in hits) - onset)
            for f in found:
                s = get(detector, f.kind, res.interval_s)
                s.findings += 1
                ok = any(f.kind == t.kind and _matches(t, f.subject) and onset <= f.opened_s <= end
                         for onset, end, t in res.truths)
                if ok:
                    s.matched += 1
                else:
                    s.false_alarms += 1
                    s.false_alarms_fault_free += res.fault_free
    return sorted(scores.values(), key=lambda s: (s.kind, s.detector))


class _StaticBook:
    """Static rules on the loop's windows each tick, opening and resolving findings as alerts do."""

    def __init__(self, scenario: Scenario) -> None:
        self.policies = static_policies()
        self.open: dict[FindingKey, OpenFinding] = {}
        self.findings: list[Finding] = []
        self._opened: dict[FindingKey, int] = {}
        self.scenario = scenario

    def tick(self, run: ScenarioRun) -> None:
        now = run.fleet.now
        pools = {
            p.name: PoolState(p.name, str(p.role), run.fleet.desired[p.name], len(run.fleet.ready(p.name)), 1,
                              p.max_replicas or p.replicas * 2, p.slo.ttft_p95, p.slo.tpot_p95,
                              expert_parallel=p.moe is not None)
            for p in self.scenario.fleet.pools
        }
        for policy in self.policies:
            inp = PolicyInput(now, run.loop.windows, pools, {k: v for k, v in self.open.items() if k.kind == policy.kind})
            result = policy.evaluate(inp)
            for report in result.findings:
                if report.key not in self.open:
                    self.open[report.key] = OpenFinding(report.key, now, report.evidence)
                    self._opened[report.key] = len(self.findings)
                    self.findings.append(Finding(STATIC, report.key.kind, report.key.subject, now - run.start, None))
            for key, _ in result.resolved:
                if key in self.open:
                    del self.open[key]
                    i = self._opened.pop(key)
                    f = self.findings[i]
                    self.findings[i] = Finding(f.detector, f.kind, f.subject, f.opened_s, now - run.start)


async def evaluate_scenario(scenario: Scenario, db_url: str) -> ScenarioResult:
    """Run one scenario and collect both detectors' findings; long ones report each tenth on stderr."""
    book = _StaticBook(scenario)
    tenth = scenario.duration / 10
    shown = 0

    def hook(run: ScenarioRun, report: TickReport) -> None:
        nonlocal shown
        book.tick(run)
        if scenario.duration >= _PROGRESS_FROM_S and run.elapsed >= (shown + 1) * tenth:
            shown += 1
            print(f"  {scenario.name}: {shown * 10} % ({run.elapsed / 3600:.1f} of {scenario.duration / 3600:.1f} "
                  f"fleet hours, {run.engine_hours():.0f} engine-hours)", file=sys.stderr, flush=True)

    run = await run_scenario(scenario, db_url, mode="observe", on_tick=hook)
    store = SqlStore.open(db_url)
    try:
        smart = [Finding(SMART, f.kind, f.subject, f.opened_at - run.start,
                         None if f.resolved_at is None else f.resolved_at - run.start)
                 for f in store.findings_since(run.start - 1)]
    finally:
        store.close()
    return ScenarioResult(scenario.name, scenario.truth_windows(), smart + book.findings, run.engine_hours(),
                          scenario.scrape_interval, run.wall_s, not scenario.faults)


def _evaluate_file(scenario: Scenario, db: Path) -> ScenarioResult:
    """One scenario in a fresh database: what each worker process runs."""
    db.unlink(missing_ok=True)
    return asyncio.run(evaluate_scenario(scenario, f"sqlite:///{db}"))


def variant(scenario: Scenario, k: int) -> Scenario:
    """The k-th variant of a scenario: another seed, and the trace window five minutes of trace time later per k.

    One run per scenario gives one detection delay per fault; variants give a distribution, on
    different arrivals, prompts and sampling, with the same faults at the same times.
    """
    if k == 0:
        return scenario
    t = scenario.trace
    start = t.start + _VARIANT_SHIFT_S * k
    span = _trace_span(*t.source())
    if span is not None:
        # Wrap within the trace, keeping at least half of it (or all the run needs) after the start.
        start %= max(span - (t.duration or scenario.duration * t.speedup), span / 2)
    trace = t.model_copy(update={"start": start})
    return scenario.model_copy(update={"name": f"{scenario.name}-v{k}", "seed": scenario.seed + k, "trace": trace})


_trace_span = functools.cache(trace_span)


def evaluate(names: Sequence[str] | None, workdir: Path,
             progress: Callable[[str, ScenarioResult | None], None] | None = None, jobs: int = 1,
             repeats: int = 1) -> EvalReport:
    """Evaluate the named scenarios (all shipped ones by default), each into its own database.

    `repeats` runs each scenario that many times as `variant`s. With `jobs` > 1 the runs go in that
    many processes at once (a soak of 500 engine-hours keeps one core busy for half an hour); the
    report lists them in the order asked for.
    """
    scenarios = [variant(load_scenario(name), k) for name in names or builtin_scenarios() for k in range(repeats)]
    for sc in scenarios:  # every file and trace window is checked before anything runs
        sc.check()
    runs = [(sc.name, functools.partial(_evaluate_file, sc, workdir / f"eval-{sc.name}.db")) for sc in scenarios]
    ordered = run_all(runs, jobs, progress)
    return EvalReport(ordered, score(ordered))


def run_all(runs: Sequence[tuple[str, Callable[[], R]]], jobs: int,
            progress: Callable[[str, R | None], None] | None = None) -> list[R]:
    """Call each named run (picklable: each has its own database), `jobs` at once in their own
    processes, reporting each as it starts and ends; the results in the order given."""
    results: dict[int, R] = {}
    if jobs <= 1:
        for i, (name, call) in enumerate(runs):
            if progress is not None:
                progress(name, None)
            results[i] = call()
            if progress is not None:
                progress(name, results[i])
        return [results[i] for i in range(len(runs))]
    # spawn: a forked child would inherit the parent's threads and open sockets half-copied.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(call): i for i, (_, call) in enumerate(runs)}
        if progress is not None:
            for name, _ in runs:
                progress(name, None)
        for future in as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if progress is not None:
                progress(runs[i][0], results[i])
    return [results[i] for i in range(len(runs))]
