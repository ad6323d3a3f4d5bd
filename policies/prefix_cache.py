"""Prefix-cache hit-rate drop: a pool's hit rate falls well below its own recent baseline.

Hit rates differ a lot by workload, so the threshold is relative to the pool's baseline
(median and MAD over the baseline window), never a fixed number. The baseline is frozen in the
finding's evidence when it opens, so a long incident cannot become its own new normal.
"""

from __future__ import annotations

import itertools
from enum import StrEnum

from pydantic import Field

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.common import current_subjects, gone_findings, reported_since
from policies.stats import median_mad
from policies.types import (
    ActionKind,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    RollBack,
    Severity,
)

__all__ = ["Cause", "PrefixCacheHitDrop", "PrefixCacheSettings"]

KIND = "prefix_cache_hit_drop"
SIGNAL = "prefix_cache_hit_rate"
DESIRED = "replicas_desired"  # engines the pool's workload asks for, as the actuator reads it


class Cause(StrEnum):
    """The likely cause the evidence points at."""

    KV_PRESSURE = "kv_pressure"
    ROUTING_OR_PROMPTS = "routing_or_prompts"


class PrefixCacheSettings(Settings):
    """Thresholds of the detector (`policies.prefix_cache_hit_drop` in the fleet file); hit rates are fractions."""

    enabled: bool = True
    baseline_s: Seconds = Field(1800.0, alias="baseline")  # how far back the baseline looks
    min_baseline_points: int = Field(8, ge=2)  # fewer points than this: no judgement yet
    recent_points: int = Field(2, ge=1)  # consecutive low points needed to open (the detection delay)
    min_abs_drop: float = Field(0.10, gt=0, lt=1)  # a drop smaller than 10 points is noise for any workload
    min_rel_drop: float = Field(0.20, gt=0, lt=1)  # ... and so is one smaller than 20 % of the baseline
    mad_k: float = Field(4.0, ge=0)  # ... and one within 4 robust sigmas of the baseline's own jitter
    min_query_rate: float = Field(1.0, ge=0)  # tokens/s looked up; an idle pool has no meaningful hit rate
    resolve_points: int = Field(3, ge=1)  # consecutive recovered points needed to resolve (hysteresis)
    recover_fraction: float = Field(0.5, gt=0, le=1)  # recovered: back above baseline - 0.5 * threshold
    kv_pressure_usage: float = Field(0.85, gt=0, le=1)  # KV usage at or above which the cache is squeezed
    saturated_waiting_per_engine: float = Field(2.0, gt=0)  # queued requests per engine that mean "out of compute"
    # A router revision this recent, when the hit rate falls for routing or prompts, is the suspect.
    router_change_window_s: Seconds = Field(1800.0, alias="router_change_window")
    # A pool without a hit rate this long (removed, or idle: no lookups) is not judged on its old points, and its
    # finding resolves.
    stale_s: Seconds = Field(900.0, alias="stale")

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval."""
        need = self.min_baseline_points + self.recent_points
        why = f"{self.min_baseline_points} baseline points besides its {self.recent_points} recent ones"
        return least_window("baseline", self.baseline_s, need, interval, why)


def _low_since(inp: PolicyInput, subject: str, bar: float, until: float | None) -> float | None:
    """When the run of hit-rate points below `bar` that reaches `until` (the latest point when None) began."""
    began = None
    for ts, value in reversed(inp.windows.series(subject, SIGNAL)):
        if until is not None and ts > until:
            continue
        if value >= bar:
            break
        began = ts
    return began


def _shed(inp: PolicyInput, subject: str, after: float, until: float) -> float | None:
    """The last time in (`after`, `until`] the pool's desired engine count fell, if it did."""
    points = inp.windows.series(subject, DESIRED, since=after)
    return max((ts for (_, a), (ts, b) in itertools.pairwise(points) if b < a and after < ts <= until), default=None)


