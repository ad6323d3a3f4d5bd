"""`fleetctl autoscale eval`: the autoscaler against static, HPA-style and oracle provisioning, on one replay.

Every strategy replays the same trace through the same simulated fleet (same seed, start-up time
and drain) and the full loop in act mode, with the same rails, starting at the size the first
minute needs (static: at the peak); only what sets replica counts differs:

- static: every pool at the peak the oracle needed, all the time (no sizer);
- hpa: `policies.hpa.HpaRule`, KV usage 0.8 or 5 waiting per replica, HPA's stabilisation windows;
- ours: `policies.autoscale.Autoscaler`, from the fleet file's `autoscaling` section;
- oracle: knows the future. Per pool and minute it needs the fewest engines with which a fleet that
  had that many all along met the pool's SLOs in that minute (found by replaying the trace once per
  size, without the control plane, the other pools at their maximum); its schedule asks, every
  scrape interval, for the largest need from then until one start-up time (and a scrape) ahead, so
  engines are ready when the load comes, and lets them go the moment no minute ahead needs them. It
  needs no control plane (its schedule is known) and is applied to the simulated fleet directly,
  with the same start-up and drain. The limit no real autoscaler reaches, though not a strict lower
  bound: a minute's need is judged one size at a time, with caches as warm as a fleet of that size
  keeps them, so the moves between sizes can cost it minutes;
- causal: what an autoscaler that cannot see ahead could do with a perfect capacity model. It knows
  every finished minute's need exactly (the oracle's), and holds the most the last `window` minutes
  needed plus `extra` engines, asked for at once (engines start in the start-up time, as every
  strategy's do); of the rules with a window of 1 to 15 minutes and 0 to 3 engines extra, the one
  that keeps the attainment goal most cheaply when each minute's need is compared with what the rule
  holds then (chosen in hindsight, so it is better than any one rule fixed in advance), replayed like
  the others. A reference for what the load's own unpredictability costs, not a bound on ours: ours
  reads the minute in progress from its scrapes, which this rule does not.

Peers (`fleetctl autoscale eval --peers dynamo`) run beside them on the same replays, one run per
configuration tried; the table shows each peer by its best configuration (`best_configuration`).

Measured from the simulated engines themselves (not from the scrape the strategies act on): per
minute, each pool's TTFT p95 and TPOT p95 from its engines' histogram deltas, as PromQL's
`histogram_quantile` computes them; a minute is within SLO when every pool's are; GPU-hours count
every engine from the moment it is asked for (a starting engine holds its GPU) until it is gone.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from collectors.derive import histogram_quantile
from controlplane.autoscaling import build_sizer
from controlplane.config import FleetConfig, Mode, Policies, Rails
from controlplane.evaluation import run_all
from controlplane.goals import Goal, at_least, at_most, goals_json
from controlplane.loop import TickReport
from controlplane.sim.engine import HISTOGRAMS
from controlplane.sim.fleet import SimFleet
from controlplane.sim.run import ScenarioRun, run_scenario
from controlplane.sim.scenario import SCALE_STEP, FaultTimeline, PoolModel, Scenario, load_scenario
from policies.autoscale import CAPACITY_FINDINGS, AutoscaleSettings, Sizer
from policies.hpa import HpaRule

__all__ = ["STRATEGIES", "TRACES", "AutoscaleReport", "MinuteMeter", "Peer", "StaticReplay", "StrategyRun",
           "best_configuration", "evaluate_autoscaling", "peer_goal", "replay", "start_sizes", "summarise", "within_slo"]

STRATEGIES = ("static", "hpa", "ours", "causal", "oracle")
CAUSAL_WINDOWS = range(1, 16)  # minutes of finished needs the causal rule holds the most of
CAUSAL_EXTRA = range(0, 4)  # engines it holds beyond that
# The traces of the evaluation, each a scenario with the fleet it runs through.
TRACES = {
    "azure-conv": "autoscale/azure-conv",
    "azure-code": "autoscale/azure-code",
    "mooncake-conversation": "autoscale/mooncake-conversation",
    "servegen-day": "autoscale/servegen-day",
}
METRICS = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:request_time_per_output_token_seconds"}
ATTAINMENT_GOAL = 0.99
VS_HPA_GOAL = 0.75  # at least 25 % fewer GPU-hours than the HPA-style rule
VS_ORACLE_GOAL = 1.10


def eval_rails() -> Rails:
    """The rails every strategy runs under: replica changes as fast as a Kubernetes HPA makes them."""
    return Rails(cooldown=60.0, max_step=SCALE_STEP, max_actions_per_hour=240, verify_after=600.0)


# measuring ----------------------------------------------------------------------------------------


class MinuteMeter:
    """Per pool and minute, the TTFT and TPOT histogram deltas of the pool's engines, and GPU-seconds held."""

    def __init__(self, fleet: SimFleet, start: float, gpus: Mapping[str, int]) -> None:
        self.start, self.gpus = start, dict(gpus)
        self._last: dict[tuple[str, str], np.ndarray] = {}
        self._t = start
        self.counts: dict[tuple[str, str, int], np.ndarray] = {}
        self.gpu_s = 0.0
        self.replicas: list[tuple[float, dict[str, int]]] = []
        self.arrivals: dict[int, int] = {}  # requests that arrived, per minute
        self._arrived = fleet.arrived
        fleet.take_departed()  # from now on

    def sample(self, fleet: SimFleet) -> None:
        """Count what finished since the last sample and the GPUs held meanwhile: each engine from when it was asked
        for (or the last sample) until now, or until it left, with what it served before it left."""
        now = fleet.now
        minute = max(0, math.ceil((now - self.start) / 60.0) - 1)
        held = {pool: len(ms) for pool, ms in fleet.members.items()}
        counted = [(pool, m) for pool, ms in fleet.members.items() for m in ms] + fleet.take_departed()
        self.gpu_s += sum(self.gpus.get(pool, 1) * max(0.0, (m.gone_at if m.gone_at is not None else now)
                                                         - max(self._t, m.asked_at)) for pool, m in counted)
        self._t = now
        self.replicas.append((now - self.start, held))
        self.arrivals[minute] = self.arrivals.get(minute, 0) + fleet.arrived - self._arrived
        self._arrived = fleet.arrived
        for pool, m in counted:
            if m.ready_at > now:
                continue
            for metric, hist in METRICS.items():
                counts = np.sum([r.hists[hist].counts for r in m.engine.ranks], axis=0)
                key = (m.pod, metric)
                last = self._last.pop(key, None) if m.gone_at is not None else self._last.get(key)
                # Not `histogram_increase`: these are the engine's own per-bucket counts, read every scrape for
                # every engine, and an engine's first reading is all it served since it became ready.
                delta = counts if last is None or (counts < last).any() else counts - last
                if m.gone_at is None:
                    self._last[key] = counts
                slot = (pool, metric, minute)
                self.counts[slot] = self.counts.get(slot, 0) + delta

    def p95(self, pool: str, metric: str, minute: int) -> float | None:
        """The minute's p95 of one pool's metric; None when nothing finished."""
        counts = self.counts.get((pool, metric, minute))
        if counts is None or float(np.sum(counts)) <= 0:
            return None
        bounds = (*HISTOGRAMS[METRICS[metric]], math.inf)
        return histogram_quantile(0.95, list(zip(bounds, np.cumsum(counts), strict=True)))


