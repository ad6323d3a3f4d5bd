"""Robust statistics shared by the policies."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["median_mad"]

# Scales the MAD to a standard deviation for normally distributed data.
MAD_TO_SIGMA = 1.4826


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """Median and MAD scaled to sigma; robust to the outliers a raw stdev would chase."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return med, mad * MAD_TO_SIGMA
