"""Small helpers the detection policies share: recent aggregates, subject parsing, staleness."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from policies.types import FindingKey, PolicyInput, PoolState
from policies.windows import SignalWindows

__all__ = [
    "current_since",
    "current_subjects",
    "engines_of",
    "gone_findings",
    "pool_of",
    "ratio_series",
    "recent_mean",
    "recent_median",
    "removed_pools",
    "reported_since",
]


def recent_mean(windows: SignalWindows, subject: str, name: str, points: int) -> float | None:
    """Mean of the newest `points` values of a series, None without any."""
    values = windows.last(subject, name, points)
    return statistics.fmean(values) if values else None


def recent_median(windows: SignalWindows, subject: str, name: str, points: int) -> float | None:
    """Median of the newest `points` values of a series, None without any."""
    values = windows.last(subject, name, points)
    return statistics.median(values) if values else None


def pool_of(subject: str) -> str:
    """The pool named by an `engine/`, `pod/` or `pool/` subject."""
    parts = subject.split("/")
    return parts[1] if len(parts) > 1 else subject


def engines_of(inp: PolicyInput, pool: str, pool_state: PoolState | None = None) -> int:
    """How many engines a pool's aggregate signals cover: reported, else ready replicas, at least 1."""
    reporting = inp.windows.latest(f"pool/{pool}", "engines_reporting")
    if reporting:
        return max(1, round(reporting))
    state = pool_state or inp.pools.get(pool)
    return max(1, state.ready if state else 1)


def ratio_series(windows: SignalWindows, subject: str, numerator: str, denominator: str,
                 since: float | None = None) -> list[tuple[float, float]]:
    """numerator/denominator at the timestamps where both series have a point (one scrape)."""
    den = dict(windows.series(subject, denominator, since=since))
    return [(ts, v / d) for ts, v in windows.series(subject, numerator, since=since)
            if (d := den.get(ts)) is not None and d > 0]


def reported_since(windows: SignalWindows, subject: str, names: Iterable[str], since: float) -> bool:
    """True when any of the named series of `subject` has a point at or after `since`."""
    return any(windows.series(subject, name, since=since) for name in names)


def current_since(windows: SignalWindows, subjects: Iterable[str], names: Sequence[str], now: float,
                  stale_s: float) -> float:
    """From when a subject counts as current: it reported in the latest round of scrapes of `subjects`
    (one that missed it left, or was replaced: its old points say nothing about now), and within
    `stale_s`. A round stamps each target at `now` plus its offset within the round (`scrape.spread`),
    so the round is what came at or after `now`, or, where nothing did (a replay), the newest point."""
    newest = max((ts for s in subjects for n in names if (ts := windows.latest_ts(s, n)) is not None),
                 default=now - stale_s)
    return max(min(newest, now), now - stale_s)


def current_subjects(windows: SignalWindows, subjects: Iterable[str], names: Sequence[str], now: float,
                     stale_s: float) -> list[str]:
    """The subjects, sorted, that reported any of `names` in the latest round of their scrapes (`current_since`)."""
    subjects = sorted(set(subjects))
    since = current_since(windows, subjects, names, now, stale_s)
    return [s for s in subjects if reported_since(windows, s, names, since)]


def gone_findings(inp: PolicyInput, kind: str, names: Iterable[str], stale_s: float,
                  skip: Iterable[str] = ()) -> list[tuple[FindingKey, str]]:
    """Open findings of `kind` whose subject reported none of `names` for `stale_s`.

    A restarted or removed pod never reports again under its old name; without this its finding
    would stay open forever, since a policy only judges subjects that have data.
    """
    names = tuple(names)
    skipped = set(skip)
    out = []
    for key in inp.open_findings:
        if key.kind != kind or key.subject in skipped:
            continue
        if not reported_since(inp.windows, key.subject, names, inp.now - stale_s):
            out.append((key, f"{key.subject} no longer reports"))
    return out


def removed_pools(inp: PolicyInput, kind: str) -> list[tuple[FindingKey, str]]:
    """Open findings of `kind` on pools no longer in the fleet file: nothing will report them settled again."""
    pools = {f"pool/{name}" for name in inp.pools}
    return [(key, "the pool is no longer in the fleet file") for key in inp.open_findings
            if key.kind == kind and key.subject not in pools]
