"""KV-transfer lag policy: tail growth against its own baseline or its peers, failures, hysteresis."""

from __future__ import annotations

import random

import pytest

from policies.kv_transfer import KIND, KvTransferLag
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput
from policies.windows import SignalWindows
from tests.policies.ticking import Ticking

STEP = 15.0
PATH = "kvpath/prefill-0->decode-1"
BASE = [0.004, 0.0042, 0.0039, 0.0041, 0.004, 0.0043, 0.0038, 0.004, 0.0041, 0.004]


def windows(series: dict[str, list[float]], failures: dict[str, list[float]] | None = None,
            name: str = "kv_transfer_p99", fail_name: str = "kv_failure_rate") -> SignalWindows:
    w = SignalWindows(horizon_s=7200)
    for subject, values in series.items():
        for i, v in enumerate(values):
            w.add(i * STEP, subject, name, v)
            w.add(i * STEP, subject, fail_name, (failures or {}).get(subject, [0.0] * len(values))[i])
            w.add(i * STEP, subject, "kv_transfer_rate", 10.0)
    return w


def run(w: SignalWindows, open_findings: dict | None = None, pools: dict | None = None):
    now = max(ts for s in w.subjects("kv_transfer_p99") for ts, _ in w.series(s, "kv_transfer_p99"))
    return KvTransferLag().evaluate(PolicyInput(now, w, pools or {}, open_findings or {}))


@pytest.mark.parametrize(
    ("values", "opens"),
    [
        pytest.param(BASE, False, id="steady"),
        pytest.param(BASE + [0.02], False, id="one-slow-point"),
        pytest.param(BASE + [0.02, 0.025], True, id="tail-grows"),
        pytest.param(BASE + [0.0055, 0.0056], False, id="within-2ms"),
    ],
)
def test_tail_against_own_baseline(values: list[float], opens: bool) -> None:
    result = run(windows({PATH: values}))
    assert bool(result.findings) is opens
    if opens:
        [f] = result.findings
        assert f.key == FindingKey(KIND, PATH) and "prefill-0->decode-1" in f.summary
        assert f.evidence["baseline_p99"] == pytest.approx(0.004, abs=2e-4)
        assert f.proposals == ()  # its decode side is no pool of the fleet


def test_only_a_path_whose_decode_side_is_a_pool_proposes_admission_control_and_a_nixl_agent_nothing() -> None:
    """A NIXL agent's name (`nixl/<host>/<agent>`) or a probe peer's is no pool: an admission limit proposed for it
    named a pool the fleet lacks."""
    from policies.types import PoolState

    pools = {"decode-1": PoolState("decode-1", "decode", 2, 2, 1, 4)}
    [f] = run(windows({PATH: BASE + [0.02, 0.025]}), pools=pools).findings
    assert [(p.kind, p.pool) for p in f.proposals] == [(ActionKind.ADMISSION_CONTROL, "decode-1")]
    agent = "nixl/node-decode-1/decode-1"
    w = windows({agent: BASE + [0.02, 0.025]}, name="nixl_xfer_time_p99", fail_name="nixl_error_rate")
    [f] = KvTransferLag().evaluate(PolicyInput(11 * STEP, w, pools, {})).findings
    assert f.key.subject == agent and f.proposals == () and f.evidence["suggested_actions"] == []


def test_one_lagging_path_among_peers_without_history() -> None:
    series = {f"kvpath/prefill-0->decode-{i}": [0.004, 0.0041, 0.0039] for i in range(4)}
    series["kvpath/prefill-0->decode-3"] = [0.004, 0.03, 0.035]
    [f] = run(windows(series)).findings
    assert f.key.subject == "kvpath/prefill-0->decode-3" and f.evidence["peers_median_p99"] == pytest.approx(0.0039)


