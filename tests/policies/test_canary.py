"""The canary judge: its statistics, its verdicts and their explanations, and the reference judges."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from policies.canary import (
    Direction,
    Dist,
    GateSettings,
    Interval,
    MetricRule,
    Outcome,
    Scale,
    blocks,
    confidence_sequence,
    event_rate_upper,
    judge,
)
from policies.canary_reference import hodges_lehmann, kayenta_judge, threshold_judge

TPOT = MetricRule(name="tpot", critical=True)
ONLY_TPOT = GateSettings(metrics=(TPOT,))


def intervals(shift: float, n: int, *, seed: int = 0, canary_n: int = 25, base_n: int = 475, spread: float = 0.15,
              common: float = 0.1) -> list[Interval]:
    """Per-request TPOTs of both arms; the load moves both arms together, the canary is `shift` slower."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        load = rng.lognormal(0.0, common)
        b = rng.lognormal(math.log(0.004 * load), spread, base_n)
        c = rng.lognormal(math.log(0.004 * load * (1 + shift)), spread, canary_n)
        out.append(Interval(30.0 * i, 30.0 * (i + 1), {"tpot": Dist.of_samples(b)}, {"tpot": Dist.of_samples(c)}))
    return out


def first_decision(ivs: list[Interval], s: GateSettings = ONLY_TPOT) -> tuple[Outcome, int]:
    for k in range(1, len(ivs) + 1):
        v = judge(ivs[:k], s, final=k == len(ivs))
        if v.decided:
            return v.outcome, k
    raise AssertionError("the final consultation always decides")


# the data types ------------------------------------------------------------------------------------


def test_dist_mean_is_exact_and_buckets_merge_as_sum_by_le() -> None:
    a = Dist(4.0, 2.0, ((0.1, 1.0), (1.0, 3.0), (math.inf, 4.0)))
    b = Dist(6.0, 9.0, ((0.1, 0.0), (1.0, 2.0), (math.inf, 6.0)))
    m = a.merge(b)
    assert m.count == 10 and m.total == 11 and m.statistic("mean") == pytest.approx(1.1)
    assert m.buckets == ((0.1, 1.0), (1.0, 5.0), (math.inf, 10.0))
    # median: rank 5 of 10 lies at the top of the (0.1, 1.0] bucket
    assert m.statistic("p50") == pytest.approx(1.0)
    # a rank in +Inf is not known: PromQL's highest finite bound would read a tail past it as no slower
    assert m.statistic("p99") is None
    # different bucket layouts cannot be merged: the mean survives, quantiles are gone
    c = Dist(1.0, 1.0, ((0.5, 1.0), (math.inf, 1.0)))
    assert a.merge(c).buckets == () and a.merge(c).statistic("p50") is None and a.merge(c).statistic("mean") == 0.6


def test_dist_of_samples_and_events() -> None:
    d = Dist.of_samples([1.0, 2.0, 3.0, 4.0])
    assert d.statistic("mean") == 2.5 and d.statistic("p50") == pytest.approx(2.5)
    assert Dist.of_events(3, 200).statistic("mean") == pytest.approx(0.015)
    assert Dist(0.0).statistic("mean") is None
    with pytest.raises(ValueError, match="statistic 'p100'"):
        d.statistic("p100")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 50.0), min_size=2, max_size=12, unique=True),
       st.lists(st.integers(0, 30), min_size=13, max_size=13), st.floats(0.01, 0.99))
def test_bucket_quantile_lies_in_the_bucket_holding_its_rank(bounds: list[float], counts: list[int], q: float) -> None:
    les = sorted(bounds)
    per = counts[: len(les) + 1]
    cum, running = [], 0.0
    for le, c in zip([*les, math.inf], per, strict=True):
        running += c
        cum.append((le, running))
    d = Dist(running, 0.0, tuple(cum))
    v = d.statistic(f"p{max(1, min(99, round(q * 100)))}")
    rank = max(1, min(99, round(q * 100))) / 100 * running
    holding = next((le for le, c in cum if c >= rank), math.inf)
    if running == 0 or math.isinf(holding):
        assert v is None, "no observations, or a rank past the highest finite bound"
        return
    assert v is not None and 0.0 <= v <= holding + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=30), st.integers(1, 50))
