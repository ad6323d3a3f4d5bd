"""`fleetctl gate eval`: the canary judge against Kayenta's and Argo's, on rollouts in the simulated fleet.

Each run replays the `gate/canary-pools` scenario (Azure conversations through twenty prefill and
twenty decode engines) from another minute of the trace, and after a two-minute warm-up:

- regression runs roll one engine (a 5 % canary) or four (20 %) of one pool out as a version whose
  forward passes are 5, 10 or 20 % slower: in the decode pool that is TPOT, in the prefill pool TTFT;
- A/A runs roll nothing out: every engine of both pools, and every block of four, takes a turn as
  the "canary" against the rest of its pool, so one run gives fifty A/A gates (they share a fleet,
  so they are not independent; the runs are).

Every step (30 s) each arm's histogram and request-count deltas are read from the simulated
engines, as the gate reads them from the pods; then the three judges see the same intervals and
are consulted after every step, as they would be during a rollout, until each decides or the
window (20 min) ends. Reported per judge: the share of regressions failed (within 10 minutes, and
at all), the median minutes to a fail, and the share of A/A gates failed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controlplane.evaluation import run_all
from controlplane.gate import HISTOGRAMS
from controlplane.goals import Goal, at_least, at_most, goals_json
from controlplane.sim.engine import SimEngine
from controlplane.sim.fleet import Member, SimFleet
from controlplane.sim.scenario import Scenario, load_scenario
from policies.canary import ERRORS, Dist, GateSettings, Interval, MetricRule, Outcome, Scale, judge
from policies.canary_reference import kayenta_judge, threshold_judge

__all__ = ["JUDGES", "GateEvalReport", "evaluate_gate", "pool_settings"]

SCENARIO = "gate/canary-pools"
JUDGES = ("ours", "kayenta", "argo")
SIZES = (0.05, 0.10, 0.20)
SHARES = (0.05, 0.20)
WARMUP_S = 120.0
WINDOW_S = 1200.0
DEADLINE_S = 600.0  # the goal's "within 10 minutes"
DETECTION_GOAL = 0.95  # of +10 % TPOT regressions at a 5 % share, failed within 10 minutes
FALSE_FAIL_GOAL = 0.01  # of A/A gates failed under continuous monitoring
FALSE_PASS_GOAL = 0.01  # of regressions of twice the allowance or more passed
POOL_METRIC = {"decode": "tpot", "prefill": "ttft"}


def pool_settings(pool: str) -> GateSettings:
    """The gate's rules for one pool: its own latency (critical), end-to-end latency and errors."""
    metrics: list[MetricRule] = [MetricRule(name=POOL_METRIC[pool], critical=True)]
    if pool == "decode":
        metrics.append(MetricRule(name="e2e", allowed=0.10))
    metrics.append(MetricRule(name=ERRORS, scale=Scale.DIFFERENCE, allowed=0.01, critical=True, min_count=50))
    return GateSettings(metrics=tuple(metrics), step=30.0, max_window=WINDOW_S)


_FAMILY = {name: HISTOGRAMS[name][0] for name in ("ttft", "tpot", "e2e")}


@dataclass(slots=True)
class _Snapshot:
    """One engine's cumulative histograms and finished requests at one moment."""

    hists: dict[str, tuple[list[float], float]]
    finished: float
    errors: float


def _snapshot(engine: SimEngine) -> _Snapshot:
    hists: dict[str, tuple[list[float], float]] = {}
    finished = errors = 0.0
    for rank in engine.ranks:
        for name, fam in _FAMILY.items():
            h = rank.hists[fam]
            counts, total = hists.get(name, ([0.0] * len(h.counts), 0.0))
            hists[name] = ([a + b for a, b in zip(counts, h.counts, strict=True)], total + h.sum)
        finished += sum(rank.finished.values())
        errors += rank.finished.get("error", 0.0)
    return _Snapshot(hists, finished, errors)


def _arm(engines: Sequence[SimEngine], before: Mapping[str, _Snapshot], after: Mapping[str, _Snapshot],
         names: Sequence[str]) -> dict[str, Dist]:
    out: dict[str, Dist] = {}
    for name in names:
        if name == ERRORS:
            trials = sum(after[e.pod].finished - before[e.pod].finished for e in engines)
            errors = sum(after[e.pod].errors - before[e.pod].errors for e in engines)
            if trials > 0:
                out[name] = Dist.of_events(errors, trials)
            continue
        bounds = engines[0].ranks[0].hists[_FAMILY[name]].bounds
        counts = [0.0] * (len(bounds) + 1)
        total = 0.0
        for e in engines:
            (c1, s1), (c0, s0) = after[e.pod].hists[name], before[e.pod].hists[name]
            counts = [acc + a - b for acc, a, b in zip(counts, c1, c0, strict=True)]
            total += s1 - s0
        n = sum(counts)
        if n > 0:
            running, cumulative = 0.0, []
            for le, c in zip((*bounds, float("inf")), counts, strict=True):
                running += c
                cumulative.append((le, running))
            out[name] = Dist(n, total, tuple(cumulative))
    return out


