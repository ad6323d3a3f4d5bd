"""KV-transfer lag: the prefill->decode KV path gets slow in its tail, or starts failing.

Watches every subject that reports a transfer-time p99 (the synthetic KV-path probe per
prefill->decode pair, vLLM's NIXL connector per decode engine, NIXL's exporter per agent) against
its own baseline and against its peers, and counts failed transfers. Alerts on the tail, never the
mean. Names the lagging path or worker; proposes draining it or admission control (the actions
run once the Kubernetes actuator exists; until then the rails hold them back).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.common import current_subjects, gone_findings
from policies.stats import median_mad
from policies.types import (
    ActionKind,
    Admit,
    Drain,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    Severity,
)
from policies.windows import SignalWindows

__all__ = ["KIND", "PATHS", "KvTransferLag", "KvTransferSettings"]

KIND = "kv_transfer_lag"


@dataclass(frozen=True, slots=True)
class PathSignals:
    """Where one kind of KV-path measurement lives: subject prefix, p99 and failure signals."""

    prefix: str
    p99: str
    failures: str
    rate: str | None  # transfers per second, to express failures as a share
    bandwidth: str | None = None  # bytes per second of transfer time, where transfer sizes vary


PATHS: tuple[PathSignals, ...] = (
    PathSignals("kvpath/", "kv_transfer_p99", "kv_failure_rate", "kv_transfer_rate"),
    PathSignals("engine/", "nixl_xfer_time_p99", "nixl_failed_transfer_rate", "nixl_transfer_rate",
                "nixl_xfer_bandwidth"),
    PathSignals("nixl/", "nixl_xfer_time_p99", "nixl_error_rate", "nixl_request_rate", "nixl_xfer_bandwidth"),
)


class KvTransferSettings(Settings):
    """Thresholds (`policies.kv_transfer_lag` in the fleet file); times in seconds."""

    enabled: bool = True
    baseline_s: Seconds = Field(1800.0, alias="baseline")
    min_baseline_points: int = Field(8, ge=2)
    recent_points: int = Field(2, ge=1)  # consecutive bad points to open: the detection delay
    resolve_points: int = Field(3, ge=1)  # consecutive good points to resolve (hysteresis)
    tail_ratio: float = Field(2.0, gt=1)  # p99 at least twice its baseline ...
    mad_k: float = Field(4.0, ge=0)  # ... and above 4 robust sigmas of its jitter ...
    min_abs_s: Seconds = Field(0.002, alias="min_abs")  # ... and at least 2 ms worse: sub-ms jitter is not lag
    peer_ratio: float = Field(3.0, gt=1)  # without history: 3x the median of its peers
    stand_out_ratio: float = Field(1.5, gt=1)  # with history and peers: the tail must also be 1.5x the peers' median
    min_peers: int = Field(2, ge=1)
    # Failed share of transfers, at each of the recent points, that opens a finding (a busy worker's background of a
    # failure or two a scrape is no fault), and that makes it critical.
    failure_share: float = Field(0.005, gt=0, le=1)
    failure_share_critical: float = Field(0.05, gt=0, le=1)
    bandwidth_drop: float = Field(0.5, gt=0, lt=1)  # with sizes that vary, a slow tail needs bandwidth at half its baseline
    stale_s: Seconds = 900.0  # an open finding whose path stopped reporting this long resolves

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval."""
        need = self.min_baseline_points + self.recent_points
        why = f"{self.min_baseline_points} baseline points besides its {self.recent_points} recent ones"
        return least_window("baseline", self.baseline_s, need, interval, why)


