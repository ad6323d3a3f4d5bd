"""SLO-driven sizing of prefill and decode pools: absolute replica targets that lead the load.

Pure: the caller hands in the signal windows, the pools, the open findings and the time. Per pool:

1. Load, from the pool's own aggregates: arrivals per second (finished requests plus the growth of
   requests in the pool, so a queue building up counts), prompt tokens per request net of prefix-cache
   hits, output tokens per request, requests running.
2. Forecast: Holt's damped trend over the arrival series, as far ahead as the pool takes to start an
   engine (learned from its own scale-ups: a raised `replicas_desired` until `replicas_ready` reaches
   it), with headroom from the upper quantile of the forecast's own errors at that horizon.
3. Curves: TTFT p95 against prefill utilisation and TPOT p95 against the batch per engine and its
   context, fitted (scikit-learn) on the pool's own points since the workload last changed shape
   (prompt or output length moving by more than `shape_shift`, a jump seen within four scrapes; the
   load's lengths are averaged over the new shape's scrapes only); the engine profile is the prior
   until `min_points` exist, over the pool's prompt-length distribution (a long tail raises the mean
   prefill and, more, the wait behind it: an M/G/1 queue). A prefill engine's passes hold the prompts
   that arrived during the last one, so at light load each prompt pays most of a pass's fixed cost; the
   cost per request is taken at the size planned. Bursts inside the minute cap the utilisation
   further: the busiest scrape's excess over the engines must clear within the TTFT budget.
4. Target: the fewest engines whose predicted TTFT p95 and TPOT p95 stay within `margin` of the SLOs at
   the forecast load, the KV cache included. A target below the current size holds only once every
   target of the last `scale_down_after` was as low (a lull between bursts sheds nothing); an open
   SLO-burn or saturation finding on a pool the curves call big enough adds an engine, since the
   curves are wrong then, and so does the pool's own record: a minute of the history in which it broke
   TTFT with requests queued and its engines unchanged keeps it above that many engines for as much
   load. One component owns replica counts: the symptom policies only report.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from pydantic import Field
from sklearn.linear_model import LinearRegression

from catalog.settings import Seconds, Settings
from policies.inputs import stale_among
from policies.stats import MAX_CONTEXT, lognormal_p95, lognormal_sigma, quadratic_moments
from policies.types import ActionKind, PolicyInput, PoolState, Proposal, ScaleTo
from policies.windows import HISTORY_S, SignalWindows, by_minute, minute_means

__all__ = [
    "CAPACITY_FINDINGS",
    "AutoscaleSettings",
    "Autoscaler",
    "EngineCurves",
    "Forecast",
    "PoolLoad",
    "PoolPlan",
    "Sizer",
    "SizerRun",
    "Unplanned",
    "arrival_series",
    "burst_factor",
    "forecast",
    "learned_startup",
    "plan_each",
    "pool_load",
    "scrape_interval",
    "slo_broken_minutes",
    "whole_minute",
]

# What the loop records each tick for every pool (from the actuator's view and from the sizer), so
# start-up times, the stabilisation window and the dashboard read them back like any signal.
DESIRED, READY = "replicas_desired", "replicas_ready"
GANG = "replicas_gang"  # engines that come and go together (a LeaderWorkerSet group's size, else 1)
TARGET, FORECAST = "autoscale_target_replicas", "autoscale_forecast_rate"
# The start-up time last measured, recorded every tick while known, so a pool that has not scaled up within the
# history still plans as far ahead as its engines take to start (and a restarted control plane reads it back).
STARTUP = "autoscale_startup_seconds"
ROLLING = "replicas_rolling"  # 1 while a new pod template rolls out: its engines restart, none is missing
# Findings that say a pool is short of capacity (their evidence's `short_pools`): inputs to the sizer,
# which alone sets replica counts.
CAPACITY_FINDINGS = ("slo_burn", "saturation")
MIN_BURST_COUNT = 5.0  # requests per scrape under which a minute says nothing about bursts
LENGTH_SCRAPES = 20  # scrapes the lengths per request are averaged over, and the blocks shapes are compared in
SHIFT_CONFIRM = 4  # scrapes in a row, all moved the same way, that mark a new shape at once
STEADY_S = 120.0  # a minute judges the pool's size only this long after its engines last changed
MIN_R2 = 0.3  # a fitted curve replaces the prior only when it explains this share of its points' variance
READS = ("request_rate", "prompt_tokens_rate", "generation_tokens_rate", "prefix_cache_hit_rate", "requests_running",
         "requests_waiting", "ttft_p95", "tpot_p95", "kv_cache_usage", "engines_reporting")


class AutoscaleSettings(Settings):
    """`autoscaling` in the fleet file: how the sizer plans (off unless enabled)."""

    enabled: bool = False
    margin: float = Field(0.8, gt=0.1, le=1.0)  # plan for p95s at this share of the SLO
    headroom_quantile: float = Field(0.9, ge=0.5, lt=1.0)  # of the forecast's errors at its horizon
    smoothing: float = Field(0.4, gt=0, le=1)  # Holt's level weight
    trend: float = Field(0.05, ge=0, le=1)  # Holt's trend weight: bursts are headroom's job, not the trend's
    damping: float = Field(0.8, gt=0, le=1)  # how fast a trend fades over the horizon
    startup: Seconds = 120.0  # start-up time assumed until the pool's own scale-ups measure it
    scale_down_after: Seconds = 600.0  # a lower target holds only after this long of lower targets
    history: Seconds = 3600.0  # how far back curves and forecast look
    min_points: int = Field(20, ge=5)  # fitted curves replace the prior with at least this many points
    shape_shift: float = Field(0.2, gt=0, lt=1)  # prompt or output length moving this much refits the curves
    kv_usage_max: float = Field(0.85, gt=0.1, le=1.0)  # KV share one engine's batch may fill
    max_utilization: float = Field(0.9, gt=0.1, lt=1.0)  # prefill utilisation never planned above this

    def problems(self, interval: float) -> list[tuple[str, str]]:
        out = []
        if self.scale_down_after < 4 * interval:
            out.append(("scale_down_after", f"{self.scale_down_after:g}s holds fewer than 4 scrapes at "
                                            f"{interval:g}s: a lull between two scrapes would shed capacity"))
        # The loop keeps HISTORY_S of signals: a hold longer than that never sees its window covered, so the pool
        # would never shrink; curves and forecast would silently read less than asked.
        if self.scale_down_after > HISTORY_S - interval:
            out.append(("scale_down_after", f"{self.scale_down_after:g}s is not shorter than the {HISTORY_S:g}s of "
                                            "history the loop keeps: the hold would never be covered, and the pool "
                                            "never scale down"))
        if self.history > HISTORY_S:
            out.append(("history", f"{self.history:g}s is longer than the {HISTORY_S:g}s of history the loop keeps"))
        return out


@dataclass(frozen=True, slots=True)
class EngineCurves:
    """One engine of a pool as its profile describes it: the prior until the fleet's own data take over."""

    prefill: tuple[float, float, float]  # seconds for one forward pass over T prompt tokens: a + bT + cT²
    decode: tuple[float, float, float]  # seconds per decode step of B sequences of context C: d + eB + fBC
    kv_tokens: int  # tokens the engine's KV cache holds
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    gpus: int = 1

    def prefill_seconds(self, tokens: float) -> float:
        """One pass over `tokens` prompt tokens."""
        a, b, c = self.prefill
        return a + b * tokens + c * tokens * tokens

    def prefill_terms(self, hit: float, pass_tokens: float | None = None) -> tuple[float, float]:
        """A prompt's prefill seconds as beta*P + gamma*P^2 with a share `hit` of it cached: its new tokens in
        passes of `pass_tokens` (default: full passes of the token budget), sharing each pass's fixed cost, each
        attending over what is already in the cache (the profile's quadratic term)."""
        a, b, c = self.prefill
        h = min(max(hit, 0.0), 1.0)
        x = float(self.max_batched_tokens) if pass_tokens is None else max(1.0, pass_tokens)
        return (1.0 - h) * (a / x + b), c * (1.0 - h) * (1.0 + h)

    def pass_tokens(self, arrivals: float, new_tokens: float, extra: float = 0.0) -> float:
        """New tokens in a pass when prompts of `new_tokens` arrive at `arrivals` per second: the prompts that came
        during the last pass, at least one (a zero-truncated Poisson count, m / (1 - e^-m) for m expected), up to
        the token budget; a fixed point. `extra`: what else each pass runs (a unified engine's decode step). At
        light load a pass carries one or two prompts, each paying most of its fixed cost."""
        x = max(1.0, new_tokens)
        for _ in range(50):
            m = arrivals * (self.prefill_seconds(x) + extra)
            per_pass = m / -math.expm1(-m) if m > 1e-9 else 1.0
            nxt = min(float(self.max_batched_tokens), max(1.0, new_tokens * per_pass))
            done = abs(nxt - x) < 0.5
            x = nxt
            if done:
                break
        return x

    def request_prefill_seconds(self, prompt: float, cached: float) -> float:
        """Engine time to compute one prompt's `prompt - cached` new tokens, when passes are full."""
        if prompt <= 0:
            return 0.0
        beta, gamma = self.prefill_terms(cached / prompt)
        return beta * prompt + gamma * prompt * prompt

    def request_prefill_moments(self, prompt: float, hit: float, sigma: float,
                                pass_tokens: float | None = None) -> tuple[float, float]:
        """Mean and second moment of a prompt's prefill seconds over lognormal prompt lengths with mean `prompt` and
        shape `sigma`, a share `hit` of each cached, in passes of `pass_tokens`: a long tail costs more than its
        mean says, and costs far more in the queue behind it (sigma 0: the mean prompt, squared)."""
        return quadratic_moments(*self.prefill_terms(hit, pass_tokens), prompt, sigma)

    def step_seconds(self, batch: float, context: float) -> float:
        """One decode step: the inter-token latency of a batch."""
        d, e, f = self.decode
        return d + e * batch + f * batch * context


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's load now: arrivals per second, and what a request asks of it."""

    arrivals: float  # requests per second entering the pool
    prompt_tokens: float  # per request, before the prefix cache
    output_tokens: float  # per request
    hit_rate: float  # prefix-cache hit share of prompt tokens
    prompt_sigma: float = 0.0  # lognormal shape of the prompt lengths (0: unknown, or all alike)

    @property
    def net_prompt_tokens(self) -> float:
        """Prompt tokens per request the pool computes (cache hits cost nothing)."""
        return self.prompt_tokens * (1.0 - self.hit_rate)

    @property
    def context(self) -> float:
        """Mean context of a decoding sequence: the prompt and half the output."""
        return self.prompt_tokens + self.output_tokens / 2.0


