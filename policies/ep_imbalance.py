"""Expert-parallel imbalance: a few hot experts make one rank of an EP group the tail-latency anchor.

vLLM exports no expert-load metric (EPLB's balancedness is a log line), so the imbalance is read
from per-rank skew inside one EP group: the data-parallel ranks of one deployment, exposed by one
pod as `engine/<pool>/<pod>/<rank>`. Per scrape, the skew of a measure is max / median over the
ranks; a finding opens when three consecutive scrapes are skewed (so one slow scrape does not),
and reports the median skew over the last five minutes:
- per-rank inter-token latency p50 (`itl_p50`, the step time a rank's requests see);
- per-GPU activity of the pod's node (`gpu_tensor_active`, else `gpu_utilization`): the rank
  that hosts the hot experts computes while the others wait for it in the all-to-all. GPUs are
  found under `gpu/<host>/`, the host being `pod_hosts["<pool>/<pod>"]`, else the `pod_host`
  pattern, by default the pod's name (what the DCGM collector uses when the exporter gives no
  hostname).
Requests running per rank tell the cause: when they are skewed too, the router or the DP load
balancer sends uneven work and EPLB would not help; when they are even, the experts are.

A finding resolves when every skew of the last `resolve_points` scrapes is back under
`resolve_ratio`, or under the group's own normal times `normal_margin` (its median skew over the
`normal_points` scrapes before the finding opened, kept in the evidence), but never above the
opening ratio: a group whose ranks always differ somewhat (8 ranks, a moderately skewed expert
popularity) resolves when the fault is gone instead of staying open for good.

EPLB is proposed only once the imbalance has lasted `persist_s` (10 min by default), since its
rearrangements cost step time. Whether a pool runs EPLB cannot be read from metrics: the settings
map pools that do to the time it was enabled (`eplb_enabled`, None when unknown). For such a pool
the policy proposes disabling EPLB when every EP group is balanced but the pool's ITL p50 is
higher than before EPLB was enabled at a comparable load (its overhead exceeds its benefit);
that judgement needs the enabling time within the signal windows (the last three hours).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field, model_validator

from catalog.settings import Problem, Seconds, Settings, least_window
from policies.common import gone_findings, reported_since
from policies.types import (
    ActionKind,
    Eplb,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    Severity,
)
from policies.windows import SignalWindows

__all__ = ["KIND", "Cause", "EpImbalance", "EpImbalanceSettings", "eplb_flags", "pool_rank_skew"]

KIND = "ep_imbalance"
RUNNING = "requests_running"
WAITING = "requests_waiting"


class Cause(StrEnum):
    """What the skew points at."""

    HOT_EXPERTS = "hot_experts"
    UNEVEN_REQUEST_LOAD = "uneven_request_load"
    HOT_EXPERTS_DESPITE_EPLB = "hot_experts_despite_eplb"
    EPLB_OVERHEAD = "eplb_overhead"
    SLOW_RANK = "slow_rank"  # a pool without expert parallelism: no experts, so the rank's GPU or node


class EpImbalanceSettings(Settings):
    """Thresholds (`policies.ep_imbalance` in the fleet file); skews are max/median ratios across ranks, times seconds."""

    enabled: bool = True
    signal: str = "itl_p50"  # per-rank step-time proxy
    gpu_signals: tuple[str, ...] = ("gpu_tensor_active", "gpu_utilization")  # first one present is used
    window_points: int = Field(20, ge=2)  # scrapes the median skew and the load skew are taken over (5 min at 15 s)
    min_ticks: int = Field(10, ge=1)  # scrapes with enough ranks needed to judge
    confirm_points: int = Field(3, ge=1)  # consecutive newest scrapes that must each be skewed to open
    skew_ratio: float = Field(1.5, gt=1)  # ITL skew that opens
    gpu_skew_ratio: float = Field(1.5, gt=1)  # GPU activity skew that opens
    resolve_ratio: float = Field(1.2, gt=1)  # every skew below this for resolve_points scrapes resolves (hysteresis) ...
    resolve_points: int = Field(8, ge=1)
    # ... or below the group's own normal (its median skew before the finding) times this, when its normal
    # is above resolve_ratio: 8 ranks under a skewed expert popularity never get back under 1.2.
    normal_margin: float = Field(1.1, gt=1)
    normal_points: int = Field(120, ge=2)  # scrapes before the finding its normal is taken over (30 min at 15 s)
    load_skew_ratio: float = Field(1.5, gt=1)  # running-request skew from which the cause is uneven load, not experts
    critical_ratio: float = Field(2.5, gt=1)
    min_ranks: int = Field(2, ge=2)
    min_running: float = Field(1.0, ge=0)  # requests running in the group: an idle group has no meaningful skew
    persist_s: Seconds = Field(600.0, alias="persist")  # imbalance must last this long before EPLB is proposed
    redundant_experts_per_rank: int = Field(1, ge=0)  # num_redundant_experts = this x ranks (divisible by EP size)
    eplb_window_size: int = Field(1000, gt=0)
    eplb_step_interval: int = Field(3000, gt=0)
    # Pools running EPLB -> the unix time it was enabled (null: unknown).
    eplb_enabled: dict[str, float | None] = Field(default_factory=dict)
    pod_hosts: dict[str, str] = Field(default_factory=dict)  # "<pool>/<pod>" -> node hostname of its GPUs
    pod_host: str = "{pod}"  # else the hostname from this pattern (`{pool}`, `{pod}`), e.g. "node-{pod}"
    eplb_overhead: float = Field(0.10, gt=0)  # pool ITL p50 this much above its pre-EPLB level: EPLB costs more
    baseline_s: Seconds = 1800.0  # how far before enabling EPLB the pre-EPLB level is taken
    min_baseline_points: int = Field(20, ge=2)
    load_tolerance: float = Field(0.25, gt=0)  # running requests within 25 % of the pre-EPLB level: comparable load
    stale_s: Seconds = 900.0

    @model_validator(mode="after")
    def _consistent(self) -> EpImbalanceSettings:
        if self.resolve_ratio >= min(self.skew_ratio, self.gpu_skew_ratio):
            raise ValueError("resolve_ratio must be below skew_ratio and gpu_skew_ratio, or findings flap")
        try:
            self.pod_host.format(pool="p", pod="q")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"pod_host may use only {{pool}} and {{pod}}: {exc}") from None
        return self

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval."""
        why = f"{self.min_baseline_points} points before EPLB was enabled to compare its step time with"
        return least_window("baseline_s", self.baseline_s, self.min_baseline_points, interval, why)