def test_blocks_hold_min_count_in_both_arms_and_lose_only_the_tail(counts: list[tuple[int, int]], min_count: int) -> None:
    ivs = [Interval(i, i + 1, {"x": Dist(float(b), float(b))}, {"x": Dist(float(c), 2.0 * c)})
           for i, (b, c) in enumerate(counts)]
    rule = MetricRule(name="x", min_count=min_count)
    got = blocks(ivs, rule)
    assert all(b.count >= min_count and c.count >= min_count for b, c in got)
    used_b = sum(b.count for b, _ in got)
    assert used_b <= sum(b for b, _ in counts)
    assert all(c.statistic("mean") == 2.0 for _, c in got)


# the confidence sequence ------------------------------------------------------------------------------


def test_confidence_sequence_covers_the_mean_at_every_look() -> None:
    """Anytime-valid: over 400 null sequences looked at after every block, the interval excludes the true
    mean at some look in at most about alpha of them (a fixed-n interval looked at 40 times would not)."""
    rng = np.random.default_rng(3)
    alpha, misses, naive = 0.05, 0, 0
    for _ in range(400):
        x = rng.normal(0.0, 0.05, 40)
        missed = naive_missed = False
        for n in range(3, 41):
            _, lo, hi = confidence_sequence(list(x[:n]), alpha, 10, 0.01)
            missed |= lo > 0 or hi < 0
            half = 1.96 * x[:n].std(ddof=1) / math.sqrt(n)
            naive_missed |= abs(x[:n].mean()) > half
        misses += missed
        naive += naive_missed
    assert misses / 400 <= alpha + 0.02
    assert naive / 400 > 2 * alpha  # peeking at a fixed-n interval: the false alarms the gate avoids


def test_confidence_sequence_narrows_and_floors_a_spread_too_good_to_be_true() -> None:
    wide = confidence_sequence([0.1, 0.12, 0.08, 0.11], 0.01, 10, 0.01)
    narrow = confidence_sequence([0.1, 0.12, 0.08, 0.11] * 10, 0.01, 10, 0.01)
    assert (narrow[2] - narrow[1]) < (wide[2] - wide[1])
    flat = confidence_sequence([0.05] * 6, 0.01, 10, 0.02)
    assert flat[2] - flat[1] > 0.02  # identical blocks still leave the floor's uncertainty


# verdicts --------------------------------------------------------------------------------------------


def test_a_ten_percent_slower_canary_fails_early_with_its_numbers_in_the_reason() -> None:
    outcome, k = first_decision(intervals(0.10, 40))
    assert outcome is Outcome.FAIL and k <= 20
    v = judge(intervals(0.10, 40)[:k], ONLY_TPOT)
    m = v.metrics[0]
    assert m.outcome is Outcome.FAIL and m.lower is not None and m.lower > 1.0 and m.estimate is not None
    assert m.estimate >= 1.05 and m.threshold == pytest.approx(1.05)
    assert "tpot: canary" in m.reason and "allowed +5.0%" in m.reason and "anytime-valid" in m.reason
    assert v.reason.startswith("critical metric failed")


def test_a_canary_whose_pods_restart_fails_at_once_however_its_latency_reads() -> None:
    # A crash loop fails the requests in flight before vLLM counts them, and the pod's counters begin again: the
    # latency it serves between crashes is the baseline's, so only the restarts tell.
    ivs = intervals(0.0, 3)
    ivs[1] = Interval(ivs[1].start, ivs[1].end, ivs[1].baseline, ivs[1].canary, ("decode-canary-0",))
    ivs[2] = Interval(ivs[2].start, ivs[2].end, ivs[2].baseline, ivs[2].canary, ("decode-canary-0", "decode-canary-1"))
    assert not judge(ivs[:1], ONLY_TPOT).decided
    v = judge(ivs, ONLY_TPOT)
    assert v.outcome is Outcome.FAIL and v.decided and v.score == 0.0
    restarts = v.metrics[-1]
    assert restarts.name == "restarts" and restarts.critical and restarts.estimate == 3.0
    assert "decode-canary-0 2 times, decode-canary-1 1 time" in v.reason and "0 allowed" in v.reason
    # Within the allowance a restart is no verdict of its own; past it, the gate fails.
    assert [m.name for m in judge(ivs[:2], ONLY_TPOT.model_copy(update={"restarts_allowed": 1})).metrics] == ["tpot"]
    assert judge(ivs, ONLY_TPOT.model_copy(update={"restarts_allowed": 2})).outcome is Outcome.FAIL
    assert GateSettings.model_validate({"restarts_allowed": 2}).restarts_allowed == 2
    with pytest.raises(ValidationError):
        GateSettings.model_validate({"restarts_allowed": -1})


