"""Speculative-decoding collapse: speculation stops paying for a pool.

Judged on the yield, accepted draft tokens per generated token (`spec_yield`), not on the
acceptance rate alone: with a draft model (EAGLE, MTP) a collapse shows as acceptance rate and
mean acceptance length falling, typically when constrained JSON or tool-call traffic grows and
the grammar mask rejects the drafts; with the ngram drafter the drafts themselves vanish (random
sampling, novel text), the acceptance rate is then undefined while the yield still falls to 0.
A one-sided CUSUM on the yield, in robust sigmas of the pool's own baseline, gated by a minimum
drop, opens the finding; drafts per generated token tell the two causes apart; TPOT p95 against
its baseline (or the SLO) tells whether speculation now costs latency, and only then is a change
proposed: lower `num_speculative_tokens` to the positions that are still accepted, or disable
speculation. Every proposal carries TPOT p95 as its verify signal: the loop judges the outcome
and the action is reverted when TPOT did not improve.

Whether speculation still pays is judged on its cost, from the measured signals: k draft tokens
make a step cost about 1 + k x (`draft_cost` + `verify_cost`) plain decode steps and yield the
mean acceptance length in tokens, so the estimated speed-up is length / cost. A sustained fall of
the acceptance rate by `acceptance_drop` (30 %) also opens the finding, though the yield, which
compresses such falls, dropped by less than its own 30 %: the finding then says whether
speculation is kept (it still pays, with the estimate) or changed (it no longer does, or TPOT rose).

The baseline is frozen in the finding's evidence when it opens. A change of the pool's number of
speculative positions (per-position counters appear or vanish) restarts the baseline, so a pool
that was retuned is judged against its new normal, not its old one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.changepoint import Baseline, Cusum, Direction, scan
from policies.common import ratio_series, recent_mean, reported_since
from policies.types import (
    ActionKind,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    Severity,
    Speculation,
)
from policies.windows import SignalWindows

__all__ = ["KIND", "Cause", "SpecDecodeCollapse", "SpecDecodeSettings"]

KIND = "spec_decode_collapse"
YIELD = "spec_yield"
TPOT = "tpot_p95"  # the pool's TPOT p95 as the vLLM collector names it: the verify signal
GENERATION = "generation_tokens_rate"
DRAFTS = "spec_draft_rate"
ACCEPTANCE = "spec_acceptance_rate"
LENGTH = "spec_mean_acceptance_length"
MAX_POSITIONS = 32  # far above any num_speculative_tokens in use


def _position(i: int) -> str:
    return f"spec_acceptance_pos_{i}"


class Cause(StrEnum):
    """Why the yield fell."""

    ACCEPTANCE_COLLAPSE = "acceptance_collapse"  # drafts are proposed but rejected
    DRAFTS_VANISHED = "drafts_vanished"  # the drafter proposes (almost) nothing


class SpecDecodeSettings(Settings):
    """Thresholds (`policies.spec_decode_collapse` in the fleet file); the yield is a fraction of generated
    tokens, times are seconds."""

    enabled: bool = True
    baseline_s: Seconds = Field(1800.0, alias="baseline")
    min_baseline_points: int = Field(20, ge=2)
    recent_points: int = Field(8, ge=2)  # the CUSUM runs over these (2 min at 15 s)
    confirm_points: int = Field(2, ge=1)  # ... and this many newest points must each be below baseline - min_drop
    cusum_k: float = Field(0.5, ge=0)
    cusum_h: float = Field(5.0, gt=0)
    min_sigma: float = Field(0.01, gt=0)  # a steady yield has a MAD near 0; 1 point of yield is its floor
    min_abs_drop: float = Field(0.10, gt=0, lt=1)  # yield drops smaller than 0.10 accepted per generated token are noise
    min_rel_drop: float = Field(0.30, gt=0, lt=1)  # ... and so are drops under 30 % of the baseline
    min_generation_rate: float = Field(5.0, ge=0)  # tokens/s: an idle pool says nothing about speculation
    tpot_points: int = Field(4, ge=1)  # TPOT p95 is judged on the mean of this many newest points
    tpot_rise: float = Field(0.10, gt=0)  # TPOT p95 10 % above its baseline: speculation now costs latency
    vanished_share: float = Field(0.25, gt=0, lt=1)  # drafts per generated token below 25 % of baseline: vanished
    min_position_acceptance: float = Field(0.30, gt=0, lt=1)  # a speculative position accepted less often does not pay
    resolve_points: int = Field(4, ge=1)  # consecutive recovered points to resolve (hysteresis)
    recover_fraction: float = Field(0.5, gt=0, le=1)  # recovered: above baseline - 0.5 * min_drop
    acceptance_drop: float = Field(0.30, gt=0, lt=1)  # acceptance rate 30 % under its baseline, sustained, opens too
    # The step cost of speculation in plain decode steps: per draft token, the drafter (an EAGLE head:
    # a tenth of a step) and verifying it in the target's forward pass.
    draft_cost: float = Field(0.10, ge=0)
    verify_cost: float = Field(0.03, ge=0)
    pays_margin: float = Field(0.05, ge=0)  # it pays while the estimated speed-up is at least 1 + this
    off_s: Seconds = 120.0  # tokens flow but no yield for this long: speculation was switched off
    stale_s: Seconds = 900.0  # no data at all for this long: the pool is gone

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval."""
        need = self.min_baseline_points + self.recent_points
        why = f"{self.min_baseline_points} baseline points besides its {self.recent_points} recent ones"
        return least_window("baseline", self.baseline_s, need, interval, why)


