"""Statistics shared by the policies: robust location and scale, and the lognormal that request lengths follow."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["MAX_CONTEXT", "lognormal_location", "lognormal_moment", "lognormal_p95", "lognormal_sigma", "median_mad",
           "quadratic_moments"]

MAX_CONTEXT = 131072.0  # tokens: the longest prompt an engine takes when its limit is not known
# Scales the MAD to a standard deviation for normally distributed data.
MAD_TO_SIGMA = 1.4826


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """Median and MAD scaled to sigma; robust to the outliers a raw stdev would chase."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return med, mad * MAD_TO_SIGMA


def lognormal_sigma(median: float | None, p95: float | None, cap: float = 1.5) -> float:
    """The shape of a lognormal through a median and a 95th percentile (0 when either is unknown)."""
    if not median or not p95 or p95 <= median:
        return 0.0
    return min(cap, math.log(p95 / median) / 1.645)


def lognormal_location(mean: float, sigma: float) -> float:
    """The location (mean of the log) of a lognormal with this mean (at least 1) and shape."""
    return math.log(max(mean, 1.0)) - sigma * sigma / 2.0


def lognormal_moment(mean: float, sigma: float, k: int, cap: float = MAX_CONTEXT) -> float:
    """E[X^k] of a lognormal with this mean and shape, over the values up to `cap` (a context limit: the
    lognormal's far tail would otherwise rule the higher moments)."""
    mu = lognormal_location(mean, sigma)
    full = math.exp(k * mu + k * k * sigma * sigma / 2.0)
    if sigma <= 0:
        return full
    z = (math.log(cap) - mu - k * sigma * sigma) / sigma
    return full * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def lognormal_p95(mean: float, sigma: float) -> float:
    """The 95th percentile of a lognormal with this mean and shape."""
    return mean * math.exp(1.645 * sigma - sigma * sigma / 2.0)


def quadratic_moments(beta: float, gamma: float, mean: float, sigma: float,
                      cap: float = MAX_CONTEXT) -> tuple[float, float]:
    """Mean and second moment of beta*X + gamma*X^2 for X lognormal with this mean and shape, cut at `cap` (a
    prompt's prefill seconds: linear work plus attention over its own length)."""
    m1, m2, m3, m4 = (lognormal_moment(mean, sigma, k, cap) for k in (1, 2, 3, 4))
    return beta * m1 + gamma * m2, beta * beta * m2 + 2.0 * beta * gamma * m3 + gamma * gamma * m4