def test_identical_versions_pass_and_no_look_fails_them() -> None:
    fails = 0
    for seed in range(60):
        outcome, _ = first_decision(intervals(0.0, 40, seed=seed))
        fails += outcome is Outcome.FAIL
    assert fails == 0


def test_too_little_traffic_is_inconclusive_never_pass() -> None:
    ivs = intervals(0.0, 40, canary_n=1)  # one canary request per interval: 20 intervals per block
    v = judge(ivs, ONLY_TPOT, final=True)
    assert v.outcome is Outcome.INCONCLUSIVE and v.decided
    assert "too little traffic" in v.metrics[0].reason and "2 of 6 blocks" in v.metrics[0].reason
    early = judge(ivs[:10], ONLY_TPOT)
    assert early.outcome is Outcome.INCONCLUSIVE and not early.decided


def test_no_canary_data_says_so() -> None:
    ivs = [Interval(i, i + 1, {"tpot": Dist.of_samples([0.01] * 30)}, {}) for i in range(10)]
    v = judge(ivs, ONLY_TPOT, final=True)
    assert v.outcome is Outcome.INCONCLUSIVE and "no data from the canary" in v.metrics[0].reason


def test_a_large_shift_with_a_wide_interval_is_never_a_pass() -> None:
    """Kayenta's known failure (spinnaker#6278): a big shift whose interval is wide passes its tolerance band."""
    rng = np.random.default_rng(1)
    ivs = []
    for i in range(8):
        b = Dist.of_samples([1.0] * 30)
        c = Dist.of_samples(list(rng.choice([1.0, 100.0], 30)) if i % 2 else [1.0] * 30)
        ivs.append(Interval(i, i + 1, {"tpot": b}, {"tpot": c}))
    v = judge(ivs, ONLY_TPOT, final=True)
    assert v.outcome is not Outcome.PASS


def test_a_shift_within_the_allowance_is_marginal_at_worst_and_passes_when_shown_small() -> None:
    small = judge(intervals(0.02, 60, spread=0.02, common=0.02), ONLY_TPOT, final=True)
    assert small.outcome in (Outcome.PASS, Outcome.MARGINAL)
    loose = GateSettings(metrics=(MetricRule(name="tpot", critical=True, allowed=0.10),))
    assert judge(intervals(0.02, 60, spread=0.02, common=0.02), loose, final=True).outcome is Outcome.PASS


def test_direction_and_difference_scale() -> None:
    # error ratio up by 5 points against an allowance of 1 point: fail; the same drop: fine for `increase`
    def errors(canary_ratio: float) -> list[Interval]:
        return [Interval(i, i + 1, {"err": Dist.of_events(2, 1000)}, {"err": Dist.of_events(canary_ratio * 100, 100)})
                for i in range(12)]
    rule = MetricRule(name="err", scale=Scale.DIFFERENCE, allowed=0.01, critical=True)
    s = GateSettings(metrics=(rule,))
    assert judge(errors(0.07), s).outcome is Outcome.FAIL
    assert judge(errors(0.0), s).outcome is Outcome.PASS
    # throughput: lower is worse
    down = GateSettings(metrics=(MetricRule(name="tpot", direction=Direction.DECREASE, critical=True),))
    assert first_decision(intervals(-0.15, 40), down)[0] is Outcome.FAIL
    assert first_decision(intervals(0.15, 40), down)[0] is Outcome.PASS


def test_scoring_non_critical_metrics_like_kayenta() -> None:
    rules = (MetricRule(name="tpot", critical=True), MetricRule(name="e2e", allowed=0.02),
             MetricRule(name="ttft"), MetricRule(name="itl"))
    s = GateSettings(metrics=rules)
    base = intervals(0.0, 30, spread=0.02, common=0.02)
    slow = intervals(0.10, 30, spread=0.02, common=0.02, seed=5)
    ivs = [Interval(b.start, b.end, {"tpot": b.baseline["tpot"], "e2e": s_.baseline["tpot"], "ttft": b.baseline["tpot"],
                                     "itl": b.baseline["tpot"]},
                    {"tpot": b.canary["tpot"], "e2e": s_.canary["tpot"], "ttft": b.canary["tpot"], "itl": b.canary["tpot"]})
           for b, s_ in zip(base, slow, strict=True)]
    v = judge(ivs, s, final=True)
    assert [m.outcome for m in v.metrics] == [Outcome.PASS, Outcome.FAIL, Outcome.PASS, Outcome.PASS]
    assert v.score == 75.0 and v.outcome is Outcome.MARGINAL and "e2e" in v.reason


