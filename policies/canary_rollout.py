"""Canary regression: while a pool rolls out a new revision, its new engines are judged against its old
ones by the same anytime-valid judge as `fleetctl gate`, and a failed canary is rolled back.

Pure: from the loop's signal windows (each engine's interval means and request rates) and the time
each pool's workload last changed (`changed_at`, from the actuator). Per pool, every tick:

- arms: the engines that first reported after the pool's last change are the canary (or, where the
  canary is a Deployment of its own beside the stable one, those whose pod matches the pool's
  `canary_pods` pattern, of its newest ReplicaSet: that Deployment's pods of earlier revisions match
  too); the others are the baseline. With no canary or no baseline left there is
  no rollout, and an open finding resolves (the canary was rolled back, or promoted);
- one pool at a time: only the pool whose rollout began first is judged; another pool rolling out
  meanwhile gets a warning, since a new prefill revision changes what every decode engine sees and
  neither comparison would be clean. A rollout past its `max_window` has had its final verdict and
  holds none back;
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
from dataclasses import dataclass
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
    Series,
    Verdict,
    arms_tpot_reading,
    engine_dists,
    judge,
    merge_into,
    step_problem,
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
from policies.windows import HISTORY_S

__all__ = ["KIND", "CanaryRegression", "CanaryRolloutSettings"]

KIND = "canary_regression"
_LOAD = "request_rate"
# Recorded only at a restart, so no input whose age says anything: a canary that never restarts has none.
_RESTARTS = "restarts"
_TPOT_AS_ITL = (*ENGINE_MEANS["itl"],)  # what a TPOT read as the inter-token latency needs


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
        why = step_problem(self.gate.step, interval)
        out: list[Problem] = [("gate.step", why)] if why else []
        # The loop tells a canary from the others by when its engines first reported, in the history it keeps: a
        # judgement that outlasts the history would count every engine new, and end the rollout in its eyes.
        if self.gate.max_window > HISTORY_S:
            out.append(("gate.max_window", f"{self.gate.max_window:g}s is longer than the {HISTORY_S:g}s of history "
                                           "the loop judges a rollout from (fleetctl gate judges longer ones)"))
        if self.lookback + self.watch_after_promotion > HISTORY_S:
            out.append(("watch_after_promotion", f"lookback plus watch_after_promotion "
                                                 f"({self.lookback + self.watch_after_promotion:g}s) is longer than "
                                                 f"the {HISTORY_S:g}s of history the loop keeps"))
        return out


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
        engines = {pool: e for pool in inp.pools if (e := self._engines(inp, pool))}
        rollouts = {pool: arms for pool, e in engines.items()
                    if (arms := _rollout(e, (state := inp.pools.get(pool)) is not None and state.rolling)) is not None}
        promoted = {pool: p for pool, e in engines.items()
                    if pool not in rollouts and (p := self._promoted(inp, e)) is not None}
        for key in inp.open_findings:
            pool = key.subject.removeprefix("pool/")
            if key.kind == KIND and pool not in rollouts and pool not in promoted:
                result.resolved.append((key, "the rollout ended: no canary engines (rolled back or promoted), "
                                             "or no baseline left"))
        ordered = sorted(rollouts, key=lambda p: rollouts[p][2])
        # One rollout at a time among those still within their window. One past it has had its final verdict: it is
        # judged on, but holds no other pool back (a canary slot kept at the stable revision would be first for good).
        ended = [p for p in ordered if inp.now - rollouts[p][2] >= self.settings.gate.max_window]
        ordered = [p for p in ordered if p not in ended]
        for pool in ordered[1:]:
            first = ordered[0]
            result.findings.append(FindingReport(
                FindingKey(KIND, f"pool/{pool}"), Severity.WARNING,
                f"{pool} rolls out while {first} does: roll out one pool at a time",
                f"{pool}'s canary started while {first}'s rollout was still being judged; a new revision in one "
                f"pool changes what the other's engines see, so neither canary can be judged cleanly. {pool} is "
                f"judged once {first}'s rollout ends.",
                {"overlaps": first, "canary": _pods(rollouts[pool][1])}, KIND))
        judged = {pool: self._judge(inp, pool, *rollouts[pool]) for pool in [*ended, *ordered[:1]]}
        judged |= {pool: self._watch(inp, pool, *promoted[pool]) for pool in promoted}
        for pool, finding in judged.items():
            key = FindingKey(KIND, f"pool/{pool}")
            if finding is not None:
                result.findings.append(finding)
            elif key in inp.open_findings:
                result.resolved.append((key, "the new revision is no longer judged worse than the old one"))
        return result

    def _engines(self, inp: PolicyInput, pool: str) -> list[_Engine]:
        """The pool's engines in the windows, each told new (on the pool's last revision) or old; none
        when nothing says which revision an engine runs."""
        pattern, changed = self._patterns.get(pool), inp.changed_at.get(pool)
        if pattern is None and changed is None:
            return []
        live_since = inp.now - 4 * self.settings.gate.step  # engines gone (rolled back, drained) are no arm
        out = []
        for subject in inp.windows.subjects(_LOAD, prefix=f"engine/{pool}/"):
            points = inp.windows.series(subject, _LOAD)
            pod = subject.split("/")[2]
            new = bool(pattern.fullmatch(pod)) if pattern is not None else points[0][0] > (changed or math.inf)
            # Without a pattern the canary is judged from the change on, however early its engines started.
            first = points[0][0] if pattern is not None else max(points[0][0], changed or -math.inf)
            out.append(_Engine(subject, pod, new, first, points[-1][0], points[-1][0] >= live_since))
        return _this_canary(out) if pattern is not None else out

    def _promoted(self, inp: PolicyInput, engines: list[_Engine]) -> tuple[list[_Engine], list[_Engine], float] | None:
        """(old engines, new engines, when the last old one stopped) within the watch after a promotion."""
        old = [e for e in engines if not e.new]
        new = [e for e in engines if e.new and e.live]
        if self.settings.watch_after_promotion <= 0 or not old or not new or any(e.live for e in old):
            return None
        promoted_at = max(e.last for e in old)
        if inp.now - promoted_at > self.settings.watch_after_promotion:
            return None
        return old, new, promoted_at

    def _steps(self, inp: PolicyInput, engines: list[_Engine], start: float, width: float, n: int,
               names: list[str], read_as: dict[str, str]) -> list[dict[str, Dist]]:
        """The engines' observations merged, in `n` consecutive steps of `width` seconds from `start` (`read_as`:
        `tpot_reading`'s choice for both arms)."""
        out: list[dict[str, Dist]] = [{} for _ in range(n)]
        wanted = (*self.reads, *(_TPOT_AS_ITL if read_as.get("tpot") == "itl" else ()))
        for e in engines:
            series = {name: inp.windows.series(e.subject, name, since=start - 2 * self.settings.gate.step)
                      for name in wanted}
            for k in range(n):
                for name, d in engine_dists(series, names, start + k * width, start + (k + 1) * width,
                                            read_as).items():
                    merge_into(out[k], name, d)
        return out

    def _tpot_as(self, inp: PolicyInput, base: list[_Engine], canary: list[_Engine], since: float) -> dict[str, str]:
        """Which TPOT both arms are read on (`arms_tpot_reading`: the per-request one unless an engine of either has
        only the inter-token latency); not read while that is not known."""
        if "tpot" not in self._names:
            return {}

        def stored(arm: list[_Engine]) -> list[Series]:
            return [{name: inp.windows.series(e.subject, name, since=since) for name in ("tpot_per_request",
                                                                                         "tpot_mean")} for e in arm]

        decided = arms_tpot_reading(stored(base), stored(canary), since)
        return {"tpot": ""} if decided is None else decided

    def _watch(self, inp: PolicyInput, pool: str, old: list[_Engine], new: list[_Engine],
               promoted_at: float) -> FindingReport | None:
        """The new revision's steps since the promotion against the old one's level, at matched load."""
        s, gate = self.settings, self.settings.gate
        names = [*self._names, REQUESTS]
        read_as = self._tpot_as(inp, old, new, promoted_at - s.lookback)
        [level] = self._steps(inp, old, promoted_at - s.lookback, s.lookback, 1, names, read_as)
        if REQUESTS not in level:
            return None
        # Per engine-second the old engines served within the lookback: some left early in the rollout.
        since = promoted_at - s.lookback
        served = sum(max(0.0, min(e.last, promoted_at) - max(e.first, since)) for e in old)
        if served <= 0:
            return None
        per_engine = level[REQUESTS].count / served
        n = int((inp.now - promoted_at) // gate.step)
        intervals = []
        for k, step in enumerate(self._steps(inp, new, promoted_at, gate.step, n, names, read_as)):
            load = step[REQUESTS].count / gate.step / len(new) if REQUESTS in step else 0.0
            if abs(load / per_engine - 1.0) <= s.load_match:
                t = promoted_at + k * gate.step
                intervals.append(Interval(t, t + gate.step, level, step))
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
            {**verdict.as_dict(), "post_promotion": True, "promoted_at": promoted_at, "old": _pods(old),
             "new": _pods(new)}, KIND)

    def _judge(self, inp: PolicyInput, pool: str, base: list[_Engine], canary: list[_Engine],
               start: float) -> FindingReport | None:
        gate = self.settings.gate
        n = int((inp.now - start) // gate.step)
        if n <= 0:
            return None
        read_as = self._tpot_as(inp, base, canary, start - 2 * gate.step)
        steps = zip(self._steps(inp, base, start, gate.step, n, self._names, read_as),
                    self._steps(inp, canary, start, gate.step, n, self._names, read_as), strict=True)
        # A pod recreated under its name by the rollout starts a new process as a crash does: such a pool's restarts
        # are the gate's to read (started once its canary runs), not told here.
        state = inp.pools.get(pool)
        restarted = [()] * n if state is not None and state.keeps_names else _restarts(inp, pool, canary, start,
                                                                                       gate.step, n)
        intervals = [Interval(start + k * gate.step, start + (k + 1) * gate.step, b, c, restarted[k])
                     for k, (b, c) in enumerate(steps)]
        final = inp.now - start >= gate.max_window
        verdict = judge(intervals, gate, final=final)
        pods = {"baseline": _pods(base), "canary": _pods(canary)}
        key = FindingKey(KIND, f"pool/{pool}")
        if verdict.outcome is Outcome.FAIL:
            failed = [m.name for m in verdict.metrics if m.outcome is Outcome.FAIL]
            return FindingReport(
                key, Severity.CRITICAL,
                f"{pool}'s canary ({', '.join(pods['canary'])}) is worse than its baseline: {', '.join(failed)}",
                f"{verdict.reason}. The canary runs the pool's new revision beside engines on the old one, under "
                f"the same load, so the difference is the revision's.",
                {**verdict.as_dict(), **pods}, KIND,
                (Proposal(ActionKind.ROLLBACK, pool, RollBack(pool),
                          f"roll {pool} back to its previous revision: its canary failed the gate ({_worst(verdict)})",
                          inputs=self.reads),),
                verdict=_verdict_record(verdict, pods))
        # A decided marginal (a non-critical metric worse, the critical ones not) is told at once: a rollout that
        # finishes before the window ends leaves no canary to judge at its end.
        if (final or verdict.decided) and verdict.outcome is not Outcome.PASS:
            return FindingReport(
                key, Severity.WARNING,
                f"{pool}'s canary is {verdict.outcome.value} after {(verdict.ended_at - verdict.started_at) / 60:g} "
                "min: a person decides",
                verdict.reason, {**verdict.as_dict(), **pods}, KIND, verdict=_verdict_record(verdict, pods))
        return None


@dataclass(frozen=True, slots=True)
class _Engine:
    """One engine of a pool as the rollout sees it."""

    subject: str
    pod: str
    new: bool  # on the pool's last revision
    first: float  # when it counts from: its first report (or the change, if later)
    last: float  # its latest report
    live: bool  # reported within the last few steps


def _this_canary(engines: list[_Engine]) -> list[_Engine]:
    """The engines with the canary's pods of this rollout only. A canary Deployment beside the stable one keeps its pods'
    pattern across revisions, so it also matches pods of its earlier revisions, gone, on their way out or serving
    beside the new ones: counted, they would date the rollout hours back and judge the old revision's steps as the new
    one's. A Deployment's (or Argo Rollout's) pod is named after its ReplicaSet, `<set>-<suffix>`: the canary is the
    pods of the set that came last (its first report the latest), a pod of it that crashed and was replaced under
    another name included. Pods named otherwise (a StatefulSet's ordinals) are one set, as before."""
    sets: dict[str, list[_Engine]] = {}
    for e in engines:
        if e.new:
            sets.setdefault(e.pod.rsplit("-", 1)[0], []).append(e)
    if len(sets) < 2:
        return engines
    newest = max(sets.values(), key=lambda s: min(e.first for e in s))
    return [e for e in engines if not e.new or e in newest]


def _rollout(engines: list[_Engine], rolling: bool) -> tuple[list[_Engine], list[_Engine], float] | None:
    """(baseline, canary, when the canary started) while both serve, else None. The canary is every new engine that
    reported in the rollout, a quiet one too: a canary pod that crashed must not take its bad steps with it. With none
    of them serving, the rollout goes on only while the pool still rolls out (its workload says so)."""
    base = [e for e in engines if e.live and not e.new]
    canary = [e for e in engines if e.new]
    if not base or not canary or not (rolling or any(e.live for e in canary)):
        return None
    return base, canary, min(e.first for e in canary)


def _restarts(inp: PolicyInput, pool: str, engines: list[_Engine], start: float, width: float,
              n: int) -> list[tuple[str, ...]]:
    """The engines' pods whose process restarted (the scrapes' `restarts`) in each of `n` steps of `width` seconds
    from `start`."""
    out: list[list[str]] = [[] for _ in range(n)]
    for pod in _pods(engines):
        for ts, _ in inp.windows.series(f"target/{pool}/{pod}/vllm", _RESTARTS, since=start):
            if ts > start and (k := math.ceil((ts - start) / width) - 1) < n:
                out[k].append(pod)
    return [tuple(pods) for pods in out]


def _pods(engines: list[_Engine]) -> list[str]:
    return sorted({e.pod for e in engines})


def _verdict_record(verdict: Verdict, pods: dict[str, list[str]]) -> dict[str, Any]:
    return {"gate": "rollout", "baseline": ",".join(pods["baseline"]), "canary": ",".join(pods["canary"]),
            **verdict.as_dict()}


def _worst(verdict: Verdict) -> str:
    failed = [m for m in verdict.metrics if m.outcome is Outcome.FAIL and m.estimate is not None]
    if not failed:
        return verdict.reason
    m = max(failed, key=lambda m: (m.critical, m.estimate or 0.0))  # a critical metric's failure is the reason
    est = m.estimate or 0.0
    shown = f"{(est - 1) * 100:+.1f}%" if m.scale.value == "ratio" else f"{est:+.4g}"
    return f"{m.name} {shown}, interval {m.lower or 0.0:.4g} to {m.upper or 0.0:.4g}"