@dataclass(frozen=True, slots=True)
class Case:
    """One simulated rollout: which pool, how much slower, how big a share (0 size: an A/A run)."""

    seed: int
    pool: str = "decode"
    size: float = 0.0
    share: float = 0.05

    @property
    def label(self) -> str:
        if not self.size:
            return f"A/A seed {self.seed}"
        return f"{POOL_METRIC[self.pool]} +{self.size:.0%} at {self.share:.0%} seed {self.seed}"


@dataclass(slots=True)
class Decision:
    """One gate's answer: which judge, on which case and arm, what, and after how many seconds."""

    judge: str
    pool: str
    size: float
    share: float
    seed: int
    outcome: str
    after_s: float


def _decide(intervals: Sequence[Interval], settings: GateSettings) -> dict[str, tuple[Outcome, float]]:
    """Each judge consulted after every step: its first decision and when."""
    out: dict[str, tuple[Outcome, float]] = {}
    for k in range(1, len(intervals) + 1):
        prefix, final = intervals[:k], k == len(intervals)
        elapsed = prefix[-1].end - prefix[0].start
        if "ours" not in out and (v := judge(prefix, settings, final=final)).decided:
            out["ours"] = (v.outcome, elapsed)
        for name, fn in (("kayenta", kayenta_judge), ("argo", threshold_judge)):
            if name not in out and ((o := fn(prefix, settings, final=final)) is not Outcome.INCONCLUSIVE or final):
                out[name] = (o, elapsed)
        if len(out) == len(JUDGES):
            break
    return out


@dataclass(slots=True)
class _Run:
    """A picklable run of one case."""

    scenario: Scenario
    case: Case

    def __call__(self) -> list[Decision]:
        case = self.case
        scenario = self.scenario.model_copy(update={
            "seed": case.seed, "trace": self.scenario.trace.model_copy(update={"start": 60.0 * (case.seed % 30)})})
        fleet = SimFleet(scenario.fleet_spec(), scenario.requests())
        fleet.advance_to(WARMUP_S)
        if case.size:
            fleet.rollout(case.pool, "canary", case.share, slowdown=1.0 + case.size)
        fleet.advance_to(WARMUP_S + 1.0)  # the canaries start (one-second start-up) and the replaced engines drain
        arms = self._arms(fleet)
        settings = {pool: pool_settings(pool) for pool in POOL_METRIC}
        step = settings["decode"].step
        intervals: dict[str, list[Interval]] = {label: [] for label in arms}
        t = fleet.now
        before = {m.engine.pod: _snapshot(m.engine) for ms in fleet.members.values() for m in ms}
        while t < WARMUP_S + 1.0 + WINDOW_S - 1e-9:
            fleet.advance_to(t + step)
            after = {m.engine.pod: _snapshot(m.engine) for ms in fleet.members.values() for m in ms}
            for label, (pool, base, can) in arms.items():
                names = [r.name for r in settings[pool].metrics]
                intervals[label].append(Interval(t, t + step, _arm(base, before, after, names),
                                                 _arm(can, before, after, names)))
            before, t = after, t + step
        out = []
        for label, (pool, _, can) in arms.items():
            share = case.share if case.size else (0.05 if len(can) == 1 else 0.20)
            for name, (outcome, after_s) in _decide(intervals[label], settings[pool]).items():
                out.append(Decision(name, pool, case.size, share, case.seed, outcome.value, after_s))
        return out

    def _arms(self, fleet: SimFleet) -> dict[str, tuple[str, list[SimEngine], list[SimEngine]]]:
        """label -> (pool, baseline engines, canary engines) for every gate this run judges."""
        def live(pool: str) -> list[Member]:
            return [m for m in fleet.members[pool] if not m.draining]
        if self.case.size:
            members = live(self.case.pool)
            can = [m.engine for m in members if m.version != "stable"]
            base = [m.engine for m in members if m.version == "stable"]
            return {"rollout": (self.case.pool, base, can)}
        arms = {}
        for pool in POOL_METRIC:
            engines = [m.engine for m in live(pool)]
            for e in engines:
                arms[f"{pool}/{e.pod}"] = (pool, [x for x in engines if x is not e], [e])
            for j in range(0, len(engines) - 3, 4):
                group = engines[j:j + 4]
                arms[f"{pool}/block{j // 4}"] = (pool, [x for x in engines if x not in group], group)
        return arms


