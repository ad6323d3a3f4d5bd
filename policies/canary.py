"""The canary judge: canary pods against baseline pods serving at the same time, anytime-valid.

Pure: the caller hands in the rollout's intervals so far. Each interval holds, per metric and per
arm, what the engines export for it over that interval (`Dist`): histogram bucket deltas with their
sum and count as vLLM exports them, raw samples, or event counts (errors among requests).

Per metric:

1. Consecutive intervals are merged into blocks until each arm holds `min_count` observations. The
   rule reads counts only, never values, so it cannot bias the test; it is how low traffic is handled.
2. Each block gives the shift of the canary's statistic against the baseline's in the same block:
   the log ratio for latencies, the difference for rates. Pairing in time cancels what both arms
   share (load, prompt mix, time of day), and the block, not the request, is the unit, since
   requests batched together share their step time (a request-level rank test, as Kayenta runs, is
   overconfident on such data).
3. A confidence sequence for the mean shift: Robbins' normal mixture with the running variance
   (Waudby-Smith et al., "Time-uniform central limit theory and asymptotic confidence sequences",
   2021), its tail read on Student's t for the few blocks a canary starts with. It holds at every
   consultation at once, so the gate may be asked every interval and stop at the first answer with
   its false-fail rate still bounded by `alpha`.
4. Fail when the whole interval lies on the worse side of `margin` and the estimate reaches the
   allowed shift; pass when the worst end of the interval stays within the allowed shift. An error
   rate also passes when the canary's own rate, bound from above from its request counts
   (`event_rate_upper`), is within the allowance: rare errors leave the blocks too few of them. A large
   shift with a wide interval is never a pass; too few blocks is inconclusive, never a pass.

Written here rather than taken from a library: `confseq` (quantile confidence sequences) builds
from C++ with Boost and ships no wheels for current Pythons, and `savvi` tests multinomial counts
against known proportions (sample-ratio mismatch), not a shift between two arms, and pulls in cvxpy.

A canary pod whose process restarted within the gate (a crash, an OOM kill: its requests in flight
failed before vLLM counted them, and its counters began again) fails the gate at once, past
`restarts_allowed`: no latency statistic sees a crash loop.

The gate's verdict combines the metrics: a failed critical metric fails it at once; once every
metric is decided, the share that passed is the score (a marginal metric counts half), judged
against `pass_score` and `marginal_score` as Kayenta judges its score; a marginal metric keeps the
gate from passing, and a gate no metric failed is never worse than marginal.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from pydantic import Field, model_validator
from scipy.optimize import brentq
from scipy.special import betainc, betaln
from scipy.stats import norm
from scipy.stats import t as student_t

from catalog.settings import Seconds, Settings

__all__ = [
    "ENGINE_MEANS",
    "ERRORS",
    "REQUESTS",
    "Direction",
    "Dist",
    "GateSettings",
    "Interval",
    "MetricRule",
    "MetricVerdict",
    "Outcome",
    "Scale",
    "Series",
    "Verdict",
    "arms_tpot_reading",
    "blocks",
    "confidence_sequence",
    "engine_dists",
    "event_rate_upper",
    "judge",
    "merge_into",
    "step_problem",
    "tpot_reading",
]

ERRORS = "error_rate"  # errors among finished requests (vLLM's request_success_total{finished_reason="error"})
REQUESTS = "requests"  # the finished requests themselves, as a count: how much load an arm carried
# Gate metric -> the per-engine interval mean the collectors store, and the rate its observations come at.
ENGINE_MEANS: Mapping[str, tuple[str, str]] = {
    "ttft": ("ttft_mean", "request_rate"), "tpot": ("tpot_mean", "request_rate"), "e2e": ("e2e_mean", "request_rate"),
    "queue_time": ("queue_time_mean", "request_rate"), "itl": ("itl_mean", "generation_tokens_rate")}


class Outcome(StrEnum):
    """A metric's or a gate's result."""

    PASS = "pass"
    MARGINAL = "marginal"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


class Direction(StrEnum):
    """Which way a change is a regression."""

    INCREASE = "increase"  # latencies, error rates
    DECREASE = "decrease"  # throughput, hit rates
    EITHER = "either"


class Scale(StrEnum):
    """How the canary's statistic is compared with the baseline's."""

    RATIO = "ratio"  # canary / baseline; `allowed` 0.05 is +5 %
    DIFFERENCE = "difference"  # canary - baseline; `allowed` in the metric's own unit


@dataclass(frozen=True, slots=True)
class Dist:
    """One arm's observations of one metric over an interval: a count and a sum, with bucket deltas
    (cumulative, `(le, count)`, `+Inf` last) or the raw samples when the source has them."""

    count: float
    total: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()
    samples: tuple[float, ...] = ()

    @classmethod
    def of_samples(cls, values: Sequence[float]) -> Dist:
        """Raw observations."""
        return cls(float(len(values)), float(sum(values)), samples=tuple(float(v) for v in values))

    @classmethod
    def of_events(cls, events: float, trials: float) -> Dist:
        """`events` among `trials` (errors among requests): its mean is the event ratio."""
        return cls(float(trials), float(events))

    def merge(self, other: Dist) -> Dist:
        """Both intervals' observations together; buckets survive only where both have the same bounds."""
        same = [le for le, _ in self.buckets] == [le for le, _ in other.buckets]
        buckets = tuple((le, a + b) for (le, a), (_, b) in zip(self.buckets, other.buckets, strict=True)) \
            if same and self.buckets else ()
        samples = self.samples + other.samples if self.samples and other.samples else ()
        return Dist(self.count + other.count, self.total + other.total, buckets, samples)

    def statistic(self, name: str) -> float | None:
        """`mean` (exact: sum over count), or `p50`, `p90`, `p95`, `p99` from the samples or the buckets
        (interpolated inside the bucket, as PromQL's `histogram_quantile`); None when it cannot be had (a quantile
        past the highest finite bound, which is only a lower bound of it)."""
        got = self.bounded(name)
        return None if got is None or got[1] else got[0]

    def bounded(self, name: str) -> tuple[float, bool] | None:
        """The statistic, and whether it is only a lower bound of it: a quantile whose rank lies past the highest
        finite bucket bound is at least that bound (PromQL answers the bound itself)."""
        if self.count <= 0:
            return None
        if name == "mean":
            return self.total / self.count, False
        q = _quantile_level(name)
        if self.samples:
            return float(np.quantile(np.asarray(self.samples), q)), False
        if len(self.buckets) >= 2:
            return _bucket_quantile(q, self.buckets)
        return None