class KvTransferLag:
    """Detects tail-latency growth and failures on the KV transfer path."""

    kind = KIND
    reads: tuple[str, ...] = tuple(dict.fromkeys(
        name for p in PATHS for name in (p.p99, p.failures, p.rate, p.bandwidth) if name))

    def __init__(self, settings: KvTransferSettings | None = None) -> None:
        self.settings = settings or KvTransferSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every KV-path subject."""
        result = PolicyResult()
        for path in PATHS:
            subjects = {*inp.windows.subjects(path.p99, prefix=path.prefix),
                        *inp.windows.subjects(path.failures, prefix=path.prefix)}
            # Not in the latest scrape (a drained worker, a missed scrape): its old points say nothing about now, as a
            # path nor as a peer, and a drain proposed from them would chase a pod that is gone.
            names = (path.p99, path.failures)
            live = current_subjects(inp.windows, subjects, names, inp.now, self.settings.stale_s)
            for subject in live:
                key = FindingKey(KIND, subject)
                report = self._judge(inp, path, subject, live, key in inp.open_findings)
                if report is not None:
                    result.findings.append(report)
                elif key in inp.open_findings and self._healthy(inp, path, subject, inp.open_findings[key].evidence):
                    result.resolved.append((key, "transfer tail and failures back to normal"))
            result.resolved += [r for r in gone_findings(inp, KIND, names, self.settings.stale_s)
                                if r[0].subject.startswith(path.prefix)]
        return result

    def _baseline(self, inp: PolicyInput, path: PathSignals, subject: str) -> tuple[float, float] | None:
        s = self.settings
        points = inp.windows.series(subject, path.p99, since=inp.now - s.baseline_s)[: -s.recent_points]
        if len(points) < s.min_baseline_points:
            return None
        return median_mad([v for _, v in points])

    def _bandwidth_fell(self, inp: PolicyInput, path: PathSignals, subject: str, subjects: list[str]) -> bool:
        """True unless the path reports bandwidth that stayed near its baseline (or its peers').

        Real KV transfers carry whole prompts: one long prompt in a scrape interval lifts the
        p99 transfer time without anything being wrong. Bytes per second of transfer time does
        not move with prompt length, so where it is reported a tail alone does not open.
        """
        if path.bandwidth is None:
            return True
        s = self.settings
        recent = inp.windows.last(subject, path.bandwidth, s.recent_points)
        if not recent:
            return True  # this path reports no bandwidth: the tail has to speak alone
        if len(recent) < s.recent_points:
            return False
        points = inp.windows.series(subject, path.bandwidth, since=inp.now - s.baseline_s)[: -s.recent_points]
        if len(points) >= s.min_baseline_points:
            ref, _ = median_mad([v for _, v in points])
        else:
            # No history yet: its peers' bandwidth, else no judgement until there is a baseline.
            peers = self._peer_median(inp, path, subject, subjects, path.bandwidth)
            if peers is None:
                return False
            ref = peers
        return all(v < ref * s.bandwidth_drop for v in recent)

    def _stands_out(self, recent: list[float], baseline: tuple[float, float] | None, peers: float | None) -> bool:
        """A tail its peers share is the pool's load (a backlog of prefills flushing), not this path's lag.

        Seen in the demo: while the prefill pool was saturated every decode worker's p99 doubled
        together, and the one a little above the others crossed its own threshold.
        """
        if baseline is None or peers is None:
            return True  # without history the peer threshold already compares it with its peers
        return all(v >= peers * self.settings.stand_out_ratio for v in recent)

    def _peer_median(self, inp: PolicyInput, path: PathSignals, subject: str, subjects: list[str],
                     signal: str) -> float | None:
        """Median of `signal` over the subject's peers (same pool for engines), None with too few."""
        # An engine's peers are its pool's: `engine/decode/` is not a prefix of `engine/decode-b/...`.
        group = subject.rsplit("/", 2)[0] + "/" if path.prefix == "engine/" else path.prefix
        values = [v for other in subjects if other != subject and other.startswith(group)
                  if (v := inp.windows.latest(other, signal)) is not None]
        return statistics.median(values) if len(values) >= self.settings.min_peers else None

    def _threshold(self, baseline: tuple[float, float] | None, peers: float | None) -> float | None:
        s = self.settings
        if baseline is not None:
            med, sigma = baseline
            return max(med * s.tail_ratio, med + s.mad_k * sigma, med + s.min_abs_s)
        if peers is not None:
            return max(peers * s.peer_ratio, peers + s.min_abs_s)
        return None

    def _judge(self, inp: PolicyInput, path: PathSignals, subject: str, subjects: list[str],
               is_open: bool) -> FindingReport | None:
        s = self.settings
        open_evidence = inp.open_findings[FindingKey(KIND, subject)].evidence if is_open else None
        # While open, the baseline is the one it opened against, even none (a path lagging from its first scrape):
        # one learned from the fault's own points would call the fault normal.
        if open_evidence is None:
            baseline = self._baseline(inp, path, subject)
        elif open_evidence.get("baseline_p99") is not None:
            baseline = (float(open_evidence["baseline_p99"]), float(open_evidence.get("baseline_sigma", 0.0)))
        else:
            baseline = None
        peers = self._peer_median(inp, path, subject, subjects, path.p99)
        threshold = self._threshold(baseline, peers)
        recent, scrapes = _tail(inp.windows, path, subject, s.recent_points)
        shares = _failed_shares(inp.windows, path, subject, s.recent_points)
        slow = (threshold is not None and scrapes == len(recent) == s.recent_points
                and all(v > threshold for v in recent))
        if slow and not is_open:
            slow = self._stands_out(recent, baseline, peers) and self._bandwidth_fell(inp, path, subject, subjects)
        failing = len(shares) == s.recent_points and all(v >= s.failure_share for v in shares)
        if not (slow or failing) and not (is_open and not self._healthy(inp, path, subject, open_evidence or {})):
            return None
        p99 = inp.windows.latest(subject, path.p99)
        fail_rate = inp.windows.latest(subject, path.failures) or 0.0
        rate = inp.windows.latest(subject, path.rate) if path.rate else None
        share = fail_rate / rate if rate else (1.0 if fail_rate > 0 else 0.0)
        evidence = {
            "signal": path.p99,
            "p99_s": None if p99 is None else round(p99, 6),
            "baseline_p99": None if baseline is None else round(baseline[0], 6),
            "baseline_sigma": None if baseline is None else round(baseline[1], 6),
            "peers_median_p99": None if peers is None else round(peers, 6),
            "threshold_s": None if threshold is None else round(threshold, 6),
            "failures_per_s": round(fail_rate, 4),
            "failed_share": round(share, 4),
            "slow": slow,
            "failing": failing,
        }
        where = subject.split("/", 1)[1]
        if failing:
            cause = (f"{where}: {fail_rate:.2f} failed transfers/s ({share:.0%} of transfers). Check the decode "
                     "worker's health, the transport (UCX) and whether the metadata server failed over.")
        else:
            ref = f"baseline {baseline[0] * 1000:.1f} ms" if baseline else f"peers {(peers or 0) * 1000:.1f} ms"
            cause = (f"{where}: KV transfer p99 {(p99 or 0) * 1000:.1f} ms against {ref}: the decode side is "
                     "slow to take the KV (CPU or NIC contention, a lagging worker) or the link is congested.")
        severity = Severity.CRITICAL if failing and share >= s.failure_share_critical else Severity.WARNING
        proposals = self._proposals(inp, subject, where)
        return FindingReport(FindingKey(KIND, subject), severity, f"KV transfer lag on {where}", cause,
                             {**evidence, "suggested_actions": [p.reason for p in proposals]},
                             KIND, proposals)

    def _proposals(self, inp: PolicyInput, subject: str, where: str) -> tuple[Proposal, ...]:
        """Drain a lagging decode worker; limit admissions to a probed path's decode side where it names a pool. A
        NIXL agent, or a probe peer named otherwise, names none (the worker's own connector signals name its pod)."""
        if subject.startswith("engine/"):
            _, pool, pod, _rank = subject.split("/")
            return (Proposal(ActionKind.DRAIN_ENGINE, pool, Drain(pod), f"drain the lagging decode worker {where}",
                             verify_signal="nixl_xfer_time_p99"),)
        target = where.split("->")[-1]
        if not subject.startswith("kvpath/") or target not in inp.pools:
            return ()
        return (Proposal(ActionKind.ADMISSION_CONTROL, target, Admit(target, 0.25),
                         f"limit admissions that hand KV to {target} until its path recovers"),)

    def _healthy(self, inp: PolicyInput, path: PathSignals, subject: str, evidence: Mapping[str, Any]) -> bool:
        s = self.settings
        recent, scrapes = _tail(inp.windows, path, subject, s.resolve_points)
        shares = _failed_shares(inp.windows, path, subject, s.resolve_points)
        bar = evidence.get("threshold_s")
        # Recovered: resolve_points clean points in a row against two bad ones to open is the
        # hysteresis. A lower bar than the opening threshold would not be: a p99 read from a
        # histogram lands on bucket bounds, and one ordinary sample in the next bucket up would
        # hold a recovered path open for many intervals.
        tail_ok = bar is None or (scrapes == s.resolve_points and all(v <= bar for v in recent))
        fail_ok = len(shares) == s.resolve_points and all(v < s.failure_share for v in shares) if shares else True
        return tail_ok and fail_ok


def _failed_shares(w: SignalWindows, path: PathSignals, subject: str, n: int) -> list[float]:
    """The failed share of transfers at each of the subject's last `n` scrapes: failures over transfers, all of them
    where failures came with no transfer rate to weigh them by."""
    failures = w.series(subject, path.failures)[-n:]
    rates = dict(w.series(subject, path.rate, since=failures[0][0])) if path.rate and failures else {}
    return [0.0 if f <= 0 else min(1.0, f / r) if (r := rates.get(ts)) else 1.0 for ts, f in failures]


def _tail(w: SignalWindows, path: PathSignals, subject: str, n: int) -> tuple[list[float], int]:
    """The transfer-time p99s of the subject's last `n` scrapes, and how many scrapes that is. The failure counter
    reports every scrape, the p99 only those with transfers: a path gone idle keeps its last bad p99s, which say
    nothing about now, and a scrape without one has no tail. Without a failure counter, the last `n` p99 points."""
    scrapes = w.series(subject, path.failures)[-n:]
    if not scrapes:
        recent = w.last(subject, path.p99, n)
        return recent, len(recent)
    at = dict(w.series(subject, path.p99, since=scrapes[0][0]))
    return [at[t] for t, _ in scrapes if t in at], len(scrapes)
