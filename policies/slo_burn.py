"""SLO burn: a pool spends its latency error budget too fast (multi-window, multi-burn-rate).

The objective of a pool is its TTFT p95 and TPOT p95 SLO from the fleet file. A scrape interval is
a bad event when the interval's p95 exceeded the SLO; the bad share of intervals over a window
divided by the error budget (the share of bad intervals the objective allows, e.g. 1 %) is the
burn rate. As in the SRE workbook's multi-window alerts, a condition fires only when both a long
and a short window burn faster than its factor: the long window proves the budget is really being
spent, the short one that it is still being spent now (so the alert stops soon after recovery).
The workbook pairs are 1 h / 5 m at 14.4 (page) and 6 h / 30 m at 6 (ticket); the policies see
at most three hours of signals, so the slow pair is 3 h / 15 m here, same factor, same 12:1 ratio.
Scrape intervals with no data (before the first scrape, or without requests) count as good, so a
window that is not yet full needs as many bad intervals as a full one: no blind spot after a
start, and no extra sensitivity either.

Attribution: a TTFT breach is queueing when the queue time p95 makes up most of the TTFT or
requests pile up per engine, else prefill compute (the prefill pool, or the pool itself when it
is unified); a TPOT breach belongs to the decode pool. The proposal scales the attributed pool.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from typing import Any

from pydantic import Field, model_validator

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.common import engines_of, gone_findings, recent_mean
from policies.types import (
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    PoolState,
    Severity,
)
from policies.windows import HISTORY_S

__all__ = ["KIND", "BurnWindow", "Cause", "SloBurn", "SloBurnSettings"]

KIND = "slo_burn"
# (pool signal, PoolState attribute holding its SLO); the signals are the vLLM collector's names.
OBJECTIVES: tuple[tuple[str, str], ...] = (("ttft_p95", "ttft_p95_slo"), ("tpot_p95", "tpot_p95_slo"))
_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class Cause(StrEnum):
    """Where the latency is lost."""

    QUEUEING = "queueing"  # requests wait to be scheduled: the pool lacks capacity
    PREFILL = "prefill"  # prompt processing is slow: the prefill pool lacks compute
    DECODE = "decode"  # token generation is slow: the decode pool is overloaded


@dataclass(frozen=True, slots=True)
class BurnWindow:
    """One alert condition: the burn rate over both windows is at least `burn`."""

    name: str
    long_s: float
    short_s: float
    burn: float
    severity: Severity


class SloBurnSettings(Settings):
    """Error budget, window pairs and attribution thresholds (`policies.slo_burn` in the fleet file); times in seconds.

    Two pairs as the SRE workbook sets them: the fast pair pages, the slow pair warns.
    """

    enabled: bool = True
    budget: float = Field(0.01, gt=0, lt=1)  # share of scrape intervals whose p95 may exceed the SLO (a 99 % objective)
    fast_burn: float = Field(14.4, gt=1)  # pages
    fast_window: Seconds = 3600.0
    fast_short_window: Seconds = 300.0
    slow_burn: float = Field(6.0, gt=1)  # warns
    slow_window: Seconds = 10800.0
    slow_short_window: Seconds = 900.0
    min_short_points: int = Field(3, ge=1)  # intervals the short window must hold before it is judged
    resolve_points: int = Field(4, ge=1)  # consecutive intervals within the SLO to resolve (hysteresis)
    resolve_fraction: float = Field(0.5, gt=0, le=1)  # ... and every short window burning under half its alerting rate
    recent_points: int = Field(4, ge=1)  # attribution looks at the mean of this many newest intervals
    queue_share: float = Field(0.5, gt=0, le=1)  # queue time p95 at least half of TTFT p95: queueing
    waiting_per_engine: float = Field(2.0, gt=0)  # ... or this many waiting requests per engine
    stale_s: Seconds = 900.0

    @model_validator(mode="after")
    def _windows_fit(self) -> SloBurnSettings:
        problems = []
        for w in self.windows:
            if w.short_s >= w.long_s:
                problems.append(f"{w.name}_short_window ({w.short_s:g}s) must be shorter than {w.name}_window "
                                f"({w.long_s:g}s)")
            if w.long_s > HISTORY_S:
                problems.append(f"{w.name}_window ({w.long_s:g}s) exceeds the {HISTORY_S:g}s of history the loop keeps")
            if w.burn * self.budget >= 1:
                problems.append(f"{w.name}_burn x budget must stay below 1, or the burn rate can never be reached")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def windows(self) -> tuple[BurnWindow, BurnWindow]:
        """The fast (paging) and slow (warning) window pairs."""
        return (BurnWindow("fast", self.fast_window, self.fast_short_window, self.fast_burn, Severity.CRITICAL),
                BurnWindow("slow", self.slow_window, self.slow_short_window, self.slow_burn, Severity.WARNING))

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval."""
        why = f"{self.min_short_points} points in each short window"
        return [p for w in self.windows
                for p in least_window(f"{w.name}_short_window", w.short_s, self.min_short_points, interval, why)]


