"""Saturation: a pool has more work than capacity.

Three signs, each judged on the pool's aggregate signals:
- the queue grows: over the trend window ending at each of the newest few scrapes, the Theil-Sen
  line of waiting requests rose by enough per engine and a Mann-Kendall test finds the rise
  significant, while the queue is also long now and the pool is not already scaling up (more
  replicas desired than ready: the queue is expected to grow until they serve). A queue that is
  long but flat keeps an open finding open and never opens one. Waiting for capacity
  (`requests_waiting_capacity`) is used when vLLM reports it, because requests deferred for a KV
  transfer are waiting on the prefill side, not on this pool;
- the KV cache is full (mean usage over a few scrapes) and requests were preempted (recomputed)
  to make room lately;
- requests fail (`finished_reason="error"`) while the pool is loaded. Errors on an idle pool are
  a bug or a bad deployment, not saturation, and are left to other alerts. vLLM's frontend
  queue-limit rejections (`vllm:admission_rejections_total`) carry no engine label and are not
  collected, so only engine-side errors count here.
The proposal scales the pool by one replica; its verify signal follows the main sign.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field

from catalog.settings import Problem, Seconds, Settings
from policies.common import engines_of, gone_findings, ratio_series, recent_mean, reported_since
from policies.types import (
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Severity,
)
from policies.windows import SignalWindows

__all__ = ["KIND", "Cause", "Saturation", "SaturationSettings", "slope"]

KIND = "saturation"
WAITING = "requests_waiting"
WAITING_CAPACITY = "requests_waiting_capacity"
KV = "kv_cache_usage"
PREEMPTIONS = "preemption_rate"
ERRORS = "request_error_rate"
REQUESTS = "request_rate"


class Cause(StrEnum):
    """Which sign of saturation holds."""

    QUEUE_GROWTH = "queue_growth"
    KV_EXHAUSTED = "kv_exhausted"
    ERRORS_UNDER_LOAD = "errors_under_load"


class SaturationSettings(Settings):
    """Thresholds (`policies.saturation` in the fleet file); queues are in requests per engine, KV usage a fraction."""

    enabled: bool = True
    trend_points: int = Field(20, ge=3)  # the slope is fitted over this many intervals (5 min at 15 s)
    min_growth_per_engine: float = Field(2.0, gt=0)  # the fitted queue grew by this much per engine over them
    min_waiting_per_engine: float = Field(2.0, gt=0)  # ... and is at least this long now (mean of level_points)
    level_points: int = Field(3, ge=1)
    confirm_points: int = Field(3, ge=1)  # growth must show in the trend windows ending at this many newest scrapes
    trend_z: float = Field(3.5, gt=0)  # ... and be significant: Mann-Kendall z this high (one-sided p ~ 2e-4)
    kv_full: float = Field(0.90, gt=0, le=1)  # mean KV usage of the pool's engines, averaged over recent_points
    recent_points: int = Field(3, ge=1)  # intervals KV usage is averaged over; consecutive intervals with errors
    preempt_points: int = Field(8, ge=1)  # a preemption within this many intervals counts as "preempting"
    error_share: float = Field(0.02, gt=0, lt=1)  # failed share of finished requests
    loaded_waiting_per_engine: float = Field(2.0, gt=0)  # errors count only while this many wait per engine
    critical_waiting_per_engine: float = Field(10.0, gt=0)
    resolve_points: int = Field(4, ge=1)  # consecutive clean intervals to resolve (hysteresis), requests served in each
    idle_resolve_points: int = Field(40, ge=1)  # ... or this many intervals (10 min) without a request resolve as idle
    # An open finding's queue counts as long while above min_waiting_per_engine, or above the pool's own
    # normal (its median queue per engine over normal_points before the finding) times normal_margin,
    # whichever is higher: a batch pool that always queues 3 per engine resolves when the burst is over.
    normal_margin: float = Field(1.25, gt=1)
    normal_points: int = Field(120, ge=2)
    stale_s: Seconds = 900.0

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval (none: it counts points)."""
        return []


def slope(points: list[tuple[float, float]]) -> float:
    """Theil-Sen slope (value per second) of (ts, value) points: the median of pairwise slopes; 0 for fewer than two.

    Unlike a least-squares line, a queue that jumped once and then held still has a median slope
    near 0: only growth that goes on through the window counts.
    """
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1:] if b[0] > a[0]]
    return statistics.median(slopes) if slopes else 0.0


@dataclass(slots=True)
class _State:
    """The pool's saturation signs, judged now."""

    queue_signal: str
    engines: int
    waiting: float
    growth: float  # fitted growth over the trend window, per engine
    kv: float | None
    preemptions: float | None
    error_share: float | None
    causes: list[Cause]
    scaling_up: bool  # the pool has more replicas desired than ready
    normal: float | None = None  # the pool's usual queue per engine before the finding, when known