def eplb_flags(window_size: int, step_interval: int, num_redundant_experts: int) -> str:
    """The vLLM flags that enable EPLB with this configuration."""
    config = {"window_size": window_size, "step_interval": step_interval, "num_redundant_experts": num_redundant_experts}
    return f"--enable-eplb --eplb-config '{json.dumps(config, separators=(',', ':'))}'"


@dataclass(frozen=True, slots=True)
class _Skew:
    """Per-scrape skews of one measure over a group: (ts, max/median, id of the max) oldest first."""

    ticks: list[tuple[float, float, str]]
    latest: dict[str, float]  # member id -> value at the newest scrape

    def median(self, n: int) -> float | None:
        values = [r for _, r, _ in self.ticks[-n:]]
        return statistics.median(values) if values else None

    def skewed_median(self, threshold: float, n: int, at_least: int) -> float | None:
        """The median of the newest `n` scrapes' skews at `threshold` or more where there are `at_least` of them, else
        of all `n`: a group skewed for three scrapes of twenty reads at its skew, not at the balanced scrapes before
        them, and one scrape under the threshold does not drop it back."""
        skewed = [r for _, r, _ in self.ticks[-n:] if r >= threshold]
        return statistics.median(skewed) if len(skewed) >= at_least else self.median(n)

    def hottest(self, n: int, at_least: float = 0.0) -> str | None:
        """The member most often at the top among the newest `n` scrapes whose skew reaches `at_least`."""
        counts = Counter(who for _, r, who in self.ticks[-n:] if r >= at_least)
        if not counts:
            counts = Counter(who for _, _, who in self.ticks[-n:])
        return counts.most_common(1)[0][0] if counts else None

    def holds(self, threshold: float, confirm: int, min_ticks: int) -> bool:
        """Each of the newest `confirm` skews reaches `threshold`, with at least `min_ticks` scrapes seen.

        Consecutive scrapes, not a window median: a median over 20 scrapes needs 10 skewed ones
        (150 s) before it moves, while the hot rank of a real shift is the same scrape after scrape.
        """
        if len(self.ticks) < min_ticks:
            return False
        return all(r >= threshold for _, r, _ in self.ticks[-confirm:])


