"""The judges the canary gate is measured against, on the same intervals and the same metric rules.

- Kayenta's NetflixACAJudge as its multi-interval stage runs it: per metric, the canary's and the
  baseline's per-interval values since the start, a Mann-Whitney test with the Hodges-Lehmann shift
  and its 98 % interval, "High" when the interval's lower end exceeds 0.25 times the shift and the
  mean ratio reaches the allowed increase; a High critical metric fails the run at any interval.
- Argo Rollouts with the relative query users write by hand (canary above `1 + allowed` times the
  baseline): each interval is one measurement, and the run fails once more than `failure_limit`
  measurements have failed.

Both are consulted every interval, as they run during a rollout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import norm

from policies.canary import Direction, GateSettings, Interval, MetricRule, Outcome, Scale

__all__ = ["hodges_lehmann", "kayenta_judge", "threshold_judge"]

KAYENTA_CONFIDENCE = 0.98
KAYENTA_TOLERANCE = 0.25


def hodges_lehmann(x: Sequence[float], y: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """The shift of `x` over `y` (median of pairwise differences) and its distribution-free interval
    from the normal approximation to the Mann-Whitney statistic."""
    d = np.sort(np.subtract.outer(np.asarray(x, dtype=float), np.asarray(y, dtype=float)).ravel())
    n, m = len(x), len(y)
    z = float(norm.ppf(0.5 + confidence / 2.0))
    k = math.floor(n * m / 2.0 - z * math.sqrt(n * m * (n + m + 1) / 12.0))
    k = min(max(k, 0), len(d) - 1)
    return float(np.median(d)), float(d[k]), float(d[len(d) - 1 - k])


def _series(intervals: Sequence[Interval], rule: MetricRule, *, baseline: bool) -> list[float]:
    out = []
    for iv in intervals:
        dist = (iv.baseline if baseline else iv.canary).get(rule.name)
        v = dist.statistic(rule.statistic) if dist is not None else None
        if v is not None and math.isfinite(v):
            out.append(v)
    return out


def _kayenta_high(intervals: Sequence[Interval], rule: MetricRule) -> bool | None:
    """True when Kayenta's classifier calls the metric High (worse), None when it has no data."""
    c, b = _series(intervals, rule, baseline=False), _series(intervals, rule, baseline=True)
    if len(c) < 2 or len(b) < 2:
        return None
    if sorted(c) == sorted(b) or len(set(c) | set(b)) == 1:
        return False
    est, lo, hi = hodges_lehmann(c, b, KAYENTA_CONFIDENCE)
    bound = KAYENTA_TOLERANCE * abs(est)
    mb, mc = float(np.mean(b)), float(np.mean(c))
    if rule.scale is Scale.RATIO:
        effect = mc / mb if mb else math.nan
        up, down = 1.0 + rule.allowed, 1.0 / (1.0 + rule.allowed)
    else:
        effect, up, down = mc - mb, rule.allowed, -rule.allowed
    high = lo > bound and (math.isnan(effect) or effect >= up)
    low = hi < -bound and (math.isnan(effect) or effect <= down)
    return (high and rule.direction is not Direction.DECREASE) or (low and rule.direction is not Direction.INCREASE)


def kayenta_judge(intervals: Sequence[Interval], settings: GateSettings, *, final: bool = False) -> Outcome:
    """Kayenta's verdict at this interval: fail once a critical metric is High, pass at the end otherwise."""
    results = [(rule, _kayenta_high(intervals, rule)) for rule in settings.metrics]
    if any(rule.critical and high for rule, high in results):
        return Outcome.FAIL
    if not final:
        return Outcome.INCONCLUSIVE
    judged = [high for _, high in results if high is not None]
    if not judged:
        return Outcome.INCONCLUSIVE
    score = 100.0 * sum(not h for h in judged) / len(judged)
    if score >= settings.pass_score:
        return Outcome.PASS
    return Outcome.MARGINAL if score >= settings.marginal_score else Outcome.FAIL


def threshold_judge(intervals: Sequence[Interval], settings: GateSettings, *, final: bool = False,
                    failure_limit: int = 2) -> Outcome:
    """Argo's verdict at this interval: fail once a critical metric's failed measurements exceed the limit."""
    for rule in settings.metrics:
        if not rule.critical:
            continue
        failed = 0
        for iv in intervals:
            b, c = iv.baseline.get(rule.name), iv.canary.get(rule.name)
            vb = b.statistic(rule.statistic) if b is not None else None
            vc = c.statistic(rule.statistic) if c is not None else None
            if vb is None or vc is None:
                continue  # an empty result is a measurement error, not a failure
            slack = vb * rule.allowed if rule.scale is Scale.RATIO else rule.allowed
            worse_up = rule.direction is not Direction.DECREASE and vc > vb + slack
            worse_down = rule.direction is not Direction.INCREASE and vc < vb - slack
            failed += worse_up or worse_down
        if failed > failure_limit:
            return Outcome.FAIL
    return Outcome.PASS if final else Outcome.INCONCLUSIVE