def _quantile_level(name: str) -> float:
    if not (name.startswith("p") and name[1:].isdigit() and 0 < int(name[1:]) < 100):
        raise ValueError(f"statistic {name!r}: expected mean or p50, p90, p95, p99 (pNN)")
    return int(name[1:]) / 100.0


def _bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> tuple[float, bool] | None:
    """The q-quantile of cumulative buckets, interpolated linearly inside its bucket from a lower bound of 0, and
    whether its rank lies past the highest finite bound (then the bound, a lower bound of it)."""
    finite = [(le, c) for le, c in buckets if math.isfinite(le)]
    total = buckets[-1][1]
    if total <= 0 or not finite:
        return None
    rank = q * total
    lower_le, lower_c = 0.0, 0.0
    for le, c in finite:
        if c >= rank:
            return (lower_le + (le - lower_le) * (rank - lower_c) / (c - lower_c) if c > lower_c else le), False
        lower_le, lower_c = le, c
    return finite[-1][0], True


class MetricRule(Settings):
    """One metric the gate judges, with what counts as a regression."""

    name: str  # ttft, tpot, itl, e2e, error_rate, or any signal the source knows
    statistic: str = "mean"  # mean, or pNN (needs buckets or samples)
    direction: Direction = Direction.INCREASE
    scale: Scale = Scale.RATIO
    allowed: float = Field(0.05, ge=0)  # the shift that matters: +5 % on a ratio, or in the metric's unit
    margin: float = Field(0.0, ge=0)  # a shift below this counts as no change (the spread between healthy pods)
    critical: bool = False  # a fail fails the gate at once
    min_count: int = Field(20, ge=1)  # observations per arm in a block
    noise_floor: float | None = Field(None, gt=0)  # least spread of block shifts assumed (ratio: log units)

    @model_validator(mode="before")
    @classmethod
    def _errors_by_difference(cls, data: Any) -> Any:
        # A healthy baseline has no errors, where a ratio is undefined: the error rate is judged by difference.
        if isinstance(data, Mapping) and data.get("name") == "error_rate" and "scale" not in data:
            return {**data, "scale": Scale.DIFFERENCE}
        return data

    @model_validator(mode="after")
    def _known(self) -> MetricRule:
        if self.name == "error_rate" and self.scale is Scale.RATIO:
            raise ValueError("error_rate by ratio can never fail against a baseline without errors (a ratio to 0 is "
                             "undefined): use scale: difference")
        if self.statistic != "mean":
            _quantile_level(self.statistic)
        if self.margin > self.allowed:
            raise ValueError(f"margin {self.margin:g} exceeds allowed {self.allowed:g}: the canary could fail "
                             f"on a shift the rule allows")
        return self

    @property
    def label(self) -> str:
        return self.name if self.statistic == "mean" else f"{self.name} {self.statistic}"

    @property
    def block_count(self) -> int:
        """Observations per arm in a block: `min_count`, and for a quantile at least ten past it (10 / (1 - q)). A
        canary that gets a small share of the traffic closes its blocks at `min_count`, where its p99 of twenty is
        about their largest, their p95: read against the baseline's p99 of thousands, every block the same way, an
        identical canary read 0.62 times the baseline, and one 20 % slower passed."""
        if self.statistic == "mean":
            return self.min_count
        return max(self.min_count, math.ceil(10.0 / (1.0 - _quantile_level(self.statistic)) - 1e-9))

    def floor(self) -> float:
        if self.noise_floor is not None:
            return self.noise_floor
        return 0.01 if self.scale is Scale.RATIO else max(self.allowed / 10.0, 1e-6)


