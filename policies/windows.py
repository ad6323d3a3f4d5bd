"""Sliding windows of recent signal values, keyed by (subject, name), and their grouping by minute."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import TypeVar

__all__ = ["HISTORY_S", "SignalWindows", "by_minute", "minute_means"]

T = TypeVar("T")

# How far back the loop keeps signals for the policies (and reloads them from the store on start):
# no policy window may be longer, or it would never fill.
HISTORY_S = 3 * 3600.0


class SignalWindows:
    """Recent (ts, value) points per (subject, name), trimmed to a horizon in seconds."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._series: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def add(self, ts: float, subject: str, name: str, value: float) -> None:
        """Append a point; out-of-order points older than the newest are ignored."""
        series = self._series.get((subject, name))
        if series is None:
            series = self._series[(subject, name)] = deque()
        if series and ts <= series[-1][0]:
            return
        series.append((ts, value))

    def extend(self, points: Iterable[tuple[float, str, str, float]]) -> None:
        """Add many (ts, subject, name, value) points."""
        for ts, subject, name, value in points:
            self.add(ts, subject, name, value)

    def trim(self, now: float) -> None:
        """Drop points older than the horizon, and series that became empty."""
        cutoff = now - self.horizon_s
        for key in list(self._series):
            series = self._series[key]
            while series and series[0][0] < cutoff:
                series.popleft()
            if not series:
                del self._series[key]

    def rewind(self, now: float) -> int:
        """Drop points stamped after `now` (a clock stepped back: they would keep every newer point out, as older
        than them); how many were dropped."""
        dropped = 0
        for key in list(self._series):
            series = self._series[key]
            while series and series[-1][0] > now:
                series.pop()
                dropped += 1
            if not series:
                del self._series[key]
        return dropped

    def series(self, subject: str, name: str, since: float | None = None) -> list[tuple[float, float]]:
        """Points of one series, oldest first, optionally only those at or after `since`."""
        series = self._series.get((subject, name))
        if not series:
            return []
        points = list(series)
        if since is None:
            return points
        return points[bisect_left(points, (since, float("-inf"))) :]

    def last(self, subject: str, name: str, n: int) -> list[float]:
        """The newest `n` values of a series (fewer if it is shorter), oldest first."""
        series = self._series.get((subject, name))
        if not series or n <= 0:
            return []
        return [v for _, v in islice(reversed(series), n)][::-1]

    def latest_ts(self, subject: str, name: str) -> float | None:
        """When the newest point of a series was taken, if any."""
        series = self._series.get((subject, name))
        return series[-1][0] if series else None

    def latest(self, subject: str, name: str) -> float | None:
        """The newest value of a series, if any."""
        series = self._series.get((subject, name))
        return series[-1][1] if series else None

    def unchanged(self, subject: str, name: str) -> tuple[float, float, int] | None:
        """(value, seconds, points) of the newest run of one unchanged value, scanned from the newest
        point back (cheap: a moving series stops at its second point); None for no series."""
        series = self._series.get((subject, name))
        if not series:
            return None
        newest_ts, value = series[-1]
        first_ts, n = newest_ts, 0
        for ts, v in reversed(series):
            if v != value:
                break
            first_ts, n = ts, n + 1
        return value, newest_ts - first_ts, n

    def subjects(self, name: str, prefix: str = "") -> Iterator[str]:
        """Subjects that have a series called `name`, filtered by subject prefix."""
        for subject, n in self._series:
            if n == name and subject.startswith(prefix):
                yield subject

    def __len__(self) -> int:
        return sum(len(s) for s in self._series.values())


def by_minute(points: Iterable[tuple[float, T]]) -> dict[int, list[T]]:
    """Values grouped by the minute they close, each minute numbered by its end (`ceil(ts / 60)`): a scrape reports
    the interval that ends at its timestamp, so the one at 60 s belongs to the first minute."""
    minutes: dict[int, list[T]] = {}
    for ts, v in points:
        minutes.setdefault(math.ceil(ts / 60.0), []).append(v)
    return minutes


def minute_means(series: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Mean of a series per minute, stamped with the minute's end (the newest minute may be partial)."""
    return [(k * 60.0, statistics.fmean(v)) for k, v in sorted(by_minute(series).items())]