def _skew(w: SignalWindows, members: dict[str, str], name: str, points: int, min_members: int,
          median_floor: float = 0.0, since: float | None = None) -> _Skew:
    """Skew of `name` across `members` (id -> subject) at each scrape they share (from `since`)."""
    by_ts: dict[float, dict[str, float]] = defaultdict(dict)
    for who, subject in members.items():
        for ts, v in w.series(subject, name, since=since)[-points:]:
            by_ts[ts][who] = v
    ticks = []
    for ts in sorted(by_ts):
        values = by_ts[ts]
        if len(values) < min_members:
            continue
        med = max(statistics.median(values.values()), median_floor)
        if med <= 0:
            continue
        who = max(values, key=lambda k: values[k])
        ticks.append((ts, values[who] / med, who))
    latest = by_ts[max(by_ts)] if by_ts else {}
    return _Skew(ticks[-points:], dict(latest))


def _mean_skew(w: SignalWindows, members: dict[str, str], name: str, points: int, floor: float) -> tuple[float, str] | None:
    """max/median across members of each member's mean over its newest `points` values, and the max member.

    Means over the window, not per-scrape ratios: a few running requests per rank make any single
    scrape look skewed, while a router that favours one rank shows in its mean.
    """
    means = {who: statistics.fmean(vals) for who, sub in members.items() if (vals := w.last(sub, name, points))}
    if len(means) < 2:
        return None
    med = max(statistics.median(means.values()), floor)
    who = max(means, key=lambda k: means[k])
    return means[who] / med, who


@dataclass(slots=True)
class _Group:
    """One EP group judged now."""

    pool: str
    pod: str
    ranks: dict[str, str]  # rank -> engine subject
    itl: _Skew
    gpu: _Skew | None
    gpu_signal: str | None
    load: tuple[float, str] | None  # running-request skew of the window means, and the busiest rank
    gpus: dict[str, str]  # GPU id -> subject, on the pod's node

    @property
    def subject(self) -> str:
        return f"pod/{self.pool}/{self.pod}"


