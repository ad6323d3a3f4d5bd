"""Where a tick's numbers come from: scraping the targets ourselves, or a Prometheus that does.

Both return an `Observation`; the loop does not know which one it has. Errors of the Prometheus
API are turned into `MetricSourceUnavailable` here, at the boundary, so the loop handles them as
any other failed tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from catalog.fleet import Role, Source
from collectors.pipeline import SignalDeriver
from collectors.prometheus_api import PrometheusError, PrometheusSource
from collectors.scraper import Scraper
from collectors.types import Objectives, ScrapeResult, Signal, Target, TargetHealth
from controlplane.actuators.base import TargetSource
from controlplane.errors import FleetError

__all__ = ["MetricSource", "MetricSourceUnavailable", "Observation", "PrometheusApiSource", "PrometheusTargets",
           "ScrapeSource"]


# Failed scrapes in a row after which a target counts as down: one timeout is noise.
DOWN_AFTER = 2


class MetricSourceUnavailable(FleetError):
    """The source of numbers (a Prometheus API) could not answer this tick."""

    exit_code = 4


@dataclass(slots=True)
class Observation:
    """One tick's signals, plus per-target outcomes where the control plane scraped itself."""

    signals: list[Signal] = field(default_factory=list)
    results: list[ScrapeResult] = field(default_factory=list)
    health: dict[str, TargetHealth] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    parse_errors: dict[str, list[str]] = field(default_factory=dict)  # a sample of each target's
    missing: dict[str, list[str]] = field(default_factory=dict)
    unfit: dict[str, dict[str, str]] = field(default_factory=dict)  # per pool, inputs the source says are unfit
    unfit_everywhere: dict[str, str] = field(default_factory=dict)  # inputs unfit in every pool (a fleet-wide query)
    parse_error_counts: dict[str, int] = field(default_factory=dict)  # how many each target had, past the sample

    def answering_engines(self) -> dict[str, set[str]]:
        """Per pool scraped here, the engine pods whose vLLM target answers (down twice in a row is down,
        as for `unfit_inputs`); a pod no longer discovered is in none."""
        out: dict[str, set[str]] = {}
        for r in self.results:
            if r.target.source != Source.VLLM:
                continue
            pods = out.setdefault(r.target.pool, set())
            health = self.health.get(r.target.key)
            if r.ok or health is None or health.consecutive_failures < DOWN_AFTER:
                pods.add(r.target.pod)
        return out

    def unfit_inputs(self, pools: Sequence[str]) -> dict[str, dict[str, str]]:
        """What this observation says cannot be trusted, per pool, with why: a producer when one of
        the pool's targets is down (twice in a row: one timeout is noise), was not read within the
        round, sent malformed lines, or lacks an expected family or a value that is a number, a signal
        when its Prometheus query matches nothing (`pools` for the fleet-wide ones), and what the source
        itself says (`unfit`)."""
        out: dict[str, dict[str, str]] = {pool: dict(inputs) for pool, inputs in self.unfit.items()}
        for pool in pools if self.unfit_everywhere else ():
            out.setdefault(pool, {}).update(self.unfit_everywhere)
        for r in self.results:
            health = self.health.get(r.target.key)
            if r.late:  # up, as far as anyone knows, but its pool's sums lack it this tick
                out.setdefault(r.target.pool, {}).setdefault(r.target.source, f"target {r.target.key}: {r.error}")
            elif not r.ok and (health is None or health.consecutive_failures >= DOWN_AFTER):
                out.setdefault(r.target.pool, {})[r.target.source] = \
                    f"target {r.target.key} is down ({r.error or 'scrape failed'})"
        for key, errs in self.parse_errors.items():
            if not key.startswith("prometheus/"):  # a malformed line's value is missing from its pool's sums
                pool, pod, source = key.split("/", 2)
                count = self.parse_error_counts.get(key, len(errs))
                out.setdefault(pool, {}).setdefault(source, f"{pod}: {count} malformed line(s), first: {errs[0]}")
        for key, names in self.missing.items():
            head, _, rest = key.partition("/")
            if head == "prometheus":
                for pool in [rest.removeprefix("pool/")] if rest.startswith("pool/") else pools:
                    for name in names:
                        out.setdefault(pool, {})[name] = "no series match its Prometheus query"
            else:
                pool, pod, source = key.split("/", 2)
                out.setdefault(pool, {})[source] = f"{pod} lacks {', '.join(names)}"
        return out


class MetricSource(Protocol):
    """Produces the signals of one tick at time `now`."""

    async def observe(self, now: float) -> Observation:
        """Collect and derive; raise a FleetError when nothing could be observed."""
        ...


