"""The static alert rules evaluated over signal windows with Prometheus' alerting semantics.

Covers: every finding kind has rules whose signals the collectors really emit; pending until the
condition held `for`, then firing, resolving as soon as it is false; a missed scrape breaks a
gauge run; range rules weight ratios and divide sums as PromQL's rate ratios do; SLO thresholds
from the pool; rank skew as max over min; the policy's findings and resolutions.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from collectors import dcgm, nixl, vllm
from collectors.derive import Histogram
from collectors.families import Delta
from policies.static_rules import (
    KINDS,
    STATIC_RULES,
    Aggregate,
    Op,
    StaticRule,
    StaticRulePolicy,
    rule_states,
    rules_for,
    static_policies,
)
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState, Severity
from policies.windows import SignalWindows

T0 = 1_767_225_600.0
STEP = 15.0


def rule(alert: str) -> StaticRule:
    return next(r for r in STATIC_RULES if r.alert == alert)


def feed(windows: SignalWindows, subject: str, name: str, values: Iterable[float | None], start: float = T0) -> float:
    """Points every STEP seconds from `start` (None: no point); returns the time of the last one."""
    t = start
    for i, v in enumerate(values):
        t = start + i * STEP
        if v is not None:
            windows.add(t, subject, name, v)
    return t


def at(windows: SignalWindows, now: float, pools: dict[str, PoolState] | None = None,
       open_findings: dict[FindingKey, OpenFinding] | None = None) -> PolicyInput:
    return PolicyInput(now=now, windows=windows, pools=pools or {}, open_findings=open_findings or {})


def hist(count: float, le: float) -> Histogram:
    """`count` observations all in the bucket bounded by `le`."""
    return Histogram(((le / 2, 0.0), (le, count), (float("inf"), count)), sum=count * le * 0.75, count=count)


def emitted_signals() -> set[str]:
    """Signal names the vLLM, NIXL and DCGM collectors derive from a delta with every family the rules use."""
    d = Delta(
        15.0,
        increases={"prompt_tokens": 10, "generation_tokens": 40, "preemptions": 0, "prefix_queries": 100,
                   "prefix_hits": 50, "spec_drafts": 10, "spec_draft_tokens": 30, "spec_accepted": 20,
                   "finished:stop": 9, "finished:error": 1, "nixl_failed_transfers": 0},
        histograms={k: hist(10, 0.5) for k in ("ttft", "itl", "tpot", "nixl_xfer_time", "nixl_bytes")},
        gauges={"kv_cache_usage": [0.5, 0.7], "requests_waiting": [1.0], "requests_running": [3.0]},
    )
    names = {s.name for s in vllm.signals(d, T0, "pool/p")}
    agent = Delta(15.0, increases={"tx_requests": 5, "tx_bytes": 1e6},
                  histograms={"xfer_time": hist(5, 1000.0)})
    names |= {s.name for s in nixl.signals(agent, T0, "nixl/h/a")}
    return names | set(dcgm.SIGNALS) | {"engines_reporting"}  # the last one the pipeline adds per pool


def test_every_kind_has_rules_on_signals_the_collectors_emit() -> None:
    assert {r.kind for r in STATIC_RULES} == set(KINDS)
    known = emitted_signals()
    for r in STATIC_RULES:
        used = {r.signal} | {n for n in (r.weight, r.per) if n}
        assert used <= known, f"{r.alert} uses {used - known}"
        assert r.expr.endswith(f"{r.op} {r.threshold:g}")
        assert r.for_s in (0.0, 300.0)
    assert len({r.alert for r in STATIC_RULES}) == len(STATIC_RULES)
    assert [p.kind for p in static_policies()] == list(KINDS)


def test_pending_until_for_has_passed_then_firing_then_resolved() -> None:
    w = SignalWindows(3 * 3600)
    kv = rule("VLLMKVCacheNearlyFull")
    policy = StaticRulePolicy("saturation", [kv])
    start_high = feed(w, "pool/decode", "kv_cache_usage_max", [0.5] * 10) + STEP
    last = feed(w, "pool/decode", "kv_cache_usage_max", [0.97] * 21, start=start_high)
    pending_end = start_high + kv.for_s - STEP
    [state] = rule_states(kv, at(w, pending_end))
    assert (state.firing, state.active_at, state.value) == (False, start_high, 0.97)
    assert policy.evaluate(at(w, pending_end)).findings == []
    [state] = rule_states(kv, at(w, last))
    assert state.firing and last - state.active_at == kv.for_s
    [finding] = policy.evaluate(at(w, last)).findings
    assert finding.key == FindingKey("saturation", "pool/decode")
    assert finding.severity is Severity.WARNING and finding.runbook == "saturation"
    assert finding.evidence["alerts"][0]["alert"] == "VLLMKVCacheNearlyFull"
    assert finding.evidence["active_since"] == start_high
    # One evaluation below the threshold resolves it, as a Prometheus alert resolves.
    w.add(last + STEP, "pool/decode", "kv_cache_usage_max", 0.9)
    opened = {finding.key: OpenFinding(finding.key, last, finding.evidence)}
    result = policy.evaluate(at(w, last + STEP, open_findings=opened))
    assert result.findings == [] and [k for k, _ in result.resolved] == [finding.key]


def test_a_missed_scrape_breaks_a_gauge_run_and_stale_data_is_no_alert() -> None:
    w = SignalWindows(3 * 3600)
    temp = rule("DCGMGpuTemperatureHigh")
    values: list[float | None] = [90.0] * 30
    values[20] = None  # the exporter missed one scrape
    last = feed(w, "gpu/node-a/0", "gpu_temperature_celsius", values)
    [state] = rule_states(temp, at(w, last))
    assert not state.firing and state.active_at == T0 + 21 * STEP
    assert rule_states(temp, at(w, last + STEP)) == [], "the last scrape did not return it: the series is gone"


def test_for_zero_fires_on_the_first_evaluation() -> None:
    w = SignalWindows(3 * 3600)
    last = feed(w, "gpu/node-a/1", "gpu_xid_last", [79.0])
    [finding] = StaticRulePolicy("gpu_health").evaluate(at(w, last)).findings
    assert finding.severity is Severity.CRITICAL and finding.key.subject == "gpu/node-a/1"
    assert "DCGMXidError" in finding.cause


def test_range_rules_weight_ratios_and_divide_sums_as_rate_ratios_do() -> None:
    w = SignalWindows(3 * 3600)
    hit = rule("VLLMPrefixCacheHitRateLow")
    # Busy intervals miss, quiet ones hit: the unweighted mean (0.5) hides what the rate ratio shows.
    rates = [0.9, 0.1] * 15
    queries = [10.0, 90.0] * 15
    last = feed(w, "pool/p", "prefix_cache_hit_rate", rates)
    feed(w, "pool/p", "prefix_cache_query_rate", queries)
    [state] = rule_states(hit, at(w, last))
    window = range(len(rates) - 20, len(rates))  # the points inside (now - 5m, now]
    expected = sum(rates[i] * queries[i] for i in window) / sum(queries[i] for i in window)
    assert state.value == pytest.approx(expected) and state.value == pytest.approx(0.18)
    assert state.firing and last - state.active_at == hit.for_s

    errors = rule("VLLMRequestErrorRatioHigh")
    w = SignalWindows(3 * 3600)
    states = []
    for i in range(60):
        t = T0 + i * STEP
        w.add(t, "pool/p", "request_error_rate", 0.5 if i >= 30 else 0.0)
        w.add(t, "pool/p", "request_rate", 10.0)
        states.append(rule_states(errors, at(w, t)))
    # 5% of requests fail from point 30 on; the 5-minute ratio passes 1% with the fifth bad point.
    first_pending = next(i for i, s in enumerate(states) if s)
    first_firing = next(i for i, s in enumerate(states) if s and s[0].firing)
    assert (first_pending, first_firing) == (34, 34 + errors.for_s / STEP)
    assert states[-1][0].value == pytest.approx(0.05)


def test_ratio_without_traffic_is_no_value() -> None:
    w = SignalWindows(3 * 3600)
    last = feed(w, "pool/p", "spec_acceptance_rate", [0.1] * 30)
    feed(w, "pool/p", "spec_draft_rate", [0.0] * 30)
    assert rule_states(rule("VLLMSpecDecodeAcceptanceLow"), at(w, last)) == []


def test_slo_rules_take_the_pools_objective() -> None:
    w = SignalWindows(3 * 3600)
    ttft = rule("VLLMTimeToFirstTokenHigh")
    last = feed(w, "pool/prefill", "ttft_p95", [1.5] * 30)
    feed(w, "pool/prefill", "request_rate", [5.0] * 30)
    assert rule_states(ttft, at(w, last)) == [], "1.5 s is under the 2 s default"
    pools = {"prefill": PoolState("prefill", "prefill", 2, 2, 1, 4, ttft_p95_slo=1.0)}
    [state] = rule_states(ttft, at(w, last, pools))
    assert state.firing and state.threshold == 1.0
    assert ttft.render(1.0, '{pool="prefill"}') == (
        'histogram_quantile(0.95, sum by (pool, le) (rate(vllm:time_to_first_token_seconds_bucket{pool="prefill"}[5m]))) > 1'
    )


def test_rank_skew_is_max_over_min_across_a_pools_engines() -> None:
    w = SignalWindows(3 * 3600)
    skew = rule("VLLMExpertParallelRankSkew")
    assert skew.aggregate is Aggregate.MAX_OVER_MIN
    last = feed(w, "engine/decode/d0/0", "itl_mean", [0.03] * 50)
    feed(w, "engine/decode/d0/1", "itl_mean", [0.03] * 5 + [0.06] * 45)
    feed(w, "engine/prefill/p0/0", "itl_mean", [0.09] * 50)  # alone in its pool: no skew to speak of
    for e in ("engine/decode/d0/0", "engine/decode/d0/1", "engine/prefill/p0/0"):
        feed(w, e, "generation_tokens_rate", [100.0] * 50)
    [state] = rule_states(skew, at(w, last))
    assert state.subject == "pool/decode" and state.value == pytest.approx(2.0) and state.firing
    [finding] = StaticRulePolicy("ep_imbalance").evaluate(at(w, last)).findings
    assert finding.key == FindingKey("ep_imbalance", "pool/decode")


def test_resolution_only_touches_its_own_kind() -> None:
    w = SignalWindows(3 * 3600)
    mine, other = FindingKey("saturation", "pool/a"), FindingKey("slo_burn", "pool/a")
    opened = {k: OpenFinding(k, T0, {}) for k in (mine, other)}
    result = StaticRulePolicy("saturation").evaluate(at(w, T0, open_findings=opened))
    assert [k for k, _ in result.resolved] == [mine]


def test_rules_are_checked_when_declared() -> None:
    base = rule("VLLMKVCacheNearlyFull")
    with pytest.raises(ValueError, match="unknown finding kind"):
        StaticRule(**{**_fields(base), "kind": "nope"})
    with pytest.raises(ValueError, match="range_s"):
        StaticRule(**{**_fields(base), "aggregate": Aggregate.MAX_OVER_MIN})
    with pytest.raises(ValueError, match=r"\$matchers"):
        StaticRule(**{**_fields(base), "slo": "ttft_p95"})
    with pytest.raises(ValueError, match="another kind"):
        StaticRulePolicy("slo_burn", [base])
    assert Op.LE.holds(1.0, 1.0) and not Op.LT.holds(1.0, 1.0) and Op.GE.holds(2.0, 1.0)
    assert rules_for("gpu_health") and all(r.kind == "gpu_health" for r in rules_for("gpu_health"))


def _fields(r: StaticRule) -> dict:
    return {name: getattr(r, name) for name in StaticRule.__dataclass_fields__}


def test_several_open_findings_resolve_together_when_their_rules_stop_firing() -> None:
    from policies.static_rules import StaticRulePolicy

    w = SignalWindows(7200)
    now = feed(w, "pool/a", "prefix_cache_hit_rate", [0.9] * 4)
    feed(w, "pool/b", "prefix_cache_hit_rate", [0.9] * 4)
    keys = [FindingKey("prefix_cache_hit_drop", s) for s in ("pool/b", "pool/a")]
    opened = {k: OpenFinding(k, T0, {}) for k in keys}
    result = StaticRulePolicy("prefix_cache_hit_drop").evaluate(at(w, now, open_findings=opened))
    assert [k.subject for k, _ in result.resolved] == ["pool/a", "pool/b"]
