"""Canary regression: while a pool rolls out a new revision, its new engines are judged against its old
ones by the same anytime-valid judge as `fleetctl gate`, and a failed canary is rolled back.

Pure: from the loop's signal windows (each engine's interval means and request rates) and the time
each pool's workload last changed (`changed_at`, from the actuator). Per pool, every tick:

- arms: the engines that first reported after the pool's last change are the canary (or, where the
  canary is a Deployment of its own beside the stable one, those whose pod matches the pool's
  `canary_pods` pattern); the others are the baseline. With no canary or no baseline left there is
  no rollout, and an open finding resolves (the canary was rolled back, or promoted);
- one pool at a time: only the pool whose rollout began first is judged; another pool rolling out
  meanwhile gets a warning, since a new prefill revision changes what every decode engine sees and
  neither comparison would be clean;
- the judge sees every step since the canary first reported and is consulted every tick; being
  anytime-valid, watching continuously costs nothing in false fails, so it keeps watching after a
  pass until the rollout ends;
- a fail opens a critical finding with the verdict's explanation and proposes rolling the pool back
  to its previous revision (through the rails, like every action); a canary still undecided after
  `max_window` gets a warning for a person;
- after a promotion (the old engines gone, the new ones serving) it keeps watching for
  `watch_after_promotion`: each step of the new revision against the old one's level over its last
  `lookback`, using only steps whose load per engine is within `load_match` of the old level's. That
  is no concurrent baseline, so a fail here is a warning for a person, not a rollback.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field, field_validator

from catalog.settings import NonNegativeSeconds, Problem, Seconds, Settings
from policies.canary import (
    ENGINE_MEANS,
    ERRORS,
    REQUESTS,
    Dist,
    GateSettings,
    Interval,
    Outcome,
    Verdict,
    engine_dists,
    judge,
    merge_into,
)
from policies.types import (
    ActionKind,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    RollBack,
    Severity,
)

__all__ = ["KIND", "CanaryRegression", "CanaryRolloutSettings"]

KIND = "canary_regression"
_LOAD = "request_rate"


class CanaryRolloutSettings(Settings):
    """`policies.canary_regression` in the fleet file: the gate's rules, and how canary engines are told apart."""

    enabled: bool = True
    gate: GateSettings = GateSettings()
    canary_pods: dict[str, str] = Field(default_factory=dict)  # pool -> regex of its canary pods' names
    watch_after_promotion: NonNegativeSeconds = 1800.0  # 0: stop at the promotion
    lookback: Seconds = 600.0  # the old revision's level: its last this long before the promotion
    load_match: float = Field(0.2, gt=0, le=1)  # post-promotion steps compared only at load per engine within this

    @field_validator("canary_pods")
    @classmethod
    def _patterns(cls, value: dict[str, str]) -> dict[str, str]:
        for pool, pattern in value.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"canary_pods[{pool}]: {pattern!r} is not a regular expression: {exc}") from None
        return value

    @field_validator("gate")
    @classmethod
    def _means_only(cls, value: GateSettings) -> GateSettings:
        unknown = [m.label for m in value.metrics if m.statistic != "mean" or m.name not in (*ENGINE_MEANS, ERRORS)]
        if unknown:
            raise ValueError(f"gate.metrics {unknown}: the loop judges the per-engine means it stores "
                             f"({', '.join([*ENGINE_MEANS, ERRORS])}, statistic mean); quantiles need "
                             f"`fleetctl gate --source prometheus`")
        return value

    def problems(self, interval: float) -> list[Problem]:
        if self.gate.step < interval:
            return [("gate.step", f"{self.gate.step:g}s is shorter than the scrape interval ({interval:g}s): "
                                  f"steps without a scrape hold no data")]
        return []


