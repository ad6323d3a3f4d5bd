"""Pure signal arithmetic: counter increases, histogram quantiles, ratios.

Counter resets (a restarted pod) are handled as Prometheus' `increase()` handles them: a value
lower than the previous one means the counter restarted from zero, so the increase is the new
value itself. Rates are the increase between two consecutive scrapes divided by the time
between them; unlike `rate()` over a range there is no extrapolation to the window edges,
because consecutive scrapes already bound the interval exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Histogram", "counter_increase", "histogram_increase", "histogram_quantile", "ratio", "share_above"]


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts keyed by upper bound (`+Inf` included), plus sum and count."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), sorted by le
    sum: float
    count: float

    def __add__(self, other: Histogram) -> Histogram:
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        if len(self.buckets) == len(other.buckets) and all(
                a[0] == b[0] for a, b in zip(self.buckets, other.buckets, strict=True)):
            merged = tuple((le, a + b) for (le, a), (_, b) in zip(self.buckets, other.buckets, strict=True))
        else:
            les = sorted({le for le, _ in self.buckets} | {le for le, _ in other.buckets})
            merged = tuple((le, _at(self.buckets, le) + _at(other.buckets, le)) for le in les)
        return Histogram(merged, self.sum + other.sum, self.count + other.count)


    def scaled(self, factor: float) -> Histogram:
        """Every count and the sum times `factor` (observations over a longer or shorter interval)."""
        if factor == 1.0:
            return self
        return Histogram(tuple((le, c * factor) for le, c in self.buckets), self.sum * factor, self.count * factor)


EMPTY_HISTOGRAM = Histogram((), 0.0, 0.0)


def _at(buckets: Sequence[tuple[float, float]], le: float) -> float:
    """A cumulative histogram's count at `le`, which it may not have as a bound: its count at the largest bound at or
    below it (engines with different bounds merged; 0 would make the sum fall between bounds)."""
    below = 0.0
    for bound, count in buckets:
        if bound > le:
            break
        below = count
    return below


def counter_increase(prev: float | None, cur: float) -> float | None:
    """Increase of a counter between two readings; None without a previous reading."""
    if prev is None:
        return None
    if cur < prev:  # reset: the counter restarted from zero
        return cur
    return cur - prev


def histogram_increase(prev: Histogram | None, cur: Histogram) -> Histogram | None:
    """Bucket-wise increase of a cumulative histogram, treating any decrease, or bounds of which each reading has some
    the other lacks (a restart with another layout), as a reset. Over the bounds both readings have: a bucket line
    missing from one scrape (malformed, dropped) leaves the others' increases exact, where counting the whole history
    would multiply the rates by the process's age."""
    if prev is None:
        return None
    before = dict(prev.buckets)
    now = {le for le, _ in cur.buckets}
    if cur.count < prev.count or any(c < before[le] for le, c in cur.buckets if le in before) or (
            now - before.keys() and before.keys() - now):
        return cur
    deltas = tuple((le, c - before[le]) for le, c in cur.buckets if le in before)
    # A restart that counted more observations than it lost shows no bucket falling, but its sum falls (every value
    # observed here is non-negative) or its increases stop being cumulative: a lower bound gaining more than a higher.
    ordered = sorted(deltas)
    if cur.sum < prev.sum or any(lo > hi + 1e-9 for (_, lo), (_, hi) in itertools.pairwise(ordered)):
        return cur
    return Histogram(deltas, cur.sum - prev.sum, cur.count - prev.count)


def _cumulative(buckets: Sequence[tuple[float, float]]) -> list[tuple[float, float]] | None:
    """Buckets sorted by bound with their counts made non-decreasing (PromQL repairs small non-monotonicity the same
    way); None without a `+Inf` bucket or observations."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][0] != math.inf:
        return None
    fixed: list[tuple[float, float]] = []
    running = 0.0
    for le, c in ordered:
        running = max(running, c)
        fixed.append((le, running))
    return fixed if running > 0 else None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The q-quantile of cumulative buckets, as PromQL's `histogram_quantile` computes it.

    Linear interpolation inside the bucket holding the rank; the lowest bucket starts at 0
    when its bound is positive; a rank in the `+Inf` bucket returns the highest finite bound.
    NaN when there are no observations.
    """
    if not buckets or math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    fixed = _cumulative(buckets)
    if fixed is None:
        return math.nan
    total = fixed[-1][1]
    rank = q * total
    idx = next(i for i, (_, c) in enumerate(fixed) if c >= rank)
    if idx == len(fixed) - 1:
        return fixed[-2][0] if len(fixed) >= 2 else math.nan
    upper, count = fixed[idx]
    if idx == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = fixed[idx - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return upper
    # min(): float rounding must not push the result past the bucket's own bound.
    return min(upper, lower + (upper - lower) * (rank - below) / in_bucket)


def share_above(threshold: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The share of observations above `threshold`: exact at a bucket bound (an objective set on one), linear inside
    a bucket as `histogram_quantile` reads it (the lowest bucket starting at 0), and, past the highest finite bound,
    the share in `+Inf`. NaN when there are no observations."""
    fixed = None if math.isnan(threshold) else _cumulative(buckets)
    if fixed is None:
        return math.nan
    total = fixed[-1][1]
    lower, below = min(0.0, fixed[0][0]), 0.0
    for le, count in fixed[:-1]:
        if threshold < le:
            at = below + (count - below) * max(0.0, threshold - lower) / (le - lower) if le > lower else below
            return 1.0 - at / total
        lower, below = le, count
    return 1.0 - below / total


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator/denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
