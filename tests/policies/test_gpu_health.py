"""GPU health: XID classification, ECC and row-remap faults, throttling, hold time and hysteresis."""

from __future__ import annotations

import random

import pytest

from policies.gpu_health import GpuHealth, GpuHealthSettings
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput
from policies.windows import SignalWindows

GPU = "gpu/node-a/3"
KEY = FindingKey("gpu_health", GPU)
STEP = 15.0


class Gpu:
    def __init__(self, seed: int = 4, xid_at_boot: int | None = None) -> None:
        self.w = SignalWindows(horizon_s=3 * 3600)
        self.ts = 0.0
        self.rng = random.Random(seed)
        self.xid = xid_at_boot  # DCGM keeps the last XID code; None: no XID since the driver loaded

    def tick(self, n: int = 1, *, xid: int | None = None, dbe: float = 0.0, remap_failure: float = 0.0,
             pending: float = 0.0, thermal: float = 0.0, power: float | None = None) -> Gpu:
        for _ in range(n):
            self.ts += STEP
            add = lambda name, v: self.w.add(self.ts, GPU, name, v)  # noqa: E731
            add("gpu_utilization", 0.8 + self.rng.gauss(0, 0.05))
            add("gpu_temperature_celsius", 65 + self.rng.gauss(0, 2))
            add("gpu_power_watts", 600 + self.rng.gauss(0, 30))
            window = 0.0
            if xid is not None:
                self.xid, window = xid, 1.0
                xid = None  # one XID per call
            if self.xid is not None:
                add("gpu_xid_last", float(self.xid))
            add("gpu_xid_errors_window", window)
            add("gpu_ecc_dbe_rate", dbe)
            add("gpu_row_remap_failure", remap_failure)
            add("gpu_remapped_rows_uncorrectable", pending)
            add("gpu_thermal_violation_seconds_rate", thermal)
            add("gpu_power_violation_seconds_rate",
                power if power is not None else max(0.0, 0.05 + self.rng.gauss(0, 0.05)))
        return self

    def run(self, open_findings: dict | None = None, settings: GpuHealthSettings | None = None):
        settings = settings or GpuHealthSettings(node_pools={"node-a": "decode"})
        return GpuHealth(settings).evaluate(PolicyInput(self.ts, self.w, {}, open_findings or {}))


@pytest.mark.parametrize("seed", range(3))
def test_healthy_gpus_are_quiet_even_with_an_old_xid(seed: int) -> None:
    for gpu in (Gpu(seed), Gpu(seed, xid_at_boot=79)):
        for _ in range(200):
            assert not gpu.tick().run().findings


def test_hardware_xid_is_critical_and_proposes_a_cordon() -> None:
    [f] = Gpu().tick(40).tick(xid=79).run().findings
    assert f.key == KEY and f.severity == "critical" and f.runbook == "gpu_health"
    ev = f.evidence
    assert (ev["node"], ev["gpu"], ev["cause"], ev["xid_codes"], ev["xid_events"]) == ("node-a", "3", "xid", [79], 1)
    [p] = f.proposals
    assert (p.kind, p.pool, p.verify_slo) == (ActionKind.CORDON_NODE, "decode", True), "judged by the pool's SLOs"
    assert "kubectl cordon node-a" in p.reason
    assert GpuHealth().evaluate(PolicyInput(0.0, SignalWindows(1.0), {}, {})).findings == []


def test_a_new_code_after_an_old_one_is_an_event() -> None:
    [f] = Gpu(xid_at_boot=13).tick(40).tick(xid=48).run().findings
    assert f.evidence["xid_codes"] == [48] and f.severity == "critical"


def test_one_xid_the_exporters_window_holds_for_five_minutes_is_one_event() -> None:
    w, subject = SignalWindows(3 * 3600), "gpu/node-1/0"
    for i in range(40):
        ts = (i + 1) * 15.0
        w.add(ts, subject, "gpu_temperature_celsius", 60.0)
        w.add(ts, subject, "gpu_xid_last", 79.0)
        w.add(ts, subject, "gpu_xid_errors_window", 1.0 if 10 <= i < 30 else 0.0)
    [f] = GpuHealth().evaluate(PolicyInput(600.0, w, {}, {})).findings
    assert f.evidence["xid_events"] == 1 and f.evidence["last_fault_at"] == 165.0, "when it came, not when it left"