DEFAULT_METRICS = (
    MetricRule(name="ttft", critical=True),
    MetricRule(name="tpot", critical=True),
    MetricRule(name="e2e", allowed=0.10),
    MetricRule(name="error_rate", scale=Scale.DIFFERENCE, allowed=0.01, critical=True, min_count=50),
)


# An error rate's blocks are read at this share of its alpha; a pass from the canary's own counts takes the rest.
BLOCKS_SHARE = 0.8
MIN_STEP_S = 1.0
MAX_WINDOW_S = 86400.0
MAX_STEPS = 10_000


class GateSettings(Settings):
    """How the gate judges: the metrics, the error bound and the window."""

    metrics: tuple[MetricRule, ...] = DEFAULT_METRICS
    alpha: float = Field(0.01, gt=0, lt=0.5)  # bound on a false verdict over the whole window, all metrics
    min_blocks: int = Field(6, ge=3)  # blocks before any metric is decided
    target_blocks: int = Field(10, ge=2)  # where the confidence sequence is tightest
    step: Seconds = 30.0  # one interval
    max_window: Seconds = 1800.0  # the gate answers by then
    pass_score: float = Field(95.0, ge=0, le=100)
    marginal_score: float = Field(75.0, ge=0, le=100)
    restarts_allowed: int = Field(0, ge=0)  # canary process restarts within the window before the gate fails

    @model_validator(mode="after")
    def _consistent(self) -> GateSettings:
        names = [m.label for m in self.metrics]
        if not names:
            raise ValueError("metrics: a gate judges at least one metric")
        if len(set(names)) != len(names):
            raise ValueError(f"metrics: {sorted({n for n in names if names.count(n) > 1})} listed twice")
        if self.marginal_score > self.pass_score:
            raise ValueError("marginal_score exceeds pass_score")
        # A gate answers within a day, reading at most every second: a step that does not move time on, or a
        # window of months, would never end (the HTTP API takes both from whoever asks).
        if self.step < MIN_STEP_S:
            raise ValueError(f"step {self.step:g}s is under {MIN_STEP_S:g}s")
        if self.max_window > MAX_WINDOW_S:
            raise ValueError(f"max_window {self.max_window:g}s is over a day ({MAX_WINDOW_S:g}s)")
        if self.max_window / self.step > MAX_STEPS:
            raise ValueError(f"max_window over step is {self.max_window / self.step:.0f} steps, over {MAX_STEPS}")
        return self


def step_problem(step: float, interval: float) -> str | None:
    """Why a gate step is too short for numbers scraped every `interval`, or None."""
    if step < interval:
        return f"{step:g}s is shorter than the scrape interval ({interval:g}s): steps without a scrape hold no data"
    return None