def test_a_metric_without_a_verdict_keeps_the_gate_from_passing() -> None:
    # The canary exports no e2e histogram (a renamed family, say); TPOT is as good as the baseline's.
    s = GateSettings(metrics=(TPOT, MetricRule(name="e2e", allowed=0.10)))
    ivs = [Interval(iv.start, iv.end, {**iv.baseline, "e2e": iv.baseline["tpot"]}, iv.canary)
           for iv in intervals(0.0, 40, spread=0.02, common=0.02)]
    v = judge(ivs, s, final=True)
    assert [m.outcome for m in v.metrics] == [Outcome.PASS, Outcome.INCONCLUSIVE]
    assert v.outcome is Outcome.INCONCLUSIVE and v.decided and "e2e: no data from the canary" in v.reason


def test_an_error_rate_is_judged_by_difference_against_a_baseline_without_errors() -> None:
    rule = MetricRule(name="error_rate", critical=True, allowed=0.01)
    assert rule.scale is Scale.DIFFERENCE
    ivs = [Interval(i, i + 1, {"error_rate": Dist.of_events(0, 1000)}, {"error_rate": Dist.of_events(100, 1000)})
           for i in range(12)]
    assert judge(ivs, GateSettings(metrics=(rule,))).outcome is Outcome.FAIL
    with pytest.raises(ValidationError, match="error_rate by ratio can never fail"):
        MetricRule(name="error_rate", scale=Scale.RATIO)


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ValidationError, match="listed twice"):
        GateSettings(metrics=(TPOT, TPOT))
    with pytest.raises(ValidationError, match="margin 0.1 exceeds allowed 0.05"):
        MetricRule(name="tpot", margin=0.1)
    with pytest.raises(ValidationError, match="statistic 'p95x'"):
        MetricRule(name="tpot", statistic="p95x")
    with pytest.raises(ValidationError, match="at least one metric"):
        GateSettings(metrics=())
    # the HTTP API takes both from whoever asks: a step that does not move time on, a window of months
    with pytest.raises(ValidationError, match="step 1e-07s is under 1s"):
        GateSettings(step="0.0001ms")
    with pytest.raises(ValidationError, match="over a day"):
        GateSettings(max_window="100000d")
    with pytest.raises(ValidationError, match="steps, over 10000"):
        GateSettings(step="1s", max_window="20000s")


# the reference judges ---------------------------------------------------------------------------------


def test_hodges_lehmann_is_the_median_pairwise_shift_with_a_distribution_free_interval() -> None:
    x, y = [3.0, 4.0, 5.0, 6.0, 7.0] * 4, [1.0, 2.0, 3.0, 4.0, 5.0] * 4
    est, lo, hi = hodges_lehmann(x, y, 0.98)
    assert est == 2.0 and lo <= 2.0 <= hi and lo > 0


def test_peeking_at_kayenta_and_argo_every_interval_fails_identical_versions_more_often_than_ours() -> None:
    s = GateSettings(metrics=(MetricRule(name="tpot", critical=True),))
    ours = kay = argo = 0
    for seed in range(40):
        ivs = intervals(0.0, 40, seed=seed, common=0.02)
        ours += first_decision(ivs, s)[0] is Outcome.FAIL
        kay += any(kayenta_judge(ivs[:k], s) is Outcome.FAIL for k in range(2, 41))
        argo += any(threshold_judge(ivs[:k], s) is Outcome.FAIL for k in range(1, 41))
    assert ours == 0 and argo > ours
    assert kay >= ours


def _rare_errors(p_canary: float, runs: int, seed: int) -> list[Outcome]:
    """Gates on error rate alone: a clean baseline of 200 requests a step, a canary of 50 failing at `p_canary`."""
    rule = MetricRule(name="error_rate", scale=Scale.DIFFERENCE, allowed=0.01, critical=True, min_count=50)
    settings, rng, outcomes = GateSettings(metrics=(rule,)), np.random.default_rng(seed), []
    for _ in range(runs):
        steps: list[Interval] = []
        for k in range(60):
            steps.append(Interval(30.0 * k, 30.0 * (k + 1), {"error_rate": Dist.of_events(0, 200)},
                                  {"error_rate": Dist.of_events(int(rng.binomial(50, p_canary)), 50)}))
            verdict = judge(steps, settings, final=k == 59)
            if verdict.decided:
                break
        outcomes.append(verdict.outcome)
    return outcomes