@dataclass(frozen=True, slots=True)
class Forecast:
    """Arrivals per second now, expected at the horizon, and the upper quantile planned for."""

    now: float
    expected: float
    upper: float
    horizon_s: float


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What the sizer would set a pool to now, and why."""

    pool: str
    desired: int
    ready: int
    target: int  # after the bounds and the scale-down hold
    recommended: int  # what the load asks for this tick, before the hold
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def proposal(self) -> Proposal | None:
        """The scale this plan asks of the rails, if any."""
        if self.target == self.desired:
            return None
        return Proposal(ActionKind.SCALE_POOL, self.pool, ScaleTo(self.target), self.reason, verify_slo=True,
                        inputs=READS)


@dataclass(frozen=True, slots=True)
class Unplanned:
    """A pool the sizer does not size this tick, and why: it keeps its size."""

    pool: str
    reason: str


class Sizer(Protocol):
    """Anything that plans replica counts from one tick's input (the autoscaler, or a baseline to compare it with);
    like a policy it must not perform I/O or read the clock. Pools are sized independently: the loop asks for one
    at a time, so a pool whose numbers break the sizer keeps its size and the others are still sized."""

    name: str

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan | Unplanned:
        """The plan for one pool, or why it does not size it now."""
        ...


@dataclass(slots=True)
class SizerRun:
    """One run of a sizer over the pools: every pool's plan, the pools it left as they are with why, and the pools
    it failed on with what it raised."""

    plans: list[PoolPlan] = field(default_factory=list)
    unplanned: dict[str, str] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)

    def errors(self) -> dict[str, str]:
        """Each failed pool's error as one line: the exception's type and message."""
        return {pool: f"{type(exc).__name__}: {exc}" for pool, exc in self.failed.items()}


def plan_each(sizer: Sizer, inp: PolicyInput) -> SizerRun:
    """The sizer run on one pool at a time, in name order: a pool whose numbers break it (a bug on data nobody
    foresaw) is reported with its error and keeps its size, and the other pools are still planned."""
    out = SizerRun()
    for name, pool in sorted(inp.pools.items()):
        try:
            plan = sizer.plan_pool(inp, pool)
        except Exception as exc:  # any error in one pool's sizing is that pool's alone
            out.failed[name] = exc
            continue
        if isinstance(plan, Unplanned):
            out.unplanned[name] = plan.reason
        else:
            out.plans.append(plan)
    return out


# load -------------------------------------------------------------------------------------------


_OWED_SCRAPES = 4


def arrival_series(w: SignalWindows, subject: str, since: float) -> list[tuple[float, float]]:
    """Arrivals per second at each scrape: finished requests plus the growth of those in the pool. A scrape at which
    more left the pool than finished (a pod that missed it took its queue out of the sums) reads zero, and growth
    at scrapes where more pods answer again, over the next `_OWED_SCRAPES`, is that queue back, up to what left:
    clamped alone, a deep queue would come back as a burst that never was. Growth while no pod comes back (a pod
    gone with its queue, a surge after it) is arrivals; without pod counts, any growth may be the queue back."""
    done = w.series(subject, "request_rate", since=since)
    inside = {ts: v for ts, v in w.series(subject, "requests_running", since=since)}
    for ts, v in w.series(subject, "requests_waiting", since=since):
        inside[ts] = inside.get(ts, 0.0) + v
    pods = dict(w.series(subject, "pods_reporting", since=since))
    out: list[tuple[float, float]] = []
    prev: tuple[float, float] | None = None
    gone, gone_for = 0.0, 0  # requests that left the sums with pods that missed a scrape; scrapes left to come back
    for ts, rate in done:
        here = inside.get(ts)
        if here is None or prev is None or ts <= prev[0]:
            out.append((ts, rate))
        else:
            span, growth = ts - prev[0], here - prev[1]
            # Pods that answered, more or fewer than the scrape before; unknown where either count was not read.
            more = pods[ts] - pods[prev[0]] if ts in pods and prev[0] in pods else None
            back = min(gone, max(0.0, growth)) if more is None or more > 0 else 0.0
            arrived = rate * span + growth - back
            gone, gone_for = gone - back, max(0, gone_for - 1)
            # Not only where fewer answered: a new pod may answer as another misses the scrape.
            if arrived < 0 and (more is None or more <= 0):
                gone, gone_for = gone - arrived, _OWED_SCRAPES
            gone = gone if gone_for else 0.0
            out.append((ts, max(0.0, arrived) / span))
        if here is not None:
            prev = (ts, here)
    return out


def _recent(w: SignalWindows, subject: str, name: str, points: int = 4, since: float | None = None) -> float | None:
    """The mean of a series' newest `points` values, of those at or after `since` where there are any."""
    values = [v for _, v in w.series(subject, name, since=since)[-points:]] if since is not None else []
    values = values or w.last(subject, name, points)
    return statistics.fmean(values) if values else None


