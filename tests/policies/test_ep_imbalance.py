"""Expert-parallel imbalance: per-rank skew, cause, persistence before EPLB, EPLB overhead, hysteresis."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from policies.ep_imbalance import EpImbalance, EpImbalanceSettings, eplb_flags, pool_rank_skew
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput, PoolState
from policies.windows import SignalWindows
from tests.policies.ticking import Ticking

STEP = 15.0
RANKS = 4
POD = "pod/decode/dp0"
KEY = FindingKey("ep_imbalance", POD)


class Group:
    """One pod `dp0` of pool `decode` with four data-parallel ranks, their GPUs and the pool aggregate."""

    def __init__(self, seed: int = 5) -> None:
        self.w = SignalWindows(horizon_s=3 * 3600)
        self.ts = 0.0
        self.rng = random.Random(seed)

    def tick(self, n: int = 1, *, itl: tuple[float, ...] = (0.03,) * RANKS, running: tuple[float, ...] = (8,) * RANKS,
             tensor: tuple[float, ...] | None = None, pool_itl: float | None = None) -> Group:
        for _ in range(n):
            self.ts += STEP
            for r in range(RANKS):
                sub = f"engine/decode/dp0/{r}"
                self.w.add(self.ts, sub, "itl_p50", itl[r] * (1 + self.rng.gauss(0, 0.05)))
                jitter = self.rng.choice((-1, 0, 1)) if running[r] else 0
                self.w.add(self.ts, sub, "requests_running", float(running[r] + jitter))
                self.w.add(self.ts, sub, "requests_waiting", 0.0)
                t = (tensor or (0.5,) * RANKS)[r]
                self.w.add(self.ts + 1.0, f"gpu/dp0/{r}", "gpu_tensor_active", t * (1 + self.rng.gauss(0, 0.04)))
            self.w.add(self.ts, POD, "itl_p50", max(itl))
            self.w.add(self.ts, "pool/decode", "itl_p50", (pool_itl or max(itl)) * (1 + self.rng.gauss(0, 0.03)))
            self.w.add(self.ts, "pool/decode", "requests_running", float(sum(running)))
        return self

    def run(self, open_findings: dict | None = None, settings: EpImbalanceSettings | None = None,
            pools: dict | None = None):
        return EpImbalance(settings).evaluate(PolicyInput(self.ts + 1.0, self.w, pools or {}, open_findings or {}))


HOT = (0.03, 0.03, 0.06, 0.03)  # rank 2 hosts the hot experts: twice the step time


def opening(g: Group, opened_ago: float = 0.0) -> dict:
    [f] = g.run().findings
    return {KEY: OpenFinding(KEY, g.ts - opened_ago, f.evidence)}


@pytest.mark.parametrize("seed", range(4))
def test_balanced_noisy_groups_stay_quiet(seed: int) -> None:
    g = Group(seed)
    for _ in range(150):
        assert not g.tick().run().findings


def test_a_hot_rank_opens_after_the_window_with_its_evidence() -> None:
    g = Group().tick(9, itl=HOT)
    assert not g.run().findings, "fewer scrapes than min_ticks"
    [f] = g.tick(itl=HOT).run().findings
    assert f.key == KEY and f.runbook == "ep_imbalance" and f.severity == "warning"
    ev = f.evidence
    assert ev["cause"] == "hot_experts" and ev["hot_rank"] == "2" and ev["ranks"] == RANKS
    assert ev["itl_skew"] == pytest.approx(2.0, rel=0.15) and ev["statistic"] >= ev["threshold"] == 1.5
    assert ev["baseline"] == pytest.approx(0.03, rel=0.1) and set(ev["rank_values"]) == {"0", "1", "2", "3"}
    assert f.proposals == (), "EPLB waits until the imbalance has persisted"


def test_a_shift_after_a_balanced_history_opens_on_its_third_skewed_scrape() -> None:
    g = Group().tick(40)
    for _ in range(2):
        assert not g.tick(itl=HOT).run().findings
    [f] = g.tick(itl=HOT).run().findings
    # It reads at the skew of the scrapes that opened it, not at the window's balanced median (about 1.1).
    assert f.evidence["statistic"] == pytest.approx(2.0, rel=0.15)
    three = (0.03, 0.03, 0.09, 0.03)
    g = Group().tick(40).tick(3, itl=three)
    [hot] = g.run().findings
    assert hot.severity == "critical", "a rank three times the median is critical from the first finding"
    opened = opening(g)
    [still] = g.tick(itl=(0.03, 0.03, 0.042, 0.03)).run(opened).findings  # one scrape under the threshold
    assert still.severity == "critical" and still.evidence["statistic"] == pytest.approx(3.0, rel=0.15)


def test_single_skewed_scrapes_between_balanced_ones_stay_quiet() -> None:
    g = Group().tick(20)
    for _ in range(10):
        assert not g.tick(itl=HOT).run().findings
        assert not g.tick(2).run().findings


def test_gpu_activity_skew_alone_is_enough() -> None:
    # In lockstep EP the ranks' step times match; the hot rank's tensor pipe is what stands out.
    [f] = Group().tick(20, tensor=(0.3, 0.3, 0.3, 0.75)).run().findings
    ev = f.evidence
    assert ev["gpu_signal"] == "gpu_tensor_active" and ev["gpu_skew"] >= 1.5 and ev["gpu_hottest"] == "3"
    assert ev["itl_skew"] < 1.2


def test_gpus_are_found_through_the_host_pattern() -> None:
    g = Group()
    for _ in range(20):
        g.ts += STEP
        for r in range(RANKS):
            g.w.add(g.ts, f"engine/decode/dp0/{r}", "itl_p50", 0.03)
            g.w.add(g.ts, f"engine/decode/dp0/{r}", "requests_running", 8.0)
            g.w.add(g.ts, f"gpu/node-dp0/{r}", "gpu_tensor_active", 0.8 if r == 1 else 0.3)
    assert not g.run().findings
    settings = EpImbalanceSettings(pod_host="node-{pod}")
    [f] = g.run(settings=settings).findings
    assert f.evidence["gpu_hottest"] == "1"


def test_a_node_two_groups_share_lends_neither_its_gpus() -> None:
    """The exporter's GPU series name no pod: one group's busy GPUs beside the other's idle ones are no skew of
    either, and balanced ranks get no EPLB."""
    rng = random.Random(1)
    w = SignalWindows(3 * 3600)
    settings = EpImbalanceSettings(pod_hosts={"moe/dp0": "node-1", "moe/dp1": "node-1"})
    t = Ticking(EpImbalance(settings), w, {"moe": PoolState("moe", "decode", 2, 2, 1, 4, expert_parallel=True)})
    for i in range(80):
        ts = (i + 1) * STEP
        for pod, gpus, tensor, running in (("dp0", range(4), 0.60, 8.0), ("dp1", range(4, 8), 0.15, 2.0)):
            for rank, gpu in enumerate(gpus):
                w.add(ts, f"engine/moe/{pod}/{rank}", "itl_p50", 0.03 * (1 + rng.gauss(0, 0.03)))
                w.add(ts, f"engine/moe/{pod}/{rank}", "requests_running", running)
                w.add(ts + 1, f"gpu/node-1/{gpu}", "gpu_tensor_active", tensor * (1 + rng.gauss(0, 0.03)))
        t.tick(ts + 1)
    assert t.log == []


def test_uneven_request_load_is_not_an_expert_problem() -> None:
    g = Group().tick(20, itl=HOT, running=(6, 6, 24, 6))
    [f] = g.run(opening(g, opened_ago=3600)).findings
    assert f.evidence["cause"] == "uneven_request_load" and f.proposals == ()


def test_eplb_is_proposed_once_the_imbalance_persisted() -> None:
    g = Group().tick(20, itl=HOT)
    [f] = g.run(opening(g, opened_ago=540)).findings
    assert f.proposals == () and f.evidence["imbalanced_for_s"] == pytest.approx(541)
    [f] = g.run(opening(g, opened_ago=600)).findings
    [p] = f.proposals
    assert (p.kind, p.pool, p.verify_signal, p.verify_lower_is_better) == (
        ActionKind.ENABLE_EPLB, "decode", "itl_p50", True)
    flags = '--enable-eplb --eplb-config \'{"window_size":1000,"step_interval":3000,"num_redundant_experts":4}\''
    assert flags in p.reason and flags == eplb_flags(1000, 3000, 4)


def test_a_dense_models_slow_rank_gets_no_eplb() -> None:
    """Data-parallel ranks of a dense model: no experts to balance. vLLM refuses --enable-eplb without expert
    parallelism, so rolling it out would crash-loop the pool."""
    g = Group().tick(20, itl=HOT)
    dense = PoolState("decode", "decode", 1, 1, 1, 4)
    [f] = g.run(opening(g, opened_ago=3600), pools={"decode": dense}).findings
    assert f.evidence["cause"] == "slow_rank" and f.proposals == () and "no expert parallelism" in f.cause
    moe = replace(dense, expert_parallel=True)
    [f] = g.run(opening(g, opened_ago=3600), pools={"decode": moe}).findings
    assert f.evidence["cause"] == "hot_experts" and [p.kind for p in f.proposals] == [ActionKind.ENABLE_EPLB]


def test_a_pool_already_running_eplb_gets_no_second_proposal() -> None:
    g = Group().tick(20, itl=HOT)
    settings = EpImbalanceSettings(eplb_enabled={"decode": None})
    [f] = g.run(opening(g, opened_ago=3600), settings).findings
    assert f.evidence["cause"] == "hot_experts_despite_eplb" and f.evidence["eplb_enabled"] and f.proposals == ()


def test_idle_and_single_rank_pods_are_not_judged() -> None:
    assert not Group().tick(20, itl=HOT, running=(0,) * RANKS).run().findings
    w = SignalWindows(3600)
    for i in range(30):
        w.add(i * STEP, "engine/decode/solo/0", "itl_p50", 0.09)
        w.add(i * STEP, "engine/decode/solo/0", "requests_running", 8.0)
    assert not EpImbalance().evaluate(PolicyInput(30 * STEP, w, {}, {})).findings


def test_resolves_only_after_enough_balanced_scrapes() -> None:
    g = Group().tick(20, itl=HOT)
    opened = opening(g)
    g.tick(7)
    result = g.run(opened)
    assert not result.resolved and result.findings, "still open, and updated"
    g.tick(itl=HOT).tick(7)
    assert not g.run(opened).resolved, "one skewed scrape restarts the count"
    g.tick()
    assert g.run(opened).resolved == [(KEY, "per-rank skew back to its normal")]


def test_a_pod_that_stops_reporting_resolves() -> None:
    g = Group().tick(20, itl=HOT)
    opened = opening(g)
    g.ts += 1000.0
    result = g.run(opened)
    assert result.findings == [] and result.resolved == [(KEY, f"{POD} no longer reports")]


def eplb_overhead(after_itl: float, after_running: tuple[float, ...] = (8,) * RANKS):
    g = Group().tick(120, pool_itl=0.030)
    enabled_at = g.ts
    g.tick(20, pool_itl=after_itl, running=after_running)
    settings = EpImbalanceSettings(eplb_enabled={"decode": enabled_at})
    return g, settings


def test_eplb_that_costs_more_than_it_saves_is_proposed_off() -> None:
    g, settings = eplb_overhead(0.036)
    [f] = g.run(settings=settings).findings
    assert f.key == FindingKey("ep_imbalance", "pool/decode") and f.severity == "info"
    ev = f.evidence
    assert ev["cause"] == "eplb_overhead" and ev["statistic"] == pytest.approx(1.2, rel=0.05)
    assert ev["threshold"] == pytest.approx(1.1) and ev["baseline"] == pytest.approx(0.03, rel=0.03)
    [p] = f.proposals
    assert (p.kind, p.pool, p.verify_signal) == (ActionKind.DISABLE_EPLB, "decode", "itl_p50")


@pytest.mark.parametrize(
    ("after_itl", "after_running"),
    [
        pytest.param(0.031, (8,) * RANKS, id="step-time-unchanged"),
        pytest.param(0.036, (16,) * RANKS, id="load-doubled"),
    ],
)
def test_no_eplb_overhead_finding_without_a_comparable_slowdown(after_itl: float, after_running: tuple) -> None:
    g, settings = eplb_overhead(after_itl, after_running)
    assert not g.run(settings=settings).findings


def test_eplb_overhead_needs_balanced_groups_and_resolves_when_step_time_returns() -> None:
    g, settings = eplb_overhead(0.036)
    g.tick(20, itl=HOT, pool_itl=0.036)
    assert [f.key.subject for f in g.run(settings=settings).findings] == [POD], "imbalanced: EPLB is needed"
    g, settings = eplb_overhead(0.036)
    [f] = g.run(settings=settings).findings
    key = f.key
    opened = {key: OpenFinding(key, g.ts, f.evidence)}
    g.tick(8, pool_itl=0.030)
    assert g.run(opened, settings).resolved == [(key, "pool step time back at its pre-EPLB level")]
    assert g.run(opened, EpImbalanceSettings()).resolved == [(key, "the pool no longer runs EPLB")]


def test_an_eplb_overhead_finding_still_resolves_once_the_points_from_before_eplb_left_the_history() -> None:
    g, settings = eplb_overhead(0.036)
    [f] = g.run(settings=settings).findings
    opened = {f.key: OpenFinding(f.key, g.ts, f.evidence)}
    g.tick(4 * 3600 // 15, pool_itl=0.036)  # hours later: the pre-EPLB points are gone, the overhead is not
    g.w.trim(g.ts)  # as the loop trims its windows every tick
    assert g.run(opened, settings).findings, "still judged, against the baseline it opened with"
    g.tick(8, pool_itl=0.030)
    assert g.run(opened, settings).resolved == [(f.key, "pool step time back at its pre-EPLB level")]


def test_a_resolved_group_is_not_reopened_by_the_incident_still_in_its_window() -> None:
    g = Group().tick(20, itl=HOT)
    opened = opening(g)
    g.tick(8)
    assert g.run(opened).resolved
    for _ in range(20):
        assert not g.tick().run().findings


def test_few_running_requests_per_rank_are_noisy_not_uneven() -> None:
    # Two to nine requests per rank at each scrape: any single scrape looks skewed, the means do not.
    g = Group()
    rng = random.Random(9)
    for _ in range(20):
        g.tick(itl=HOT)
        for r in range(RANKS):
            g.w.add(g.ts + 0.5, f"engine/decode/dp0/{r}", "requests_running", float(rng.randint(2, 9)))
    [f] = g.run().findings
    assert f.evidence["cause"] == "hot_experts" and f.evidence["load_skew"] < 1.5


def test_a_group_whose_normal_skew_is_above_the_resolve_ratio_still_resolves() -> None:
    # 8 ranks under a moderately skewed expert popularity: one rank always ~1.35x the median, between
    # the resolve ratio (1.2) and the opening one (1.5). A hot expert lifts it to 2x for ten minutes.
    usual, hot = (0.03, 0.03, 0.0405, 0.03), (0.03, 0.03, 0.06, 0.03)
    g = Group().tick(140, itl=usual)
    assert not g.run().findings
    g.tick(3, itl=hot)
    [f] = g.run().findings
    assert f.evidence["normal_itl_skew"] == pytest.approx(1.35, abs=0.08)
    opened = {KEY: OpenFinding(KEY, g.ts, f.evidence)}
    g.tick(37, itl=hot)
    assert g.run(opened).findings, "still hot"
    g.tick(8, itl=usual)
    assert [k for k, _ in g.run(opened).resolved] == [KEY], "back to its own normal: resolved"
    # Without the normal it would stay open for good, as it did before.
    assert not EpImbalance().evaluate(PolicyInput(g.ts + 1.0, g.w, {}, {KEY: OpenFinding(KEY, g.ts, {})})).resolved


def test_an_idle_group_is_not_judged_on_the_skew_it_had_before() -> None:
    """vLLM reports no ITL while no token is generated: the last skew is no reading of now, and never grounds an
    EPLB proposal."""
    w, rng = SignalWindows(3 * 3600), random.Random(1)
    ticking = Ticking(EpImbalance(), w)
    t, proposals = 0.0, []
    for n, itl, running in ((60, (0.03,) * 4, 8.0), (20, (0.03, 0.03, 0.06, 0.03), 8.0), (60, None, 0.0)):
        for _ in range(n):
            t += 15.0
            for rank in range(4):
                subject = f"engine/decode/dp0/{rank}"
                if itl is not None:
                    w.add(t, subject, "itl_p50", itl[rank] * (1 + rng.gauss(0, 0.05)))
                w.add(t, subject, "requests_running", running)
                w.add(t, subject, "requests_waiting", 0.0)
            proposals += [p for f in ticking.tick(t).findings for p in f.proposals]
    assert len(ticking.events("open")) == 1 and ticking.open == {}
    assert "nothing to balance" in ticking.log[-1][3] and proposals == []


def test_a_pools_rank_skew_for_the_advisor_leaves_out_groups_the_router_skews() -> None:
    def group(running_hot: float) -> SignalWindows:
        w = SignalWindows(3600)
        for i in range(40):
            for rank in range(4):
                subject = f"engine/moe/moe-0/{rank}"
                w.add(i * 15.0, subject, "itl_p50", 0.04 if rank == 0 else 0.02)
                w.add(i * 15.0, subject, "requests_running", 10.0 * (running_hot if rank == 0 else 1.0))
        return w

    assert pool_rank_skew(group(1.0), "moe", 0.0) == pytest.approx(2.0), "even work, a slow rank: the experts"
    assert pool_rank_skew(group(3.0), "moe", 0.0) is None, "the slow rank gets three times the work: the router"
    assert pool_rank_skew(group(1.0), "other", 0.0) is None