@dataclass(frozen=True, slots=True)
class Interval:
    """One step of a rollout: each metric's observations in both arms."""

    start: float
    end: float
    baseline: Mapping[str, Dist]
    canary: Mapping[str, Dist]
    restarted: tuple[str, ...] = ()  # the canary's pods whose process restarted in the step, once per restart


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    """One metric's judgement, with everything a person needs to check it."""

    name: str
    outcome: Outcome
    decided: bool
    reason: str
    critical: bool
    scale: Scale
    estimate: float | None = None  # ratio (1.07 is +7 %) or difference
    lower: float | None = None
    upper: float | None = None
    threshold: float | None = None  # the estimate at which the shift matters
    baseline: float | None = None  # the arm's statistic over the whole window
    canary: float | None = None
    blocks: int = 0
    baseline_count: float = 0.0
    canary_count: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "result": self.outcome.value, "decided": self.decided, "critical": self.critical,
                "scale": self.scale.value, "estimate": self.estimate, "lower": self.lower, "upper": self.upper,
                "threshold": self.threshold, "baseline": self.baseline, "canary": self.canary, "blocks": self.blocks,
                "baseline_count": self.baseline_count, "canary_count": self.canary_count, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's answer now: decided (pass or fail, or anything at the end of the window) or keep watching."""

    outcome: Outcome
    decided: bool
    score: float | None
    reason: str
    metrics: tuple[MetricVerdict, ...]
    started_at: float
    ended_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"result": self.outcome.value, "decided": self.decided, "score": self.score, "reason": self.reason,
                "started_at": self.started_at, "ended_at": self.ended_at,
                "metrics": [m.as_dict() for m in self.metrics]}


def tpot_reading(per_request: Iterable[bool]) -> dict[str, str]:
    """Where both arms' TPOT is read, given whether each engine of both has the per-request histogram: that one when
    every engine has it, else the inter-token latency for all (engines before it). Each arm on its own would compare
    a per-request mean with a token-weighted one."""
    return {} if all(per_request) else {"tpot": "itl"}


Series = Mapping[str, Sequence[tuple[float, float]]]  # an engine's stored signals: name -> points, oldest first


def _stored_tpot_reading(engines: Iterable[Series], since: float) -> dict[str, str] | None:
    """`tpot_reading` from engines' stored signals (each name -> points): by each engine's last `tpot_per_request`
    after `since`; None where none of them has one yet."""
    marks = [points[-1][1] >= 1.0 for e in engines if (points := [p for p in e.get("tpot_per_request", ())
                                                                   if p[0] > since])]
    return tpot_reading(marks) if marks else None


def arms_tpot_reading(baseline: Sequence[Series], canary: Sequence[Series], since: float) -> dict[str, str] | None:
    """`tpot_reading` for two arms from their engines' stored signals, once each arm has said which TPOT its engines
    have (`_stored_tpot_reading`); as stored where neither has said but both have a TPOT (signals from before engines
    said); None while that is not known yet (TPOT is then not read)."""
    said = [_stored_tpot_reading(arm, since) for arm in (baseline, canary)]
    if all(r is not None for r in said):
        return _stored_tpot_reading([*baseline, *canary], since)
    if all(r is None for r in said) and all(any(e.get("tpot_mean") for e in arm) for arm in (baseline, canary)):
        return {}
    return None


def engine_dists(series: Series, names: Sequence[str], start: float,
                 end: float, read_as: Mapping[str, str] | None = None) -> dict[str, Dist]:
    """One engine's observations in (start, end] from its stored signals (name -> points, oldest first): each
    interval mean weighted by the observations its rate implies since the point before it. Only means: the
    per-engine quantiles the collectors keep cannot be merged across engines. `read_as`: a metric read as another's
    mean (`tpot_reading`), or not at all ("")."""
    def counts(name: str) -> dict[float, float]:
        out: dict[float, float] = {}
        prev: float | None = None
        for ts, rate in series.get(name, ()):
            if prev is not None and start < ts <= end and math.isfinite(rate):
                out[ts] = max(0.0, rate) * (ts - prev)
            prev = ts
        return out

    out: dict[str, Dist] = {}
    requests = counts("request_rate")
    for name in names:
        if name == REQUESTS:
            if (total := sum(requests.values())) > 0:
                out[name] = Dist(total, total)
            continue
        if name == ERRORS:
            trials = sum(requests.values())
            if trials > 0:
                out[name] = Dist.of_events(sum(counts("request_error_rate").values()), trials)
            continue
        source = (read_as or {}).get(name, name)
        if not source:
            continue
        mean_name, rate_name = ENGINE_MEANS[source]
        weights = requests if rate_name == "request_rate" else counts(rate_name)
        for ts, value in series.get(mean_name, ()):
            n = weights.get(ts, 0.0)
            if start < ts <= end and n > 0 and math.isfinite(value):
                merge_into(out, name, Dist(n, value * n))
    return out


def merge_into(arm: dict[str, Dist], name: str, d: Dist) -> None:
    """Add `d` to an arm's observations of `name`."""
    arm[name] = d if name not in arm else arm[name].merge(d)