def _length_points(w: SignalWindows, subject: str, since: float | None) -> list[tuple[float, float, float, float]]:
    """(time, requests finished a second, prompt and output tokens a second of those requests) per scrape since
    `since` (any). From the length histograms, which count a request when it finishes, as the finished count does: the
    token counters count a prompt when it is prefilled and an output token as it is made, so while the load steps up
    tokens over finished requests read lengths many times too long (the requests begun outnumber those done). Where
    the histograms are not reported, the token counters stand in."""
    finished = w.series(subject, "request_rate", since=since)
    prompt_mean = dict(w.series(subject, "prompt_len_mean", since=since))
    if prompt_mean:  # a scrape that finished none has no mean, and adds nothing
        output_mean = dict(w.series(subject, "output_len_mean", since=since))
        return [(ts, r, r * prompt_mean.get(ts, 0.0), r * output_mean.get(ts, 0.0)) for ts, r in finished
                if r <= 0 or ts in prompt_mean]
    prompt = dict(w.series(subject, "prompt_tokens_rate", since=since))
    gen = dict(w.series(subject, "generation_tokens_rate", since=since))
    return [(ts, r, prompt[ts], gen.get(ts, 0.0)) for ts, r in finished if ts in prompt]


def _mean_lengths(w: SignalWindows, subject: str, since: float | None) -> tuple[float, float]:
    """Mean prompt and output tokens per finished request over the newest `LENGTH_SCRAPES` scrapes (those since
    `since` where there are any); (0, 0) while none finished."""
    points = (_length_points(w, subject, since) or _length_points(w, subject, None))[-LENGTH_SCRAPES:]
    done = sum(r for _, r, _, _ in points)
    if done <= 0:
        return 0.0, 0.0
    return sum(p for _, _, p, _ in points) / done, sum(o for _, _, _, o in points) / done


def pool_load(w: SignalWindows, pool: str, arrivals: Sequence[tuple[float, float]],
              shape_since: float | None = None) -> PoolLoad | None:
    """The pool's load over its last few scrapes (arrivals, from `arrival_series`, over the last minute;
    lengths and their spread, where the pool reports prompt-length quantiles, over `LENGTH_SCRAPES`, or
    those since `shape_since` when the workload changed shape more recently), or None when it reports nothing."""
    subject = f"pool/{pool}"
    if not arrivals:
        return None

    def recent(name: str) -> float | None:
        return _recent(w, subject, name, LENGTH_SCRAPES, shape_since)

    rate = statistics.fmean(v for _, v in arrivals[-4:])
    prompt, output = _mean_lengths(w, subject, shape_since)
    return PoolLoad(
        arrivals=rate,
        prompt_tokens=prompt,
        output_tokens=output,
        hit_rate=min(1.0, max(0.0, recent("prefix_cache_hit_rate") or 0.0)),
        prompt_sigma=lognormal_sigma(recent("prompt_len_p50"), recent("prompt_len_p95")),
    )


# forecast ---------------------------------------------------------------------------------------


def _holt(values: Sequence[float], alpha: float, beta: float) -> tuple[list[float], list[float]]:
    level, trend = [values[0]], [0.0]
    for v in values[1:]:
        lv = alpha * v + (1 - alpha) * (level[-1] + trend[-1])
        trend.append(beta * (lv - level[-1]) + (1 - beta) * trend[-1])
        level.append(lv)
    return level, trend


def _ahead(level: float, trend: float, phi: float, steps: int) -> float:
    damped = sum(phi ** k for k in range(1, steps + 1))
    return level + damped * trend


def forecast(series: Sequence[tuple[float, float]], horizon_s: float, s: AutoscaleSettings) -> Forecast:
    """Arrivals `horizon_s` ahead (Holt, damped trend) with the upper quantile of its own errors there; `series`
    holds one point at least."""
    if not series:
        raise ValueError("forecast: no arrivals to forecast from")
    ts = [t for t, _ in series]
    values = [v for _, v in series]
    step = statistics.median(b - a for a, b in itertools.pairwise(ts)) if len(ts) > 1 else 15.0
    steps = max(1, math.ceil(horizon_s / step))
    level, trend = _holt(values, s.smoothing, s.trend)
    expected = max(0.0, _ahead(level[-1], trend[-1], s.damping, steps))
    # The errors the same forecast made over the window, `steps` ahead: headroom sized by the past.
    errors = [values[i + steps] - _ahead(level[i], trend[i], s.damping, steps) for i in range(len(values) - steps)]
    if len(errors) >= 8:
        headroom = max(0.0, float(np.quantile(errors, s.headroom_quantile)))
    else:  # too little history: a fifth of the level, so the first minutes do not run at the edge
        headroom = 0.2 * max(values[-1], expected)
    return Forecast(values[-1], expected, expected + headroom, steps * step)


def _most(flags: Sequence[bool]) -> bool:
    """Whether most of a minute's scrapes say so (one slow scrape is noise every fleet has)."""
    return 2 * sum(flags) > len(flags)


def slo_broken_minutes(series: Sequence[tuple[float, float]], slo: float, whole: int = 1) -> list[int]:
    """The minutes (numbered by their end, as `by_minute`) of at least `whole` scrapes in which most scrapes' p95 broke
    the SLO."""
    return sorted(m for m, values in by_minute(series).items()
                  if len(values) >= whole and _most([v > slo for v in values]))


def whole_minute(w: SignalWindows, subject: str) -> int:
    """The scrapes that make a whole minute of a pool's points: four at 15 s, two at 30 s, the one at 40 s or a minute
    (whose p95 is the minute's own); at 10 s or faster, all but one (a scrape lost is no partial minute). A minute
    that a window starts or ends in may hold a few slow scrapes, which are no broken minute."""
    n = max(1, math.floor(60.0 / scrape_interval(w, subject) + 0.05))  # 15.003 s apart (ticks run late) is 15 s
    return n - 1 if n > 4 else n


