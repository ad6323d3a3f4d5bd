"""Saturation: queue growth, KV exhaustion with preemptions, errors under load, and hysteresis."""

from __future__ import annotations

import random

import pytest

from policies.saturation import Saturation, slope
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState
from policies.windows import SignalWindows
from tests.policies.ticking import Ticking

POOL = "pool/decode"
KEY = FindingKey("saturation", POOL)
STEP = 15.0
ENGINES = 3


class Pool:
    def __init__(self, seed: int = 2) -> None:
        self.w = SignalWindows(horizon_s=3 * 3600)
        self.ts = 0.0
        self.rng = random.Random(seed)

    def tick(self, n: int = 1, *, waiting: float | None = None, grow: float = 0.0, kv: float = 0.6,
             preempt: float = 0.0, errors: float = 0.0, rate: float = 20.0, capacity: float | None = None) -> Pool:
        for _ in range(n):
            self.ts += STEP
            if waiting is None:  # a healthy queue: a few requests come and go
                q = float(sum(1 for _ in range(ENGINES * 4) if self.rng.random() < 0.25))
            else:
                waiting += grow
                q = waiting
            self.w.add(self.ts, POOL, "requests_waiting", q)
            if capacity is not None:
                self.w.add(self.ts, POOL, "requests_waiting_capacity", capacity)
            self.w.add(self.ts, POOL, "engines_reporting", float(ENGINES))
            self.w.add(self.ts, POOL, "kv_cache_usage", min(1.0, kv + self.rng.gauss(0, 0.02)))
            self.w.add(self.ts, POOL, "preemption_rate", preempt)
            self.w.add(self.ts, POOL, "request_rate", rate)
            self.w.add(self.ts, POOL, "request_error_rate", errors)
        return self

    def run(self, open_findings: dict | None = None, desired: int = ENGINES):
        pools = {"decode": PoolState("decode", "decode", desired, ENGINES, 1, 6)}
        return Saturation().evaluate(PolicyInput(self.ts, self.w, pools, open_findings or {}))


def test_slope_of_a_line_and_of_a_step() -> None:
    assert slope([(0.0, 1.0), (10.0, 3.0), (20.0, 5.0)]) == pytest.approx(0.2)
    assert slope([(0.0, 1.0)]) == 0.0
    step = [(float(t), 0.0) for t in range(17)] + [(17.0, 9.0), (18.0, 9.0), (19.0, 9.0)]
    assert slope(step) == 0.0, "one jump is not a trend"


def test_a_queue_that_jumped_once_and_holds_does_not_open() -> None:
    assert not Pool().tick(40).tick(3, waiting=12.0).run().findings


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_noisy_pool_is_quiet(seed: int) -> None:
    pool = Pool(seed).tick(40)
    for _ in range(200):
        assert not pool.tick().run().findings


def test_a_growing_queue_opens_and_proposes_scaling() -> None:
    pool = Pool().tick(40)
    # +1.5 requests per interval across the pool: +10 per engine over five minutes.
    pool.tick(12, waiting=3.0, grow=1.5)
    [f] = pool.run().findings
    assert f.key == KEY and f.runbook == "saturation" and f.evidence["cause"] == "queue_growth"
    ev = f.evidence
    assert ev["statistic"] >= ev["threshold"] == 2.0 and ev["waiting_per_engine"] >= 2.0
    assert ev["signal"] == "requests_waiting" and ev["engines"] == ENGINES
    assert f.proposals == () and ev["short_pools"] == ["decode"], "capacity is the autoscaler's to add"


def test_a_growing_queue_does_not_open_while_replicas_are_being_added() -> None:
    pool = Pool().tick(40).tick(12, waiting=3.0, grow=1.5)
    assert not pool.run(desired=ENGINES + 1).findings
    [f] = pool.tick(kv=0.97, preempt=0.5, n=3).run(desired=ENGINES + 1).findings
    assert f.evidence["causes"] == ["kv_exhausted"] and f.evidence["scaling_up"]


def test_a_long_but_flat_queue_does_not_open() -> None:
    assert not Pool().tick(40, waiting=30.0).run().findings