def blocks(intervals: Sequence[Interval], rule: MetricRule) -> list[tuple[Dist, Dist]]:
    """Consecutive intervals merged until both arms hold `block_count` observations; an unfinished tail is left out."""
    out: list[tuple[Dist, Dist]] = []
    base: Dist | None = None
    can: Dist | None = None
    for iv in intervals:
        b, c = iv.baseline.get(rule.name), iv.canary.get(rule.name)
        if b is not None:
            base = b if base is None else base.merge(b)
        if c is not None:
            can = c if can is None else can.merge(c)
        if base is not None and can is not None and base.count >= rule.block_count and can.count >= rule.block_count:
            out.append((base, can))
            base = can = None
    return out


def confidence_sequence(shifts: Sequence[float], alpha: float, target: int, floor: float, *,
                        at_least: float = 0.0) -> tuple[float, float, float]:
    """Mean of `shifts` and its two-sided (1 - alpha) confidence sequence, tightest after `target` shifts; `at_least`
    is a spread known from how the shifts are sampled, below which the estimate is not believed.

    Robbins' normal mixture: |mean - mu| <= s * sqrt(2 (n r² + 1) / (n² r²) * log(sqrt(n r² + 1) / alpha)).
    With the spread `s` estimated from a handful of blocks the boundary is too tight (a 5 % sequence
    looked at from the third block misses a fifth of the time), so its normal tail probability is
    read back on Student's t with n - 1 degrees of freedom, as a t interval corrects a z interval;
    and `s` is shrunk towards `floor` with two pseudo-observations, since identical blocks are not
    proof of no noise.
    """
    n = len(shifts)
    x = np.asarray(shifts, dtype=float)
    mean = float(x.mean())
    ss = float(((x - mean) ** 2).sum()) if n > 1 else 0.0
    s = max(math.sqrt((ss + 2.0 * floor * floor) / (n - 1 + 2.0)), at_least)
    log_a = -2.0 * math.log(alpha)
    r2 = (log_a + math.log(log_a + 1.0)) / target
    half = s * math.sqrt(2.0 * (n * r2 + 1.0) / (n * n * r2) * math.log(math.sqrt(n * r2 + 1.0) / alpha))
    se = s / math.sqrt(n)
    tail = float(norm.sf(half / se))
    half = float(student_t.isf(tail, max(n - 1, 1))) * se
    return mean, mean - half, mean + half


def event_rate_upper(events: float, trials: float, delta: float, prior_mean: float) -> float:
    """An anytime-valid upper bound on the rate of `events` among `trials`: where every trial's chance of an event is
    at least p whatever came before, the chance that the bound is ever below p, however often it is read, is at most
    `delta`.

    A test martingale per candidate rate p0: the likelihood of the trials under the rates below p0 (a Beta prior with
    mean `prior_mean`, cut at p0) against their likelihood under p0, rejected at 1/delta (Ville's inequality); the
    bound is where rejection starts. With no events in n trials it comes close to log(1/delta) / n, where a normal
    approximation needs several times the trials."""
    if not (math.isfinite(events) and math.isfinite(trials)) or trials <= 0:
        return 1.0
    events = min(max(events, 0.0), trials)  # counts read from rates over separately aligned series may overshoot
    if events >= trials:
        return 1.0
    s, f = events, trials - events
    a, b = 1.0, max(1.0, 1.0 / prior_mean - 1.0)
    evidence = betaln(s + a, f + b) - betaln(a, b)

    def excess(p0: float) -> float:
        posterior, prior = float(betainc(s + a, f + b, p0)), float(betainc(a, b, p0))  # their mass below p0
        if posterior <= 0.0 or prior <= 0.0:  # a mass too small for a float: read as not rejected, the safe side
            return -1.0
        return float(evidence + math.log(posterior) - math.log(prior) - s * math.log(p0) - f * math.log1p(-p0)
                     - math.log(1.0 / delta))

    tiny = 1e-12
    seen, top = min(max(s / trials, tiny), 1.0 - tiny), 1.0 - tiny
    if excess(top) < 0:  # nothing above the rate seen is rejected yet
        return 1.0
    return float(brentq(excess, seen, top, xtol=1e-12, rtol=1e-9))


def judge(intervals: Sequence[Interval], settings: GateSettings, *, final: bool = False) -> Verdict:
    """The gate's verdict from every interval since the canary started; `final` when the window is over."""
    alpha = settings.alpha / len(settings.metrics)  # each metric's share: the gate's bound holds over all of them
    verdicts = tuple(_judge_metric(intervals, rule, settings, alpha, final) for rule in settings.metrics)
    if (restarts := _restarts(intervals, settings)) is not None:
        verdicts += (restarts,)
    started = intervals[0].start if intervals else 0.0
    ended = intervals[-1].end if intervals else 0.0
    outcome, decided, score, reason = _combine(verdicts, settings, final)
    return Verdict(outcome, decided, score, reason, verdicts, started, ended)


