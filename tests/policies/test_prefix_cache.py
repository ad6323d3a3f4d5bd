"""Prefix-cache hit-drop policy: when it opens, what cause and proposal it gives, when it resolves.

Pure: windows are built by hand, time is an argument, no mocks.
"""

from __future__ import annotations

import pytest

from policies.prefix_cache import PrefixCacheHitDrop
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput, PoolState, RollBack
from policies.windows import SignalWindows
from tests.policies.ticking import Ticking

POOL = "pool/prefill"
KEY = FindingKey("prefix_cache_hit_drop", POOL)
STEP = 15.0


def windows(hits: list[float], *, kv: float = 0.3, preempt: float = 0.0, waiting: float = 0.0,
            ttft: float = 0.1, query_rate: float = 1000.0) -> SignalWindows:
    w = SignalWindows(horizon_s=7200)
    for i, h in enumerate(hits):
        ts = i * STEP
        for name, value in (("prefix_cache_hit_rate", h), ("kv_cache_usage_max", kv), ("preemption_rate", preempt),
                            ("requests_waiting", waiting), ("ttft_p95", ttft), ("prefix_cache_query_rate", query_rate)):
            w.add(ts, POOL, name, value)
        w.add(ts, "engine/prefill/p0/0", "prefix_cache_hit_rate", h)
        w.add(ts, "engine/prefill/p1/0", "prefix_cache_hit_rate", h * 0.9)
    return w


def run(w: SignalWindows, open_findings: dict | None = None, slo: float | None = 0.5,
        router_changed_ago: float | None = None):
    now = max(ts for ts, _ in w.series(POOL, "prefix_cache_hit_rate"))
    pools = {"prefill": PoolState("prefill", "prefill", 3, 3, 2, 6, ttft_p95_slo=slo)}
    changed = {} if router_changed_ago is None else {"router": now - router_changed_ago}
    return PrefixCacheHitDrop().evaluate(PolicyInput(now, w, pools, open_findings or {}, changed))


STABLE = [0.80, 0.79, 0.81, 0.80, 0.78, 0.80, 0.82, 0.79, 0.80, 0.81]


@pytest.mark.parametrize(
    ("hits", "opens"),
    [
        pytest.param(STABLE, False, id="stable"),
        pytest.param(STABLE + [0.40], False, id="one-low-point-is-not-enough"),
        pytest.param(STABLE + [0.40, 0.42], True, id="two-low-points-open"),
        pytest.param(STABLE + [0.72, 0.71], False, id="small-dip-below-threshold"),
        pytest.param(STABLE[:5] + [0.40, 0.42], False, id="too-little-baseline"),
        pytest.param([0.10, 0.11, 0.09, 0.10, 0.10, 0.12, 0.10, 0.11, 0.10, 0.09, 0.01, 0.0], False,
                     id="low-baseline-needs-absolute-drop"),
    ],
)
def test_when_a_drop_opens(hits: list[float], opens: bool) -> None:
    result = run(windows(hits))
    assert bool(result.findings) is opens


def test_idle_pool_is_not_judged() -> None:
    assert not run(windows(STABLE + [0.1, 0.1], query_rate=0.0)).findings


def test_kv_pressure_is_reported_for_the_autoscaler_not_scaled_here() -> None:
    [finding] = run(windows(STABLE + [0.4, 0.4], kv=0.95, preempt=0.5)).findings
    assert finding.evidence["cause"] == "kv_pressure"
    assert finding.proposals == ()


def test_routing_without_saturation_only_pages() -> None:
    [finding] = run(windows(STABLE + [0.4, 0.4])).findings
    assert finding.evidence["cause"] == "routing_or_prompts"
    assert finding.proposals == ()
    assert finding.runbook == "prefix_cache_hit_drop"
    assert finding.evidence["engine_hit_rates"] == {"p0/0": 0.4, "p1/0": 0.36}


@pytest.mark.parametrize(
    ("waiting", "ttft", "slo"),
    [pytest.param(9.0, 0.1, None, id="queue"), pytest.param(0.0, 0.9, 0.5, id="ttft-above-slo")],
)
def test_routing_with_saturation_leaves_capacity_to_the_autoscaler(waiting: float, ttft: float,
                                                                    slo: float | None) -> None:
    [finding] = run(windows(STABLE + [0.4, 0.4], waiting=waiting, ttft=ttft), slo=slo).findings
    assert finding.evidence["saturated"] is True and finding.proposals == ()