class ScrapeSource:
    """The control plane scrapes every target itself and derives the signals (with each pool's share of requests over
    its `objectives`)."""

    def __init__(self, targets: TargetSource, scraper: Scraper, objectives: Mapping[str, Objectives] | None = None) -> None:
        self.targets = targets
        self.scraper = scraper
        self.deriver = SignalDeriver(objectives)

    async def observe(self, now: float) -> Observation:
        listed = list(await self.targets.targets())
        results = await self.scraper.scrape(listed, now)
        out = self.deriver.derive(results, now)
        errors = {r.target.key: r.error or "scrape failed" for r in results if not r.ok and not r.skipped}
        errors.update(_counted(out.parse_errors, "malformed line(s)", out.parse_error_counts))
        # Pod discovery serves its last good list while the API fails (`KubernetesPodTargets.stale`): an engine that
        # came or went since is not in the pools' sums, so nothing is acted on from them until the list is fresh.
        stale = "the pod list is the last one read: the Kubernetes API fails" if self.targets.stale else None
        return Observation(out.signals, results, dict(self.scraper.health), errors, out.parse_errors,
                           out.missing_families,
                           unfit_everywhere=dict.fromkeys({t.source for t in listed}, stale) if stale else {},
                           parse_error_counts=out.parse_error_counts)


class PrometheusApiSource:
    """Prometheus scrapes the fleet; each tick asks it for the same signals over `window_s`."""

    def __init__(self, source: PrometheusSource, window_s: float, pools: dict[str, str] | None = None,
                 objectives: Mapping[str, Objectives] | None = None) -> None:
        self.source = source
        self.window_s = window_s
        self.pools = pools
        self.objectives = objectives

    async def observe(self, now: float) -> Observation:
        try:
            out = await asyncio.to_thread(self.source.signals, now, self.window_s, self.pools, self.objectives)
        except PrometheusError as exc:
            raise MetricSourceUnavailable(f"Prometheus at {self.source.shown}: {exc}") from exc
        missing: dict[str, list[str]] = {}
        for m in out.missing:
            missing.setdefault(f"prometheus/{m.scope}", []).append(m.signal)
        malformed: dict[str, list[str]] = {}
        unfit: dict[str, dict[str, str]] = {}
        everywhere: dict[str, str] = {}
        for bad, unanswered in [(m, False) for m in out.malformed] + [(f, True) for f in out.failed]:
            malformed.setdefault(f"prometheus/{bad.scope}", []).append(f"{bad.signal}: {bad.problem} ({bad.query})")
            # Absent this tick, the signal's last value would be read as now's.
            why = f"Prometheus: {bad.problem}" if unanswered else f"Prometheus' series: {bad.problem}"
            if bad.scope.startswith("pool/"):
                unfit.setdefault(bad.scope.removeprefix("pool/"), {})[bad.signal] = why
            elif unanswered:  # a query over every pool's (or engine's) series
                everywhere.setdefault(bad.signal, why)
        for d in out.down:
            # The selector picks the engines' jobs (as target discovery assumes): a down target is an engine.
            unfit.setdefault(d.pool, {})[Source.VLLM] = f"target {d.instance} is down in Prometheus (its latest scrape failed)"
        for pool, why in out.doubtful.items():
            unfit.setdefault(pool, {}).setdefault(Source.VLLM, f"Prometheus' series: {why}")
        errors = _counted(malformed, "signal(s) unreadable")
        if out.unattributed:
            errors["prometheus/unattributed"] = (f"series of {len(out.unattributed)} engine(s) or pool(s) left out of "
                                                 f"the signals, first: {out.unattributed[0]}")
        return Observation(out.signals, errors=errors, parse_errors=malformed, missing=missing, unfit=unfit,
                           unfit_everywhere=everywhere)


def _counted(problems: Mapping[str, list[str]], what: str, counts: Mapping[str, int] | None = None) -> dict[str, str]:
    """Per key, its problems as one tick error: how many (`counts`, where the list is a sample), and the first."""
    return {key: f"{(counts or {}).get(key, len(errs))} {what}, first: {errs[0]}"
            for key, errs in problems.items() if errs}


class PrometheusTargets:
    """Targets as Prometheus sees them (for the dry-run actuator's replica counts)."""

    stale = False  # a failing Prometheus raises: no list is served in its place

    def __init__(self, source: PrometheusSource, clock_now: ClockNow, roles: dict[str, Role]) -> None:
        self.source = source
        self.now = clock_now
        self.roles = roles

    async def targets(self) -> Sequence[Target]:
        try:
            return await asyncio.to_thread(self.source.discover_targets, self.now(), roles=self.roles)
        except PrometheusError as exc:
            raise MetricSourceUnavailable(f"Prometheus at {self.source.shown}: {exc}") from exc


class ClockNow(Protocol):
    def __call__(self) -> float: ...