def within_slo(meter: MinuteMeter, pool: PoolModel, minute: int) -> bool:
    """Whether the pool's TTFT and TPOT p95 met its SLOs in that minute (a minute where nothing finished does)."""
    for metric, slo in (("ttft", pool.slo.ttft_p95), ("tpot", pool.slo.tpot_p95)):
        if slo is None:
            continue
        value = meter.p95(pool.name, metric, minute)
        if value is not None and value > slo:
            return False
    return True


# the oracle -----------------------------------------------------------------------------------------


def resized(scenario: Scenario, replicas: Mapping[str, int]) -> Scenario:
    """The scenario with its pools starting at these sizes."""
    pools = [p.model_copy(update={"replicas": replicas.get(p.name, p.replicas)}) for p in scenario.fleet.pools]
    return scenario.model_copy(update={"fleet": scenario.fleet.model_copy(update={"pools": pools})})


def pool_ceiling(p: PoolModel) -> int:
    """The most engines any strategy may give the pool."""
    return p.max_replicas or p.replicas * 2


def replay(scenario: Scenario, replicas: Mapping[str, int],
           schedule: Callable[[float], Mapping[str, int]] | None = None) -> tuple[MinuteMeter, int]:
    """Replay the trace without the control plane: pools at fixed sizes, or set every scrape interval to
    what `schedule` says for that moment (seconds from the start). Returns the meter and the scale events."""
    sized = resized(scenario, replicas)
    fleet = SimFleet(sized.fleet_spec(), sized.requests(), now=0.0)
    meter = MinuteMeter(fleet, 0.0, {p.name: p.gpus for p in scenario.fleet.pools})
    faults = FaultTimeline(scenario.faults, 0.0)
    interval, events = scenario.scrape_interval, 0
    for i in range(1, int(scenario.duration // interval) + 1):
        for pool, n in (schedule((i - 1) * interval) if schedule else {}).items():
            if fleet.desired[pool] != n:
                fleet.scale(pool, n)
                events += 1
        faults.advance(fleet, i * interval)
        fleet.advance_to(i * interval)
        meter.sample(fleet)
    return meter, events


def oracle_needs(scenario: Scenario, jobs: int = 1,
                 progress: Callable[[str, Any], None] | None = None) -> dict[str, list[int]]:
    """Per pool and minute, the fewest engines that met the pool's SLOs in that minute.

    Sizes are tried from one up, `jobs` at a time, until one meets the SLOs in every minute (no
    minute needs more) or the pool's maximum; the other pools stay at their maximum meanwhile.
    """
    minutes = math.ceil(scenario.duration / 60.0)
    ceiling = {p.name: pool_ceiling(p) for p in scenario.fleet.pools}
    needs: dict[str, list[int]] = {}
    for p in scenario.fleet.pools:
        need: list[int | None] = [None] * minutes
        n = 1
        while n <= ceiling[p.name] and any(x is None for x in need):
            sizes = list(range(n, min(ceiling[p.name], n + max(1, jobs) - 1) + 1))
            meters = run_all([(f"{scenario.name}: {p.name} at {k}", StaticReplay(scenario, {**ceiling, p.name: k}))
                              for k in sizes], jobs, progress)
            for k, meter in zip(sizes, meters, strict=True):
                for m in range(minutes):
                    if need[m] is None and within_slo(meter, p, m):
                        need[m] = k
            n = sizes[-1] + 1
        needs[p.name] = [ceiling[p.name] if x is None else x for x in need]
    return needs


@dataclass(frozen=True)
class StaticReplay:
    """One replay with the pools fixed at `replicas`, picklable for a worker process."""

    scenario: Scenario
    replicas: dict[str, int]

    def __call__(self) -> MinuteMeter:
        return replay(self.scenario, self.replicas)[0]


@dataclass(frozen=True)
class OracleSchedule:
    """Replica counts read off the future: per pool, the largest need from now until a start-up time ahead."""

    needs: dict[str, list[int]]
    lead_s: dict[str, float]

    def __call__(self, elapsed: float) -> dict[str, int]:
        out = {}
        for pool, need in self.needs.items():
            first, last = int(elapsed // 60), int((elapsed + self.lead_s[pool]) // 60)
            out[pool] = max(need[first:last + 1] or need[-1:])
        return out


@dataclass(frozen=True)
class CausalRule:
    """Replica counts from the past only: per pool, the most any of the last `window` finished minutes needed, plus
    `extra` engines (before the first minute finishes, the common start)."""

    needs: dict[str, list[int]]
    window: int
    extra: int
    start: dict[str, int]
    ceiling: dict[str, int]

    def __call__(self, elapsed: float) -> dict[str, int]:
        done = int(elapsed // 60)
        return {pool: min(self.ceiling[pool], max(need[max(0, done - self.window):done]) + self.extra)
                if done else self.start[pool] for pool, need in self.needs.items()}


def causal_rule(scenario: Scenario, needs: Mapping[str, list[int]]) -> CausalRule:
    """The causal rule that keeps the attainment goal (else the most minutes) with the fewest GPU-seconds, judged by
    each minute's need against the ready engines the rule holds through it (`_held`)."""
    start = start_sizes(scenario, needs)
    ceiling = {p.name: pool_ceiling(p) for p in scenario.fleet.pools}
    minutes = len(next(iter(needs.values()), []))
    best: tuple[tuple[bool, int, float], CausalRule] | None = None
    for window in CAUSAL_WINDOWS:
        for extra in CAUSAL_EXTRA:
            rule = CausalRule(dict(needs), window, extra, start, ceiling)
            held, cost = _held(scenario, rule, minutes)
            kept = sum(all(held[p][m] >= needs[p][m] for p in needs) for m in range(minutes))
            short = kept < ATTAINMENT_GOAL * minutes
            # Those that keep the goal by cost alone; short of it, the most minutes first.
            key = (short, -kept if short else 0, cost)
            if best is None or key < best[0]:
                best = (key, rule)
    assert best is not None
    return best[1]


def _held(scenario: Scenario, rule: Callable[[float], Mapping[str, int]], minutes: int
          ) -> tuple[dict[str, list[int]], float]:
    """Per pool and minute, the fewest ready engines `rule` holds through it when applied every scrape interval as
    the replay applies it (an engine asked for is ready a start-up time later; a scale-down removes the newest at
    once, starting ones first), and the GPU-seconds it holds meanwhile. What it asked a start-up time before is not
    what it holds: a lower ask since has removed some."""
    pools = {p.name: p for p in scenario.fleet.pools}
    interval = scenario.scrape_interval
    ready_at: dict[str, list[float]] = {pool: [0.0] * n for pool, n in rule(0.0).items()}
    held = {pool: [math.inf] * minutes for pool in ready_at}
    cost = 0.0
    for i in range(int(scenario.duration // interval)):
        t = i * interval
        for pool, n in rule(t).items():
            engines = ready_at[pool]
            engines.sort()
            if n > len(engines):
                engines += [t + pools[pool].startup] * (n - len(engines))
            del engines[n:]
            m = min(minutes - 1, int(t // 60))
            held[pool][m] = min(held[pool][m], sum(1 for r in engines if r <= t))
            cost += len(engines) * pools[pool].gpus * interval
    return {pool: [int(h) if math.isfinite(h) else 0 for h in hs] for pool, hs in held.items()}, cost


def start_sizes(scenario: Scenario, needs: Mapping[str, list[int]]) -> dict[str, int]:
    """The fleet every dynamic strategy starts with, the oracle's own first step: per pool, the most any minute within
    the first start-up time needs. A running fleet would be sized for the load about to come; no strategy could have
    planned for it before the trace began, and one that starts short pays the start-up time in missed minutes."""
    return OracleSchedule(dict(needs), _leads(scenario))(0.0)


def _leads(scenario: Scenario) -> dict[str, float]:
    """Per pool, how far ahead the oracle asks: its start-up time and one scrape."""
    return {p.name: p.startup + scenario.scrape_interval for p in scenario.fleet.pools}


# one strategy ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class StrategyRun:
    """One strategy on one trace: GPU-hours, minutes within both SLOs, scale events."""

    trace: str
    strategy: str
    gpu_hours: float
    minutes: int
    minutes_within: int
    scale_events: int
    wall_s: float
    replicas: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (seconds, engines held per pool)
    within: list[bool] = field(default_factory=list)  # per minute
    arrivals: list[int] = field(default_factory=list)  # requests per minute: the load

    @property
    def attainment(self) -> float:
        """Share of minutes within both SLOs."""
        return self.minutes_within / self.minutes if self.minutes else 1.0


def _config(scenario: Scenario, db_url: str, settings: AutoscaleSettings, strategy: str) -> FleetConfig:
    base = scenario.controlplane_config(db_url, Mode.ACT)
    pools = [p.model_copy(update={"replicas": p.replicas.model_copy(update={"max": pool_ceiling(m)})})
             for p, m in zip(base.pools, scenario.fleet.pools, strict=True)]
    # Detection runs as it would beside any sizer; only SLO burn and saturation, whose findings are the
    # autoscaler's inputs: nothing else may change the fleet during the comparison.
    only = {name: getattr(base.policies, name).model_copy(update={"enabled": name in CAPACITY_FINDINGS})
            for name in type(base.policies).model_fields}
    return base.model_copy(update={
        "pools": pools, "rails": eval_rails(), "policies": Policies(**only),
        "autoscaling": settings.model_copy(update={"enabled": strategy == "ours"})})


@dataclass(frozen=True)
class _Strategy:
    """One strategy's run, picklable for a worker process."""

    trace: str
    scenario: Scenario
    strategy: str
    needs: dict[str, list[int]]
    settings: AutoscaleSettings

    def __call__(self) -> StrategyRun:
        return asyncio.run(self._run())

    async def _run(self) -> StrategyRun:
        peak = {pool: max(n) for pool, n in self.needs.items()}
        if self.strategy in ("oracle", "causal"):
            # Neither needs a control plane: its schedule is known, so it is applied as it falls due.
            schedule: Callable[[float], dict[str, int]] = (
                OracleSchedule(self.needs, _leads(self.scenario)) if self.strategy == "oracle"
                else causal_rule(self.scenario, self.needs))
            wall = time.perf_counter()
            meter, events = replay(self.scenario, schedule(0.0), schedule)
            return self._result(meter, events, time.perf_counter() - wall)
        # Static holds the peak; the others start where the oracle does.
        scenario = resized(self.scenario, peak if self.strategy == "static" else start_sizes(self.scenario, self.needs))
        gpus = {p.name: p.gpus for p in scenario.fleet.pools}
        meters: list[MinuteMeter] = []
        events = 0

        def on_tick(run: ScenarioRun, report: TickReport) -> None:
            nonlocal events
            if not meters:
                meters.append(MinuteMeter(run.fleet, run.start, gpus))
            meters[0].sample(run.fleet)
            events += sum(1 for a in report.actions if a.kind == "scale_pool")

        with tempfile.TemporaryDirectory() as tmp:
            db = f"sqlite:///{Path(tmp) / 'run.db'}"
            config = _config(scenario, db, self.settings, self.strategy)
            sizer: Sizer | None = build_sizer(config) if self.strategy == "ours" else (
                HpaRule() if self.strategy == "hpa" else None)
            run = await run_scenario(scenario, db, mode="act", config=config, sizer=sizer, on_tick=on_tick, start=0.0)
        return self._result(meters[0], events, run.wall_s)

    def _result(self, meter: MinuteMeter, events: int, wall_s: float) -> StrategyRun:
        return summarise(self.trace, self.strategy, self.scenario, meter, events, wall_s)


def summarise(trace: str, strategy: str, scenario: Scenario, meter: MinuteMeter, events: int,
              wall_s: float) -> StrategyRun:
    """A strategy's replay judged minute by minute against every pool's SLOs."""
    minutes = math.ceil(scenario.duration / 60.0)
    within = [all(within_slo(meter, p, m) for p in scenario.fleet.pools) for m in range(minutes)]
    return StrategyRun(trace, strategy, meter.gpu_s / 3600.0, minutes, sum(within), events, wall_s,
                       meter.replicas[::4], within, [meter.arrivals.get(m, 0) for m in range(minutes)])


# the report -----------------------------------------------------------------------------------------


class Peer(Protocol):
    """Another project's autoscaler, run beside the strategies: one replay per configuration it is tried in."""

    @property
    def name(self) -> str:
        """The peer's name in the table."""
        ...

    def runs(self, trace: str, scenario: Scenario, needs: Mapping[str, list[int]]) -> Sequence[Callable[[], StrategyRun]]:
        """Picklable replays, each returning a run whose strategy is `<name>:<configuration>`."""
        ...


def best_configuration(runs: Sequence[StrategyRun]) -> StrategyRun:
    """A peer's best configuration on a trace: the cheapest that keeps the attainment goal, else the most attaining."""
    keeping = [r for r in runs if r.attainment >= ATTAINMENT_GOAL]
    if keeping:
        return min(keeping, key=lambda r: r.gpu_hours)
    return max(runs, key=lambda r: (r.attainment, -r.gpu_hours))


@dataclass(slots=True)
class AutoscaleReport:
    """Every strategy on one trace, with the oracle's needs, any peers' configurations and the goals."""

    trace: str
    runs: list[StrategyRun]
    needs: dict[str, list[int]]
    peers: dict[str, list[StrategyRun]] = field(default_factory=dict)  # peer -> one run per configuration

    def run(self, strategy: str) -> StrategyRun:
        """The run of one strategy, or a peer's best configuration."""
        if strategy in self.peers:
            return best_configuration(self.peers[strategy])
        return next(r for r in self.runs if r.strategy == strategy)

    def _row(self, r: StrategyRun, oracle: float | None, strategy: str | None = None) -> dict[str, Any]:
        name, _, configuration = r.strategy.partition(":")
        return {"strategy": strategy or name, "configuration": configuration or None,
                "gpu_hours": round(r.gpu_hours, 3), "attainment": round(r.attainment, 4),
                "minutes_within": r.minutes_within, "minutes": r.minutes, "scale_events": r.scale_events,
                "vs_oracle": round(r.gpu_hours / oracle, 3) if oracle else None, "wall_s": round(r.wall_s, 1)}

    def rows(self) -> list[dict[str, Any]]:
        """The table: per strategy (a peer by its best configuration), GPU-hours, attainment, scale events,
        GPU-hours over the oracle's."""
        oracle = self.run("oracle").gpu_hours if any(r.strategy == "oracle" for r in self.runs) else None
        shown = [r.strategy for r in self.runs]
        order = shown[:shown.index("ours")] + list(self.peers) + shown[shown.index("ours"):] if "ours" in shown \
            else shown + list(self.peers)
        return [self._row(self.run(s), oracle, s) for s in order]

    def peer_rows(self) -> list[dict[str, Any]]:
        """Every configuration of every peer, as rows of the table."""
        oracle = self.run("oracle").gpu_hours if any(r.strategy == "oracle" for r in self.runs) else None
        return [self._row(r, oracle) for runs in self.peers.values() for r in runs]

    def goals(self) -> list[Goal]:
        """At least 99 % of minutes within both SLOs, 25 % fewer GPU-hours than HPA at equal or better
        attainment, at most 1.10 times the oracle's GPU-hours; against each peer's best configuration, equal
        or better attainment with fewer GPU-hours."""
        ours, hpa, oracle = self.run("ours"), self.run("hpa"), self.run("oracle")
        vs_hpa = ours.gpu_hours / hpa.gpu_hours if hpa.gpu_hours else None
        goals = [
            at_least(f"{self.trace}: share of minutes within both SLOs", round(ours.attainment, 4), ATTAINMENT_GOAL),
            at_least(f"{self.trace}: attainment against the HPA-style rule's", round(ours.attainment - hpa.attainment, 4),
                     0.0),
            at_most(f"{self.trace}: GPU-hours over the HPA-style rule's", None if vs_hpa is None else round(vs_hpa, 3),
                    VS_HPA_GOAL),
            at_most(f"{self.trace}: GPU-hours over the oracle's",
                    round(ours.gpu_hours / oracle.gpu_hours, 3) if oracle.gpu_hours else None, VS_ORACLE_GOAL),
        ]
        for peer in self.peers:
            best = self.run(peer)
            goals.append(at_least(f"{self.trace}: attainment against {peer}'s best configuration",
                                  round(ours.attainment - best.attainment, 4), 0.0))
            goals.append(at_most(f"{self.trace}: GPU-hours over {peer}'s best configuration's",
                                 round(ours.gpu_hours / best.gpu_hours, 3) if best.gpu_hours else None, 0.999))
        return goals

    def beats(self, peer: str) -> bool:
        """Whether ours keeps equal or better attainment than the peer's best configuration with fewer GPU-hours."""
        ours, best = self.run("ours"), self.run(peer)
        return ours.attainment >= best.attainment and ours.gpu_hours < best.gpu_hours

    def as_json(self) -> dict[str, Any]:
        """The report as JSON: the goals, the table, every peer configuration, the oracle's needs and each run's
        timeline."""
        return {"goals": goals_json(self.goals()), "trace": self.trace, "strategies": self.rows(),
                "peer_configurations": self.peer_rows(), "oracle_needs": self.needs,
                "runs": [asdict(r) for r in self.runs] + [asdict(r) for runs in self.peers.values() for r in runs]}


def peer_goal(reports: Sequence[AutoscaleReport], peer: str, at_least_traces: int = 3) -> Goal:
    """Across traces: on how many ours beats the peer's best configuration (equal or better attainment, fewer
    GPU-hours)."""
    won = sum(1 for r in reports if peer in r.peers and r.beats(peer))
    return at_least(f"traces where ours beats {peer}'s best configuration", won, min(at_least_traces, len(reports)))


def evaluate_autoscaling(trace: str, *, minutes: float | None = None, jobs: int = 1,
                         settings: AutoscaleSettings | None = None, peers: Sequence[Peer] = (),
                         progress: Callable[[str, Any], None] | None = None) -> AutoscaleReport:
    """Run every strategy (and every peer configuration) on one trace, a name of `TRACES` or a scenario, and judge them
    (ours with `settings`). ValueError for settings the replay's scrapes cannot serve, before anything runs."""
    scenario = load_scenario(TRACES.get(trace, trace))
    if minutes is not None:
        scenario = scenario.model_copy(update={"duration": minutes * 60.0})
    settings = settings or AutoscaleSettings(enabled=True)
    if problems := settings.problems(scenario.scrape_interval):
        raise ValueError(f"{trace} is scraped every {scenario.scrape_interval:g}s: "
                         + "; ".join(f"autoscaling.{name}: {why}" for name, why in problems))
    needs = oracle_needs(scenario, jobs, progress)
    tasks: list[tuple[str, Callable[[], StrategyRun]]] = [
        (f"{trace}: {s}", _Strategy(trace, scenario, s, needs, settings)) for s in STRATEGIES]
    for peer in peers:
        tasks += [(f"{trace}: {peer.name} #{i}", run) for i, run in enumerate(peer.runs(trace, scenario, needs))]
    done = run_all(tasks, jobs, progress)
    report = AutoscaleReport(trace, done[:len(STRATEGIES)], needs)
    for run in done[len(STRATEGIES):]:
        report.peers.setdefault(run.strategy.partition(":")[0], []).append(run)
    return report