@pytest.mark.parametrize(("ago", "rolls_back"), [(240.0, True), (1700.0, True), (7200.0, False), (None, False),
                                                 (5.0, False)])
def test_a_recent_router_change_is_rolled_back(ago: float | None, rolls_back: bool) -> None:
    """The cause, not the symptom: the router got a new revision just before the drop. One made after the drop began
    (5 s ago: the operator's fix, often) explains nothing, and rolling it back would undo the fix."""
    [finding] = run(windows(STABLE + [0.4, 0.4], waiting=9.0), router_changed_ago=ago).findings
    if rolls_back:
        [p] = finding.proposals
        assert (p.kind, p.change, p.verify_signal, p.verify_lower_is_better) == (
            ActionKind.ROLLBACK, RollBack("router"), "prefix_cache_hit_rate", False)
        assert "roll it back" in finding.cause
    else:
        assert finding.proposals == () and "routing runbook" in finding.cause
    assert finding.evidence["router_changed_s_ago"] == (None if ago is None else round(ago))


def test_an_engine_gone_since_is_no_part_of_the_spread() -> None:
    w = windows(STABLE + [0.4, 0.4])
    w.add(0.0, "engine/prefill/p9/0", "prefix_cache_hit_rate", 0.95)  # drained an hour's worth of scrapes ago
    [finding] = run(w).findings
    assert sorted(finding.evidence["engine_hit_rates"]) == ["p0/0", "p1/0"]


def test_a_router_fix_made_after_a_finding_older_than_the_history_opened_is_no_cause() -> None:
    """The run of low points began before the three hours the loop keeps: the finding's opening stands for it."""
    w = windows([0.4] * 20)  # the drop is all the history holds
    now = 19 * STEP
    opened = {KEY: OpenFinding(KEY, -4 * 3600.0, {"baseline": 0.8, "threshold": 0.16})}
    pools = {"prefill": PoolState("prefill", "prefill", 3, 3, 2, 6, ttft_p95_slo=0.5)}
    [finding] = PrefixCacheHitDrop().evaluate(PolicyInput(now, w, pools, opened, {"router": now - 600.0})).findings
    assert finding.proposals == () and "routing runbook" in finding.cause


@pytest.mark.parametrize(("sizes", "shed_ago"), [
    pytest.param([3, 3, 2, 2, 2], 30.0, id="shed-then-fell"),
    pytest.param([3, 3, 3, 2, 2], 15.0, id="shed-as-it-fell"),
    pytest.param([3, 3, 3, 3, 2], None, id="fell-then-shed"),
    pytest.param([3, 3, 3, 3, 3], None, id="no-shed"),
    pytest.param([2, 2, 2, 3, 3], None, id="grew"),
    pytest.param([3, 2, 2, 2, 2], None, id="shed-before-the-router-changed"),
])
def test_a_drop_that_began_when_the_pool_shed_engines_is_not_the_routers(sizes: list[int],
                                                                         shed_ago: float | None) -> None:
    """The router changed a minute before; the hit rate held, and fell only when engines (and their caches) went."""
    w = windows(STABLE[:8] + [0.80, 0.80, 0.80, 0.4, 0.4], waiting=9.0)
    now = 12 * STEP
    for i, n in enumerate(sizes):  # desired engines over the last five scrapes
        w.add(now - (4 - i) * STEP, POOL, "replicas_desired", float(n))
    [finding] = run(w, router_changed_ago=3.5 * STEP).findings
    assert finding.evidence["pool_shed_s_ago"] == shed_ago
    assert bool(finding.proposals) is (shed_ago is None)
    assert ("no rollback" in finding.cause) is (shed_ago is not None)