def _broken_minutes(w: SignalWindows, subject: str, slo: float, since: float,
                    arrivals: Sequence[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(minute end, engines, arrivals per second) of each whole minute since `since` in which, in most scrapes, TTFT
    p95 broke `slo` with requests waiting for an engine (a slow first token with nothing queued is the prompt's own
    prefill, which more engines do not shorten), the same engines serving since `STEADY_S` before it (engines just
    added start with cold prefix caches: no measure of the size)."""
    engines = w.series(subject, "engines_reporting", since=since - STEADY_S)
    changes = [t for (_, a), (t, b) in itertools.pairwise(engines) if a != b]
    waiting = dict(w.series(subject, "requests_waiting", since=since))
    broken = by_minute((ts, ttft > slo and waiting.get(ts, 0.0) > 0)
                       for ts, ttft in w.series(subject, "ttft_p95", since=since))
    sizes, rates = by_minute(engines), by_minute(arrivals)
    whole = whole_minute(w, subject)
    out = []
    for m, broke in sorted(broken.items()):
        start, end = (m - 1) * 60.0, m * 60.0
        if len(broke) < whole or not _most(broke) or any(start - STEADY_S < t <= end for t in changes):
            continue
        if sizes.get(m) and rates.get(m) and (r := statistics.fmean(rates[m])) > 0:
            out.append((end, statistics.fmean(sizes[m]), r))
    return out


def _record_floor(w: SignalWindows, subject: str, slo: float, since: float, arrivals: Sequence[tuple[float, float]],
                  plan_rate: float, recommended: int, reason: str, evidence: dict[str, Any]) -> tuple[int, str]:
    """At least one engine more than the pool had in a steady minute of its history in which it broke TTFT with
    requests queued, for as much load.

    Where the curves are wrong the pool says so: n engines at r req/s that broke TTFT with a queue prove n too
    few for r whatever the model allows (Mooncake's long prompts: a queue behind one prompt's prefill at a fifth
    of the engines' time), for as long as the history holds that minute.
    """
    broke = _broken_minutes(w, subject, slo, since, arrivals)
    if not broke:
        return recommended, reason
    evidence["broke_with"] = [{"minute_end": t, "engines": round(n, 1), "arrivals": round(r, 3)} for t, n, r in broke]
    floor, n, r = max((math.floor(n * min(1.0, plan_rate / r) + 1e-9) + 1, n, r) for _, n, r in broke)
    if floor <= recommended:
        return recommended, reason
    return floor, reason + f"; at least {floor}: {n:.0f} engines broke TTFT with requests queued at {r:.2f} req/s"


def _short_findings(inp: PolicyInput, pool: PoolState) -> list[str]:
    """The open capacity findings (SLO burn, saturation) that name the pool short."""
    return sorted({key.kind for key, f in inp.open_findings.items()
                   if key.kind in CAPACITY_FINDINGS and pool.name in f.evidence.get("short_pools", ())})


def _findings_floor(inp: PolicyInput, pool: PoolState, short: Sequence[str], recommended: int,
                    reason: str) -> tuple[int, str]:
    """One engine more than the pool has while a capacity finding names it short and its SLO breaks now, though
    the curves call it enough (level-triggered: not for a burn that is clearing)."""
    w, subject = inp.windows, f"pool/{pool.name}"
    # Fresh points only: a latency quantile has none while nothing finishes, and the last ones of a burst that
    # stopped would read as a breach now.
    fresh = inp.now - 2 * scrape_interval(w, subject)
    breaching = any((points := w.series(subject, name, since=fresh)[-2:]) and statistics.fmean(v for _, v in points) > slo
                    for name, slo in pool.slos.items())
    if short and breaching and recommended <= pool.desired and pool.ready == pool.desired:
        return pool.desired + 1, f"{pool.name}: {', '.join(short)} open although the curves call {pool.desired} enough: add one"
    return recommended, reason


def burst_factor(arrivals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """How far a minute's busiest scrape runs above the minute's mean arrivals, beyond what Poisson noise
    gives: the median over the loaded minutes of the series (1.0 without any), and the scrape interval.

    A per-minute forecast cannot see a burst inside the minute; Azure's code trace packs most of a
    minute's requests into one scrape, and the queue that burst leaves is what its TTFT p95 pays for.
    """
    ts = [t for t, _ in arrivals]
    interval = statistics.median(b - a for a, b in itertools.pairwise(ts)) if len(ts) > 1 else 15.0
    ratios = []
    enough = min(3, max(2, round(60.0 / interval)))  # scrapes of a loaded minute to compare: two at 30 s
    for counts in by_minute((t, rate * interval) for t, rate in arrivals).values():
        mean = statistics.fmean(counts)
        if len(counts) < enough or mean < MIN_BURST_COUNT:
            continue
        # Blom's approximation of the expected largest of k standard normals: the busiest of k Poisson counts.
        k = len(counts)
        noise = statistics.NormalDist().inv_cdf((k - 0.375) / (k + 0.25)) * math.sqrt(mean)
        ratios.append(max(1.0, (max(counts) - noise) / mean))
    return (statistics.median(ratios) if ratios else 1.0), interval


def learned_startup(w: SignalWindows, pool: str, since: float) -> tuple[float | None, int]:
    """Median seconds from a raised `replicas_desired` to `replicas_ready` reaching it, and how many scale-ups."""
    subject = f"pool/{pool}"
    desired = w.series(subject, DESIRED, since=since)
    ready = w.series(subject, READY, since=since)
    # The record has gaps (the control plane down or failing over, the workload unreadable): a raise, or its
    # readiness, seen across one is timed by the outage, not by the engines.
    gap = 4 * scrape_interval(w, subject)
    took = []
    for i, ((t0, before), (t1, after)) in enumerate(itertools.pairwise(desired)):
        if after <= before or t1 - t0 > gap:
            continue
        # Ready by the next change of the target, or never: a raise given up (its pods never scheduled, the target
        # lowered again) is no start-up, nor is a later scale-up's readiness its own.
        until = next((t for t, d in desired[i + 2:] if d != after), math.inf)
        seen = [(t, r) for t, r in ready if t0 <= t <= until]
        done = next((t for t, r in seen if t >= t1 and r >= after), None)
        if done is not None and all(b - a <= gap for (a, _), (b, _) in itertools.pairwise(
                [(t, r) for t, r in seen if t <= done])):
            took.append(done - t0)  # the raise happened between t0 and t1: count from the scrape before
    return (statistics.median(took) if took else None), len(took)


# curves -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Fit:
    coef: tuple[float, ...]
    intercept: float
    points: int
    source: str  # "fitted" or "prior"
    r2: float | None = None  # how much of the points' variance the fit explains


_NO_PRIOR = _Fit((0.0,), 0.0, 0, "prior")  # `_fit`'s stand-in where the prior is known only later


@dataclass(frozen=True, slots=True)
class _TtftPoints:
    loads: list[tuple[float]]  # u/(1-u) per scrape
    waits: list[float]  # TTFT p95 per scrape
    fit: _Fit  # the line through them, or `_NO_PRIOR` with the points' count and R² where it does not hold


def _fit(rows: Sequence[tuple[float, ...]], y: Sequence[float], prior: _Fit, min_points: int) -> _Fit:
    """A non-negative linear fit of y on rows when enough spread points exist, else the prior."""
    if len(rows) < min_points:
        return prior
    x = np.asarray(rows, dtype=float)
    if float(np.ptp(x[:, 0])) <= 1e-9:
        return prior  # one operating point says nothing about the slope
    target = np.asarray(y, dtype=float)
    model = LinearRegression(positive=True).fit(x, target)
    if model.intercept_ < 0:
        # Points bunched at high load, steep across them: the line crosses zero before an idle engine. Raising its
        # intercept to zero would lift it everywhere (several times what was seen where the points lie); the line
        # through the origin is the nearest that predicts no negative time, and it is scored as it is used.
        model = LinearRegression(positive=True, fit_intercept=False).fit(x, target)
    r2 = round(float(model.score(x, target)), 3)
    if r2 < MIN_R2:  # noise around a flat line: the prior knows more
        return replace(prior, points=len(rows), r2=r2)
    return _Fit(tuple(float(c) for c in model.coef_), float(model.intercept_), len(rows), "fitted", r2)


def _lengths(w: SignalWindows, subject: str, since: float) -> list[tuple[float, float, float]]:
    """(time, prompt tokens, output tokens) per finished request, per scrape that finished at least
    `MIN_BURST_COUNT` requests (a few long or short ones would read as a new shape)."""
    interval = scrape_interval(w, subject)
    return [(ts, p / r, o / r) for ts, r, p, o in _length_points(w, subject, since) if r * interval >= MIN_BURST_COUNT]


def _since_shape(w: SignalWindows, subject: str, since: float, shift: float) -> float:
    """The start of the current workload shape: the last time prompt or output length per request
    moved by more than `shift` (llm-d's throughput analyzer resets likewise).

    A jump shows at once: the last `SHIFT_CONFIRM` scrapes all beyond `shift` of the median of the (up
    to `LENGTH_SCRAPES`, at least twice as many) before them, on one side; the shape starts where that run of
    scrapes does. A slower move shows once the last `LENGTH_SCRAPES` scrapes' median differs from an earlier
    block's."""
    lengths = _lengths(w, subject, since)
    n = LENGTH_SCRAPES
    if len(lengths) >= 3 * SHIFT_CONFIRM:
        base = lengths[-n - SHIFT_CONFIRM:-SHIFT_CONFIRM]
        for k in (1, 2):  # prompt, output
            centre = max(statistics.median(x[k] for x in base), 1.0)
            moved = [(x[k] - centre) / centre for x in lengths]
            for side in (1.0, -1.0):
                start = len(moved)
                while start > 0 and side * moved[start - 1] > shift:
                    start -= 1
                if len(moved) - start >= SHIFT_CONFIRM:
                    return lengths[start][0]
    if len(lengths) < 2 * n:
        return since
    tail = lengths[-n:]
    isl = statistics.median(x[1] for x in tail)
    osl = statistics.median(x[2] for x in tail)

    def unlike(i: float, o: float) -> bool:
        return abs(i - isl) > shift * max(isl, 1.0) or abs(o - osl) > shift * max(osl, 1.0)

    # Walk back in blocks until one block's lengths differ.
    for end in range(len(lengths) - n, n - 1, -n):
        block = lengths[end - n:end]
        if unlike(statistics.median(x[1] for x in block), statistics.median(x[2] for x in block)):
            # The blocks slide a scrape every tick, so their edge is no change point (the fits' window would move
            # every tick): the shape starts at the first run of scrapes like the newest, the same scrape each tick.
            for i in range(end - n, min(len(lengths), end + n) - SHIFT_CONFIRM + 1):
                run = lengths[i:i + SHIFT_CONFIRM]
                if not (unlike(run[0][1], run[0][2]) or unlike(statistics.median(x[1] for x in run),
                                                               statistics.median(x[2] for x in run))):
                    return run[0][0]
            return block[-1][0]
    return since


# sizing -----------------------------------------------------------------------------------------


class Autoscaler:
    """Plans every pool that has an SLO from its load forecast and its learned curves."""

    name = "autoscaler"

    def __init__(self, settings: AutoscaleSettings, curves: Mapping[str, EngineCurves]) -> None:
        self.settings = settings
        self.curves = dict(curves)

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan | Unplanned:
        """The plan for one pool, or why not: no profile or SLO to size it by, no load reported yet, or requests
        arriving of which none has finished to size them by."""
        # The curves, the pool's record and its scrapes count vLLM engines, its workload pods: a pod serving k
        # data-parallel engines, or a LeaderWorkerSet group of pods serving one engine across them, is planned in
        # engines that come and go together, and the plan given in pods.
        unit = scaling_unit(inp.windows, f"pool/{pool.name}", pool)
        if unit == ScalingUnit():
            return self._plan(inp, pool, unit)
        plan = self._plan(inp, replace(pool, desired=unit.engines_in(pool.desired), ready=unit.engines_in(pool.ready),
                                       min_replicas=unit.engines_in(pool.min_replicas, up=True),
                                       max_replicas=unit.engines_in(pool.max_replicas), gang=unit.engines), unit)
        if isinstance(plan, Unplanned):
            return plan
        plan.evidence["engines_per_pod"] = unit.engines / unit.pods
        return PoolPlan(pool.name, pool.desired, pool.ready, unit.pods_for(plan.target),
                        unit.pods_for(plan.recommended), f"{plan.reason} ({unit})", plan.evidence)

    def _plan(self, inp: PolicyInput, pool: PoolState, unit: ScalingUnit) -> PoolPlan | Unplanned:
        if pool.name not in self.curves:
            return Unplanned(pool.name, "no engine profile to size it by")
        if pool.ttft_p95_slo is None and pool.tpot_p95_slo is None:
            return Unplanned(pool.name, "no TTFT or TPOT objective to size it for (`pools[].slo`)")
        if stale := stale_among(READS, pool.stale_inputs):
            # Sums over part of the pool read as a lull: planned, their lower targets would later count towards the
            # scale-down hold. Unplanned, the gap restarts the hold once the inputs are whole again.
            why = "; ".join(f"{k}: {v}" for k, v in sorted(stale.items()))
            return Unplanned(pool.name, f"its inputs are stale, so it is not sized: {why}")
        s, w, prior = self.settings, inp.windows, self.curves[pool.name]
        since = inp.now - s.history
        subject = f"pool/{pool.name}"
        arrivals = arrival_series(w, subject, since)  # once: the load, the forecast and the TTFT curve read it
        shape_since = _since_shape(w, subject, since, s.shape_shift)
        load = pool_load(w, pool.name, arrivals, shape_since)
        if pool.desired <= 0:
            return Unplanned(pool.name, "scaled to zero: the sizer starts no pool from nothing")
        if load is None:
            return Unplanned(pool.name, "no load reported yet")
        startup, scale_ups = learned_startup(w, pool.name, since)
        if startup is None:
            startup = w.latest(subject, STARTUP)
        interval = scrape_interval(w, subject)
        horizon = (startup if startup is not None else s.startup) + interval
        # Per minute: the forecast's errors measure how the minutes differ; a burst inside one is the TTFT
        # curve's to plan for (`burst_factor`).
        fc = forecast(minute_means(arrivals), horizon, s)  # `load` exists: so do arrivals
        plan_rate = max(fc.upper, load.arrivals)
        evidence: dict[str, Any] = {
            "arrivals": round(load.arrivals, 3), "forecast": round(fc.expected, 3), "planned_for": round(plan_rate, 3),
            "horizon_s": round(fc.horizon_s), "startup_s": None if startup is None else round(startup),
            "startup_measured_from": scale_ups, "prompt_tokens": round(load.prompt_tokens),
            "output_tokens": round(load.output_tokens), "hit_rate": round(load.hit_rate, 3),
            "prompt_sigma": round(load.prompt_sigma, 3),
            "shape_age_s": round(inp.now - shape_since) if shape_since > since else None,
        }
        sized = self._sized(w, subject, pool, prior, load, since, shape_since, arrivals, fc, plan_rate,
                            evidence) if plan_rate > 0 else None
        if sized is not None:
            recommended, reason = sized
        elif load.arrivals > 0:
            return Unplanned(pool.name, f"{load.arrivals:.2f} req/s arrive but none has finished lately: their "
                                        "prompt and output lengths, which size the pool, are not known yet")
        else:
            # The pool is idle: nothing is forecast a start-up time ahead, or nothing has finished for so long that
            # the lengths to size a forecast by are unknown. One engine is enough, shed through the hold as ever;
            # the first requests to finish size the pool again.
            recommended = 1
            why = (f"nor forecast {fc.horizon_s:.0f}s ahead" if plan_rate <= 0 else
                   f"and none finished lately to size the {plan_rate:.2f} req/s forecast by")
            reason = f"{pool.name}: no arrivals now {why}: one engine is enough"
        short = _short_findings(inp, pool)
        recommended, reason = _findings_floor(inp, pool, short, recommended, reason)
        target, reason = self._held(inp, pool, bool(short), recommended, reason, unit)
        return PoolPlan(pool.name, pool.desired, pool.ready, target, recommended, reason, evidence)

    def _sized(self, w: SignalWindows, subject: str, pool: PoolState, prior: EngineCurves, load: PoolLoad,
               since: float, shape_since: float, arrivals: Sequence[tuple[float, float]], fc: Forecast,
               plan_rate: float, evidence: dict[str, Any]) -> tuple[int, str] | None:
        """The engines `plan_rate` needs by the pool's capacity, at least what its own record says, and why; None
        while the lengths its work is sized by are unknown."""
        s = self.settings
        prefill = pool.role != "decode" and load.prompt_tokens > 0
        decode = pool.role != "prefill" and load.output_tokens > 0
        if not (prefill or decode):
            return None
        headroom = plan_rate / max(fc.expected, load.arrivals, 1e-9)
        # A prefill engine's passes carry the prompts that arrive while one runs: fewer engines, fuller passes,
        # each prompt paying less of a pass's fixed cost. So the capacity depends on the size planned: from the
        # size now, to the size that its capacity calls for (a few rounds; the last one counts).
        per_engine_at = self._capacity(w, subject, pool, prior, load, since, shape_since, prefill, decode, evidence,
                                       dict(arrivals), headroom)
        recommended = max(1, pool.desired)
        for _ in range(4 if pool.role == "prefill" else 1):
            per_engine = per_engine_at(plan_rate / recommended)
            engines = max(1, math.ceil(plan_rate / per_engine - 1e-9))
            if engines == recommended:
                break
            recommended = engines
        evidence["per_engine_rate"] = round(per_engine, 3)
        reason = (f"{pool.name}: {recommended} engines at {per_engine:.2f} req/s each keep TTFT and TPOT p95 within "
                  f"{s.margin:.0%} of the SLOs at {plan_rate:.2f} req/s (forecast {fc.expected:.2f} req/s "
                  f"{fc.horizon_s:.0f}s ahead, now {load.arrivals:.2f})")
        if prefill and pool.ttft_p95_slo is not None:
            return _record_floor(w, subject, pool.ttft_p95_slo, since, arrivals, plan_rate, recommended, reason,
                                 evidence)
        return recommended, reason

    def _held(self, inp: PolicyInput, pool: PoolState, short: bool, recommended: int, reason: str,
              unit: ScalingUnit) -> tuple[int, str]:
        """The target from the recommendation: a scale-down held while capacity is short or the SLO broke within
        the hold window, else until lower recommendations last it, and a quarter of the engines at most at once
        (`unit`: how the pods its recorded targets count serve engines)."""
        s, w, subject = self.settings, inp.windows, f"pool/{pool.name}"
        # An open capacity finding, or a breach within the hold window, holds every scale-down: the curves
        # said enough then too. Otherwise a lower target must last the hold window, and a pool sheds at
        # most a quarter of its engines at once, so the next breach finds it one step lower, not at the floor.
        recently = inp.now - s.scale_down_after
        breached_since = any(slo_broken_minutes(w.series(subject, name, since=recently), slo)
                             for name, slo in pool.slos.items())
        if short or breached_since:
            target = max(recommended, pool.desired)
        else:
            # The targets recorded are pods.
            target = unit.engines_in(stabilised(w, subject, inp.now, s.scale_down_after, unit.pods_for(recommended),
                                                unit.pods_for(pool.desired)))
            # A gang pool (a LeaderWorkerSet) sheds a whole group at least, or it could never shed one.
            target = max(target, pool.desired - max(1, pool.gang, pool.desired // 4))
        g = max(1, pool.gang)
        held = target > -(-recommended // g) * g  # rounded up to a whole group or pod, the recommendation is no hold
        target = max(pool.min_replicas, min(pool.max_replicas, target))
        if g > 1:  # the engines a gang pool can run: whole groups, within its maximum
            target = max(g, min(-(-target // g) * g, pool.most_replicas))
        # Said in the fleet file's replicas (pods), where the plan is read.
        if recommended > target and target >= pool.most_replicas:  # not only in `pool_at_max`
            reason += f"; capped at its maximum of {unit.pods_for(target)}"
        elif held and target == pool.desired:
            why = "the SLO broke within" if breached_since or short else "lower targets last"
            reason += f"; held at {unit.pods_for(pool.desired)} until {why} {s.scale_down_after:.0f}s"
        return target, reason

    def _capacity(self, w: SignalWindows, subject: str, pool: PoolState, prior: EngineCurves, load: PoolLoad,
                  since: float, shape_since: float, prefill: bool, decode: bool, evidence: dict[str, Any],
                  rates: Mapping[float, float], headroom: float) -> Callable[[float], float]:
        """Requests per second one engine serves with TTFT and TPOT p95 within the margin of the SLOs, as a function
        of the requests per second each engine gets (the pool's signals read and its curves fitted once).

        An engine's time per request is its prefill (the new prompt tokens, attending over the cached
        prefix) plus its share of the decode steps (output tokens times the step time at batch B, over
        B), from the profile, times what the pool showed while backlogged (its finished requests are
        then all its engines can do). B is the largest batch whose TPOT p95 fits the margin and whose
        KV fits the cache; the utilisation that keeps TTFT p95 within the margin comes from the TTFT
        curve, `k0 + k1 * u/(1-u)`. Both curves are fitted on the pool's scrapes since the shape changed. A
        prefill-only engine's prompts ride passes as full as the rate per engine (for a TTFT point, that
        scrape's) fills them; a unified engine's ride its decode steps, taken as full.
        """
        s = self.settings
        engines = dict(w.series(subject, "engines_reporting", since=since))
        running = dict(w.series(subject, "requests_running", since=since))
        batch = float(prior.max_num_seqs)
        if decode:
            batch = self._batch(w, subject, pool, prior, load, shape_since, engines, running, evidence)

        def decoding(prompt: float, output: float, b: float) -> float:
            """A request's share of the decode steps by the profile; throughput takes the mean step time."""
            b = max(1.0, b)
            return output * prior.step_seconds(b, prompt + output / 2.0) / b if decode else 0.0

        def service(prompt: float, output: float, hit: float, b: float) -> float:
            """Engine-seconds per request by the profile."""
            pre = prior.request_prefill_moments(prompt, hit, load.prompt_sigma)[0] if prefill else 0.0
            return pre + decoding(prompt, output, b)

        # Backlogged scrapes run full passes: the factor compares them with full passes.
        factor = _throughput_factor(w, subject, since, engines, running, service)

        def passes(rate: float) -> float | None:
            """New tokens per pass on a prefill-only engine at `rate` requests per second (None: full passes)."""
            return prior.pass_tokens(rate, max(load.net_prompt_tokens, 1.0)) if pool.role == "prefill" else None

        def prefill_at(rate: float) -> tuple[float, float]:
            """The load's prefill seconds (mean, second moment) at `rate` requests per second per engine."""
            if not prefill:
                return 0.0, 0.0
            return prior.request_prefill_moments(load.prompt_tokens, load.hit_rate, load.prompt_sigma, passes(rate))

        rest = decoding(load.prompt_tokens, load.output_tokens, batch)
        ttft = None
        if prefill and pool.ttft_p95_slo is not None:
            ttft = self._ttft_points(w, subject, load, shape_since, engines, running, rates,
                                     lambda b, r: factor * (prefill_at(r)[0]
                                                            + decoding(load.prompt_tokens, load.output_tokens, b)))

        def per_engine_at(rate: float) -> float:
            pre, pre_second = prefill_at(rate)
            if prefill and (x := passes(rate)) is not None:
                evidence["pass_tokens"] = round(x)
            per_request = factor * (pre + rest)
            evidence["engine_s_per_request"] = round(per_request, 5)
            evidence["profile_correction"] = round(factor, 3)
            u_max = s.max_utilization
            if ttft is not None:
                # A queue's wait grows with the service's second moment (Pollaczek-Khinchine): long prompts make
                # everyone behind them wait. Only the prefill varies with the prompt; the rest of a request is as is.
                spread = (pre_second + 2.0 * rest * pre + rest * rest) / (pre + rest) ** 2 if pre + rest > 0 else 1.0
                u_max = self._utilisation(w, subject, pool, prior, load, rates, headroom, evidence, ttft,
                                          per_request, spread)
            return u_max / per_request if per_request > 0 else float("inf")

        return per_engine_at

    def _batch(self, w: SignalWindows, subject: str, pool: PoolState, prior: EngineCurves, load: PoolLoad,
               shape_since: float, engines: Mapping[float, float], running: Mapping[float, float],
               evidence: dict[str, Any]) -> float:
        """The largest batch per engine whose TPOT p95 (`d + e*B + f*B*C`) fits the margin and whose KV fits."""
        s = self.settings
        d, e, f = prior.decode
        batches: list[tuple[float, float]] = []
        steps: list[float] = []
        for ts, value in w.series(subject, "tpot_p95", since=shape_since):
            n, r = engines.get(ts), running.get(ts)
            if n and r is not None:
                batches.append((r / n, r / n * load.context))
                steps.append(value)
        prior_fit = _Fit((e * 1.2, f * 1.2), d * 1.2, 0, "prior")  # a p95 step runs about a fifth over the mean
        tpot = _fit(batches, steps, prior_fit, s.min_points)
        slo = pool.tpot_p95_slo
        by_latency = float(prior.max_num_seqs)
        if slo is not None:
            by_latency = _largest(tpot, prior_fit, s.margin * slo, load.context,
                                  [b for (b, _), v in zip(batches, steps, strict=True) if v <= s.margin * slo])
        by_kv = s.kv_usage_max * prior.kv_tokens / max(load.prompt_tokens + load.output_tokens, 1.0)
        batch = max(1.0, min(by_latency, by_kv, float(prior.max_num_seqs)))
        evidence["tpot_curve"] = {"source": tpot.source, "points": tpot.points, "r2": tpot.r2,
                                  "d_s": round(tpot.intercept, 5), "e_s": round(tpot.coef[0], 7),
                                  "f_s": round(tpot.coef[1], 10), "max_batch": round(batch, 1), "slo": slo,
                                  "now": _round(w.latest(subject, "tpot_p95")),
                                  "limited_by": "kv" if by_kv < by_latency else "latency"}
        return batch

    def _ttft_points(self, w: SignalWindows, subject: str, load: PoolLoad, shape_since: float,
                     engines: Mapping[float, float], running: Mapping[float, float], rates: Mapping[float, float],
                     per_request_at: Callable[[float, float], float]) -> _TtftPoints:
        """The pool's TTFT p95 against `u/(1-u)` at its scrapes since the shape changed, and the line through them
        (before it is judged against a prior: `_fit` with a stand-in)."""
        loads: list[tuple[float]] = []
        waits: list[float] = []
        waiting = dict(w.series(subject, "requests_waiting", since=shape_since))
        for ts, value in w.series(subject, "ttft_p95", since=shape_since):
            n, rate = engines.get(ts), rates.get(ts)
            # A backlog a burst left behind stretches TTFT at any utilisation: it says nothing about the curve.
            if not n or not rate or waiting.get(ts, 0.0) > n:
                continue
            u = min(0.98, rate * per_request_at((running.get(ts) or 0.0) / n, rate / n) / n)
            loads.append((u / (1.0 - u),))
            waits.append(value)
        return _TtftPoints(loads, waits, _fit(loads, waits, _NO_PRIOR, self.settings.min_points))

    def _utilisation(self, w: SignalWindows, subject: str, pool: PoolState, prior: EngineCurves, load: PoolLoad,
                     rates: Mapping[float, float], headroom: float, evidence: dict[str, Any], points: _TtftPoints,
                     per_request: float, spread: float) -> float:
        """How busy an engine may run with TTFT p95 within the margin: the TTFT curve over utilisation (`spread`:
        the service time's second moment over its mean squared, 1 when every request costs the same)."""
        s = self.settings
        assert pool.ttft_p95_slo is not None
        loads, waits = points.loads, points.waits
        # Idle: the pass in flight, then a 95th-percentile prompt's own prefill (at least a mean one's); queueing:
        # an M/G/1 queue's p95 wait, about thrice its mean, 1.5 * E[S²]/E[S] per u/(1-u).
        p95 = min(MAX_CONTEXT, lognormal_p95(load.prompt_tokens, load.prompt_sigma))
        in_flight = prior.prefill_seconds(max(load.net_prompt_tokens, 1.0))
        idle = in_flight + max(in_flight, prior.request_prefill_seconds(p95, p95 * load.hit_rate))
        prior_fit = _Fit((1.5 * per_request * spread,), idle, 0, "prior")
        ttft = points.fit if points.fit.source == "fitted" else replace(prior_fit, points=points.fit.points,
                                                                         r2=points.fit.r2)
        budget = s.margin * pool.ttft_p95_slo
        # The fit may lower what the prior allows, but raise it only as far as the pool has been seen to go.
        seen = max((x / (1.0 + x) for (x,), v in zip(loads, waits, strict=True) if v <= budget), default=0.0)
        allowed = max(_u_at(prior_fit, budget) or 0.3, seen)
        fitted = _u_at(ttft, budget)
        # A burst inside the minute: the busiest scrape brings `burst` times the expected rate, and what the
        # engines cannot serve within that scrape must clear within the TTFT budget after it (a fluid queue).
        # Planned for the expected rate: the forecast's headroom (the rate planned for over the expected one)
        # already covers busier minutes and is not stacked on it.
        burst, interval = burst_factor(sorted(rates.items()))
        u_burst = (1.0 + max(0.0, budget - idle) / interval) / burst * headroom
        # A fit whose idle TTFT is past the budget says engines cannot buy it back (long prompts): it is
        # reported, and sizing keeps to what the prior and the pool's own history allow.
        u_max = min(s.max_utilization, u_burst, allowed if fitted is None else min(fitted, allowed))
        evidence["ttft_curve"] = {"source": ttft.source, "points": ttft.points, "r2": ttft.r2,
                                  "k0_s": round(ttft.intercept, 4), "k1_s": round(ttft.coef[0], 4),
                                  "max_utilization": round(u_max, 3), "floor_over_budget": fitted is None,
                                  "burst": round(burst, 2), "burst_utilization": round(u_burst, 3),
                                  "slo": pool.ttft_p95_slo, "now": _round(w.latest(subject, "ttft_p95"))}
        return u_max


def _throughput_factor(w: SignalWindows, subject: str, since: float, engines: Mapping[float, float],
                       running: Mapping[float, float], service: Callable[[float, float, float, float], float]) -> float:
    """Engine time per request the pool showed while backlogged, over what the profile says for the same
    requests: what it finished then was all its engines could do. 1.0 until it has been backlogged at four
    scrapes (more than two waiting per engine at two in a row: a lump of arrivals clears in one, and at least
    one request running per engine: a queue behind one long prompt beside idle engines is not the profile's
    error)."""
    finished = dict(w.series(subject, "request_rate", since=since))
    prompt = dict(w.series(subject, "prompt_tokens_rate", since=since))
    gen = dict(w.series(subject, "generation_tokens_rate", since=since))
    hit = dict(w.series(subject, "prefix_cache_hit_rate", since=since))
    ratios = []
    ready = dict(w.series(subject, READY, since=since))  # pods
    pods = dict(w.series(subject, "pods_reporting", since=since))
    for (_, before), (ts, waiting) in itertools.pairwise(w.series(subject, "requests_waiting", since=since)):
        # Engines that take work: a draining one still reports, but is finishing, not taking more.
        per_pod = (engines.get(ts) or 0.0) / pods[ts] if pods.get(ts) else 1.0
        n, done = min(engines.get(ts) or 0.0, (ready.get(ts) or math.inf) * per_pod), finished.get(ts)
        if not n or not done or min(before, waiting) <= 2 * n or (running.get(ts) or 0.0) < n:
            continue
        model = service(prompt.get(ts, 0.0) / done, gen.get(ts, 0.0) / done, hit.get(ts, 0.0), (running.get(ts) or 0.0) / n)
        if model > 0:
            ratios.append((n / done) / model)
    if len(ratios) < 4:
        return 1.0
    return min(5.0, max(0.5, statistics.median(ratios)))


def _u_at(fit: _Fit, budget: float) -> float | None:
    """The utilisation at which `k0 + k1 * u/(1-u)` reaches `budget`; None when even an idle engine misses it."""
    k0, (k1,) = fit.intercept, fit.coef
    if budget <= k0:
        return None
    if k1 <= 0:
        return 1.0
    x = (budget - k0) / k1
    return x / (1.0 + x)


def _largest(fit: _Fit, prior: _Fit, budget: float, context: float, seen: list[float]) -> float:
    """The largest batch whose step time fits `budget`: the fit's, but above the prior's only as far as seen."""

    def limit(f: _Fit) -> float:
        per_seq = f.coef[0] + f.coef[1] * context
        return (budget - f.intercept) / per_seq if per_seq > 0 else math.inf

    return min(limit(fit), max(limit(prior), max(seen, default=0.0)))


def engines_per_pod(w: SignalWindows, subject: str, scrapes: int = 4) -> int:
    """vLLM engines a pod of the pool serves (its data-parallel ranks): the most the last `scrapes` scrapes saw since
    the pool last rolled out (ranks that missed a scrape would read as a pod of fewer, and plan more pods; a rollout
    may change the ranks); 1 unknown."""
    pods = dict(w.series(subject, "pods_reporting")[-scrapes:])
    seen = [(ts, engines / pods[ts]) for ts, engines in w.series(subject, "engines_reporting")[-scrapes:]
            if engines and pods.get(ts)]
    rolled = max((ts for ts, v in w.series(subject, ROLLING) if v), default=-math.inf)
    if seen and rolled < seen[-1][0]:  # a rollout over: its ranks from the scrapes since (mid-rollout, all of them)
        seen = [(ts, r) for ts, r in seen if ts > rolled]
    return max(1, round(max(r for _, r in seen))) if seen else 1


@dataclass(frozen=True, slots=True)
class ScalingUnit:
    """What a pool's workload adds or removes at once, counted both ways: `pods` pods (a LeaderWorkerSet group's
    size, else one) serving `engines` vLLM engines."""

    engines: int = 1
    pods: int = 1

    def engines_in(self, pods: int, up: bool = False) -> int:
        """The engines `pods` pods serve: whole units only (a partial group serves none), or `up` to the next one."""
        units = -(-pods // self.pods) if up else pods // self.pods
        return units * self.engines

    def pods_for(self, engines: int) -> int:
        """The pods that serve `engines` engines: whole units, rounded up."""
        return -(-engines // self.engines) * self.pods

    def __str__(self) -> str:
        if self.pods == 1:
            return f"{self.engines} engines a pod"
        return f"{self.engines} engine{'s' * (self.engines != 1)} a group of {self.pods} pods"


def scaling_unit(w: SignalWindows, subject: str, pool: PoolState) -> ScalingUnit:
    """How the pool's pods serve engines, as the last scrapes saw them: a pod's data-parallel ranks (`engines_per_pod`,
    over the pods that report) and, in a gang pool, whether every pod of a group serves (data parallel across it) or
    only its leader does (one engine across the group's nodes, whose other pods run no vLLM server and report none),
    told apart by how many of the ready groups' pods report."""
    k, g = engines_per_pod(w, subject), max(1, pool.gang)
    if g == 1:
        return ScalingUnit(k, 1)
    # Pods reporting against the groups ready at the same scrape, the most of the last few: a group's pods first count
    # a scrape after it turns ready (no delta before), so the newest alone read an all-serving gang as leaders only the
    # tick a scale-up finished, and its engines as a quarter of them.
    ready = dict(w.series(subject, READY)[-8:])
    ratios = [pods / (ready[ts] // g) for ts, pods in w.series(subject, "pods_reporting")[-4:]
              if pods and ready.get(ts, 0) >= g]
    if not ratios and (pods := w.latest(subject, "pods_reporting")) and pool.ready >= g:
        ratios = [pods / (pool.ready // g)]
    leaders_only = bool(ratios) and max(ratios) < (1 + g) / 2
    return ScalingUnit(k * (1 if leaders_only else g), g)


def stabilised(w: SignalWindows, subject: str, now: float, window_s: float, target: int, desired: int) -> int:
    """A scale-down held to the highest recommendation (`autoscale_target_replicas`) of the last `window_s`,
    as Kubernetes' HPA stabilises: until recommendations cover the whole window, held at `desired`. A gap of
    more than four scrapes (the control plane down, the pool not planned) is no cover: nothing was recommended
    then, and the hold starts again."""
    if target >= desired:
        return target
    step = scrape_interval(w, subject)
    recorded = w.series(subject, TARGET, since=now - window_s - step)
    times = [t for t, _ in recorded] + [now]
    if not recorded or times[0] > now - window_s + step or max(b - a for a, b in itertools.pairwise(times)) > 4 * step:
        return desired
    past = [v for t, v in recorded if t >= now - window_s]
    return min(desired, max(target, math.ceil(max(past, default=target))))


def scrape_interval(w: SignalWindows, subject: str) -> float:
    """Seconds between a pool's scrapes, from its last ones (15 s before it has any)."""
    ts = [t for t, _ in w.series(subject, "request_rate")][-10:]
    return statistics.median(b - a for a, b in itertools.pairwise(ts)) if len(ts) > 1 else 15.0


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
