"""Signal arithmetic: counter resets, histogram quantiles as PromQL computes them, ratios.

Property tests check the quantile stays inside the bucket holding the rank and never
decreases with q; example tests pin PromQL's edge cases.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.derive import Histogram, counter_increase, histogram_increase, histogram_quantile, ratio, share_above

INF = math.inf


@pytest.mark.parametrize(
    ("prev", "cur", "expected"),
    [
        pytest.param(None, 10.0, None, id="first-reading"),
        pytest.param(10.0, 15.0, 5.0, id="increase"),
        pytest.param(10.0, 10.0, 0.0, id="flat"),
        pytest.param(100.0, 7.0, 7.0, id="reset-counts-from-zero"),
    ],
)
def test_counter_increase(prev: float | None, cur: float, expected: float | None) -> None:
    assert counter_increase(prev, cur) == expected


def test_histogram_increase_and_reset() -> None:
    before = Histogram(((0.1, 5.0), (1.0, 8.0), (INF, 10.0)), 4.0, 10.0)
    after = Histogram(((0.1, 6.0), (1.0, 12.0), (INF, 15.0)), 6.5, 15.0)
    inc = histogram_increase(before, after)
    assert inc == Histogram(((0.1, 1.0), (1.0, 4.0), (INF, 5.0)), 2.5, 5.0)
    restarted = Histogram(((0.1, 1.0), (1.0, 1.0), (INF, 2.0)), 0.3, 2.0)
    assert histogram_increase(before, restarted) == restarted
    # A bucket line missing from one scrape (dropped as malformed): the others' increases, not the whole history.
    gap = Histogram(((0.1, 6.0), (INF, 15.0)), 6.5, 15.0)
    assert histogram_increase(before, gap) == Histogram(((0.1, 1.0), (INF, 5.0)), 2.5, 5.0)
    assert histogram_increase(gap, Histogram(((0.1, 7.0), (1.0, 14.0), (INF, 17.0)), 7.0, 17.0)) == Histogram(
        ((0.1, 1.0), (INF, 2.0)), 0.5, 2.0)
    # Bounds of which each reading has some the other lacks: another layout, after a restart, even if counts rose.
    relaid = Histogram(((0.5, 20.0), (2.0, 30.0), (INF, 40.0)), 9.0, 40.0)
    assert histogram_increase(before, relaid) == relaid


def test_a_restart_that_counted_more_than_it_lost_is_a_reset() -> None:
    # A quiet canary restarts between scrapes: two slow requests before, three fast ones after. No bucket and not the
    # count fell; read as an increase, its mean would be -9.7 s and its quantiles drawn from 3 of 1 observation.
    before = Histogram(((0.1, 0.0), (1.0, 0.0), (10.0, 2.0), (INF, 2.0)), 10.0, 2.0)
    after = Histogram(((0.1, 3.0), (1.0, 3.0), (10.0, 3.0), (INF, 3.0)), 0.3, 3.0)
    assert histogram_increase(before, after) == after
    # Its sum alone may not tell (the new process's values larger): increases that are no longer cumulative do.
    larger = Histogram(((0.1, 3.0), (1.0, 3.0), (10.0, 3.0), (INF, 3.0)), 10.2, 3.0)
    assert histogram_increase(before, larger) == larger


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        pytest.param(0.5, [(1.0, 0.0), (2.0, 10.0), (INF, 10.0)], 1.5, id="interpolate-in-bucket"),
        pytest.param(0.5, [(1.0, 10.0), (INF, 10.0)], 0.5, id="first-bucket-starts-at-zero"),
        pytest.param(0.99, [(1.0, 5.0), (2.0, 5.0), (INF, 10.0)], 2.0, id="rank-in-inf-returns-highest-bound"),
        pytest.param(0.5, [(1.0, 0.0), (INF, 0.0)], math.nan, id="no-observations"),
        pytest.param(0.5, [(1.0, 3.0)], math.nan, id="no-inf-bucket"),
        pytest.param(1.5, [(1.0, 3.0), (INF, 3.0)], INF, id="q-above-one"),
        pytest.param(-0.1, [(1.0, 3.0), (INF, 3.0)], -INF, id="q-below-zero"),
    ],
)
def test_histogram_quantile_matches_promql(q: float, buckets: list, expected: float) -> None:
    got = histogram_quantile(q, buckets)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


bounds = st.lists(st.floats(0.001, 1000.0), min_size=1, max_size=12, unique=True).map(sorted)


@st.composite
def histograms(draw: st.DrawFn) -> list[tuple[float, float]]:
    les = draw(bounds)
    counts = draw(st.lists(st.integers(0, 1000), min_size=len(les) + 1, max_size=len(les) + 1))
    cumulative, total = [], 0
    for le, c in zip([*les, INF], counts, strict=True):
        total += c
        cumulative.append((le, float(total)))
    return cumulative


@settings(max_examples=300, deadline=None)
@given(histograms(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_quantile_is_monotone_and_within_bounds(buckets: list, q1: float, q2: float) -> None:
    lo, hi = sorted((q1, q2))
    a, b = histogram_quantile(lo, buckets), histogram_quantile(hi, buckets)
    if buckets[-1][1] == 0:
        assert math.isnan(a) and math.isnan(b)
        return
    assert a <= b + 1e-9
    finite = [le for le, _ in buckets if le != INF]
    assert 0.0 <= a <= max(finite) and 0.0 <= b <= max(finite)


@settings(max_examples=200, deadline=None)
@given(histograms(), histograms())
def test_merged_histogram_counts_add(a: list, b: list) -> None:
    ha, hb = Histogram(tuple(a), 1.0, a[-1][1]), Histogram(tuple(b), 2.0, b[-1][1])
    merged = ha + hb
    assert merged.count == ha.count + hb.count
    assert dict(merged.buckets)[INF] == a[-1][1] + b[-1][1]


def test_histograms_with_other_bounds_merge_without_a_dip() -> None:
    # One engine's buckets end at 10 s, another's go on to 40 s: the first's count at 20 s is its count at 10 s (all
    # of its observations are under 1 s), not 0, which would read the pool's p95 as 40 s.
    short = Histogram(((1.0, 100.0), (10.0, 100.0), (INF, 100.0)), 50.0, 100.0)
    long = Histogram(((1.0, 0.0), (10.0, 0.0), (20.0, 100.0), (40.0, 100.0), (INF, 100.0)), 1500.0, 100.0)
    merged = short + long
    assert merged.buckets == ((1.0, 100.0), (10.0, 100.0), (20.0, 200.0), (40.0, 200.0), (INF, 200.0))
    assert histogram_quantile(0.95, merged.buckets) == pytest.approx(19.0)


def test_ratio_guards_empty_denominator() -> None:
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(1.0, 4.0) == 0.25


def test_share_above_an_objective_on_a_bound_is_exact() -> None:
    buckets = [(0.01, 90.0), (0.025, 97.0), (0.05, 100.0), (math.inf, 100.0)]
    assert share_above(0.01, buckets) == pytest.approx(0.10)
    assert share_above(0.025, buckets) == pytest.approx(0.03)
    assert share_above(0.0175, buckets) == pytest.approx(0.065)  # halfway through (0.01, 0.025]: linear
    assert share_above(0.005, buckets) == pytest.approx(0.55)  # the lowest bucket starts at 0
    assert share_above(1.0, [(0.5, 8.0), (math.inf, 10.0)]) == pytest.approx(0.2)  # past the bounds: the +Inf share
    assert math.isnan(share_above(0.01, [(0.01, 0.0), (math.inf, 0.0)]))
    assert math.isnan(share_above(0.01, [(0.01, 3.0)]))  # no +Inf bucket: not a histogram


@settings(max_examples=300, deadline=None)
@given(histograms(), st.floats(0.0, 20.0))
def test_share_above_is_a_share_that_falls_as_the_threshold_rises(buckets: list, threshold: float) -> None:
    if buckets[-1][1] == 0:
        assert math.isnan(share_above(threshold, buckets))
        return
    a, b = share_above(threshold, buckets), share_above(threshold * 1.5 + 0.01, buckets)
    assert 0.0 <= b <= a + 1e-12 <= 1.0 + 1e-12


@settings(max_examples=300, deadline=None)
@given(histograms(), st.floats(0.05, 0.95))
def test_share_above_inverts_the_quantile(buckets: list, q: float) -> None:
    """What `histogram_quantile` reads as the q-quantile has 1 - q of the observations above it, wherever it falls
    strictly inside a bucket of finite bounds."""
    value = histogram_quantile(q, buckets)
    if buckets[-1][1] == 0 or value <= 0 or any(value == le for le, _ in buckets) or value > buckets[-2][0]:
        return
    assert share_above(value, buckets) == pytest.approx(1.0 - q, abs=1e-6)