def test_peers_that_stopped_reporting_are_no_peers() -> None:
    """Two paths drained a while ago, their last p99s slow: read as peers, they would hide the one lagging now."""
    series = {f"kvpath/prefill-0->decode-{i}": [0.004, 0.0041, 0.0039] for i in range(3)}
    series["kvpath/prefill-0->decode-2"] = [0.004, 0.03, 0.035]
    w = windows(series)
    for gone in ("kvpath/prefill-0->decode-8", "kvpath/prefill-0->decode-9"):
        w.add(0.0, gone, "kv_transfer_p99", 0.05)
        w.add(0.0, gone, "kv_failure_rate", 0.0)
    [f] = run(w).findings
    assert f.key.subject == "kvpath/prefill-0->decode-2" and f.evidence["peers_median_p99"] == pytest.approx(0.0039)


@pytest.mark.parametrize(("lagging", "opens"), [pytest.param(1, True, id="one-path"),
                                                   pytest.param(4, False, id="every-path")])
def test_a_tail_its_peers_share_is_not_one_paths_lag(lagging: int, opens: bool) -> None:
    """Every path's p99 doubling together is the pool's load (a prefill backlog flushing), not a lagging worker."""
    series = {f"kvpath/prefill-0->decode-{i}": BASE + ([0.02, 0.025] if i < lagging else [0.004, 0.0041])
              for i in range(4)}
    findings = run(windows(series)).findings
    assert [f.key.subject for f in findings] == (["kvpath/prefill-0->decode-0"] if opens else [])


def test_failures_open_a_critical_finding_and_name_the_worker() -> None:
    w = windows({"engine/decode/decode-2/0": BASE + [0.004, 0.004]},
                {"engine/decode/decode-2/0": [0.0] * 10 + [2.0, 3.0]},
                name="nixl_xfer_time_p99", fail_name="nixl_failed_transfer_rate")
    for i in range(12):
        w.add(i * STEP, "engine/decode/decode-2/0", "nixl_transfer_rate", 10.0)
    [f] = KvTransferLag().evaluate(PolicyInput(11 * STEP, w, {}, {})).findings
    assert f.severity == "critical" and f.evidence["failing"] is True
    assert [(p.kind, p.pool) for p in f.proposals] == [(ActionKind.DRAIN_ENGINE, "decode")]


def test_a_busy_workers_background_of_failures_is_no_fault_and_does_not_hold_one_open() -> None:
    """A failure or two a scrape out of 200 transfers a second (0.03 %): opened on any two such scrapes, the finding
    flapped all hour with a drain proposed on most ticks."""
    subject = "engine/decode/decode-2/0"

    def worker(failures: list[float]) -> SignalWindows:
        w = windows({subject: BASE + [0.004] * (len(failures) - len(BASE))}, {subject: failures},
                    name="nixl_xfer_time_p99", fail_name="nixl_failed_transfer_rate")
        for i in range(len(failures)):
            w.add(i * STEP, subject, "nixl_transfer_rate", 200.0)
        return w

    background = [0.0] * 10 + [0.06, 0.07]  # about one failure a scrape
    assert not KvTransferLag().evaluate(PolicyInput(11 * STEP, worker(background), {}, {})).findings
    w = worker([0.0] * 10 + [4.0, 5.0])  # 2 % of transfers fail: a fault
    [f] = KvTransferLag().evaluate(PolicyInput(11 * STEP, w, {}, {})).findings
    opening = {f.key: OpenFinding(f.key, 11 * STEP, f.evidence)}
    back = worker([0.0] * 10 + [4.0, 5.0, 0.06, 0.0, 0.07])  # the background again
    assert KvTransferLag().evaluate(PolicyInput(14 * STEP, back, {}, opening)).resolved


def test_resolves_only_after_three_good_points() -> None:
    [f] = run(windows({PATH: BASE + [0.02, 0.025]})).findings
    opened = {f.key: OpenFinding(f.key, 0.0, f.evidence)}
    still = run(windows({PATH: BASE + [0.02, 0.025, 0.004, 0.004]}), opened)
    assert not still.resolved and still.findings
    done = run(windows({PATH: BASE + [0.02, 0.025, 0.004, 0.004, 0.0041]}), opened)
    assert done.resolved == [(f.key, "transfer tail and failures back to normal")]


