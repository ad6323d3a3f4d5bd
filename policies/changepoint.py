"""Change detection on one series: a robust baseline and three sequential detectors.

Every detector works in robust sigmas of a `Baseline` (median and MAD of a reference window),
so one parameter set serves hit rates, latencies and token yields alike. The detectors are small
state machines fed one value at a time; `scan` runs one over a series and reports where it stands.
They read no clock and keep no history beyond their statistic, so a policy can rebuild one from
its signal window on every evaluation.

Average run lengths (ARL) are counted in samples: ARL0 is the mean number of in-control samples
until a false alarm, ARL1 the mean number of samples from the start of a shift of the given size
(in sigmas) until the alarm, the alarm sample included. At one sample per 15 s scrape, ARL0 = 1000
is one false alarm per series every ~4 h before any other gate, which is why the policies also
require a minimum effect size and consecutive confirmations. The figures hold for independent,
normally distributed samples and a known baseline; a baseline estimated from n points lowers ARL0
somewhat (use n >= 20), and autocorrelated series (p95s over overlapping intervals) lower it more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from policies.stats import median_mad

__all__ = ["Baseline", "Cusum", "Detector", "Direction", "Ewma", "PageHinkley", "Scan", "scan"]


class Direction(StrEnum):
    """Which change a detector looks for."""

    UP = "up"
    DOWN = "down"
    BOTH = "both"  # EWMA only: the one-sided detectors are run once per side instead


@dataclass(frozen=True, slots=True)
class Baseline:
    """The in-control level of a series and its spread, in the series' own unit."""

    center: float
    sigma: float

    @classmethod
    def robust(cls, values: Sequence[float], min_sigma: float = 1e-9) -> Baseline:
        """Median and MAD-scaled sigma of `values`; `min_sigma` floors the spread.

        A floor is needed: a series that sat on one value (a queue at 0, a p95 stuck on a bucket
        bound) has a MAD of 0, which would turn any later wiggle into an infinite z-score.
        """
        if not values:
            raise ValueError("a baseline needs at least one value")
        center, sigma = median_mad(values)
        return cls(center, max(sigma, min_sigma, 1e-12))

    def z(self, value: float) -> float:
        """`value` in robust sigmas from the center."""
        return (value - self.center) / self.sigma


class Detector(Protocol):
    """A sequential change detector: feed values, read its statistic against its threshold."""

    @property
    def statistic(self) -> float:
        """The current test statistic, in robust sigmas."""
        ...

    @property
    def threshold(self) -> float:
        """The statistic above which the detector alarms."""
        ...

    def update(self, value: float) -> bool:
        """Take one value; True when the detector is in alarm after it."""
        ...


def _one_sided(direction: Direction) -> Direction:
    if direction is Direction.BOTH:
        raise ValueError("this detector is one-sided: run one for each direction")
    return direction


class Cusum:
    """One-sided tabular CUSUM on robust z-scores: S = max(0, S + z - k), alarm when S > h.

    Defaults k = 0.5, h = 5 (sigmas). Expected performance, one-sided, zero start:
    - ARL0 ~ 930 samples. The published two-sided tables give 465 for k = 0.5, h = 5 (Montgomery,
      *Introduction to Statistical Quality Control*, table of the tabular CUSUM); one side alarms
      half as often, and Siegmund's approximation gives 938. The Monte Carlo test accepts 750-1150.
    - Delay (ARL1): 1 sigma ~ 10.4 samples, 1.5 sigma ~ 5.8, 2 sigma ~ 4.0.
    With h = 4 (k = 0.5) the two-sided figures in reference/canary_alerting_changepoint.md (Lucas and
    Crosier 1982, table 1) apply: ARL0 168 two-sided, so ~ 336 one-sided; ARL1 8.38 at 1 sigma,
    4.75 at 1.5 sigma, 3.34 at 2 sigma (the opposite side adds nothing for shifts of 1 sigma or
    more). h = 5 is the default because it nearly triples ARL0 for ~1.2 samples of extra delay.
    """

    def __init__(self, baseline: Baseline, *, k: float = 0.5, h: float = 5.0, direction: Direction = Direction.UP) -> None:
        if k < 0 or h <= 0:
            raise ValueError(f"CUSUM needs k >= 0 and h > 0, got k={k}, h={h}")
        self.baseline = baseline
        self.k = k
        self.h = h
        self.direction = _one_sided(direction)
        self._s = 0.0

    @property
    def statistic(self) -> float:
        """The cumulative sum S, in sigmas."""
        return self._s

    @property
    def threshold(self) -> float:
        """The decision interval h."""
        return self.h

    def update(self, value: float) -> bool:
        """Add one value; True while S exceeds h."""
        z = self.baseline.z(value)
        if self.direction is Direction.DOWN:
            z = -z
        self._s = max(0.0, self._s + z - self.k)
        return self._s > self.h

    def reset(self) -> None:
        """Back to S = 0, e.g. after an alarm was handled."""
        self._s = 0.0