def _restarts(intervals: Sequence[Interval], s: GateSettings) -> MetricVerdict | None:
    """A failed critical verdict once the canary's pods restarted more than `restarts_allowed` times, else None."""
    pods = Counter(pod for iv in intervals for pod in iv.restarted)
    n = sum(pods.values())
    if n <= s.restarts_allowed:
        return None
    each = ", ".join(f"{pod} {k} time{'s' if k > 1 else ''}" for pod, k in sorted(pods.items()))
    return MetricVerdict("restarts", Outcome.FAIL, True,
                         f"restarts: the canary's pods restarted {n} time{'s' if n > 1 else ''} within the gate ({each}), "
                         f"{s.restarts_allowed} allowed", True, Scale.DIFFERENCE, estimate=float(n),
                         threshold=float(s.restarts_allowed), canary=float(n))


def _combine(verdicts: Sequence[MetricVerdict], s: GateSettings,
             final: bool) -> tuple[Outcome, bool, float | None, str]:
    failed_critical = [v for v in verdicts if v.critical and v.outcome is Outcome.FAIL]
    if failed_critical:
        return Outcome.FAIL, True, 0.0, "critical metric failed: " + "; ".join(v.reason for v in failed_critical)
    if not final and not all(v.decided for v in verdicts):
        waiting = ", ".join(v.name for v in verdicts if not v.decided)
        return Outcome.INCONCLUSIVE, False, None, f"still collecting evidence on {waiting}"
    unknown_critical = [v for v in verdicts if v.critical and v.outcome is Outcome.INCONCLUSIVE]
    if unknown_critical:
        return (Outcome.INCONCLUSIVE, True, None, "no verdict on critical metric(s) by the end of the window: "
                + "; ".join(v.reason for v in unknown_critical))
    judged = [v for v in verdicts if v.outcome is not Outcome.INCONCLUSIVE]
    if not judged:
        return Outcome.INCONCLUSIVE, True, None, "no metric could be judged: " + "; ".join(v.reason for v in verdicts)
    unknown = [v for v in verdicts if v.outcome is Outcome.INCONCLUSIVE]
    # A marginal metric counts half, as Keptn scores a warning; it keeps the gate from passing.
    points = sum(1.0 if v.outcome is Outcome.PASS else 0.5 if v.outcome is Outcome.MARGINAL else 0.0 for v in judged)
    score = round(100.0 * points / len(judged), 2)
    below = [v for v in judged if v.outcome is not Outcome.PASS]
    detail = "; ".join(v.reason for v in below) if below else "every metric within its allowance"
    if not below and score >= s.pass_score:
        if unknown:
            # A metric without a verdict (no data, a renamed histogram) is never a pass, critical or not.
            return (Outcome.INCONCLUSIVE, True, None, "every judged metric within its allowance, but no verdict "
                    "on " + "; ".join(v.reason for v in unknown))
        return Outcome.PASS, True, score, f"score {score:g}: {detail}"
    if score >= s.marginal_score or all(v.outcome is not Outcome.FAIL for v in judged):
        return Outcome.MARGINAL, True, score, f"score {score:g} (marginal): {detail}"
    return Outcome.FAIL, True, score, f"score {score:g} < {s.marginal_score:g}: {detail}"