class EpImbalance:
    """Detects persistent per-rank skew in EP groups; proposes enabling (or disabling) EPLB."""

    kind = KIND

    def __init__(self, settings: EpImbalanceSettings | None = None) -> None:
        self.settings = settings or EpImbalanceSettings()
        self.reads = (self.settings.signal, RUNNING, WAITING, *self.settings.gpu_signals)

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every multi-rank pod, then over every pool that runs EPLB."""
        s = self.settings
        result = PolicyResult()
        groups, fresh_pods = self._groups(inp)
        for group in groups:
            key = FindingKey(KIND, group.subject)
            open_finding = inp.open_findings.get(key)
            if open_finding is None:
                if not self._imbalanced(inp, group):
                    continue
                normal = self._normal(inp.windows, group)  # taken once, at opening, and kept in the evidence
            else:
                normal = {m: open_finding.evidence.get(f"normal_{m}") for m in ("itl_skew", "gpu_skew")}
                if not group.itl.ticks and (group.gpu is None or not group.gpu.ticks):
                    result.resolved.append((key, "no rank generated tokens within the window: nothing to balance"))
                    continue
                if self._balanced(group, s.resolve_points, normal):
                    result.resolved.append((key, "per-rank skew back to its normal"))
                    continue
            report = self._report(inp, group, None if open_finding is None else open_finding.opened_at)
            report.evidence.update({f"normal_{m}": v for m, v in normal.items()})
            result.findings.append(report)
        for pool, enabled_at in sorted(s.eplb_enabled.items()):
            self._overhead(inp, pool, enabled_at, [g for g in groups if g.pool == pool], result)
        judged = {g.subject for g in groups}
        for key in inp.open_findings:
            if key.kind != KIND or key.subject in judged:
                continue
            kind, _, rest = key.subject.partition("/")
            if kind == "pool" and rest not in s.eplb_enabled:
                result.resolved.append((key, "the pool no longer runs EPLB"))
            elif kind == "pod" and rest not in fresh_pods:
                result.resolved.append((key, f"{key.subject} no longer reports"))
            elif kind == "pod":
                result.resolved.append((key, f"{key.subject} has fewer than {s.min_ranks} ranks now"))
        done = {k for k, _ in result.resolved}
        pools = [k.subject for k in inp.open_findings if k.kind == KIND and not k.subject.startswith("pool/")]
        result.resolved += [r for r in gone_findings(inp, KIND, (s.signal, RUNNING), s.stale_s, skip=pools)
                            if r[0] not in done]
        return result

    # groups and skews ---------------------------------------------------------------------------

    def _groups(self, inp: PolicyInput) -> tuple[list[_Group], set[str]]:
        """EP groups with enough ranks, and every "<pool>/<pod>" with a fresh engine."""
        s = self.settings
        w = inp.windows
        fresh = inp.now - s.stale_s
        members = _by_group(sub for sub in set(w.subjects(s.signal, prefix="engine/"))
                            | set(w.subjects(RUNNING, prefix="engine/"))
                            if reported_since(w, sub, (s.signal, RUNNING), fresh))
        # One pass over the GPU series for all groups: scanning per group would cost groups x series.
        gpus_of: dict[str, dict[str, str]] = defaultdict(dict)
        for name in s.gpu_signals:
            for sub in w.subjects(name, prefix="gpu/"):
                _, host, gpu_id = sub.split("/", 2)
                gpus_of[host][gpu_id] = sub
        groups = []
        n = s.window_points
        hosts = {key: s.pod_hosts.get(f"{key[0]}/{key[1]}") or s.pod_host.format(pool=key[0], pod=key[1])
                 for key in members}
        # The exporter's GPU series carry no pod: a node two groups share shows both groups' GPUs, and one group's busy
        # GPUs beside the other's idle ones would read as a skew in each.
        shared = {host for host, count in Counter(hosts.values()).items() if count > 1}
        for (pool, pod), ranks in sorted(members.items()):
            if len(ranks) < s.min_ranks:
                continue
            # Within the group's newest window of scrapes: an idle engine reports running requests but no ITL, and
            # the last skew it had is no reading of now.
            window = min((pts[0][0] for sub in ranks.values() if (pts := w.series(sub, RUNNING)[-n:])), default=None)
            itl = _skew(w, ranks, s.signal, n, s.min_ranks, since=window)
            load = _mean_skew(w, ranks, RUNNING, n, floor=0.5)
            host = hosts[(pool, pod)]
            gpus = {} if host in shared else gpus_of.get(host, {})
            gpu_signal = next((name for name in s.gpu_signals
                               if any(w.latest(sub, name) is not None for sub in gpus.values())), None)
            gpu = _skew(w, gpus, gpu_signal, n, s.min_ranks) if gpu_signal and len(gpus) >= s.min_ranks else None
            groups.append(_Group(pool, pod, dict(sorted(ranks.items())), itl, gpu, gpu_signal, load, gpus))
        return groups, {f"{pool}/{pod}" for pool, pod in members}

    def _stat(self, group: _Group) -> tuple[float | None, float | None]:
        """ITL skew and GPU skew: the median of the window's skewed scrapes (else of all), None where too few scrapes."""
        s = self.settings
        n, confirm = s.window_points, s.confirm_points
        itl = group.itl.skewed_median(s.skew_ratio, n, confirm) if len(group.itl.ticks) >= s.min_ticks else None
        gpu = None
        if group.gpu is not None and len(group.gpu.ticks) >= s.min_ticks:
            gpu = group.gpu.skewed_median(s.gpu_skew_ratio, n, confirm)
        return itl, gpu

    def _imbalanced(self, inp: PolicyInput, group: _Group) -> bool:
        s = self.settings
        running = sum(inp.windows.latest(sub, RUNNING) or 0.0 for sub in group.ranks.values())
        if running < s.min_running:
            return False
        confirm = s.confirm_points
        return group.itl.holds(s.skew_ratio, confirm, s.min_ticks) or (
            group.gpu is not None and group.gpu.holds(s.gpu_skew_ratio, confirm, s.min_ticks))

    def _normal(self, w: SignalWindows, group: _Group) -> dict[str, float | None]:
        """The group's median skew per measure over the scrapes before the newest window: what it
        looks like when nothing is wrong. None without enough history."""
        s = self.settings
        out: dict[str, float | None] = {"itl_skew": None, "gpu_skew": None}
        for measure, members, signal in (("itl_skew", group.ranks, s.signal),
                                         ("gpu_skew", group.gpus, group.gpu_signal)):
            if signal is None or len(members) < s.min_ranks:
                continue
            ticks = _skew(w, members, signal, s.normal_points + s.window_points, s.min_ranks).ticks[:-s.window_points]
            if len(ticks) >= s.min_ticks:
                out[measure] = round(statistics.median(r for _, r, _ in ticks), 3)
        return out

    def _balanced(self, group: _Group, n: int, normal: Mapping[str, float | None]) -> bool:
        s = self.settings
        measures = [(sk, normal.get(m), open_at) for sk, m, open_at in
                    ((group.itl, "itl_skew", s.skew_ratio), (group.gpu, "gpu_skew", s.gpu_skew_ratio))
                    if sk is not None and len(sk.ticks) >= n]

        def limit(usual: float | None, open_at: float) -> float:
            return min(max(s.resolve_ratio, (usual or 0.0) * s.normal_margin), open_at)

        return bool(measures) and all(ratio < limit(usual, open_at)
                                      for sk, usual, open_at in measures for _, ratio, _ in sk.ticks[-n:])

    # reports ------------------------------------------------------------------------------------

    def _report(self, inp: PolicyInput, group: _Group, opened_at: float | None) -> FindingReport:
        s = self.settings
        itl, gpu = self._stat(group)
        load, busiest = group.load if group.load is not None else (None, None)
        eplb = group.pool in s.eplb_enabled
        state = inp.pools.get(group.pool)
        if load is not None and load >= s.load_skew_ratio:
            cause = Cause.UNEVEN_REQUEST_LOAD
        elif state is not None and not state.expert_parallel:
            cause = Cause.SLOW_RANK
        else:
            cause = Cause.HOT_EXPERTS_DESPITE_EPLB if eplb else Cause.HOT_EXPERTS
        lasted = 0.0 if opened_at is None else inp.now - opened_at
        # Name the outlier by the measure that shows it: in lockstep EP only the GPUs do.
        by_gpu = gpu is not None and group.gpu is not None and (itl is None or gpu / s.gpu_skew_ratio > itl / s.skew_ratio)
        statistic = (gpu if by_gpu else itl) or 0.0
        threshold = s.gpu_skew_ratio if by_gpu else s.skew_ratio
        hot = (group.gpu.hottest(s.window_points, threshold) if by_gpu and group.gpu
               else group.itl.hottest(s.window_points, threshold))
        outlier = f"GPU {hot}" if by_gpu else f"rank {hot}"
        rank_values = {r: round(v, 5) for r, v in sorted(group.itl.latest.items())}
        med = statistics.median(rank_values.values()) if rank_values else None
        evidence: dict[str, Any] = {
            "signal": s.signal,
            "value": max(rank_values.values()) if rank_values else None,
            "baseline": None if med is None else round(med, 5),  # the ranks' median: what a balanced rank sees
            "statistic": round(statistic, 3),
            "threshold": threshold,
            "measure": "gpu_skew" if by_gpu else "itl_skew",
            "itl_skew": _round(itl),
            "gpu_skew": _round(gpu),
            "gpu_signal": group.gpu_signal,
            "gpu_values": {g: round(v, 4) for g, v in sorted(group.gpu.latest.items())} if group.gpu else {},
            "gpu_hottest": group.gpu.hottest(s.window_points, s.gpu_skew_ratio) if group.gpu else None,
            "load_skew": _round(load),
            "ranks": len(group.ranks),
            "hot_rank": group.itl.hottest(s.window_points, s.skew_ratio),
            "rank_values": rank_values,
            "rank_running": _latest(inp.windows, group.ranks, RUNNING),
            "rank_waiting": _latest(inp.windows, group.ranks, WAITING),
            "eplb_enabled": eplb,
            "imbalanced_for_s": round(lasted, 1),
            "cause": cause.value,
        }
        where = f"{group.pool}/{group.pod}"
        if cause is Cause.UNEVEN_REQUEST_LOAD:
            text = (f"Requests are spread unevenly over the ranks of {where} (running-request skew {load:.2f}): the "
                    f"router or the data-parallel load balancer, not the experts, makes rank {busiest} the slow one. "
                    "EPLB would not help.")
        elif cause is Cause.SLOW_RANK:
            text = (f"{outlier.capitalize()} of {where} stands out: step-time skew {itl or 0:.2f}x"
                    + (f", GPU activity skew {gpu:.2f}x" if gpu is not None else "")
                    + f", while requests are spread evenly. {group.pool} runs no expert parallelism "
                    "(engine.expert_parallel is off in the fleet file), so no experts are hot: look at that rank's "
                    "GPU and node (clocks, thermals, a degraded link). EPLB does not apply.")
        else:
            text = (f"{outlier.capitalize()} of {where} stands out: step-time skew {itl or 0:.2f}x"
                    + (f", GPU activity skew {gpu:.2f}x" if gpu is not None else "")
                    + ", while requests are spread evenly: hot experts make it the tail-latency anchor of the group.")
            if eplb:
                text += " EPLB is on and has not balanced it: raise num_redundant_experts or lower step_interval."
        proposals: tuple[Proposal, ...] = ()
        if cause is Cause.HOT_EXPERTS:
            if lasted >= s.persist_s:
                n = s.redundant_experts_per_rank * len(group.ranks)
                flags = eplb_flags(s.eplb_window_size, s.eplb_step_interval, n)
                change = Eplb(True, s.eplb_window_size, s.eplb_step_interval, n)
                proposals = (Proposal(ActionKind.ENABLE_EPLB, group.pool, change,
                                      f"enable EPLB on {group.pool}: the imbalance of {where} lasted "
                                      f"{lasted / 60:.0f} min: {flags}",
                                      verify_signal=s.signal, verify_lower_is_better=True),)
            else:
                text += f" EPLB is proposed if it lasts {s.persist_s / 60:.0f} min."
        evidence["suggested_actions"] = [p.reason for p in proposals]
        severity = Severity.CRITICAL if statistic >= s.critical_ratio else Severity.WARNING
        summary = f"expert-parallel imbalance in {where}: {outlier} at {statistic:.2f}x the median"
        return FindingReport(FindingKey(KIND, group.subject), severity, summary, text, evidence, KIND, proposals)

    def _overhead(self, inp: PolicyInput, pool: str, enabled_at: float | None, groups: list[_Group],
                  result: PolicyResult) -> None:
        """Propose disabling EPLB where the pool is balanced but slower than before EPLB."""
        s = self.settings
        w = inp.windows
        subject = f"pool/{pool}"
        key = FindingKey(KIND, subject)
        opened = inp.open_findings.get(key)
        if enabled_at is None:
            return
        before = [(ts, v) for ts, v in w.series(subject, s.signal, since=enabled_at - s.baseline_s) if ts < enabled_at]
        after = [(ts, v) for ts, v in w.series(subject, s.signal, since=enabled_at)][-s.window_points:]
        # An open finding keeps the baseline it opened against: the points from before EPLB leave the history in a
        # few hours, and it would be neither judged nor resolved from then on.
        kept = opened.evidence.get("baseline") if opened is not None else None
        if (len(before) < s.min_baseline_points and kept is None) or len(after) < s.min_ticks:
            return
        base_itl = float(kept) if kept is not None else statistics.median(v for _, v in before)
        bound = base_itl * (1 + s.eplb_overhead)
        run_before = [v for ts, v in w.series(subject, RUNNING, since=enabled_at - s.baseline_s) if ts < enabled_at]
        run_after = [v for _, v in w.series(subject, RUNNING, since=enabled_at)][-s.window_points:]
        base_run = statistics.median(run_before) if run_before else 0.0
        now_run = statistics.median(run_after) if run_after else 0.0
        now_itl = statistics.median(v for _, v in after)
        comparable = base_run > 0 and abs(now_run / base_run - 1) <= s.load_tolerance
        balanced = bool(groups) and all(self._balanced(g, s.min_ticks, {}) for g in groups)
        is_open = key in inp.open_findings
        if is_open:
            recent = [v for _, v in after[-s.resolve_points:]]
            if all(v < bound for v in recent) or not balanced:
                why = "pool step time back at its pre-EPLB level" if balanced else "EP groups are imbalanced again"
                result.resolved.append((key, why))
                return
        elif not (balanced and comparable and now_itl >= bound):
            return
        flags = "the same flags without --enable-eplb and --eplb-config"
        proposal = Proposal(ActionKind.DISABLE_EPLB, pool, Eplb(False),
                            f"disable EPLB on {pool}: balanced, but ITL p50 {now_itl * 1000:.1f} ms against "
                            f"{base_itl * 1000:.1f} ms before EPLB at a comparable load; restart with {flags}",
                            verify_signal=s.signal, verify_lower_is_better=True)
        evidence = {
            "signal": s.signal,
            "value": round(now_itl, 5),
            "baseline": round(base_itl, 5),
            "statistic": round(now_itl / base_itl, 3) if base_itl > 0 else None,
            "threshold": 1 + s.eplb_overhead,
            "requests_running": round(now_run, 2),
            "baseline_requests_running": round(base_run, 2),
            "eplb_enabled_at": enabled_at,
            "groups": [g.subject for g in groups],
            "cause": Cause.EPLB_OVERHEAD.value,
            "suggested_actions": [proposal.reason],
        }
        text = (f"Every EP group of {pool} is balanced, yet its ITL p50 is {now_itl / base_itl:.2f}x what it was before "
                "EPLB was enabled, at a comparable load: the rearrangements cost more step time than the balance saves.")
        result.findings.append(FindingReport(key, Severity.INFO, f"EPLB overhead on {pool}", text, evidence, KIND,
                                             (proposal,)))