class CanaryRegression:
    """Judge each rolling-out pool's new engines against its old ones; roll back a failed canary."""

    kind = KIND

    def __init__(self, settings: CanaryRolloutSettings | None = None) -> None:
        self.settings = settings or CanaryRolloutSettings()
        self._names = [m.name for m in self.settings.gate.metrics]
        means = {ENGINE_MEANS[n][0] for n in self._names if n in ENGINE_MEANS}
        rates = {ENGINE_MEANS[n][1] for n in self._names if n in ENGINE_MEANS}
        self.reads: tuple[str, ...] = tuple(sorted({_LOAD, *means, *rates, *(("request_error_rate",) if ERRORS in
                                                                             self._names else ())}))
        self._patterns = {pool: re.compile(p) for pool, p in self.settings.canary_pods.items()}

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        result = PolicyResult()
        rollouts = {pool: arms for pool in inp.pools if (arms := self._arms(inp, pool)) is not None}
        promoted = {pool: p for pool in inp.pools if pool not in rollouts and (p := self._promoted(inp, pool))}
        for key in inp.open_findings:
            pool = key.subject.removeprefix("pool/")
            if key.kind == KIND and pool not in rollouts and pool not in promoted:
                result.resolved.append((key, "the rollout ended: no canary engines (rolled back or promoted), "
                                             "or no baseline left"))
        ordered = sorted(rollouts, key=lambda p: rollouts[p][2])
        for pool in ordered[1:]:
            first = ordered[0]
            result.findings.append(FindingReport(
                FindingKey(KIND, f"pool/{pool}"), Severity.WARNING,
                f"{pool} rolls out while {first} does: roll out one pool at a time",
                f"{pool}'s canary started while {first}'s rollout was still being judged; a new revision in one "
                f"pool changes what the other's engines see, so neither canary can be judged cleanly. {pool} is "
                f"judged once {first}'s rollout ends.",
                {"overlaps": first, "canary": sorted(rollouts[pool][1])}, KIND))
        judged = {pool: self._judge(inp, pool, *rollouts[pool]) for pool in ordered[:1]}
        judged |= {pool: self._watch(inp, pool, *promoted[pool]) for pool in promoted}
        for pool, finding in judged.items():
            key = FindingKey(KIND, f"pool/{pool}")
            if finding is not None:
                result.findings.append(finding)
            elif key in inp.open_findings:
                result.resolved.append((key, "the new revision is no longer judged worse than the old one"))
        return result

    def _arms(self, inp: PolicyInput, pool: str) -> tuple[list[str], list[str], float] | None:
        """(baseline engines, canary engines, when the canary first reported), or None when no rollout runs."""
        pattern = self._patterns.get(pool)
        changed = inp.changed_at.get(pool)
        if pattern is None and changed is None:
            return None
        base: list[str] = []
        canary: list[str] = []
        first = math.inf
        live_since = inp.now - 4 * self.settings.gate.step  # engines gone (rolled back, drained) are no arm
        for subject in inp.windows.subjects(_LOAD, prefix=f"engine/{pool}/"):
            if (inp.windows.latest_ts(subject, _LOAD) or -math.inf) < live_since:
                continue
            pod = subject.split("/")[2]
            points = inp.windows.series(subject, _LOAD)
            started = points[0][0] if points else math.inf
            new = bool(pattern.fullmatch(pod)) if pattern is not None else started > (changed or math.inf)
            (canary if new else base).append(subject)
            if new:
                first = min(first, started)
        if not base or not canary:
            return None
        return base, canary, max(first, changed or -math.inf) if pattern is None else first

    def _promoted(self, inp: PolicyInput, pool: str) -> tuple[list[str], list[str], float] | None:
        """(old engines, new engines, when the last old one stopped) within the watch after a promotion."""
        changed = inp.changed_at.get(pool)
        pattern = self._patterns.get(pool)
        if self.settings.watch_after_promotion <= 0 or (changed is None and pattern is None):
            return None
        live_since = inp.now - 4 * self.settings.gate.step
        old: list[str] = []
        new: list[str] = []
        for subject in inp.windows.subjects(_LOAD, prefix=f"engine/{pool}/"):
            points = inp.windows.series(subject, _LOAD)
            pod = subject.split("/")[2]
            is_new = bool(pattern.fullmatch(pod)) if pattern is not None else points[0][0] > (changed or math.inf)
            if is_new and points[-1][0] >= live_since:
                new.append(subject)
            elif not is_new:
                if points[-1][0] >= live_since:
                    return None  # an old engine still serves: a rollout, or none
                old.append(subject)
        if not old or not new:
            return None
        promoted_at = max(inp.windows.series(s, _LOAD)[-1][0] for s in old)
        if inp.now - promoted_at > self.settings.watch_after_promotion:
            return None
        return old, new, promoted_at

    def _watch(self, inp: PolicyInput, pool: str, old: list[str], new: list[str],
               promoted_at: float) -> FindingReport | None:
        """The new revision's steps since the promotion against the old one's level, at matched load."""
        s, gate = self.settings, self.settings.gate
        before = promoted_at - s.lookback
        level: dict[str, Dist] = {}
        for subject in old:
            series = {name: inp.windows.series(subject, name, since=before - 2 * gate.step) for name in self.reads}
            for name, d in engine_dists(series, [*self._names, REQUESTS], before, promoted_at).items():
                merge_into(level, name, d)
        if REQUESTS not in level:
            return None
        per_engine = level[REQUESTS].count / s.lookback / len(old)
        intervals = []
        t = promoted_at
        while t + gate.step <= inp.now:
            step: dict[str, Dist] = {}
            for subject in new:
                series = {name: inp.windows.series(subject, name, since=t - 2 * gate.step) for name in self.reads}
                for name, d in engine_dists(series, [*self._names, REQUESTS], t, t + gate.step).items():
                    merge_into(step, name, d)
            load = step[REQUESTS].count / gate.step / len(new) if REQUESTS in step else 0.0
            if per_engine > 0 and abs(load / per_engine - 1.0) <= s.load_match:
                intervals.append(Interval(t, t + gate.step, level, step))
            t += gate.step
        if not intervals:
            return None
        verdict = judge(intervals, gate)
        if verdict.outcome is not Outcome.FAIL:
            return None
        failed = [m.name for m in verdict.metrics if m.outcome is Outcome.FAIL]
        return FindingReport(
            FindingKey(KIND, f"pool/{pool}"), Severity.WARNING,
            f"since its promotion, {pool}'s new revision is worse than the old one was: {', '.join(failed)}",
            f"{verdict.reason}. Compared with the old revision's level over its last {s.lookback / 60:g} min, at "
            f"load per engine within {s.load_match:.0%} of it ({len(intervals)} steps): no concurrent baseline, so "
            f"a person decides whether to roll back.",
            {**verdict.as_dict(), "post_promotion": True, "promoted_at": promoted_at,
             "old": sorted(x.split("/")[2] for x in old), "new": sorted(x.split("/")[2] for x in new)}, KIND)

    def _intervals(self, inp: PolicyInput, base: list[str], canary: list[str], start: float) -> list[Interval]:
        step = self.settings.gate.step
        n = int((inp.now - start) // step)
        if n <= 0:
            return []
        arms: list[tuple[dict[str, Dist], dict[str, Dist]]] = [({}, {}) for _ in range(n)]
        names = {*self.reads}
        for side, subjects in ((0, base), (1, canary)):
            for subject in subjects:
                series = {name: inp.windows.series(subject, name, since=start - 2 * step) for name in names}
                for k in range(n):
                    for name, d in engine_dists(series, self._names, start + k * step, start + (k + 1) * step).items():
                        merge_into(arms[k][side], name, d)
        return [Interval(start + k * step, start + (k + 1) * step, b, c) for k, (b, c) in enumerate(arms)]

    def _judge(self, inp: PolicyInput, pool: str, base: list[str], canary: list[str],
               start: float) -> FindingReport | None:
        gate = self.settings.gate
        intervals = self._intervals(inp, base, canary, start)
        if not intervals:
            return None
        final = inp.now - start >= gate.max_window
        verdict = judge(intervals, gate, final=final)
        pods = {"baseline": sorted(s.split("/")[2] for s in base), "canary": sorted(s.split("/")[2] for s in canary)}
        evidence: dict[str, Any] = {**verdict.as_dict(), **pods}
        key = FindingKey(KIND, f"pool/{pool}")
        if verdict.outcome is Outcome.FAIL:
            failed = [m.name for m in verdict.metrics if m.outcome is Outcome.FAIL]
            return FindingReport(
                key, Severity.CRITICAL,
                f"{pool}'s canary ({', '.join(pods['canary'])}) is worse than its baseline: {', '.join(failed)}",
                f"{verdict.reason}. The canary runs the pool's new revision beside engines on the old one, under "
                f"the same load, so the difference is the revision's.",
                evidence, KIND,
                (Proposal(ActionKind.ROLLBACK, pool, RollBack(pool),
                          f"roll {pool} back to its previous revision: its canary failed the gate ({_worst(verdict)})",
                          inputs=self.reads),))
        if final and verdict.outcome is not Outcome.PASS:
            return FindingReport(
                key, Severity.WARNING,
                f"{pool}'s canary is {verdict.outcome.value} after {gate.max_window / 60:g} min: a person decides",
                verdict.reason, evidence, KIND)
        return None


def _worst(verdict: Verdict) -> str:
    failed = [m for m in verdict.metrics if m.outcome is Outcome.FAIL and m.estimate is not None]
    if not failed:
        return verdict.reason
    m = max(failed, key=lambda m: (m.critical, m.estimate or 0.0))  # a critical metric's failure is the reason
    est = m.estimate or 0.0
    shown = f"{(est - 1) * 100:+.1f}%" if m.scale.value == "ratio" else f"{est:+.4g}"
    return f"{m.name} {shown}, interval {m.lower or 0.0:.4g} to {m.upper or 0.0:.4g}"