class Ewma:
    """EWMA chart on robust z-scores: Z = lam * z + (1 - lam) * Z, alarm when Z leaves +-L * sd(Z).

    The limits are the asymptotic ones, L * sqrt(lam / (2 - lam)), and Z starts at the baseline
    center. Defaults lam = 0.1, L = 2.814, two-sided (Lucas and Saccucci 1990, the ARL0 = 500 row for
    lam = 0.1):
    - ARL0 ~ 500 samples two-sided, ~ 1000 when run one-sided (UP or DOWN) with the same L. The Monte
      Carlo test accepts 400-600 for the two-sided default.
    - Delay (ARL1): 1 sigma ~ 10.3 samples, 2 sigma ~ 4.4 (either sidedness: the far limit is
      practically never crossed during a shift).
    The rows quoted in reference/canary_alerting_changepoint.md (same paper, table 3, ARL0 = 500) are
    alternatives: lam = 0.5, L = 3.071 reacts faster to big shifts (ARL1 3.63 at 2 sigma, 17.5 at 1 sigma);
    lam = 0.03, L = 2.437 to small ones (12.6 at 1 sigma, 5.99 at 2 sigma).
    """

    def __init__(self, baseline: Baseline, *, lam: float = 0.1, L: float = 2.814,  # noqa: N803 (the chart's name)
                 direction: Direction = Direction.BOTH) -> None:
        if not 0 < lam <= 1 or L <= 0:
            raise ValueError(f"EWMA needs 0 < lam <= 1 and L > 0, got lam={lam}, L={L}")
        self.baseline = baseline
        self.lam = lam
        self.L = L
        self.direction = direction
        self._limit = L * math.sqrt(lam / (2.0 - lam))
        self._z = 0.0

    @property
    def ewma(self) -> float:
        """The smoothed value in sigmas from the center, signed."""
        return self._z

    @property
    def statistic(self) -> float:
        """The smoothed deviation in the watched direction (absolute for BOTH), in sigmas."""
        if self.direction is Direction.UP:
            return self._z
        if self.direction is Direction.DOWN:
            return -self._z
        return abs(self._z)

    @property
    def threshold(self) -> float:
        """The control limit L * sqrt(lam / (2 - lam)), in sigmas."""
        return self._limit

    def update(self, value: float) -> bool:
        """Smooth in one value; True while the EWMA is beyond its limit."""
        self._z = self.lam * self.baseline.z(value) + (1.0 - self.lam) * self._z
        return self.statistic > self._limit

    def reset(self) -> None:
        """Back to the baseline center."""
        self._z = 0.0


class PageHinkley:
    """Page-Hinkley test: a CUSUM against the series' own running mean instead of a fixed center.

    m = m + (x - mean - delta) for increases (mirrored for decreases), alarm when m - min(m) > lam.
    Only the baseline's sigma is used (deviations are in sigmas); the reference level is learned
    from the values themselves, so it needs no clean history, at the price of adapting to a shift
    it has not yet flagged. No alarm is raised during the first `min_points` values (as river does).
    No published table exists for this running-mean form; the figures below were measured by
    simulation, and the Monte Carlo test reproduces them. Defaults delta = 0.5, lam = 5 (sigmas),
    min_points = 30:
    - ARL0 ~ 1000 samples (the test accepts 800-1250).
    - Delay for a shift after 50 in-control samples: 2 sigma ~ 4 samples (90 % within 6); 1 sigma
      ~ 11-15 on average with a long tail (median 10, 90 % within ~26), because the running mean
      follows the shift. Prefer `Cusum` when a clean baseline exists.
    """

    def __init__(self, baseline: Baseline, *, delta: float = 0.5, lam: float = 5.0, direction: Direction = Direction.UP,
                 min_points: int = 30) -> None:
        if delta < 0 or lam <= 0 or min_points < 1:
            raise ValueError(f"Page-Hinkley needs delta >= 0, lam > 0, min_points >= 1, got {delta}, {lam}, {min_points}")
        self.sigma = baseline.sigma
        self.delta = delta
        self.lam = lam
        self.direction = _one_sided(direction)
        self.min_points = min_points
        self._n = 0
        self._mean = 0.0
        self._m = 0.0
        self._min = 0.0

    @property
    def statistic(self) -> float:
        """m - min(m), in sigmas."""
        return self._m - self._min

    @property
    def threshold(self) -> float:
        """The alarm level lam."""
        return self.lam

    def update(self, value: float) -> bool:
        """Take one value; True while the statistic exceeds lam after the warm-up."""
        self._n += 1
        x = value / self.sigma
        self._mean += (x - self._mean) / self._n
        dev = x - self._mean if self.direction is Direction.UP else self._mean - x
        self._m += dev - self.delta
        self._min = min(self._min, self._m)
        return self._n >= self.min_points and self.statistic > self.lam

    def reset(self) -> None:
        """Forget everything, the running mean included."""
        self._n = 0
        self._mean = self._m = self._min = 0.0


@dataclass(frozen=True, slots=True)
class Scan:
    """Where a detector stands after a series: final statistic, threshold, first alarm."""

    statistic: float
    threshold: float
    first_alarm: int | None  # index into the scanned values; None when it never alarmed
    alarming: bool  # in alarm after the last value

    def evidence(self) -> dict[str, float | int | bool | None]:
        """The scan as JSON-ready evidence fields."""
        return {"statistic": round(self.statistic, 3), "threshold": round(self.threshold, 3),
                "first_alarm": self.first_alarm, "alarming": self.alarming}


def scan(detector: Detector, values: Iterable[float]) -> Scan:
    """Feed `values` to `detector` in order; the statistic is not reset at an alarm."""
    first: int | None = None
    alarming = False
    for i, value in enumerate(values):
        alarming = detector.update(value)
        if alarming and first is None:
            first = i
    return Scan(detector.statistic, detector.threshold, first, alarming)