def test_rare_errors_at_the_allowance_do_not_pass() -> None:
    # At 50 requests a block most blocks see no error, so the spread read from the blocks is near 0; a canary failing
    # 1 % of requests (the allowance) passed 30 of 400 such gates before its binomial spread bounded it (now 0).
    assert _rare_errors(0.01, 200, seed=1).count(Outcome.PASS) <= 2  # the gate's alpha, 0.01
    # A clean canary still passes within the window: 0 errors in some 1,500 requests bound its rate under 1 %.
    assert _rare_errors(0.0, 20, seed=2) == [Outcome.PASS] * 20


def test_a_clean_small_canary_passes_its_error_rule_from_its_request_counts() -> None:
    # Alpha as the default four metrics share it. On the blocks alone (their spread floored at the binomial one at the
    # allowance) a canary of 50 requests a step without errors passed after 20.5 minutes, one of 20 a step never.
    rule = MetricRule(name="error_rate", scale=Scale.DIFFERENCE, allowed=0.01, critical=True, min_count=50)
    settings = GateSettings(metrics=(rule,), alpha=0.01 / 4)
    for per_step, minutes in ((50, 9.5), (20, 24.0)):
        steps = [Interval(30.0 * k, 30.0 * (k + 1), {"error_rate": Dist.of_events(0, 200)},
                          {"error_rate": Dist.of_events(0, per_step)}) for k in range(int(minutes * 2))]
        assert judge(steps, settings).outcome is Outcome.PASS
        assert judge(steps[:-1], settings).outcome is Outcome.INCONCLUSIVE


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 5000), st.sampled_from([1e-4, 0.01, 0.1]), st.sampled_from([1e-3, 0.01, 0.3]))
def test_the_event_rate_bound_tightens_with_trials_and_widens_with_confidence(events: int, trials: int, delta: float,
                                                                              prior: float) -> None:
    events = min(events, trials)
    up = event_rate_upper(events, trials, delta, prior)
    assert events / trials <= up <= 1.0
    assert event_rate_upper(events, trials, delta / 10, prior) >= up - 1e-9
    # Ten times the trials at the same rate seen: the bound comes down towards it.
    assert event_rate_upper(10 * events, 10 * trials, delta, prior) <= up + 1e-9


def test_the_event_rate_bound_takes_counts_that_overshoot_and_none() -> None:
    # Counts read from rates over separately aligned series may hold more errors than requests, or none at all.
    assert event_rate_upper(2.0, 1.0, 0.01, 0.01) == event_rate_upper(float("nan"), 10.0, 0.01, 0.01) == 1.0
    assert event_rate_upper(0.0, 0.0, 0.01, 0.01) == 1.0
    assert event_rate_upper(-1.0, 1000.0, 0.01, 0.01) == event_rate_upper(0.0, 1000.0, 0.01, 0.01) < 0.02


def test_the_event_rate_bound_holds_however_often_it_is_read() -> None:
    # Read every 100 requests up to 3,000: the share of sequences whose bound ever falls below the true rate stays
    # under delta (measured 0.039 at 0.05 for a rate of 1 %).
    rng = np.random.default_rng(3)
    delta, runs = 0.1, 300
    for p in (0.01, 0.05):
        seen = [np.cumsum(rng.random(3000) < p) for _ in range(runs)]
        below = sum(any(event_rate_upper(s[n - 1], n, delta, 0.01) < p for n in range(100, 3001, 100)) for s in seen)
        assert below <= delta * runs, (p, below)


def _tail(past: float, seed: int, n: int = 1000) -> Dist:
    """A TTFT histogram whose buckets end at 10 s: `n` requests under 1 s but `past` of them beyond 10 s (a p99 block
    holds 1,000 of each arm's)."""
    rng = np.random.default_rng(seed)
    n_past = int(rng.binomial(n, past))
    fast = n - n_past
    return Dist(float(n), 0.3 * fast + 30.0 * n_past, ((0.5, fast * 0.6), (1.0, float(fast)), (10.0, float(fast)),
                                                       (math.inf, float(n))))


