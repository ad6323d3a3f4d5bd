"""Robust statistics shared by the policies."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["MAX_CONTEXT", "lognormal_moment", "lognormal_sigma", "median_mad"]

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


def lognormal_moment(mean: float, sigma: float, k: int, cap: float = MAX_CONTEXT) -> float:
    """E[X^k] of a lognormal with this mean and shape, over the values up to `cap` (a context limit: the
    lognormal's far tail would otherwise rule the higher moments)."""
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2.0
    full = math.exp(k * mu + k * k * sigma * sigma / 2.0)
    if sigma <= 0:
        return full
    z = (math.log(cap) - mu - k * sigma * sigma) / sigma
    return full * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