def pool_rank_skew(w: SignalWindows, pool: str, since: float, settings: EpImbalanceSettings | None = None
                   ) -> float | None:
    """How far the slowest rank of `pool`'s most skewed EP group ran from its median rank since `since`: the median
    over scrapes of the ITL skew, among groups whose ranks got even work (uneven work is the router's, which EPLB
    does not fix). None where no group of the pool has ranks to compare."""
    s = settings or EpImbalanceSettings()
    groups = _by_group(w.subjects(s.signal, prefix=f"engine/{pool}/"))
    skews = []
    for ranks in groups.values():
        if len(ranks) < s.min_ranks:
            continue
        points = max(len(w.series(sub, RUNNING, since=since)) for sub in ranks.values())
        load = _mean_skew(w, ranks, RUNNING, points, floor=0.5)
        if points == 0 or (load is not None and load[0] >= s.load_skew_ratio):
            continue
        itl = _skew(w, ranks, s.signal, 1 << 30, s.min_ranks, since=since)
        if len(itl.ticks) >= s.min_ticks and (m := itl.median(len(itl.ticks))) is not None:
            skews.append(m)
    return max(skews, default=None)


def _by_group(subjects: Iterable[str]) -> dict[tuple[str, str], dict[str, str]]:
    """Rank subjects (`engine/<pool>/<pod>/<rank>`) by their EP group, (pool, pod): rank -> subject."""
    groups: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for subject in subjects:
        parts = subject.split("/")
        if len(parts) == 4:
            groups[(parts[1], parts[2])][parts[3]] = subject
    return groups


def _latest(w: SignalWindows, ranks: dict[str, str], name: str) -> dict[str, float]:
    return {r: v for r, sub in ranks.items() if (v := w.latest(sub, name)) is not None}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