def test_a_tail_past_the_highest_bound_can_fail_and_never_pass() -> None:
    rule = MetricRule(name="ttft", statistic="p99", critical=True)
    settings = GateSettings(metrics=(rule,))
    steps = [Interval(30.0 * k, 30.0 * (k + 1), {"ttft": _tail(0.0, k)}, {"ttft": _tail(0.05, 100 + k)})
             for k in range(20)]
    verdict = judge(steps, settings)
    # The canary's p99 is at least 10 s against a baseline's under 1 s: a regression, though the bound hides its size.
    assert verdict.outcome is Outcome.FAIL and "only a lower bound" in verdict.metrics[0].reason
    # The other way round, the baseline's tail past the bound: the canary is better by at least what is shown, so it
    # may pass, and is never failed on it.
    flipped = [Interval(s.start, s.end, s.canary, s.baseline) for s in steps]
    assert judge(flipped, settings).outcome is Outcome.PASS
    # A canary as slow past the bound as its baseline: nothing to compare, never a pass.
    both = [Interval(s.start, s.end, s.canary, s.canary) for s in steps]
    assert judge(both, settings, final=True).outcome is Outcome.INCONCLUSIVE


@pytest.mark.parametrize(("base_bounds", "can_bounds", "base_s", "can_s"), [
    # An identical canary exported with coarser buckets read 0.595 s against 4.775 s: failed at once.
    ((0.1, 0.25, 0.5, 0.6, 0.75, 1.0, 2.5, 5.0, 10.0), (0.5, 5.0, 10.0), 0.55, 0.55),
    # A canary 27 % slower with finer buckets read 84 % faster: passed.
    ((0.5, 5.0, 10.0), (0.1, 0.25, 0.5, 0.6, 0.75, 1.0, 2.5, 5.0, 10.0), 0.55, 0.70),
])
def test_a_quantile_is_never_compared_across_two_bucket_layouts(base_bounds: tuple[float, ...],
                                                               can_bounds: tuple[float, ...], base_s: float,
                                                               can_s: float) -> None:
    def hist(value: float, bounds: tuple[float, ...]) -> Dist:
        return Dist(100.0, 100 * value, tuple((le, 100.0 * (value <= le)) for le in bounds) + ((math.inf, 100.0),))

    rule = MetricRule(name="ttft", statistic="p95", critical=True)
    intervals = [Interval(i * 30.0, (i + 1) * 30.0, {"ttft": hist(base_s, base_bounds)}, {"ttft": hist(can_s, can_bounds)})
                 for i in range(12)]
    verdict = judge(intervals, GateSettings(metrics=(rule,)))
    [metric] = verdict.metrics
    assert metric.outcome is Outcome.INCONCLUSIVE and "different bucket bounds" in metric.reason
    assert verdict.outcome is Outcome.INCONCLUSIVE


def _lognormal_gate(rng: np.random.Generator, slow: float, canary_n: int, base_n: int = 2000) -> Any:
    """A p99 rule over 60 intervals of 30 s, TTFT lognormal around 0.3 s in vLLM's buckets, the canary `slow` times."""
    bounds = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)
    rules = GateSettings(metrics=(MetricRule(name="ttft", statistic="p99", critical=True),), max_window=1800)

    def dist(x: np.ndarray) -> Dist:
        return Dist(len(x), float(x.sum()), tuple((le, float((x <= le).sum())) for le in bounds))

    intervals: list[Interval] = []
    for i in range(60):
        b = rng.lognormal(math.log(0.3), 0.6, base_n)
        c = rng.lognormal(math.log(0.3), 0.6, canary_n) * slow
        intervals.append(Interval(30.0 * i, 30.0 * i + 30, {"ttft": dist(b)}, {"ttft": dist(c)}))
        v = judge(intervals, rules, final=i == 59)
        if v.decided:
            break
    return v


def test_a_quantile_is_read_from_blocks_of_enough_observations_whatever_the_canarys_share() -> None:
    """Blocks closed at twenty canary observations, whose p99 is about their largest, their p95: against the
    baseline's p99 of thousands, an identical canary read 0.62 times the baseline, and one 20 % slower passed 10 of
    30 gates."""
    assert MetricRule(name="ttft", statistic="p99").block_count == 1000
    assert MetricRule(name="ttft", statistic="p95").block_count == 200
    assert MetricRule(name="ttft").block_count == 20
    rng = np.random.default_rng(7)
    assert all(_lognormal_gate(rng, 1.2, 20).outcome is not Outcome.PASS for _ in range(10))
    assert all(_lognormal_gate(rng, 1.2, 400).outcome is Outcome.FAIL for _ in range(3))
    same = _lognormal_gate(rng, 1.0, 400)
    assert same.outcome is not Outcome.FAIL and abs((same.metrics[0].estimate or 0.0) - 1.0) < 0.05