def test_a_short_growing_queue_does_not_open() -> None:
    # Growth from 0 to 4 over the window: 1.3 per engine, below both thresholds.
    assert not Pool().tick(40).tick(20, waiting=0.0, grow=0.2).run().findings


def test_kv_full_with_preemptions_opens_but_kv_full_alone_does_not() -> None:
    assert not Pool().tick(40).tick(5, kv=0.97).run().findings
    pool = Pool().tick(40).tick(2, kv=0.97, preempt=0.5)
    assert not pool.run().findings, "two intervals are not enough"
    [f] = pool.tick(kv=0.97, preempt=0.5).run().findings
    assert f.evidence["cause"] == "kv_exhausted" and f.evidence["threshold"] == 0.9
    assert f.evidence["short_pools"] == ["decode"] and f.evidence["signal"] == "kv_cache_usage"


def test_a_kv_cache_full_every_other_interval_keeps_its_finding_open_not_flapping() -> None:
    pool = Pool().tick(40)
    opened: dict = {}
    states = []
    for i in range(20):  # 0.94 and 0.85 in turn, preempting all along
        pool.tick(kv=0.94 if i % 2 == 0 else 0.85, preempt=0.5)
        result = pool.run(opened)
        for f in result.findings:
            opened[f.key] = OpenFinding(f.key, pool.ts, dict(f.evidence))
        for key, _ in result.resolved:
            opened.pop(key, None)
        states.append((bool(result.findings), bool(result.resolved)))
    first = next(i for i, (found, _) in enumerate(states) if found)
    assert not any(resolved for _, resolved in states[first:]), "open until the cache stays clear"


def test_a_capacity_queue_that_stopped_reporting_is_not_read_for_now() -> None:
    # The engines were rolled to a vLLM without the by-reason gauge: its last value (a long queue) is not now's.
    pool = Pool().tick(40, capacity=0.0)
    for i in range(12):  # the capacity queue grows, then the gauge is gone
        pool.tick(waiting=0.0, capacity=3.0 + 1.5 * i)
    assert not pool.tick(8, waiting=0.0).run().findings


def test_errors_count_only_under_load() -> None:
    assert not Pool().tick(40).tick(5, errors=2.0).run().findings, "errors on a quiet pool are not saturation"
    [f] = Pool().tick(40, waiting=9.0).tick(5, errors=2.0, waiting=9.0).run().findings
    assert f.evidence["causes"] == ["errors_under_load"] and f.severity == "critical"
    assert f.evidence["error_share"] == pytest.approx(0.1)
    assert f.evidence["short_pools"] == ["decode"] and f.evidence["signal"] == "request_error_rate"


def test_two_signs_at_once_are_critical() -> None:
    [f] = Pool().tick(40).tick(12, waiting=3.0, grow=1.5, kv=0.97, preempt=0.5).run().findings
    assert f.evidence["causes"] == ["queue_growth", "kv_exhausted"] and f.severity == "critical"


def test_requests_deferred_for_kv_transfers_are_not_a_capacity_queue() -> None:
    pool = Pool().tick(40, capacity=0.0).tick(12, waiting=3.0, grow=1.5, capacity=0.0)
    assert not pool.run().findings


def test_open_finding_stays_while_the_queue_is_long_and_resolves_after_clean_points() -> None:
    pool = Pool().tick(40).tick(12, waiting=3.0, grow=1.5)
    [f] = pool.run().findings
    opening = {KEY: OpenFinding(KEY, pool.ts, f.evidence)}
    # The queue stops growing but stays long: still saturated.
    pool.tick(20, waiting=21.0)
    [f] = pool.run(opening).findings
    assert f.evidence["causes"] == ["queue_growth"] and f.evidence["short_pools"] == ["decode"]
    pool.tick(3, waiting=1.0)
    result = pool.run(opening)
    assert not result.resolved and result.findings[0].evidence["short_pools"] == []
    pool.tick(waiting=1.0)
    assert pool.run(opening).resolved == [(KEY, "queue, KV cache and errors back to normal")]