class Saturation:
    """Detects pools whose queue grows, whose KV cache overflows, or that fail under load."""

    kind = KIND
    reads: tuple[str, ...] = (WAITING, WAITING_CAPACITY, KV, PREEMPTIONS, ERRORS, REQUESTS, "engines_reporting")

    def __init__(self, settings: SaturationSettings | None = None) -> None:
        self.settings = settings or SaturationSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every pool that reports a queue."""
        s = self.settings
        result = PolicyResult()
        subjects = sorted(inp.windows.subjects(WAITING, prefix="pool/"))
        for subject in subjects:
            if not reported_since(inp.windows, subject, (WAITING,), inp.now - s.stale_s):
                continue  # judged on old data it would reopen what `gone_findings` resolves below
            key = FindingKey(KIND, subject)
            is_open = key in inp.open_findings
            normal = inp.open_findings[key].evidence.get("normal_waiting_per_engine") if is_open else None
            state = self._judge(inp, subject, is_open, normal)
            if state is None:
                continue
            why = self._clean(inp, subject, state) if is_open and not state.causes else None
            if why is not None:
                result.resolved.append((key, why))
                continue
            if state.causes or is_open:
                result.findings.append(self._report(subject, state))
        result.resolved += gone_findings(inp, KIND, (WAITING,), s.stale_s)
        return result

    def _long(self, waiting: float, normal: float | None) -> bool:
        """A queue per engine too long to call the pool fine: above the floor, and above its own normal."""
        s = self.settings
        return waiting >= max(s.min_waiting_per_engine, (normal or 0.0) * s.normal_margin)

    def _judge(self, inp: PolicyInput, subject: str, is_open: bool, normal: float | None) -> _State | None:
        s = self.settings
        w = inp.windows
        pool = subject.removeprefix("pool/")
        # The queue for want of capacity where the engines report it, and report it still (not after a rollout to a
        # vLLM without the by-reason gauge, whose last values would stand for now's).
        capacity_at, waiting_at = w.latest_ts(subject, WAITING_CAPACITY), w.latest_ts(subject, WAITING)
        fresh = capacity_at is not None and (waiting_at is None or capacity_at >= waiting_at)
        queue_signal = WAITING_CAPACITY if fresh else WAITING
        level = recent_mean(w, subject, queue_signal, s.level_points)
        if level is None:
            return None
        engines = engines_of(inp, pool)
        series = w.series(subject, queue_signal)[-(s.trend_points + s.confirm_points - 1):]
        # Growth over the trend windows ending at each of the newest scrapes: every one must be
        # large and significant, so one noisy window of a fluctuating queue does not pass for a trend.
        fits = [_growth(series[max(0, len(series) - s.trend_points - k): len(series) - k], s.trend_points)
                for k in range(s.confirm_points)]
        growth = fits[0][0] / engines
        growing = all(g / engines >= s.min_growth_per_engine and z >= s.trend_z for g, z in fits)
        waiting = level / engines
        causes = []
        long_queue = self._long(waiting, normal) if is_open else waiting >= s.min_waiting_per_engine
        state = inp.pools.get(pool)
        scaling = state is not None and state.desired > state.ready and state.stalled_for is None
        # Opening needs growth, and not while replicas are being added: the queue is expected to
        # grow until they serve (a stalled pool's never come). An open finding stays while the queue is still long.
        if long_queue and ((growing and not scaling) or is_open):
            causes.append(Cause.QUEUE_GROWTH)
        if self._kv_exhausted(w, subject, s.recent_points):
            causes.append(Cause.KV_EXHAUSTED)
        shares = [v for _, v in ratio_series(w, subject, ERRORS, REQUESTS)][-s.recent_points:]
        kv_now = w.latest(subject, KV)
        loaded = waiting >= s.loaded_waiting_per_engine or (kv_now is not None and kv_now >= s.kv_full)
        if len(shares) == s.recent_points and all(v >= s.error_share for v in shares) and loaded:
            causes.append(Cause.ERRORS_UNDER_LOAD)
        if causes and not is_open:  # opening: the pool's usual queue before, what "back to normal" will mean
            before = w.last(subject, queue_signal, s.normal_points + s.trend_points)[:-s.trend_points]
            normal = round(statistics.median(before) / engines, 3) if len(before) >= s.trend_points else None
        return _State(queue_signal, engines, waiting, growth, kv_now, w.latest(subject, PREEMPTIONS),
                      shares[-1] if shares else None, causes, scaling, normal)

    def _kv_exhausted(self, w: SignalWindows, subject: str, n: int) -> bool:
        """KV usage averaged over the newest `n` intervals is full, and preemptions happened lately."""
        s = self.settings
        kv = w.last(subject, KV, n)
        if len(kv) < n or statistics.fmean(kv) < s.kv_full:
            return False
        return any(v > 0 for v in w.last(subject, PREEMPTIONS, s.preempt_points))

    def _clean(self, inp: PolicyInput, subject: str, state: _State) -> str | None:
        """Why the finding resolves now, or None while it must stay open."""
        s = self.settings
        w = inp.windows
        n = s.resolve_points
        queue = w.last(subject, state.queue_signal, n)
        if len(queue) < n or self._long(statistics.fmean(queue) / state.engines, state.normal):
            return None
        # Clean means each of the last n intervals was: a KV cache full in any of them while preemptions go on keeps
        # it open (a mean of them, against the bar it opened at, would resolve and reopen it every other tick).
        if any(v >= s.kv_full for v in w.last(subject, KV, n)) and any(
                v > 0 for v in w.last(subject, PREEMPTIONS, s.preempt_points)):
            return None
        # The errors of the last n intervals, one without requests counting as clean: over the intervals that had
        # requests only, an idle pool would show the same old errors for as long as the history keeps them.
        last = w.series(subject, REQUESTS)[-n:]
        since = last[0][0] if last else None
        if not all(v < s.error_share for _, v in ratio_series(w, subject, ERRORS, REQUESTS, since=since)):
            return None
        # Recovery must be seen under traffic: a lull between bursts empties the queue with nothing
        # fixed (the Azure code trace pauses for minutes at a time), and the next burst reopens it.
        served = w.last(subject, REQUESTS, s.idle_resolve_points)
        if not served or all(v > 0 for v in served[-n:]):
            return "queue, KV cache and errors back to normal"
        if len(served) == s.idle_resolve_points and not any(served):
            return f"no requests for {s.idle_resolve_points} intervals: nothing left to saturate"
        return None

    def _report(self, subject: str, st: _State) -> FindingReport:
        s = self.settings
        pool = subject.removeprefix("pool/")
        texts = []
        if Cause.QUEUE_GROWTH in st.causes:
            texts.append(f"{st.waiting:.1f} requests wait per engine, {st.growth:+.1f} per engine over the last "
                         f"{s.trend_points} intervals: arrivals outpace what {st.engines} engines serve.")
        if Cause.KV_EXHAUSTED in st.causes:
            texts.append(f"KV cache {st.kv:.0%} full with {st.preemptions:.2f} preemptions/s: running requests are "
                         "evicted and recomputed to make room, so each request costs more compute.")
        if Cause.ERRORS_UNDER_LOAD in st.causes:
            texts.append(f"{st.error_share:.1%} of finished requests fail while the pool is loaded.")
        if not st.causes:
            texts.append("The signs have eased; waiting for the queue, KV cache and errors to stay normal.")
        main = st.causes[0] if st.causes else None
        if main is Cause.KV_EXHAUSTED:
            value, baseline, statistic, threshold, signal = st.kv, None, st.kv, s.kv_full, KV
        elif main is Cause.ERRORS_UNDER_LOAD:
            value, baseline, statistic, threshold, signal = st.error_share, None, st.error_share, s.error_share, ERRORS
        else:
            value, statistic, threshold, signal = st.waiting, st.growth, s.min_growth_per_engine, st.queue_signal
            baseline = st.waiting - st.growth
        evidence: dict[str, Any] = {
            "signal": signal,
            "value": _round(value),
            "baseline": _round(baseline),
            "statistic": _round(statistic),
            "threshold": threshold,
            "causes": [c.value for c in st.causes],
            "cause": None if main is None else main.value,
            "waiting_per_engine": round(st.waiting, 3),
            "normal_waiting_per_engine": st.normal,
            "queue_growth_per_engine": round(st.growth, 3),
            "queue_signal": st.queue_signal,
            "engines": st.engines,
            "scaling_up": st.scaling_up,
            "kv_cache_usage": _round(st.kv),
            "preemption_rate": _round(st.preemptions),
            "error_share": _round(st.error_share),
            "short_pools": [pool] if main is not None else [],
            "suggested_actions": [f"add capacity to {pool} (the autoscaler's input)"] if main is not None else [],
        }
        critical = (Cause.ERRORS_UNDER_LOAD in st.causes or len(st.causes) >= 2
                    or st.waiting >= s.critical_waiting_per_engine)
        severity = Severity.CRITICAL if critical and st.causes else Severity.WARNING
        summary = (f"{pool} is saturated: {', '.join(c.value for c in st.causes)}" if st.causes
                   else f"{pool} is recovering from saturation")
        return FindingReport(FindingKey(KIND, subject), severity, summary, " ".join(texts), evidence, KIND)


def _growth(points: list[tuple[float, float]], trend_points: int) -> tuple[float, float]:
    """How much the queue grew over `points` (Theil-Sen line), and the Mann-Kendall z of that trend.

    The slope gives the size of the growth; the Mann-Kendall statistic, which counts rising minus
    falling pairs, tells a trend from noise with a null distribution that does not depend on how
    the queue is distributed. (0, 0) with less than half a trend window.
    """
    if len(points) < max(3, trend_points // 2):
        return 0.0, 0.0
    values = [v for _, v in points]
    n = len(values)
    s = sum((b > a) - (b < a) for i, a in enumerate(values) for b in values[i + 1:])
    ties = Counter(values).values()
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties)) / 18
    z = (s - 1) / math.sqrt(var) if s > 0 and var > 0 else 0.0
    return slope(points) * (points[-1][0] - points[0][0]), z


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
