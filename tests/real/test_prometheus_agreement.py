"""Our collectors against a real Prometheus scraping the same simulated engines, window by window.

How windows are aligned (see `tests/real/scenario.py` for the run itself): the engines publish a
new state every 2 s; our scraper reads each state once at `s_k`, Prometheus samples every target
every second. Each of our windows (s_{k-1}, s_k] is compared with Prometheus at evaluation time
`s_k`, over a range equal to our interval `s_k - s_{k-1}`, on the same pair of states:
Prometheus' latest sample at or before `s_k` holds exactly the state our scrape read (checked).

Two exact PromQL views, both asserted within 1 % (relative):

* **Sample-aligned `increase()`** (Prometheus' own counter-reset handling): each target is
  evaluated with an `@` modifier at its own sample time `p(k)` (the latest sample at or before
  `s_k`) with a range of exactly `p(k) - p(k-1)` in milliseconds. The window then starts and
  ends on a sample, so `increase()` extrapolates nothing (Prometheus 2.x ranges include both
  ends). Per-target terms are joined with `or` so pools aggregate as `sum by (pool, le)`.
  Rates are these increases divided by our interval.
* **Two-point delta at our scrape time**: `x - x offset W` evaluated at `s_k`, with a decrease
  taken as a restart from zero (`... >= 0 or (x and ... < 0)`), exactly as our collector diffs
  two scrapes; rates divide by our interval. This is what `collectors.prometheus_api` issues
  in `delta` mode.

Compared per engine and per pool: prefix-cache hit rate, request rate, prompt-token rate, and
TTFT p50/p95 as `histogram_quantile(q, sum by (le) (...))`. One engine restarts mid-run; the
restart window is compared like every other, and Prometheus must have counted the reset.

Also reported, not asserted, how far Prometheus' `rate()` itself is from our rates: on the
sample-aligned windows (it divides by its own sample interval, so only scrape-timestamp jitter
shows), and evaluated at our scrape time over one and over five of our intervals, where the
window edges fall between samples and `rate()` extrapolates to them. On the simulator's 2-second
staircase that last error is large by construction (a 2 s window holds one or two samples).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable

import pytest

from collectors.types import pool_subject
from tests.real.scenario import TOLERANCE, Run, rel_diff

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

QUANTILES = (("ttft_p50", 0.5), ("ttft_p95", 0.95))
TTFT = "vllm:time_to_first_token_seconds_bucket"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
REQUESTS, PROMPT = "vllm:request_success_total", "vllm:prompt_tokens_total"

Values = dict[tuple[int, str, str], float]  # (window, subject, signal) -> value


def _samples(run: Run) -> dict[str, list[tuple[float, float]]]:
    """Raw (timestamp, value) samples of the prompt-token counter per instance, over the whole run."""
    end = run.scrape_ts[-1] + 1.0
    span = math.ceil(end - run.scrape_ts[0] + 10.0)
    out = {}
    for series in run.prometheus.query(f"{PROMPT}[{span}s]", end):
        out[series["metric"]["instance"]] = [(float(t), float(v)) for t, v in series["values"]]
    return out


def _latest(samples: list[tuple[float, float]], at: float) -> tuple[float, float]:
    return max((s for s in samples if s[0] <= at + 1e-9), key=lambda s: s[0])


def _aligned_stamps(run: Run) -> dict[tuple[int, str], float]:
    """(window, instance) -> the Prometheus sample time holding the state our scrape k read."""
    samples = _samples(run)
    return {
        (k, instance): _latest(series, ts)[0]
        for k, ts in enumerate(run.scrape_ts)
        for instance, series in samples.items()
    }


def _collect(run: Run, rows: list[dict], k: int, subject_of: Callable[[dict[str, str]], str], name: str, out: Values) -> None:
    for row in rows:
        value = float(row["value"][1])
        if math.isfinite(value):
            out[(k, subject_of(row["metric"]), name)] = value


Increase = Callable[[str], str]  # metric -> PromQL of its per-series increase over one window


def _queries(by: str, inc: Increase, seconds: float) -> dict[str, str]:
    return {
        "prefix_cache_hit_rate": f"sum by ({by}) ({inc(HITS)}) / (sum by ({by}) ({inc(QUERIES)}) > 0)",
        "request_rate": f"sum by ({by}) ({inc(REQUESTS)}) / {seconds!r}",
        "prompt_tokens_rate": f"sum by ({by}) ({inc(PROMPT)}) / {seconds!r}",
        **{name: f"histogram_quantile({q}, sum by ({by}, le) ({inc(TTFT)}))" for name, q in QUANTILES},
    }


def _evaluate(run: Run, k: int, at: float, inc: Increase, seconds: float, out: Values) -> None:
    groups = (("instance", lambda m: run.subject(m["instance"])), ("pool", lambda m: pool_subject(m["pool"])))
    for by, subject_of in groups:
        for name, expr in _queries(by, inc, seconds).items():
            _collect(run, run.prometheus.query(expr, at), k, subject_of, name, out)


def _aligned(run: Run, stamps: dict[tuple[int, str], float], k: int, metric: str, fn: str = "increase") -> str:
    """`fn` of every target over its own window from sample p(k-1) to sample p(k), joined with `or`."""
    terms = []
    for instance in run.by_instance:
        end, start = stamps[(k, instance)], stamps[(k - 1, instance)]
        terms.append(f'{fn}({metric}{{instance="{instance}"}}[{round((end - start) * 1000)}ms] @ {end:.3f})')
    return " or ".join(terms)


def sample_aligned(run: Run) -> Values:
    """Prometheus' increase() with every target's window starting and ending on its samples."""
    stamps = _aligned_stamps(run)
    out: Values = {}
    for w in run.windows:
        _evaluate(run, w.k, w.ts, lambda metric, k=w.k: _aligned(run, stamps, k, metric), w.seconds, out)
    return out


def two_point(run: Run) -> Values:
    """`x - x offset W` at our scrape time, a decrease counted as a restart from zero."""
    out: Values = {}
    for w in run.windows:
        ms = round(w.seconds * 1000)

        def delta(metric: str, ms: int = ms) -> str:
            d = f"({metric} - {metric} offset {ms}ms)"
            return f"(({d} >= 0) or ({metric} and ({d} < 0)))"

        _evaluate(run, w.k, w.ts, delta, w.seconds, out)
    return out


def _ours(run: Run, names: set[str]) -> Values:
    windows = {w.k for w in run.windows}
    return {key: v for key, v in run.ours.items() if key[0] in windows and key[2] in names and not key[1].startswith("pod/")}


def _compare(run: Run, theirs: Values) -> dict[str, tuple[float, int]]:
    """Per signal: (max relative difference, number of values compared); asserts both sides agree on presence."""
    ours = _ours(run, {name for _, _, name in theirs})
    assert set(theirs) == set(ours), (
        f"only Prometheus: {sorted(set(theirs) - set(ours))[:5]}, only ours: {sorted(set(ours) - set(theirs))[:5]}"
    )
    worst: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for key, value in ours.items():
        worst[key[2]] = max(worst[key[2]], rel_diff(value, theirs[key]))
        counts[key[2]] += 1
    return {name: (worst[name], counts[name]) for name in sorted(worst)}


def _report(title: str, figures: dict[str, tuple[float, int]]) -> None:
    print(f"\n{title}")
    for name, (worst, n) in figures.items():
        print(f"  {name:<24} max rel diff {worst:.2e} over {n} values")


def test_prometheus_sampled_the_states_our_scrapes_read(prometheus_run: Run) -> None:
    run = prometheus_run
    samples = _samples(run)
    assert set(samples) == set(run.by_instance)
    for w in run.windows:
        for instance, series in samples.items():
            _, value = _latest(series, w.ts)
            assert value == run.read[(w.k, instance)], (w.k, instance, run.sync_lag_s)
    print(f"\nour scrape instants are {run.phase_margin_s * 1000:.0f} ms from the nearest Prometheus scrape;"
          f" swaps completed at most {max(run.sync_lag_s) * 1000:.0f} ms late")


def test_sample_aligned_increase_agrees_with_our_collectors(prometheus_run: Run) -> None:
    figures = _compare(prometheus_run, sample_aligned(prometheus_run))
    _report("sample-aligned increase() vs ours", figures)
    assert set(figures) == {"prefix_cache_hit_rate", "request_rate", "prompt_tokens_rate", "ttft_p50", "ttft_p95"}
    assert all(worst <= TOLERANCE for worst, _ in figures.values()), figures


def test_two_point_delta_agrees_with_our_collectors(prometheus_run: Run) -> None:
    figures = _compare(prometheus_run, two_point(prometheus_run))
    _report("two-point delta (x - x offset W) vs ours", figures)
    assert all(worst <= TOLERANCE for worst, _ in figures.values()), figures


def test_restart_is_a_counter_reset_on_both_sides(prometheus_run: Run) -> None:
    run = prometheus_run
    [w] = [w for w in run.windows if w.restart]
    stamps = _aligned_stamps(run)
    end, start = stamps[(w.k, run.restarted)], stamps[(w.k - 1, run.restarted)]
    window = f'[{round((end - start) * 1000)}ms] @ {end:.3f}'
    [resets] = run.prometheus.query(f'resets({PROMPT}{{instance="{run.restarted}"}}{window})', w.ts)
    assert float(resets["value"][1]) == 1.0
    # After a restart the increase is the new value itself, on both sides.
    expected = run.read[(w.k, run.restarted)]
    assert run.read[(w.k - 1, run.restarted)] > expected
    ours = run.ours[(w.k, run.subject(run.restarted), "prompt_tokens_rate")]
    assert ours == pytest.approx(expected / w.seconds, rel=1e-12)
    [theirs] = run.prometheus.query(f'increase({PROMPT}{{instance="{run.restarted}"}}{window})', w.ts)
    assert float(theirs["value"][1]) == pytest.approx(expected, rel=1e-12)


def test_report_how_far_rate_itself_is(prometheus_run: Run) -> None:
    """Prometheus' rate() against our rates: sample-aligned, then at our scrape time over one and five intervals."""
    run = prometheus_run
    lines = []
    stamps = _aligned_stamps(run)
    aligned: dict[str, list[float]] = defaultdict(list)
    for w in run.windows:
        for metric, name in ((REQUESTS, "request_rate"), (PROMPT, "prompt_tokens_rate")):
            expr = f"sum by (instance) ({_aligned(run, stamps, w.k, metric, 'rate')})"
            for row in run.prometheus.query(expr, w.ts):
                ours = run.ours[(w.k, run.subject(row["metric"]["instance"]), name)]
                aligned[name].append(rel_diff(ours, float(row["value"][1])))
    for name, values in sorted(aligned.items()):
        lines.append(f"  rate() sample-aligned        {name:<20} median {statistics.median(values):.2%}"
                     f"  max {max(values):.2%}  over {len(values)} values")
    for span in (1, 5):
        diffs: dict[str, list[float]] = defaultdict(list)
        for w in run.windows[span - 1:]:
            ks = range(w.k - span + 1, w.k + 1)
            ms = round(w.seconds * span * 1000)
            for metric, name in ((REQUESTS, "request_rate"), (PROMPT, "prompt_tokens_rate")):
                for row in run.prometheus.query(f"sum by (instance) (rate({metric}[{ms}ms]))", w.ts):
                    instance = row["metric"]["instance"]
                    if instance == run.restarted and run.restart_k in ks:
                        continue  # our mean over a restart is not a rate of one counter run
                    subject = run.subject(instance)
                    ours = statistics.fmean(run.ours[(k, subject, name)] for k in ks)
                    diffs[name].append(rel_diff(ours, float(row["value"][1])))
        for name, values in sorted(diffs.items()):
            lines.append(f"  rate()[{span} x our interval] {name:<20} median {statistics.median(values):.2%}"
                         f"  max {max(values):.2%}  over {len(values)} values")
            assert all(math.isfinite(v) for v in values)
    print("\nPrometheus' own rate() vs ours (reported, not asserted):\n" + "\n".join(lines))