@dataclass(slots=True)
class GateEvalReport:
    """Every decision of every judge, with the table and the goals."""

    decisions: list[Decision]
    seeds: int
    aa_runs: int
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def _of(self, judge_name: str, *, pool: str | None = None, size: float | None = None,
            share: float | None = None) -> list[Decision]:
        return [d for d in self.decisions if d.judge == judge_name and (pool is None or d.pool == pool)
                and (size is None or abs(d.size - size) < 1e-9) and (share is None or abs(d.share - share) < 1e-9)]

    def rows(self) -> list[dict[str, Any]]:
        """Per judge, regression and share: detection within 10 min and at all, median minutes to a fail;
        per judge and share: the A/A false-fail rate."""
        def cells(j: str, ds: list[Decision]) -> dict[str, Any]:
            fails = [d for d in ds if d.outcome == "fail"]
            # `pass`: a regression let through, the gate's other error, the one a rollout pays for.
            return {f"{j}_fail_10m": _share(sum(d.after_s <= DEADLINE_S for d in fails), len(ds)),
                    f"{j}_fail": _share(len(fails), len(ds)),
                    f"{j}_minutes": round(statistics.median(d.after_s for d in fails) / 60, 1) if fails else None,
                    f"{j}_pass": _share(sum(d.outcome == "pass" for d in ds), len(ds))}

        cases: list[tuple[str, str | None, float]] = [
            *((f"{metric} +{size:.0%}", pool, size) for pool, metric in POOL_METRIC.items() for size in SIZES),
            ("A/A", None, 0.0)]
        rows = []
        for case, pool, size in cases:
            for share in SHARES:
                row: dict[str, Any] = {"case": case, "share": share}
                for j in JUDGES:
                    row.update(cells(j, self._of(j, pool=pool, size=size, share=share)))
                row["runs"] = len(self._of("ours", pool=pool, size=size, share=share))
                rows.append(row)
        return rows

    def goals(self) -> list[Goal]:
        """+10 % TPOT at a 5 % share failed within 10 minutes in 95 % of runs; at most 1 % of A/A gates failed; at
        most 1 % of regressions of twice the allowance or more passed."""
        hits = self._of("ours", pool="decode", size=0.10, share=0.05)
        detected = _share(sum(d.outcome == "fail" and d.after_s <= DEADLINE_S for d in hits), len(hits))
        aa = self._of("ours", size=0.0)
        false_fail = _share(sum(d.outcome == "fail" for d in aa), len(aa))
        allowed = pool_settings("decode").metrics[0].allowed  # TTFT's and TPOT's, +5 %
        clear = [d for d in self._of("ours") if d.size >= 2 * allowed - 1e-9]
        false_pass = _share(sum(d.outcome == "pass" for d in clear), len(clear))
        return [at_least("+10% TPOT at a 5% canary share: failed within 10 minutes", detected, DETECTION_GOAL),
                at_most("A/A gates failed under continuous monitoring", false_fail, FALSE_FAIL_GOAL),
                at_most(f"regressions of +{2 * allowed:.0%} and more passed", false_pass, FALSE_PASS_GOAL)]

    def as_json(self) -> dict[str, Any]:
        """The report as JSON: the goals, the table, and every decision."""
        return {"goals": goals_json(self.goals()), "seeds": self.seeds, "aa_runs": self.aa_runs,
                "window_s": WINDOW_S, "step_s": 30.0, "rows": self.rows(), "wall_s": round(self.wall_s, 1),
                "notes": self.notes, "decisions": [asdict(d) for d in self.decisions]}


def _share(n: int, total: int) -> float | None:
    return round(n / total, 4) if total else None


def evaluate_gate(*, seeds: int = 10, aa_runs: int = 10, jobs: int = 1, sizes: Sequence[float] = SIZES,
                  shares: Sequence[float] = SHARES, pools: Sequence[str] = tuple(POOL_METRIC),
                  progress: Callable[[str, Any], None] | None = None) -> GateEvalReport:
    """Run every regression case `seeds` times and `aa_runs` A/A runs, then judge each with every judge."""
    scenario = load_scenario(SCENARIO)
    cases = [Case(seed, pool, size, share) for pool in pools for size in sizes for share in shares
             for seed in range(seeds)]
    cases += [Case(1000 + seed) for seed in range(aa_runs)]
    began = time.monotonic()
    results = run_all([(c.label, _Run(scenario, c)) for c in cases], jobs, progress)
    report = GateEvalReport([d for r in results for d in r], seeds, aa_runs)
    report.wall_s = time.monotonic() - began
    return report
