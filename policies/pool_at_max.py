"""Pools the load has outgrown: the sizer asks for more engines than the pool's `replicas.max`.

The autoscaler never sizes a pool past its maximum, so a load that needs more is served short, and
nothing else says why: the SLO burn names the symptom, the plan's target reads as met. A Kubernetes
HorizontalPodAutoscaler says the same in its `ScalingLimited` condition (`TooManyReplicas`). The
finding opens once the pool has held its maximum while every plan for `hold` asked for more (a
burst the forecast's headroom rides out is not the ceiling); it is critical where a whole minute
broke a p95 objective meanwhile. It resolves once `resolve_points` plans in a row fit under the
maximum (the load fell, or the fleet file raised it), or once the pool has not been planned for `hold`
(its inputs stale, scaled to zero, the sizer off). No action: more engines than the maximum are
a person's decision (GPUs the cluster may not have, a budget).
"""

from __future__ import annotations

from pydantic import Field

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.autoscale import DESIRED, TARGET, scrape_interval, slo_broken_minutes, whole_minute
from policies.common import removed_pools
from policies.types import FindingKey, FindingReport, PolicyInput, PolicyResult, PoolState, Severity

__all__ = ["KIND", "PoolAtMax", "PoolAtMaxSettings"]

KIND = "pool_at_max"


class PoolAtMaxSettings(Settings):
    """`policies.pool_at_max` in the fleet file."""

    enabled: bool = True
    hold: Seconds = 600.0  # how long every plan must have asked for more than the maximum
    resolve_points: int = Field(4, ge=1)  # plans in a row within the maximum to resolve

    def problems(self, interval: float) -> list[Problem]:
        return least_window("hold", self.hold, 3, interval, "three plans over the maximum")


class PoolAtMax:
    """A finding per pool held at its maximum while the sizer asks for more, open while it does."""

    kind = KIND
    reads: tuple[str, ...] = (TARGET, DESIRED, "ttft_p95", "tpot_p95")

    def __init__(self, settings: PoolAtMaxSettings | None = None) -> None:
        self.settings = settings or PoolAtMaxSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        s, result = self.settings, PolicyResult()
        for name, pool in sorted(inp.pools.items()):
            subject, top = f"pool/{name}", pool.most_replicas
            key = FindingKey(KIND, subject)
            asked = inp.windows.series(subject, TARGET, since=inp.now - s.hold)
            lately = inp.now - 2 * scrape_interval(inp.windows, subject)  # the policies run before this tick's plan
            at_top_now = pool.desired >= top and bool(asked) and asked[-1][0] >= lately and asked[-1][1] > top
            if at_top_now and (key in inp.open_findings or self._capped(asked, top)):
                # Open, it is told again while the pool is at its maximum and asked past it, so its severity and
                # numbers follow the load; plans that dip under the maximum between do not resolve it.
                result.findings.append(self._report(inp, pool, asked, top))
            elif key in inp.open_findings:
                last = inp.windows.last(subject, TARGET, s.resolve_points)
                if len(last) == s.resolve_points and all(v <= top for v in last):
                    result.resolved.append((key, f"the last {s.resolve_points} plans fit within its maximum of {top}"))
                elif not asked:  # nothing will say it fits again: the sizer is off, or the pool scaled to zero
                    result.resolved.append((key, f"not planned for {s.hold / 60:.0f} min"))
        result.resolved += removed_pools(inp, KIND)
        return result

    def _capped(self, asked: list[tuple[float, float]], top: int) -> bool:
        """Every plan for `hold` asked for more than `top`: planned for most of it (a pool whose inputs went stale
        is not planned, and a gap is no evidence)."""
        return len(asked) >= 3 and asked[-1][0] - asked[0][0] >= 0.75 * self.settings.hold and all(
            v > top for _, v in asked)

    def _report(self, inp: PolicyInput, pool: PoolState, asked: list[tuple[float, float]], top: int) -> FindingReport:
        s, subject = self.settings, f"pool/{pool.name}"
        whole = whole_minute(inp.windows, subject)
        broken = {name: [m * 60.0 for m in minutes] for name, slo in pool.slos.items()
                  if (minutes := slo_broken_minutes(inp.windows.series(subject, name, since=inp.now - s.hold), slo,
                                                    whole))}
        now_asked, most = round(asked[-1][1]), round(max(v for _, v in asked))
        whole_groups = f" (whole groups of {pool.gang} within replicas.max {pool.max_replicas})" \
            if top != pool.max_replicas else ""
        summary = (f"{pool.name} is held at its maximum of {top} replicas{whole_groups}; the load asks for "
                   f"{now_asked} (up to {most} over {s.hold / 60:.0f} min)")
        if broken:
            cause = ("it broke " + " and ".join(f"{n.split('_')[0].upper()} p95 in {len(b)} minute(s)"
                                                for n, b in broken.items()) + " meanwhile: ")
        else:
            cause = "its objectives held so far, on the headroom the sizer plans with: "
        cause += ("raise `replicas.max` in the fleet file if the cluster has the GPUs, or shed load; the sizer sizes "
                  "no pool past its maximum")
        evidence = {"signal": TARGET, "max": top, "desired": pool.desired, "asked": now_asked,
                    "asked_most": most, "hold_s": s.hold, "broken": broken}
        return FindingReport(FindingKey(KIND, subject), Severity.CRITICAL if broken else Severity.WARNING, summary,
                             cause, evidence, KIND)