class PrefixCacheHitDrop:
    """Detects pool-level prefix-cache hit-rate drops and proposes a fix by cause."""

    kind = KIND
    reads: tuple[str, ...] = (SIGNAL, "prefix_cache_query_rate", "kv_cache_usage_max", "preemption_rate",
                              "requests_waiting", "ttft_p95", "engines_reporting")

    def __init__(self, settings: PrefixCacheSettings | None = None) -> None:
        self.settings = settings or PrefixCacheSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every pool that reports a hit rate."""
        result = PolicyResult()
        for subject in sorted(inp.windows.subjects(SIGNAL, prefix="pool/")):
            if not reported_since(inp.windows, subject, (SIGNAL,), inp.now - self.settings.stale_s):
                continue  # judged on old points it would re-report, and propose again, what has gone
            key = FindingKey(KIND, subject)
            open_finding = inp.open_findings.get(key)
            if open_finding is not None:
                baseline = float(open_finding.evidence["baseline"])
                threshold = float(open_finding.evidence["threshold"])
                if self._recovered(inp, subject, baseline, threshold):
                    result.resolved.append((key, "hit rate back near its baseline"))
                    continue
                report = self._report(inp, subject, baseline, threshold, open_finding.opened_at)
                if report is not None:
                    result.findings.append(report)
                continue
            judged = self._baseline(inp, subject)
            if judged is None:
                continue
            baseline, threshold = judged
            if self._dropped(inp, subject, baseline, threshold):
                report = self._report(inp, subject, baseline, threshold)
                if report is not None:
                    result.findings.append(report)
        result.resolved += gone_findings(inp, KIND, (SIGNAL,), self.settings.stale_s)
        return result

    def _baseline(self, inp: PolicyInput, subject: str) -> tuple[float, float] | None:
        s = self.settings
        points = inp.windows.series(subject, SIGNAL, since=inp.now - s.baseline_s)
        history = [v for _, v in points[: -s.recent_points]]
        if len(history) < s.min_baseline_points:
            return None
        med, sigma = median_mad(history)
        threshold = max(s.min_abs_drop, s.min_rel_drop * med, s.mad_k * sigma)
        return med, threshold

    def _dropped(self, inp: PolicyInput, subject: str, baseline: float, threshold: float) -> bool:
        s = self.settings
        recent = inp.windows.last(subject, SIGNAL, s.recent_points)
        if len(recent) < s.recent_points:
            return False
        if (inp.windows.latest(subject, "prefix_cache_query_rate") or 0.0) < s.min_query_rate:
            return False
        return all(v < baseline - threshold for v in recent)

    def _recovered(self, inp: PolicyInput, subject: str, baseline: float, threshold: float) -> bool:
        s = self.settings
        recent = inp.windows.last(subject, SIGNAL, s.resolve_points)
        bar = baseline - s.recover_fraction * threshold
        return len(recent) == s.resolve_points and all(v >= bar for v in recent)

    def _report(self, inp: PolicyInput, subject: str, baseline: float, threshold: float,
                opened_at: float | None = None) -> FindingReport | None:
        s = self.settings
        current = inp.windows.latest(subject, SIGNAL)
        if current is None:
            return None
        pool = subject.removeprefix("pool/")
        kv_max = inp.windows.latest(subject, "kv_cache_usage_max") or 0.0
        preemptions = inp.windows.latest(subject, "preemption_rate") or 0.0
        # The engines of the latest scrape: one drained or gone since keeps its last rate in the history.
        reporting = current_subjects(inp.windows, inp.windows.subjects(SIGNAL, prefix=f"engine/{pool}/"), (SIGNAL,),
                                     inp.now, self.settings.stale_s)
        engine_rates = {e.removeprefix(f"engine/{pool}/"): v for e in reporting
                        if (v := inp.windows.latest(e, SIGNAL)) is not None}
        spread = max(engine_rates.values()) - min(engine_rates.values()) if engine_rates else 0.0
        drop = baseline - current
        evidence = {
            "signal": SIGNAL,
            "value": round(current, 4),
            "baseline": round(baseline, 4),
            "threshold": round(threshold, 4),
            "drop": round(drop, 4),
            "kv_cache_usage_max": round(kv_max, 4),
            "preemption_rate": round(preemptions, 4),
            "engine_hit_rates": {k: round(v, 4) for k, v in sorted(engine_rates.items())},
            "engine_spread": round(spread, 4),
        }
        severity = Severity.CRITICAL if baseline > 0 and drop / baseline >= 0.5 else Severity.WARNING
        state = inp.pools.get(pool)
        # Saturation is judged on a short mean so one noisy scrape neither triggers nor hides it.
        waiting = _recent_mean(inp, subject, "requests_waiting", s.recent_points + 1) or 0.0
        ttft = _recent_mean(inp, subject, "ttft_p95", s.recent_points + 1)
        engines = max(1, state.ready if state else len(engine_rates))
        evidence["requests_waiting_per_engine"] = round(waiting / engines, 3)
        evidence["ttft_p95"] = None if ttft is None else round(ttft, 4)
        slo = state.ttft_p95_slo if state else None
        saturated = waiting / engines >= s.saturated_waiting_per_engine or (
            slo is not None and ttft is not None and ttft > slo
        )
        evidence["saturated"] = saturated
        proposals: tuple[Proposal, ...] = ()
        if kv_max >= s.kv_pressure_usage or preemptions > 0:
            cause = Cause.KV_PRESSURE
            text = (
                f"KV usage peaks at {kv_max:.0%} with {preemptions:.2f} preemptions/s: the prefix working set "
                "no longer fits in the KV cache left free by running requests."
            )
            # Capacity is the autoscaler's to add: the finding is one of its inputs, not a scale of its own.
        else:
            cause = Cause.ROUTING_OR_PROMPTS
            text = (
                f"KV usage is {kv_max:.0%} with no preemptions, so cache capacity is not the problem: the router "
                "stopped sending shared prefixes to the same engines, or the prompt population changed."
            )
            changed = inp.changed_at.get("router")
            evidence["router_changed_s_ago"] = None if changed is None else round(inp.now - changed)
            # The drop began with the run of low points that opened the finding, whatever it did since.
            began = _low_since(inp, subject, baseline - threshold, opened_at)
            # A revision can explain only a drop that came after it: one made since (the operator's fix, often) is
            # no cause, and rolling it back would undo the fix.
            # Where the run of low points is older than the history, the finding's opening stands in for its start.
            onset = began if began is not None else opened_at
            recent = (changed is not None and 0 <= inp.now - changed <= s.router_change_window_s
                      and (onset is None or changed <= onset))
            shed = _shed(inp, subject, changed, began) if recent and changed is not None and began is not None else None
            evidence["pool_shed_s_ago"] = None if shed is None else round(inp.now - shed)
            if shed is not None:
                # The hit rate held after the router's revision and fell when the pool shed engines: their
                # cached prefixes went with them, and a rollback of the router would not bring them back.
                text += (f" The router's last revision came {(inp.now - (changed or 0)) / 60:.0f} min ago, but the "
                         f"hit rate held until the pool shed engines {(inp.now - shed) / 60:.0f} min ago and their "
                         "cached prefixes went with them: no rollback.")
            elif recent:
                # The cause, not the symptom: extra prefill replicas would only pay for the misses.
                text += (f" The router got a new revision {(inp.now - (changed or 0)) / 60:.0f} min ago, just before "
                         "the drop: roll it back.")
                proposals = (
                    Proposal(ActionKind.ROLLBACK, pool, RollBack("router"),
                             f"roll the router back to its previous revision: it changed "
                             f"{(inp.now - (changed or 0)) / 60:.0f} min before {pool}'s hit rate fell",
                             verify_signal=SIGNAL, verify_lower_is_better=False),
                )
            else:
                text += " No router change explains it: follow the routing runbook (the prompts may have changed)."
            if saturated:
                text += (
                    f" The misses cost prefill compute meanwhile ({waiting / engines:.1f} waiting per engine, "
                    f"TTFT p95 {ttft or 0:.2f}s); the autoscaler weighs that, not this finding."
                )
        evidence["cause"] = cause.value
        # While open, the summary names the lowest point: the latest may already be recovering.
        opened = inp.open_findings.get(FindingKey(KIND, subject))
        lowest = min(current, float(opened.evidence.get("lowest", current))) if opened else current
        evidence["lowest"] = round(lowest, 4)
        summary = f"prefix-cache hit rate of {pool} fell to {lowest:.0%} from a baseline of {baseline:.0%}"
        return FindingReport(
            key=FindingKey(KIND, subject),
            severity=severity,
            summary=summary,
            cause=text,
            evidence=evidence,
            runbook=KIND,
            proposals=proposals,
        )


def _recent_mean(inp: PolicyInput, subject: str, name: str, points: int) -> float | None:
    values = inp.windows.last(subject, name, points)
    return sum(values) / len(values) if values else None