@dataclass(frozen=True, slots=True)
class _Frozen:
    """What the finding keeps from the moment it opened."""

    yield_: Baseline
    min_drop: float
    tpot: float | None
    draft_share: float | None
    acceptance: float | None
    length: float | None
    positions: int

    def evidence(self) -> dict[str, Any]:
        return {
            "baseline": round(self.yield_.center, 4),
            "baseline_sigma": round(self.yield_.sigma, 4),
            "min_drop": round(self.min_drop, 4),
            "baseline_tpot_p95": _round(self.tpot, 5),
            "baseline_draft_share": _round(self.draft_share, 4),
            "baseline_acceptance_rate": _round(self.acceptance, 4),
            "baseline_mean_acceptance_length": _round(self.length, 3),
            "num_speculative_tokens": self.positions or None,
        }

    @classmethod
    def from_evidence(cls, ev: Any) -> _Frozen:
        def opt(name: str) -> float | None:
            v = ev.get(name)
            return None if v is None else float(v)

        return cls(Baseline(float(ev["baseline"]), float(ev["baseline_sigma"])), float(ev["min_drop"]),
                   opt("baseline_tpot_p95"), opt("baseline_draft_share"), opt("baseline_acceptance_rate"),
                   opt("baseline_mean_acceptance_length"), int(ev.get("num_speculative_tokens") or 0))