def test_an_open_findings_drop_keeps_the_onset_that_opened_it() -> None:
    """A point back above the bar and down again after the pool shed engines does not move the blame to the router."""
    hits = STABLE[:8] + [0.80, 0.80, 0.80, 0.4, 0.4]
    w = windows(hits, waiting=9.0)
    opened = 12 * STEP
    for i, n in enumerate([3, 3, 3, 2, 2]):
        w.add(opened - (4 - i) * STEP, POOL, "replicas_desired", float(n))
    [finding] = run(w, router_changed_ago=3.5 * STEP).findings
    for i, h in enumerate([0.70, 0.4, 0.4], start=13):  # above the bar once, then down again
        for name, value in (("prefix_cache_hit_rate", h), ("kv_cache_usage_max", 0.3), ("preemption_rate", 0.0),
                            ("requests_waiting", 9.0), ("ttft_p95", 0.1), ("prefix_cache_query_rate", 1000.0),
                            ("replicas_desired", 2.0)):
            w.add(i * STEP, POOL, name, value)
    open_findings = {KEY: OpenFinding(KEY, opened, finding.evidence)}
    [later] = run(w, open_findings, router_changed_ago=6.5 * STEP).findings
    assert later.proposals == () and later.evidence["pool_shed_s_ago"] == 4 * STEP


def _open(hits: list[float]) -> dict:
    [finding] = run(windows(hits)).findings
    return {KEY: OpenFinding(KEY, 0.0, finding.evidence)}


def test_open_finding_keeps_its_baseline_and_resolves_with_hysteresis() -> None:
    opened = _open(STABLE + [0.4, 0.4])
    baseline = opened[KEY].evidence["baseline"]
    # A long incident: the window's own median is now the low value, but the frozen baseline holds.
    long_low = STABLE + [0.4] * 30
    result = run(windows(long_low), opened)
    assert result.findings and result.findings[0].evidence["baseline"] == baseline
    # Two good points are not enough to resolve; three are.
    assert not run(windows(long_low + [0.8, 0.8]), opened).resolved
    assert run(windows(long_low + [0.8, 0.8, 0.8]), opened).resolved == [(KEY, "hit rate back near its baseline")]


def test_a_noisy_recovery_does_not_resolve() -> None:
    opened = _open(STABLE + [0.4, 0.4])
    result = run(windows(STABLE + [0.4, 0.4, 0.8, 0.45, 0.8]), opened)
    assert not result.resolved and result.findings


def test_an_open_finding_keeps_naming_its_lowest_point_while_it_recovers() -> None:
    from policies.prefix_cache import KIND, PrefixCacheHitDrop
    from policies.types import FindingKey, OpenFinding, PolicyInput
    from policies.windows import SignalWindows

    w = SignalWindows(3600)
    values = [0.8] * 12 + [0.05, 0.0, 0.5]
    for i, v in enumerate(values):
        w.add(i * 15.0, "pool/p", "prefix_cache_hit_rate", v)
        w.add(i * 15.0, "pool/p", "prefix_cache_query_rate", 100.0)
    key = FindingKey(KIND, "pool/p")
    opened = {key: OpenFinding(key, 13 * 15.0, {"baseline": 0.8, "threshold": 0.16, "lowest": 0.0})}
    [report] = PrefixCacheHitDrop().evaluate(PolicyInput(14 * 15.0, w, {}, opened)).findings
    assert report.evidence["lowest"] == 0.0 and "fell to 0%" in report.summary


def test_a_pool_that_stops_reporting_is_neither_judged_on_old_points_nor_left_open() -> None:
    w, pool = SignalWindows(3 * 3600), "pool/p"
    ticking = Ticking(PrefixCacheHitDrop(), w)
    t = 0.0
    for i in range(140):
        t += 15.0
        for name, value in (("prefix_cache_hit_rate", 0.7 if i < 120 else 0.3), ("prefix_cache_query_rate", 100.0),
                            ("kv_cache_usage_max", 0.5), ("preemption_rate", 0.0)):
            w.add(t, pool, name, value)
        ticking.tick(t)
    assert len(ticking.events("open")) == 1
    reported = []
    for _ in range(80):  # twenty minutes: the pool was deleted (or has no lookups to report)
        t += 15.0
        reported += ticking.tick(t).findings
    assert ticking.open == {} and "no longer reports" in ticking.log[-1][3]
    assert ticking.events("resolve") == [140 * 15.0 + 900.0 + 15.0], "once its newest point is stale_s old"
    assert len(reported) <= 900 / 15, "not re-reported, nor proposed again, once stale"