def test_a_path_gone_idle_is_judged_by_its_scrapes_not_by_its_last_slow_transfers() -> None:
    # The tail grew, then no transfer went that way (the router avoids it): the failure counter goes on reporting 0
    # every scrape, the p99 only where there were transfers. Its last slow p99s say nothing about now.
    [f] = run(windows({PATH: BASE + [0.02, 0.025]})).findings
    opened = {f.key: OpenFinding(f.key, 0.0, f.evidence)}
    w = windows({PATH: BASE + [0.02, 0.025]})
    for i in range(12, 16):
        w.add(i * STEP, PATH, "kv_failure_rate", 0.0)
    result = KvTransferLag().evaluate(PolicyInput(15 * STEP, w, {}, opened))
    assert result.resolved == [(f.key, "transfer tail and failures back to normal")] and not result.findings


def test_points_back_under_the_opening_threshold_resolve_even_above_the_baseline() -> None:
    """A histogram p99 lands on bucket bounds: one ordinary sample a bucket up must not hold it open."""
    [f] = run(windows({PATH: BASE + [0.02, 0.025]})).findings
    opened = {f.key: OpenFinding(f.key, 0.0, f.evidence)}
    near = 0.9 * f.evidence["threshold_s"]
    assert near > f.evidence["baseline_p99"]
    done = run(windows({PATH: BASE + [0.02, 0.025, near, near, near]}), opened)
    assert done.resolved and not done.findings


def test_a_tail_without_history_needs_its_bandwidth_below_its_peers() -> None:
    """Early on, one long prompt must not open a finding: bytes per second of transfer time holds."""
    def early(lagging_bandwidth: float) -> list:
        w = SignalWindows(3600)
        for i in range(3):
            for k in range(4):
                subject = f"engine/decode/decode-{k}/0"
                lagging = k == 1 and i >= 1
                w.add(i * STEP, subject, "nixl_xfer_time_p99", 0.5 if lagging else 0.05)
                w.add(i * STEP, subject, "nixl_xfer_bandwidth", lagging_bandwidth if lagging else 30e9)
        return KvTransferLag().evaluate(PolicyInput(2 * STEP, w, {}, {})).findings

    assert not early(30e9)  # a long prompt: slower, at the same bytes per second
    [f] = early(3e9)  # the link itself slowed down
    assert f.key.subject == "engine/decode/decode-1/0" and f.evidence["slow"] is True


def test_a_path_lagging_from_its_first_scrape_stays_open_against_its_peers() -> None:
    """No history of its own: it opens against its peers, and its own lagging points never become its baseline."""
    w, rng = SignalWindows(3 * 3600), random.Random(3)
    ticking = Ticking(KvTransferLag(), w)
    t = 0.0
    for i in range(200):
        t += 15.0
        paths = {f"kvpath/prefill-0->decode-{d}": 0.004 + rng.gauss(0, 0.0002) for d in range(3)}
        if i >= 100:
            paths["kvpath/prefill-0->decode-9"] = 0.030 + rng.gauss(0, 0.001)
        for subject, p99 in paths.items():
            for name, value in (("kv_transfer_p99", p99), ("kv_failure_rate", 0.0), ("kv_transfer_rate", 5.0)):
                w.add(t, subject, name, value)
        ticking.tick(t)
    assert [s for _, kind, s, _ in ticking.log] == ["kvpath/prefill-0->decode-9"]
    assert FindingKey(KIND, "kvpath/prefill-0->decode-9") in ticking.open


def test_an_engines_peers_are_its_own_pools_not_a_pool_of_a_similar_name() -> None:
    w = SignalWindows(3 * 3600)
    for t in (15.0, 30.0):
        for subject, p99 in (("engine/decode/d-0/0", 0.040), ("engine/decode-b/b-0/0", 0.004),
                             ("engine/decode-b/b-1/0", 0.004)):
            w.add(t, subject, "nixl_xfer_time_p99", p99)
            w.add(t, subject, "nixl_failed_transfer_rate", 0.0)
    assert KvTransferLag().evaluate(PolicyInput(30.0, w, {}, {})).findings == [], "decode-b is not decode's peer"