class SpecDecodeCollapse:
    """Detects per-pool speculative-decoding collapse and proposes retuning or disabling it."""

    kind = KIND
    reads: tuple[str, ...] = (YIELD, TPOT, GENERATION, DRAFTS, ACCEPTANCE, LENGTH, "spec_acceptance_pos_{n}")

    def __init__(self, settings: SpecDecodeSettings | None = None) -> None:
        self.settings = settings or SpecDecodeSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every pool that reports a speculative yield, and every open finding."""
        result = PolicyResult()
        subjects = set(inp.windows.subjects(YIELD, prefix="pool/"))
        subjects |= {k.subject for k in inp.open_findings if k.kind == KIND}
        for subject in sorted(subjects):
            key = FindingKey(KIND, subject)
            open_finding = inp.open_findings.get(key)
            if open_finding is not None:
                frozen = _Frozen.from_evidence(open_finding.evidence)
                why = self._resolved(inp, subject, frozen)
                if why is not None:
                    result.resolved.append((key, why))
                    continue
            else:
                judged = self._baseline(inp, subject)
                if judged is None or not self._collapsed(inp, subject, judged):
                    continue
                frozen = judged
            report = self._report(inp, subject, frozen)
            if report is not None:
                result.findings.append(report)
        return result

    # baseline and detection ---------------------------------------------------------------------

    def _baseline(self, inp: PolicyInput, subject: str) -> _Frozen | None:
        s = self.settings
        w = inp.windows
        since = max(inp.now - s.baseline_s, _config_change(w, subject))
        history = w.series(subject, YIELD, since=since)[: -s.recent_points]
        if len(history) < s.min_baseline_points:
            return None
        start, end = history[0][0], history[-1][0]
        base = Baseline.robust([v for _, v in history], s.min_sigma)
        min_drop = max(s.min_abs_drop, s.min_rel_drop * base.center)
        shares = [v for ts, v in ratio_series(w, subject, DRAFTS, GENERATION, since=start) if ts <= end]
        return _Frozen(
            base, min_drop, _median(_between(w, subject, TPOT, start, end)), _median(shares),
            _median(_between(w, subject, ACCEPTANCE, start, end)), _median(_between(w, subject, LENGTH, start, end)),
            _positions(w, subject, start),
        )

    def _collapsed(self, inp: PolicyInput, subject: str, frozen: _Frozen) -> bool:
        s = self.settings
        points = inp.windows.series(subject, YIELD, since=inp.now - s.off_s)
        if not points:
            return False  # the newest yields are old: speculation is off, nothing to judge now
        recent = inp.windows.last(subject, YIELD, s.recent_points)
        if len(recent) < s.confirm_points:
            return False
        generated = recent_mean(inp.windows, subject, GENERATION, s.confirm_points)
        if generated is None or generated < s.min_generation_rate:
            return False
        cusum = scan(Cusum(frozen.yield_, k=s.cusum_k, h=s.cusum_h, direction=Direction.DOWN), recent)
        bar = frozen.yield_.center - frozen.min_drop
        if cusum.alarming and all(v < bar for v in recent[-s.confirm_points:]):
            return True
        acceptance = inp.windows.last(subject, ACCEPTANCE, s.recent_points)
        return (frozen.acceptance is not None and len(acceptance) == s.recent_points
                and all(v < (1 - s.acceptance_drop) * frozen.acceptance for v in acceptance))

    def speedup(self, length: float | None, k: int) -> float | None:
        """Estimated decode speed-up of speculating k tokens at this mean acceptance length (None: unknown)."""
        if length is None or k <= 0:
            return None
        return length / (1 + k * (self.settings.draft_cost + self.settings.verify_cost))

    def _resolved(self, inp: PolicyInput, subject: str, frozen: _Frozen) -> str | None:
        s = self.settings
        w = inp.windows
        if not reported_since(w, subject, (YIELD, GENERATION), inp.now - s.stale_s):
            return f"{subject} no longer reports"
        # Tokens flow and no yield: switched off. An idle pool has no yield either (0 drafts over 0 steps), and a lull
        # is no recovery: resolved then, the collapse would become its own baseline when the load came back.
        flowing = any(v >= s.min_generation_rate for _, v in w.series(subject, GENERATION, since=inp.now - s.off_s))
        if not w.series(subject, YIELD, since=inp.now - s.off_s) and flowing:
            return "speculation no longer reports: it was switched off"
        recent = w.last(subject, YIELD, s.resolve_points)
        bar = frozen.yield_.center - s.recover_fraction * frozen.min_drop
        # The acceptance that opens a finding on its own must be back above that bar too, else a drop in
        # acceptance the yield hides (few drafts per step) would resolve and reopen every other tick.
        acceptance = w.last(subject, ACCEPTANCE, s.resolve_points)
        accepting = frozen.acceptance is None or not acceptance or any(
            v >= (1 - s.acceptance_drop) * frozen.acceptance for v in acceptance)
        if len(recent) == s.resolve_points and all(v >= bar for v in recent) and accepting:
            return "speculative yield back near its baseline"
        positions = _positions(w, subject, _nth_newest_ts(w, subject, YIELD, s.resolve_points))
        tpot = w.last(subject, TPOT, s.resolve_points)
        if (0 < positions < frozen.positions and frozen.tpot is not None and len(tpot) == s.resolve_points
                and all(v <= frozen.tpot * (1 + s.tpot_rise) for v in tpot)):
            return (f"num_speculative_tokens went from {frozen.positions} to {positions} and TPOT p95 is back "
                    "at its baseline")
        return None

    # the report ---------------------------------------------------------------------------------

    def _report(self, inp: PolicyInput, subject: str, frozen: _Frozen) -> FindingReport | None:
        s = self.settings
        w = inp.windows
        current = w.latest(subject, YIELD)
        if current is None:
            return None
        pool = subject.removeprefix("pool/")
        recent = w.last(subject, YIELD, s.recent_points)
        cusum = scan(Cusum(frozen.yield_, k=s.cusum_k, h=s.cusum_h, direction=Direction.DOWN), recent)
        # Speculative signals move with the yield, so they are read over the points that confirmed
        # the drop; TPOT p95 is noisier and gets a few more.
        # Acceptance figures stop being emitted when drafts vanish: older values must not stand in.
        since = _nth_newest_ts(w, subject, YIELD, s.confirm_points)
        acceptance = _mean_since(w, subject, ACCEPTANCE, since)
        length = _mean_since(w, subject, LENGTH, since)
        drafts = _mean_since(w, subject, DRAFTS, since)
        generated = _mean_since(w, subject, GENERATION, since)
        share = drafts / generated if drafts is not None and generated else None
        tpot = recent_mean(w, subject, TPOT, s.tpot_points)
        state = inp.pools.get(pool)
        slo = state.tpot_p95_slo if state else None
        tpot_ratio = tpot / frozen.tpot if tpot is not None and frozen.tpot else None
        costs = (tpot_ratio is not None and tpot_ratio >= 1 + s.tpot_rise) or (
            slo is not None and tpot is not None and tpot > slo)
        k = frozen.positions or _positions(w, subject, since)
        per_position = {i: v for i in range(k) if (v := _mean_since(w, subject, _position(i), since)) is not None}
        vanished = (frozen.draft_share is not None and frozen.draft_share > 0
                    and (share is None or share <= s.vanished_share * frozen.draft_share))
        cause = Cause.DRAFTS_VANISHED if vanished else Cause.ACCEPTANCE_COLLAPSE
        evidence: dict[str, Any] = {
            "signal": YIELD,
            "value": round(current, 4),
            **frozen.evidence(),
            "drop": round(frozen.yield_.center - current, 4),
            "statistic": round(cusum.statistic, 3),
            "threshold": s.cusum_h,
            "detector": f"one-sided CUSUM (down), k={s.cusum_k}, h={s.cusum_h} robust sigmas",
            "acceptance_rate": _round(acceptance, 4),
            "mean_acceptance_length": _round(length, 3),
            "draft_share": _round(share, 4),
            "generation_tokens_rate": _round(generated, 2),
            "tpot_p95": _round(tpot, 5),
            "tpot_ratio": _round(tpot_ratio, 3),
            "tpot_p95_slo": slo,
            "speculation_costs_latency": costs,
            "position_acceptance": {str(i): round(v, 4) for i, v in per_position.items()},
            "engine_yields": {
                e.removeprefix(f"engine/{pool}/"): round(v, 4)
                for e in sorted(w.subjects(YIELD, prefix=f"engine/{pool}/"))
                if (v := w.latest(e, YIELD)) is not None
            },
            "cause": cause.value,
        }
        if cause is Cause.DRAFTS_VANISHED:
            text = (f"The drafter stopped proposing: {_pct(share)} drafts per generated token against "
                    f"{_pct(frozen.draft_share)} before. An n-gram drafter finds no matches in this traffic (sampled, "
                    "novel text), so every step pays for a lookup that yields nothing.")
        else:
            text = (f"Drafts are proposed but rejected: acceptance rate {_pct(acceptance)} against "
                    f"{_pct(frozen.acceptance)}, mean acceptance length {_num(length)} against {_num(frozen.length)}. "
                    "Constrained decoding (JSON mode, tool calls) masks draft tokens, or the traffic moved away from "
                    "what the draft model predicts well.")
        gain, before = self.speedup(length, k), self.speedup(frozen.length, k)
        pays = cause is not Cause.DRAFTS_VANISHED and gain is not None and gain >= 1 + s.pays_margin
        evidence |= {"estimated_speedup": _round(gain, 3), "baseline_estimated_speedup": _round(before, 3),
                     "speculation_pays": pays}
        if gain is not None:
            text += (f" At {k} draft tokens a step costs about {1 + k * (s.draft_cost + s.verify_cost):.2f} plain "
                     f"steps and yields {_num(length)} tokens: an estimated {gain:.2f}x"
                     + (f" (was {before:.2f}x)" if before is not None else "") + ".")
        if costs:
            text += f" TPOT p95 is {_num(tpot, 's')} against {_num(frozen.tpot, 's')} before: speculation now costs latency."
        elif not pays:
            text += " Speculation no longer pays for its cost: it is changed before TPOT shows it."
        else:
            text += " Speculation still pays for its cost and TPOT p95 has not risen: it is kept as it is."
        proposals = self._proposals(pool, cause, k, per_position) if costs or not pays else ()
        evidence["suggested_actions"] = [p.reason for p in proposals]
        severity = Severity.CRITICAL if costs else Severity.WARNING if not pays else Severity.INFO
        # While open, the summary names the lowest yield seen: the latest may already be recovering.
        opened = inp.open_findings.get(FindingKey(KIND, subject))
        lowest = min(current, float(opened.evidence.get("lowest", current))) if opened else current
        evidence["lowest"] = round(lowest, 4)
        summary = (f"speculative decoding of {pool} stopped paying: yield {lowest:.0%} of generated tokens "
                   f"against {frozen.yield_.center:.0%}")
        return FindingReport(FindingKey(KIND, subject), severity, summary, text, evidence, KIND, proposals)

    def _proposals(self, pool: str, cause: Cause, k: int, per_position: dict[int, float]) -> tuple[Proposal, ...]:
        s = self.settings
        check = "; then TPOT p95 must improve, otherwise revert"
        disable = Proposal(ActionKind.DISABLE_SPECULATION, pool, Speculation(0),
                           f"serve {pool} without --speculative-config ({cause.value}){check}",
                           verify_signal=TPOT, verify_lower_is_better=True)
        if cause is Cause.DRAFTS_VANISHED or k == 1:
            return (disable,)
        if k == 0:  # positions unknown: step down by one
            return (Proposal(ActionKind.TUNE_SPECULATION, pool, Speculation(step=-1),
                             f"lower num_speculative_tokens of {pool} by one in --speculative-config{check}",
                             verify_signal=TPOT, verify_lower_is_better=True),)
        new = k - 1
        if per_position:
            # Acceptance at a position implies acceptance at every earlier one, so the positions
            # worth keeping are a prefix: cut at the first that is rarely accepted.
            keep = next((i for i in range(k) if per_position.get(i, 0.0) < s.min_position_acceptance), k)
            if keep == 0:
                return (disable,)
            new = min(keep, k - 1)
        return (Proposal(ActionKind.TUNE_SPECULATION, pool, Speculation(new),
                         f"lower num_speculative_tokens of {pool} from {k} to {new} in --speculative-config "
                         f"(positions from {new} on are accepted in under {s.min_position_acceptance:.0%} of drafts)"
                         f"{check}",
                         verify_signal=TPOT, verify_lower_is_better=True),)


def _between(w: SignalWindows, subject: str, name: str, start: float, end: float) -> list[float]:
    return [v for ts, v in w.series(subject, name, since=start) if ts <= end]


def _mean_since(w: SignalWindows, subject: str, name: str, since: float) -> float | None:
    values = [v for _, v in w.series(subject, name, since=since)]
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _positions(w: SignalWindows, subject: str, since: float) -> int:
    """Speculative positions reported at or after `since`: num_speculative_tokens, 0 if unknown."""
    n = 0
    while n < MAX_POSITIONS and w.series(subject, _position(n), since=since):
        n += 1
    return n


def _nth_newest_ts(w: SignalWindows, subject: str, name: str, n: int) -> float:
    points = w.series(subject, name)
    return points[-min(n, len(points))][0] if points else float("inf")


def _config_change(w: SignalWindows, subject: str) -> float:
    """When num_speculative_tokens last changed, as far as the history shows, else -inf.

    Fewer positions now than before means it was lowered (just after the last point of the first
    position no longer reported); a highest position that began reporting within the history means
    it was raised (that position's first point). Either way older yields belong to the old
    configuration. No positions at all now says nothing (drafts vanished, or idle).
    """
    now_positions = _positions(w, subject, _nth_newest_ts(w, subject, YIELD, 1))
    if now_positions == 0:
        return float("-inf")
    gone = w.series(subject, _position(now_positions))
    lowered = gone[-1][0] + 1e-6 if gone else float("-inf")
    newest = w.series(subject, _position(now_positions - 1))
    earliest = w.series(subject, YIELD)
    raised = newest[0][0] if newest and earliest and newest[0][0] > earliest[0][0] else float("-inf")
    return max(lowered, raised)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _num(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.3g}{unit}"