def _judge_metric(intervals: Sequence[Interval], rule: MetricRule, s: GateSettings, alpha: float,
                  final: bool) -> MetricVerdict:
    whole_b = _whole(intervals, rule.name, baseline=True)
    whole_c = _whole(intervals, rule.name, baseline=False)
    counts = {"baseline_count": whole_b.count if whole_b else 0.0, "canary_count": whole_c.count if whole_c else 0.0}
    values = {"baseline": whole_b.statistic(rule.statistic) if whole_b else None,
              "canary": whole_c.statistic(rule.statistic) if whole_c else None}
    common = {"name": rule.label, "critical": rule.critical, "scale": rule.scale, **counts, **values}
    pairs = blocks(intervals, rule)
    read = [got for b, c in pairs if (got := _shift(b, c, rule)) is not None]
    shifts = [d for d, _, _ in read]
    # A quantile past the highest bucket bound is only a lower bound of itself: the canary's makes a block's shift a
    # lower bound of the true one (it may show a regression, never clear one), the baseline's an upper bound.
    understated, overstated = any(c for _, _, c in read), any(b for _, b, _ in read)
    if counts["baseline_count"] <= 0 or counts["canary_count"] <= 0:
        arm = "baseline" if counts["baseline_count"] <= 0 else "canary"
        return MetricVerdict(outcome=Outcome.INCONCLUSIVE, decided=False, reason=f"{rule.label}: no data from the {arm}",
                             **common)  # type: ignore[arg-type]
    if whole_b is not None and whole_c is not None and _layouts_differ(whole_b, whole_c, rule.statistic):
        return MetricVerdict(outcome=Outcome.INCONCLUSIVE, decided=False, reason=(
            f"{rule.label}: the arms' histograms have different bucket bounds, so their {rule.statistic} cannot be "
            "compared (judge the mean, or export the same buckets)"), **common)  # type: ignore[arg-type]
    if len(shifts) < s.min_blocks:
        reason = (f"{rule.label}: {len(shifts)} of {s.min_blocks} blocks with {rule.block_count} observations per arm "
                  f"(canary has {counts['canary_count']:.0f}, baseline {counts['baseline_count']:.0f}): too little "
                  f"traffic to judge yet")
        return MetricVerdict(outcome=Outcome.INCONCLUSIVE, decided=False, reason=reason, blocks=len(shifts),
                             **common)  # type: ignore[arg-type]
    errors = rule.name == ERRORS
    counts_alpha = alpha * (1.0 - BLOCKS_SHARE)  # an error rate's counts take the rest of its alpha
    sampling = _sampling_spread(pairs, rule.allowed) if errors else 0.0
    level = alpha * BLOCKS_SHARE if errors else alpha
    mean, lo, hi = confidence_sequence(shifts, level, s.target_blocks, rule.floor(), at_least=sampling)
    ratio = rule.scale is Scale.RATIO
    allowed = math.log1p(rule.allowed) if ratio else rule.allowed
    margin = math.log1p(rule.margin) if ratio else rule.margin
    worse_up = _fails(mean, lo, allowed, margin) if rule.direction is not Direction.DECREASE else False
    worse_down = _fails(-mean, -hi, allowed, margin) if rule.direction is not Direction.INCREASE else False
    below, above = hi <= allowed, lo >= -allowed  # the shift shown within the allowance, from above and below
    canary_bound = None  # the canary's own error rate from above, where that, not the blocks, shows it within
    if errors and not below:
        assert whole_c is not None  # a canary without requests was answered above
        canary_bound = _canary_errors_within(whole_c, rule, counts_alpha)
        below = canary_bound is not None
    if understated:  # the true shift is at least this one: shown small from above, or worse downwards, it may not be
        worse_down = below = False
    if overstated:
        worse_up = above = False
    within = (below or rule.direction is Direction.DECREASE) and (above or rule.direction is Direction.INCREASE)
    if worse_up or worse_down:
        outcome, decided = Outcome.FAIL, True
    elif within:
        outcome, decided = Outcome.PASS, True
    elif final:
        significant = (lo > margin and rule.direction is not Direction.DECREASE) or \
                      (hi < -margin and rule.direction is not Direction.INCREASE)
        outcome, decided = (Outcome.MARGINAL if significant else Outcome.INCONCLUSIVE), True
    else:
        outcome, decided = Outcome.INCONCLUSIVE, False
    shown = (math.exp(mean), math.exp(lo), math.exp(hi)) if ratio else (mean, lo, hi)
    threshold = 1.0 + rule.allowed if ratio else rule.allowed
    why = None
    if outcome is Outcome.PASS and canary_bound is not None:
        why = (f"the canary's own error rate is at most {canary_bound:.4g} by its {counts['canary_count']:.0f} "
               f"requests ({1 - counts_alpha:.2%} anytime-valid), within the allowance whatever the "
               f"baseline's")
    reason = _explain(rule, outcome, decided, shown, len(shifts), values, 1.0 - level, why)
    if understated or overstated:
        arm = "the canary's" if understated else "the baseline's"
        reason += (f" ({arm} {rule.statistic} lay past the highest bucket bound in some blocks: that bound is only a "
                   f"lower bound of it, so the shift shown is a {'lower' if understated else 'upper'} bound)")
    return MetricVerdict(outcome=outcome, decided=decided, estimate=shown[0], lower=shown[1], upper=shown[2],
                         threshold=threshold, blocks=len(shifts), reason=reason,
                         **common)  # type: ignore[arg-type]


