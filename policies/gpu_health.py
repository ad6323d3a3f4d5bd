"""GPU health: XID errors, uncorrectable memory errors, row-remap failures, thermal and power throttling.

Reads the GPU signals of dcgm-exporter (or the NVML collector), per `gpu/<host>/<gpu>[/<mig>]`.
Faults are events: a fault seen within the hold time (default 1 h) keeps the finding open, so a
GPU that threw an uncorrectable error does not look healthy again two scrapes later. Throttling
is a state: it must hold for several consecutive intervals to open, and stay away for more to
resolve.

XIDs are classified by the code of the last XID (`gpu_xid_last`, DCGM_FI_DEV_XID_ERRORS): codes that
point at the hardware or its firmware (double-bit ECC 48, GSP/micro-controller 61/62/119/120, row
remapping 63/64, NVLink 74, fallen off the bus 79, ECC rate and containment 92/94/95) make the finding
critical; codes usually raised by the application (13, 31, 43, 45: an engine exception, a page
fault, a stopped or cleaned-up context) only warn and never cordon, since the node is fine; any
other code warns and proposes a cordon, to be safe. DCGM_FI_DEV_XID_ERRORS holds the last code
forever, so a new XID is seen as the code changing, the exporter's windowed count
(DCGM_EXP_XID_ERRORS_COUNT) or its counter rising.

The proposal is to cordon the node and drain its engines. The node's pool comes from the settings'
`node_pools` (hostname -> pool), else from the engines that report now and whose pod maps to the
node by `pod_host` (`{pool}`, `{pod}`, as in `ep_imbalance`); without either the proposal names no
pool (and the rails hold it), and the node is named in the reason and the evidence. A GPU that did
not report in the latest scrape is not judged: its node was replaced or cordoned already, and a
cordon proposed from old points would chase a node that is gone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field, model_validator

from catalog.settings import Problem, Seconds, Settings
from policies.common import current_since, current_subjects, gone_findings
from policies.types import (
    ActionKind,
    Cordon,
    FindingKey,
    FindingReport,
    PolicyInput,
    PolicyResult,
    Proposal,
    Severity,
)
from policies.windows import SignalWindows

__all__ = ["APPLICATION_XIDS", "HARDWARE_XIDS", "KIND", "Fault", "GpuHealth", "GpuHealthSettings"]

KIND = "gpu_health"
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})
APPLICATION_XIDS = frozenset({13, 31, 43, 45})

XID_LAST = "gpu_xid_last"
XID_COUNT = "gpu_xid_errors"
XID_WINDOW = "gpu_xid_errors_window"
DBE = "gpu_ecc_dbe_rate"
REMAP_FAILURE = "gpu_row_remap_failure"
REMAP_PENDING = "gpu_remapped_rows_uncorrectable"
THERMAL = "gpu_thermal_violation_seconds_rate"
POWER = "gpu_power_violation_seconds_rate"
TEMPERATURE = "gpu_temperature_celsius"
ENGINE_ALIVE = "requests_running"  # every engine reports it while it serves
# Signals every GPU reports while its exporter runs: their absence means the GPU is gone.
ALIVE = ("gpu_utilization", TEMPERATURE, "gpu_power_watts", "gpu_memory_used_bytes")
WATCHED = (XID_LAST, XID_COUNT, XID_WINDOW, DBE, REMAP_FAILURE, REMAP_PENDING, THERMAL, POWER)


class Fault(StrEnum):
    """What is wrong with the GPU, most serious first."""

    ROW_REMAP_FAILURE = "row_remap_failure"
    ECC_DOUBLE_BIT = "ecc_double_bit"
    XID = "xid"
    ROW_REMAP_PENDING = "row_remap_pending"
    THERMAL_THROTTLING = "thermal_throttling"
    POWER_THROTTLING = "power_throttling"
    XID_APPLICATION = "xid_application"


_ORDER = list(Fault)


class GpuHealthSettings(Settings):
    """Thresholds (`policies.gpu_health` in the fleet file); shares are throttled seconds per second, times seconds."""

    enabled: bool = True
    hardware_xids: frozenset[int] = HARDWARE_XIDS
    application_xids: frozenset[int] = APPLICATION_XIDS
    thermal_share: float = Field(0.10, gt=0, le=1)  # throttled for heat 10 % of the time: the cooling cannot keep up
    power_share: float = Field(0.50, gt=0, le=1)  # power capping is normal under load; half the time is not
    throttle_points: int = Field(2, ge=1)  # consecutive intervals to open (30 s at 15 s): sustained heat, not a spike
    resolve_points: int = Field(8, ge=1)  # consecutive unthrottled intervals to resolve
    fault_hold_s: Seconds = Field(3600.0, alias="fault_hold")  # a fault keeps the finding open this long after it was seen
    node_pools: dict[str, str] = Field(default_factory=dict)  # hostname -> pool running there, named by the cordon proposal
    pod_host: str | None = None  # hostname of a pod's node from `{pool}` and `{pod}`, e.g. "node-{pod}"
    stale_s: Seconds = 900.0

    @model_validator(mode="after")
    def _pattern(self) -> GpuHealthSettings:
        try:
            (self.pod_host or "").format(pool="p", pod="q")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"pod_host may use only {{pool}} and {{pod}}: {exc}") from None
        return self

    def problems(self, interval: float) -> list[Problem]:
        """Settings under which the detector could never judge at this scrape interval (none: it counts points)."""
        return []


@dataclass(slots=True)
class _Health:
    faults: dict[Fault, str]  # fault -> one-line detail
    severity: Severity
    cordon: bool
    evidence: dict[str, Any]


class GpuHealth:
    """Detects failing or throttled GPUs and proposes cordoning their node."""

    kind = KIND
    reads: tuple[str, ...] = (*WATCHED, *ALIVE, ENGINE_ALIVE)

    def __init__(self, settings: GpuHealthSettings | None = None) -> None:
        self.settings = settings or GpuHealthSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """One evaluation over every GPU that reports a health signal."""
        s = self.settings
        result = PolicyResult()
        subjects: set[str] = set()
        for name in WATCHED:
            subjects.update(inp.windows.subjects(name, prefix="gpu/"))
        names = (*ALIVE, *WATCHED)
        hosts = self._engine_hosts(inp.windows, current_since(inp.windows, subjects, names, inp.now, s.stale_s))
        for subject in current_subjects(inp.windows, subjects, names, inp.now, s.stale_s):
            key = FindingKey(KIND, subject)
            health = self._judge(inp, subject)
            if health.faults:
                result.findings.append(self._report(subject, health, hosts))
            elif key in inp.open_findings and self._throttle_clear(inp.windows, subject):
                result.resolved.append((key, f"no fault for {s.fault_hold_s / 60:.0f} min and no throttling"))
        result.resolved += gone_findings(inp, KIND, (*ALIVE, *WATCHED), s.stale_s)
        return result

    def _judge(self, inp: PolicyInput, subject: str) -> _Health:
        s = self.settings
        w = inp.windows
        since = inp.now - s.fault_hold_s
        faults: dict[Fault, str] = {}
        events, codes = _xid_events(w, subject, since)
        hardware = sorted(c for c in codes if c in s.hardware_xids)
        unknown = sorted(c for c in codes if c not in s.hardware_xids and c not in s.application_xids)
        if events:
            if hardware or unknown or not codes:
                faults[Fault.XID] = (f"{len(events)} XID event(s), codes {hardware + unknown or 'unknown'}"
                                     + (" (hardware)" if hardware else ""))
            else:
                faults[Fault.XID_APPLICATION] = f"{len(events)} XID event(s), application codes {sorted(codes)}"
        dbe = [ts for ts, v in w.series(subject, DBE, since=since) if v > 0]
        if dbe:
            faults[Fault.ECC_DOUBLE_BIT] = f"uncorrectable (double-bit) ECC errors in {len(dbe)} interval(s)"
        remap_failed = (w.latest(subject, REMAP_FAILURE) or 0.0) >= 1.0
        if remap_failed:
            faults[Fault.ROW_REMAP_FAILURE] = "row remapping failed: the GPU has no spare rows left"
        pending = [ts for ts, v in w.series(subject, REMAP_PENDING, since=since) if v > 0]
        if pending:
            faults[Fault.ROW_REMAP_PENDING] = "rows were remapped after uncorrectable errors: a GPU reset applies them"
        thermal = w.last(subject, THERMAL, s.throttle_points)
        if len(thermal) == s.throttle_points and all(v >= s.thermal_share for v in thermal):
            faults[Fault.THERMAL_THROTTLING] = f"throttled for heat {min(thermal):.0%}-{max(thermal):.0%} of the time"
        power = w.last(subject, POWER, s.throttle_points)
        if len(power) == s.throttle_points and all(v >= s.power_share for v in power):
            faults[Fault.POWER_THROTTLING] = f"held at its power cap {min(power):.0%}-{max(power):.0%} of the time"
        faults = dict(sorted(faults.items(), key=lambda kv: _ORDER.index(kv[0])))
        critical = bool(hardware) or Fault.ECC_DOUBLE_BIT in faults or remap_failed
        cordon = any(f is not Fault.XID_APPLICATION for f in faults)
        last_fault = max([*events, *dbe, *pending], default=None)
        evidence = {
            "xid_events": len(events),
            "xid_codes": sorted(codes),
            "ecc_dbe_intervals": len(dbe),
            "row_remap_failure": remap_failed,
            "row_remap_pending_intervals": len(pending),
            "thermal_violation_share": _round(w.latest(subject, THERMAL)),
            "power_violation_share": _round(w.latest(subject, POWER)),
            "temperature_celsius": _round(w.latest(subject, TEMPERATURE), 1),
            "last_fault_at": last_fault,
        }
        return _Health(faults, Severity.CRITICAL if critical else Severity.WARNING, cordon, evidence)

    def _throttle_clear(self, w: SignalWindows, subject: str) -> bool:
        s = self.settings
        n = s.resolve_points
        for name, share in ((THERMAL, s.thermal_share), (POWER, s.power_share)):
            values = w.last(subject, name, n)
            if values and (len(values) < n or any(v >= share for v in values)):
                return False
        return True

    def _engine_hosts(self, w: SignalWindows, since: float) -> dict[str, str]:
        """hostname -> pool of the engines reporting since `since`, through `pod_host`."""
        if self.settings.pod_host is None:
            return {}
        out = {}
        for sub in w.subjects(ENGINE_ALIVE, prefix="engine/"):
            if w.series(sub, ENGINE_ALIVE, since=since):
                _, pool, pod, _rank = sub.split("/", 3)
                out[self.settings.pod_host.format(pool=pool, pod=pod)] = pool
        return out

    def _report(self, subject: str, health: _Health, hosts: Mapping[str, str]) -> FindingReport:
        s = self.settings
        _, host, *rest = subject.split("/")
        gpu = "/".join(rest)
        main = next(iter(health.faults))
        statistic, threshold, signal = {
            Fault.THERMAL_THROTTLING: (health.evidence["thermal_violation_share"], s.thermal_share, THERMAL),
            Fault.POWER_THROTTLING: (health.evidence["power_violation_share"], s.power_share, POWER),
            Fault.ECC_DOUBLE_BIT: (health.evidence["ecc_dbe_intervals"], 0, DBE),
            Fault.ROW_REMAP_FAILURE: (1, 0, REMAP_FAILURE),
            Fault.ROW_REMAP_PENDING: (health.evidence["row_remap_pending_intervals"], 0, REMAP_PENDING),
        }.get(main, (health.evidence["xid_events"], 0, XID_LAST))
        evidence: dict[str, Any] = {
            "signal": signal,
            "value": statistic,
            "baseline": 0,  # a healthy GPU reports no faults and no throttling
            "statistic": statistic,
            "threshold": threshold,
            "node": host,
            "gpu": gpu,
            "faults": {f.value: detail for f, detail in health.faults.items()},
            "cause": main.value,
            **health.evidence,
        }
        proposals: tuple[Proposal, ...] = ()
        if health.cordon:
            pool = s.node_pools.get(host) or hosts.get(host, "")
            proposals = (Proposal(ActionKind.CORDON_NODE, pool, Cordon(host),
                                  f"cordon node {host} and drain its engines ({main.value} on GPU {gpu}): "
                                  f"kubectl cordon {host}; kubectl drain {host} --ignore-daemonsets "
                                  "--delete-emptydir-data",
                                  # Judged by the pool serving within its SLOs once its engines moved: the fault
                                  # holds the finding open for an hour, so its resolving says nothing of the cordon.
                                  verify_slo=True,
                                  # It rests on the GPU's own signals: the engine's /metrics may be down with it.
                                  inputs=(*WATCHED, *ALIVE)),)
        evidence["suggested_actions"] = [p.reason for p in proposals]
        text = "; ".join(f"{f.value}: {d}" for f, d in health.faults.items()) + "."
        if not health.cordon:
            text += " Application XIDs point at the workload (a crash, an illegal access), not the node: check the engine."
        summary = f"GPU {gpu} on {host}: {', '.join(f.value for f in health.faults)}"
        return FindingReport(FindingKey(KIND, subject), health.severity, summary, text, evidence, KIND, proposals)


def _xid_events(w: SignalWindows, subject: str, since: float) -> tuple[list[float], set[int]]:
    """Times of new XIDs since `since`, and the XID codes seen with them."""
    events: set[float] = set()
    codes: set[int] = set()
    events.update(ts for ts, v in w.series(subject, XID_COUNT, since=since) if v > 0)
    # The exporter's count over its own window (five minutes) shows one XID for that long: an event is where it rose.
    # A storm at a steady pace holds it level, never rising again: still above zero with no rise within the hold, its
    # latest point is one.
    window = w.series(subject, XID_WINDOW)
    events.update(ts for (_, a), (ts, b) in itertools.pairwise([(-math.inf, 0.0), *window]) if b > a and ts >= since)
    if window and window[-1][1] > 0 and window[-1][0] >= since and not events:
        events.add(window[-1][0])  # a storm older than the hold, still going: counted once, as of now
    last = w.series(subject, XID_LAST)
    alive = [pts[0][0] for name in ALIVE if (pts := w.series(subject, name))]
    for i, (ts, code) in enumerate(last):
        # A new code, or a first code after readings without one (the gauge is 0, not emitted, until
        # the first XID since the driver loaded).
        new = code != last[i - 1][1] if i else bool(alive) and min(alive) < ts
        if new and ts >= since:
            events.add(ts)
            codes.add(int(code))
    if events and last and not codes:
        codes.add(int(last[-1][1]))  # counted XIDs: the code is the last one the GPU reported
    return sorted(events), codes


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