@dataclass(slots=True)
class _Burn:
    """One objective of one pool, judged now."""

    signal: str
    slo: float
    value: float
    bad_share: dict[str, float]
    burn: dict[str, float]
    firing: list[BurnWindow]
    cause: Cause | None = None
    target: str | None = None

    def statistic(self, window: BurnWindow) -> float:
        """The pair's burn rate: the smaller of the two, since both must exceed the factor."""
        return min(self.burn.get(_label(window.long_s), 0.0), self.burn.get(_label(window.short_s), 0.0))

    def evidence(self) -> dict[str, Any]:
        return {
            "slo": self.slo,
            "value": round(self.value, 5),
            "bad_share": {k: round(v, 4) for k, v in self.bad_share.items()},
            "burn": {k: round(v, 2) for k, v in self.burn.items()},
            "firing": [w.name for w in self.firing],
            "cause": None if self.cause is None else self.cause.value,
            "attributed_pool": self.target,
        }


class SloBurn:
    """Multi-window burn-rate alerting on each pool's TTFT and TPOT p95 objectives."""

    kind = KIND
    reads: tuple[str, ...] = ("ttft_p95", "tpot_p95", "queue_time_p95", "requests_waiting")

    def __init__(self, settings: SloBurnSettings | None = None) -> None:
        self.settings = settings or SloBurnSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every pool with an SLO."""
        s = self.settings
        result = PolicyResult()
        judged: set[str] = set()
        for name, state in sorted(inp.pools.items()):
            subject = f"pool/{name}"
            objectives = [b for signal, attr in OBJECTIVES
                          if (slo := getattr(state, attr)) is not None
                          and (b := self._judge(inp, subject, signal, slo)) is not None]
            key = FindingKey(KIND, subject)
            if not any(getattr(state, attr) is not None for _, attr in OBJECTIVES) and key in inp.open_findings:
                result.resolved.append((key, "the pool no longer has an SLO"))
                continue
            if not objectives:
                continue
            judged.add(subject)
            firing = [b for b in objectives if b.firing]
            if not firing and key not in inp.open_findings:
                continue
            if not firing and self._clean(inp, subject, objectives):
                result.resolved.append((key, "latency back within the SLO and the budget no longer burning"))
                continue
            result.findings.append(self._report(inp, state, objectives))
        for key in inp.open_findings:
            if key.kind == KIND and key.subject.removeprefix("pool/") not in inp.pools:
                result.resolved.append((key, "the pool is no longer in the fleet"))
        done = {k for k, _ in result.resolved}
        result.resolved += [r for r in gone_findings(inp, KIND, [sig for sig, _ in OBJECTIVES], s.stale_s, skip=judged)
                            if r[0] not in done]
        return result

    def _judge(self, inp: PolicyInput, subject: str, signal: str, slo: float) -> _Burn | None:
        s = self.settings
        points = inp.windows.series(subject, signal, since=inp.now - s.stale_s)
        if not points:
            return None  # no fresh data: judged on old data it would reopen what `gone_findings` resolves
        value = points[-1][1]
        bad_share: dict[str, float] = {}
        burn: dict[str, float] = {}
        firing = []
        longest = inp.windows.series(subject, signal, since=inp.now - max(w.long_s for w in s.windows))
        gaps = [b[0] - a[0] for a, b in pairwise(longest)]
        interval = statistics.median(gaps) if gaps else None
        for window in s.windows:
            shares = []
            for length, need in ((window.long_s, 2), (window.short_s, s.min_short_points)):
                points = inp.windows.series(subject, signal, since=inp.now - length)
                # Intervals without data count as good: right after a start the long window is not
                # yet full, and dividing by the few points there would page on a short blip that a
                # full window shrugs off. A breach must fill the same share of the whole window.
                expected = length / interval if interval else 0.0
                total = max(float(len(points)), expected)
                share = sum(1 for _, v in points if v > slo) / total if total else 0.0
                bad_share[_label(length)] = share
                burn[_label(length)] = share / s.budget
                shares.append(share if len(points) >= need else None)
            if all(x is not None and x / s.budget >= window.burn for x in shares):
                firing.append(window)
        return _Burn(signal, slo, value, bad_share, burn, firing)

    def _clean(self, inp: PolicyInput, subject: str, objectives: list[_Burn]) -> bool:
        s = self.settings
        n = s.resolve_points
        recents = [(b, inp.windows.last(subject, b.signal, n)) for b in objectives]
        full = [(b, r) for b, r in recents if len(r) == n]
        # A pool that keeps burning its budget right at the alerting rate would otherwise resolve
        # and reopen with every single bad interval (seen in a 36 h replay): the short windows
        # must cool well below the rate that opened it.
        cooled = all(b.burn[_label(w.short_s)] < s.resolve_fraction * w.burn for b in objectives for w in s.windows
                     if b.burn[_label(w.long_s)] >= w.burn)
        return bool(full) and cooled and all(v <= b.slo for b, r in recents for v in r)

    def _attribute(self, inp: PolicyInput, state: PoolState, burn: _Burn) -> None:
        s = self.settings
        subject = f"pool/{state.name}"
        if burn.signal == "tpot_p95":
            burn.cause = Cause.DECODE
            burn.target = state.name if state.role != "prefill" else _busiest(inp, "decode", burn, state.name, s.stale_s)
            return
        ttft = recent_mean(inp.windows, subject, "ttft_p95", s.recent_points)
        queue = recent_mean(inp.windows, subject, "queue_time_p95", s.recent_points)
        waiting = (recent_mean(inp.windows, subject, "requests_waiting", s.recent_points) or 0.0) / engines_of(inp, state.name)
        if (queue is not None and ttft and queue >= s.queue_share * ttft) or waiting >= s.waiting_per_engine:
            burn.cause = Cause.QUEUEING
            burn.target = state.name
        else:
            burn.cause = Cause.PREFILL
            burn.target = state.name if state.role != "decode" else _busiest(inp, "prefill", burn, state.name, s.stale_s)

    def _report(self, inp: PolicyInput, state: PoolState, objectives: list[_Burn]) -> FindingReport:
        s = self.settings
        subject = f"pool/{state.name}"
        firing = [b for b in objectives if b.firing]
        for b in firing:
            self._attribute(inp, state, b)
        if firing:
            worst, window = max(((b, w) for b in firing for w in b.firing),
                                key=lambda bw: (_RANK[bw[1].severity], bw[0].statistic(bw[1])))
            severity = window.severity
        else:  # open and no longer burning, but not yet clean: keep it open quietly
            worst, window = max(((b, w) for b in objectives for w in s.windows), key=lambda bw: bw[0].statistic(bw[1]))
            severity = Severity.WARNING
        texts = []
        short: list[str] = []  # pools short of capacity: the autoscaler's input, which alone sets replica counts
        for b in firing:
            what = "TTFT" if b.signal == "ttft_p95" else "TPOT"
            long_label = _label(b.firing[0].long_s)
            texts.append(f"{what} p95 is {b.value:.3g}s against an SLO of {b.slo:.3g}s; "
                         f"{b.bad_share[long_label]:.0%} of intervals breached it over {long_label}. " + _why(b))
            if b.target and b.target not in short:
                short.append(b.target)
        if not firing:
            texts.append("The budget is no longer burning fast; waiting for latency to stay within the SLO.")
        evidence: dict[str, Any] = {
            "signal": worst.signal,
            "value": round(worst.value, 5),
            "slo": worst.slo,
            "baseline": s.budget,  # the bad share the objective allows
            "statistic": round(worst.statistic(window), 2),
            "threshold": window.burn,
            "window": f"{window.name}: {_label(window.long_s)} and {_label(window.short_s)}",
            "objectives": {b.signal: b.evidence() for b in objectives},
            "cause": None if not firing else worst.cause.value if worst.cause else None,
            "short_pools": short,
            "suggested_actions": [f"add capacity to {pool} (the autoscaler's input)" for pool in short],
        }
        names = " and ".join(("TTFT" if b.signal == "ttft_p95" else "TPOT") for b in firing) or "latency"
        summary = f"{state.name} burns its {names} p95 error budget at {worst.statistic(window):.1f}x ({window.name})"
        return FindingReport(FindingKey(KIND, subject), severity, summary, " ".join(texts), evidence, KIND)


def _why(b: _Burn) -> str:
    if b.cause is Cause.QUEUEING:
        return f"Requests wait to be scheduled in {b.target}: it lacks capacity."
    if b.cause is Cause.PREFILL:
        return f"Queueing is small, so prompt processing itself is slow: {b.target} lacks prefill compute."
    return f"Token generation is slow: {b.target} is overloaded (batch too large or KV pressure)."


def _busiest(inp: PolicyInput, role: str, burn: _Burn, fallback: str, stale_s: float) -> str:
    """The pool of `role` furthest over its own objective for the burning signal (the burning pool's where it has
    none), by its latest point within `stale_s`; `fallback` when none has one. By the raw latency, a pool with a
    looser objective, or one whose series stopped an hour ago, would be blamed for another's breach."""
    over: list[tuple[float, str]] = []
    for p in sorted(inp.pools.values(), key=lambda p: p.name):
        points = inp.windows.series(f"pool/{p.name}", burn.signal, since=inp.now - stale_s) if p.role == role else []
        if points:
            over.append((points[-1][1] / (p.slos.get(burn.signal) or burn.slo), p.name))
    return max(over, key=lambda o: o[0])[1] if over else fallback


def _label(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