def _canary_errors_within(can: Dist, rule: MetricRule, delta: float) -> float | None:
    """The canary's own error rate from above, request by request (`event_rate_upper`), where it is within the
    allowance; None where it is not shown to be. Where errors are rare most blocks see none, and the blocks' spread is
    floored at the binomial one at the allowance, so a small canary needs some 2,500 requests to pass on them; its
    own rate shows the same within about 1,000 (a clean canary of 50 requests a step passes in 9.5 minutes, not 20.5).
    A canary under the allowance is within it whatever its baseline's rate, and this holds where rates move over the
    gate and the arms' shares do, where the difference of the arms' pooled rates would not (Simpson's paradox)."""
    bound = event_rate_upper(can.total, can.count, delta, prior_mean=min(0.5, max(rule.allowed, 1e-3)))
    return bound if bound <= rule.allowed else None


def _sampling_spread(pairs: Sequence[tuple[Dist, Dist]], allowed: float) -> float:
    """How far a block's difference of two error rates spreads by sampling alone (binomial), with the canary's rate at
    least the baseline's plus the allowance: where errors are rare most blocks see none, and the spread read from the
    blocks would be near 0, which would pass a canary failing at the allowance far more often than `alpha`."""
    if not pairs:
        return 0.0
    base = sum(b.total for b, _ in pairs) / sum(b.count for b, _ in pairs)
    can = min(1.0, max(sum(c.total for _, c in pairs) / sum(c.count for _, c in pairs), base + allowed))
    per_b, per_c = (sum(d.count for d in arm) / len(pairs) for arm in zip(*pairs, strict=True))
    return math.sqrt(base * (1 - base) / per_b + can * (1 - can) / per_c)


def _fails(mean: float, lo: float, allowed: float, margin: float) -> bool:
    return lo > margin and mean >= allowed


def _whole(intervals: Sequence[Interval], name: str, *, baseline: bool) -> Dist | None:
    out: Dist | None = None
    for iv in intervals:
        d = (iv.baseline if baseline else iv.canary).get(name)
        if d is not None:
            out = d if out is None else out.merge(d)
    return out


def _layouts_differ(base: Dist, can: Dist, statistic: str) -> bool:
    """Whether a quantile would be read from two bucket layouts: each arm's is interpolated inside its own buckets, so
    an identical canary exported with coarser buckets (a vLLM upgrade that changed them) reads several times slower,
    and a slower one with finer buckets faster."""
    return (statistic != "mean" and not (base.samples and can.samples) and bool(base.buckets) and bool(can.buckets)
            and [le for le, _ in base.buckets] != [le for le, _ in can.buckets])


def _shift(base: Dist, can: Dist, rule: MetricRule) -> tuple[float, bool, bool] | None:
    """A block's shift, and whether the baseline's and the canary's statistic were only lower bounds of themselves
    (None where both were, or either is missing, or the arms' bucket layouts differ)."""
    if _layouts_differ(base, can, rule.statistic):
        return None
    got_b, got_c = base.bounded(rule.statistic), can.bounded(rule.statistic)
    if got_b is None or got_c is None or (got_b[1] and got_c[1]):
        return None
    (b, b_low), (c, c_low) = got_b, got_c
    if rule.scale is Scale.DIFFERENCE:
        return c - b, b_low, c_low
    if b <= 0 or c <= 0:
        return None
    return math.log(c / b), b_low, c_low


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _shift_text(v: float, scale: Scale) -> str:
    return f"{(v - 1) * 100:+.1f}%" if scale is Scale.RATIO else f"{v:+.4g}"


def _explain(rule: MetricRule, outcome: Outcome, decided: bool, shown: tuple[float, float, float], n: int,
             values: Mapping[str, float | None], level: float, why: str | None = None) -> str:
    est, lo, hi = shown
    allowed = f"+{rule.allowed * 100:.1f}%" if rule.scale is Scale.RATIO else f"{rule.allowed:+.4g}"
    head = (f"{rule.label}: canary {_fmt(values['canary'])} vs baseline {_fmt(values['baseline'])}, "
            f"shift {_shift_text(est, rule.scale)} (interval {_shift_text(lo, rule.scale)} to "
            f"{_shift_text(hi, rule.scale)}, {level:.1%} anytime-valid, {n} blocks), allowed {allowed}")
    why = why or {
        Outcome.FAIL: "the whole interval is worse than the baseline and the shift reaches the allowance",
        Outcome.PASS: "even the worst end of the interval stays within the allowance",
        Outcome.MARGINAL: "worse than the baseline with confidence, but not shown to reach the allowance",
        Outcome.INCONCLUSIVE: ("the interval still straddles the allowance" if not decided
                               else "the window ended with the interval straddling the allowance"),
    }[outcome]
    return f"{head}: {outcome.value}, {why}"