def test_an_xid_storm_at_a_steady_pace_stays_a_fault_while_the_window_counts_it() -> None:
    """An XID every minute for two hours: the window reads 5 at every scrape from the fifth minute on and never rises
    again, so an hour later no rise is within the hold."""
    key = FindingKey("gpu_health", "gpu/node-1/0")
    w = SignalWindows(3 * 3600)
    for i in range(1, 481):
        ts = 15.0 * i
        w.add(ts, "gpu/node-1/0", "gpu_temperature_celsius", 60.0)
        w.add(ts, "gpu/node-1/0", "gpu_xid_last", 79.0)
        w.add(ts, "gpu/node-1/0", "gpu_xid_errors_window", float(min(5, max(0, int((ts - 600) // 60) + 1))))
    result = GpuHealth().evaluate(PolicyInput(7200.0, w, {}, {key: OpenFinding(key, 615.0, {})}))
    assert [f.key for f in result.findings] == [key] and not result.resolved
    assert result.findings[0].evidence["last_fault_at"] == 7200.0


def test_application_xid_warns_without_cordon() -> None:
    [f] = Gpu().tick(40).tick(xid=13).run().findings
    assert f.severity == "warning" and f.evidence["cause"] == "xid_application" and f.proposals == ()


def test_unknown_xid_warns_and_proposes_a_cordon_to_be_safe() -> None:
    [f] = Gpu().tick(40).tick(xid=999).run().findings
    assert f.severity == "warning" and f.evidence["cause"] == "xid"
    assert [p.kind for p in f.proposals] == [ActionKind.CORDON_NODE]


def test_without_node_pools_the_proposal_names_the_node_only() -> None:
    [f] = Gpu().tick(40).tick(xid=79).run(settings=GpuHealthSettings()).findings
    [p] = f.proposals
    assert p.pool == "" and "node-a" in p.reason


@pytest.mark.parametrize(
    ("kwargs", "cause", "severity"),
    [
        pytest.param({"dbe": 0.1}, "ecc_double_bit", "critical", id="double-bit-ecc"),
        pytest.param({"remap_failure": 1.0}, "row_remap_failure", "critical", id="row-remap-failure"),
        pytest.param({"pending": 2.0}, "row_remap_pending", "warning", id="row-remap-pending"),
    ],
)
def test_memory_faults(kwargs: dict, cause: str, severity: str) -> None:
    [f] = Gpu().tick(40).tick(**kwargs).run().findings
    assert (f.evidence["cause"], f.severity) == (cause, severity)
    assert [p.kind for p in f.proposals] == [ActionKind.CORDON_NODE]


def test_thermal_throttling_must_be_sustained() -> None:
    gpu = Gpu().tick(40).tick(thermal=0.3)
    assert not gpu.run().findings  # one throttled interval is a spike
    [f] = gpu.tick(thermal=0.3).run().findings
    ev = f.evidence
    assert (ev["cause"], ev["statistic"], ev["threshold"], f.severity) == ("thermal_throttling", 0.3, 0.1, "warning")
    assert [p.kind for p in f.proposals] == [ActionKind.CORDON_NODE]


def test_power_capping_under_load_is_normal_until_it_dominates() -> None:
    assert not Gpu().tick(40).tick(10, power=0.3).run().findings
    assert not Gpu().tick(40).tick(1, power=0.7).run().findings
    [f] = Gpu().tick(40).tick(2, power=0.7).run().findings
    assert f.evidence["cause"] == "power_throttling"


def test_a_fault_keeps_the_finding_open_for_the_hold_time() -> None:
    gpu = Gpu().tick(40).tick(xid=79)
    [f] = gpu.run().findings
    opening = {KEY: OpenFinding(KEY, gpu.ts, f.evidence)}
    gpu.tick(200)  # 50 minutes of a quiet GPU
    result = gpu.run(opening)
    assert result.findings and not result.resolved
    assert result.findings[0].evidence["last_fault_at"] == f.evidence["last_fault_at"]
    gpu.tick(41)
    assert gpu.run(opening).resolved == [(KEY, "no fault for 60 min and no throttling")]


def test_throttling_resolves_after_enough_clean_intervals() -> None:
    gpu = Gpu().tick(40).tick(6, thermal=0.3)
    [f] = gpu.run().findings
    opening = {KEY: OpenFinding(KEY, gpu.ts, f.evidence)}
    gpu.tick(7)
    assert not gpu.run(opening).resolved
    gpu.tick(thermal=0.2).tick(7)
    assert not gpu.run(opening).resolved, "a relapse restarts the count"
    gpu.tick()
    assert [k for k, _ in gpu.run(opening).resolved] == [KEY]


def test_a_gpu_that_stops_reporting_resolves() -> None:
    gpu = Gpu().tick(40).tick(xid=79)
    [f] = gpu.run().findings
    gpu.ts += 1000.0
    result = gpu.run({KEY: OpenFinding(KEY, 0.0, f.evidence)})
    assert result.findings == [] and [k for k, _ in result.resolved] == [KEY]


def test_every_node_of_a_round_is_judged_though_each_is_scraped_at_its_own_offset() -> None:
    # A round at t stamps each target at t plus its offset within `scrape.spread`: node-a at t+0.4, node-b at t+2.1.
    w = SignalWindows(horizon_s=3 * 3600)
    for i in range(1, 41):
        t = i * STEP
        for gpu, offset, dbe in (("gpu/node-a/0", 0.4, 1.0 if i == 40 else 0.0), ("gpu/node-b/0", 2.1, 0.0)):
            for name, value in (("gpu_utilization", 0.8), ("gpu_xid_errors_window", 0.0), ("gpu_ecc_dbe_rate", dbe)):
                w.add(t + offset, gpu, name, value)
    [f] = GpuHealth().evaluate(PolicyInput(40 * STEP, w, {}, {})).findings
    assert f.key == FindingKey("gpu_health", "gpu/node-a/0") and f.severity == "critical"