def test_a_lull_between_bursts_does_not_resolve_but_ten_idle_minutes_do() -> None:
    """Bursty traffic (the Azure code trace pauses for minutes) empties the queue without fixing anything."""
    pool = Pool().tick(40).tick(12, waiting=3.0, grow=1.5)
    [f] = pool.run().findings
    opening = {KEY: OpenFinding(KEY, pool.ts, f.evidence)}
    pool.tick(10, waiting=0.0, rate=0.0)
    result = pool.run(opening)
    assert not result.resolved and result.findings
    pool.tick(30, waiting=0.0, rate=0.0)
    assert pool.run(opening).resolved == [(KEY, "no requests for 40 intervals: nothing left to saturate")]


def test_a_pool_that_stops_reporting_resolves() -> None:
    pool = Pool().tick(40).tick(12, waiting=3.0, grow=1.5)
    [f] = pool.run().findings
    pool.ts += 1000.0
    result = pool.run({KEY: OpenFinding(KEY, 0.0, f.evidence)})
    assert result.findings == [] and [k for k, _ in result.resolved] == [KEY]


def test_preemptions_come_singly_and_still_count_with_a_full_cache() -> None:
    pool = Pool().tick(40).tick(2, kv=0.95).tick(kv=0.95, preempt=0.07).tick(3, kv=0.95)
    [f] = pool.run().findings
    assert f.evidence["causes"] == ["kv_exhausted"]


@pytest.mark.parametrize("seed", range(3))
def test_a_busy_fluctuating_queue_without_a_trend_does_not_open(seed: int) -> None:
    # 0 to 8 requests per engine at random: long at times, never growing for long.
    rng = random.Random(seed)
    pool = Pool(seed)
    for i in range(240):
        pool.tick(waiting=float(rng.randint(0, 8 * ENGINES)))
        assert i < 40 or not pool.run().findings


def test_a_noisy_ramp_is_still_a_trend() -> None:
    rng = random.Random(4)
    pool = Pool().tick(40)
    opened = None
    for i in range(30):
        pool.tick(waiting=max(0.0, 3 + 1.5 * i + rng.randint(-5, 5)))
        if pool.run().findings:
            opened = i + 1
            break
    assert opened is not None and opened <= 15


def test_a_pool_that_always_queues_resolves_back_at_its_own_normal() -> None:
    # A batch pool: 9 requests wait (3 per engine) all day. A burst grows the queue, then it drains
    # back to 9: the finding must resolve, though 3 per engine is above the absolute floor of 2.
    pool = Pool().tick(130, waiting=9.0)
    pool.tick(25, waiting=9.0, grow=2.0)
    [f] = pool.run().findings
    assert f.evidence["normal_waiting_per_engine"] == pytest.approx(3.0)
    opened = {KEY: OpenFinding(KEY, pool.ts, f.evidence)}
    pool.tick(4, waiting=9.0)
    assert [k for k, _ in pool.run(opened).resolved] == [KEY]
    assert not Saturation().evaluate(PolicyInput(pool.ts, pool.w, {}, {KEY: OpenFinding(KEY, pool.ts, {})})).resolved, \
        "without its normal it would never resolve"


def test_a_finding_opened_on_errors_resolves_once_the_pool_goes_idle() -> None:
    w, pool = SignalWindows(3 * 3600), "pool/decode"
    ticking = Ticking(Saturation(), w, {"decode": PoolState("decode", "decode", 3, 3, 1, 6)})
    t = 0.0
    for n, (waiting, rate, errors) in ((40, (1.0, 20.0, 0.0)), (10, (9.0, 20.0, 2.0)), (120, (0.0, 0.0, 0.0))):
        for _ in range(n):
            t += 15.0
            for name, value in (("requests_waiting", waiting), ("engines_reporting", 3.0), ("kv_cache_usage", 0.5),
                                ("preemption_rate", 0.0), ("request_rate", rate), ("request_error_rate", errors)):
                w.add(t, pool, name, value)
            ticking.tick(t)
    assert len(ticking.events("open")) == 1 and len(ticking.events("resolve")) == 1
    assert "no requests for" in ticking.log[-1][3]
