"""The canary gate's Prometheus source against a real Prometheus, on the run the collectors' agreement
tests share: one decode engine as the canary, the others as the baseline, over the whole run.

`increase()` extrapolates a histogram's `_sum` and `_count` by the same factor (they are scraped
together), so each arm's mean, the statistic the gate judges, must match what our collectors
derived from the same engines' expositions (their per-window means weighted by their requests).
Prometheus scrapes at its own instants, up to a couple of seconds from ours, so the requests at the
edges of the run differ: the means agree within 4 % and the request counts within 10 %, which a
wrong arm (one pod against two) misses by far. The buckets come back cumulative with `+Inf` last,
and the same versions do not fail.
"""

from __future__ import annotations

import math

import pytest

from collectors.prometheus_api import PrometheusSource
from controlplane.gate import ArmSelector, PromGateSource
from policies.canary import GateSettings, MetricRule, Outcome, judge
from tests.real.scenario import Run, rel_diff

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]


def _ours(run: Run, pods: list[str], signal: str) -> tuple[float, float]:
    """Our collectors' mean of `signal` over the run for these decode pods, weighted by requests, and the requests."""
    total = weight = 0.0
    for w in run.windows:
        for pod in pods:
            subject = f"engine/decode/{pod}/0"
            mean, rate = run.ours.get((w.k, subject, signal)), run.ours.get((w.k, subject, "request_rate"))
            if mean is not None and rate:
                total += mean * rate * w.seconds
                weight += rate * w.seconds
    return total / weight, weight


async def test_the_prometheus_source_reads_each_arm_as_our_collectors_do(prometheus_run: Run) -> None:
    run = prometheus_run
    decode = sorted(t.pod for t in run.targets if t.pool == "decode")
    canary, baseline = decode[:1], decode[1:]
    rules = (MetricRule(name="e2e", critical=True), MetricRule(name="ttft"), MetricRule(name="error_rate",
                                                                                         allowed=0.01))
    prom = PrometheusSource(run.prometheus.url, timeout=5.0)
    try:
        source = PromGateSource(prom, ArmSelector.parse(f"pool=decode,pod in ({','.join(baseline)})"),
                                ArmSelector.parse(f"pool=decode,pod={canary[0]}"), rules)
        start, end = run.windows[0].ts - run.windows[0].seconds, run.windows[-1].ts
        whole = await source.interval(start, end)
        steps = [await source.interval(w.ts - w.seconds, w.ts) for w in run.windows]
    finally:
        prom.close()
    for arm, pods in ((whole.canary, canary), (whole.baseline, baseline)):
        e2e = arm["e2e"]
        assert e2e.count > 10 and e2e.buckets[-1][0] == math.inf and e2e.buckets[-1][1] == pytest.approx(e2e.count)
        got = e2e.statistic("mean")
        mean, requests = _ours(run, pods, "e2e_mean")
        assert got is not None
        assert rel_diff(got, mean) < 0.04, (pods, got, mean)
        assert rel_diff(e2e.count, requests) < 0.10, (pods, e2e.count, requests)
        assert arm["error_rate"].statistic("mean") == 0.0
    # The canary's process start, read all along, says it never restarted.
    assert len(source._started) == 1 and all(not step.restarted for step in steps)
    verdict = judge(steps, GateSettings(metrics=rules, min_blocks=3, step=2.0), final=True)
    assert verdict.outcome is not Outcome.FAIL, verdict.reason
