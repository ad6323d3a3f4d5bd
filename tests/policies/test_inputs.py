"""Inputs fit to act on: frozen gauges, and the finding that says why a pool's actions are held."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.inputs import StaleInputs, frozen_inputs, vanished_inputs
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState, Severity
from policies.windows import SignalWindows

NOW = 100_000.0


def windows(values: list[float], name: str = "requests_running", pod: str = "decode-0", step: float = 15.0
            ) -> SignalWindows:
    w = SignalWindows(3 * 3600)
    start = NOW - step * (len(values) - 1)
    w.extend((start + i * step, f"engine/decode/{pod}/0", name, v) for i, v in enumerate(values))
    return w


def test_a_gauge_held_at_one_non_zero_value_is_frozen() -> None:
    frozen = frozen_inputs(windows([7.0] * 61), NOW, after=900)
    assert frozen == {"decode": {"requests_running": "requests_running of engine/decode/decode-0/0 has been 7 for 15 min"}}


def test_a_moving_an_idle_a_short_or_an_old_series_is_not() -> None:
    assert frozen_inputs(windows([7.0] * 60 + [8.0]), NOW, after=900) == {}
    assert frozen_inputs(windows([0.0] * 61), NOW, after=900) == {}, "an idle engine reads 0 steadily"
    assert frozen_inputs(windows([7.0] * 20), NOW, after=900) == {}, "5 minutes say nothing yet"
    assert frozen_inputs(windows([7.0] * 61), NOW + 3600, after=900) == {}, "an engine gone an hour ago"
    assert frozen_inputs(windows([7.0] * 61), NOW, after=0) == {}, "switched off"


def test_a_saturated_engines_full_batch_is_not_frozen() -> None:
    # 256 running (max_num_seqs) at every scrape with requests waiting behind them: each one that finishes is replaced
    # at once. Read as frozen, the pool's inputs would be stale, and its scale-ups held, exactly while it is saturated.
    w = windows([256.0] * 61)
    w.extend((NOW - 15 * i, "engine/decode/decode-0/0", "requests_waiting", 40.0 + i % 3) for i in reversed(range(61)))
    assert frozen_inputs(w, NOW, after=900) == {}
    w.add(NOW + 15, "engine/decode/decode-0/0", "requests_waiting", 0.0)
    w.add(NOW + 15, "engine/decode/decode-0/0", "requests_running", 256.0)
    assert "requests_running" in frozen_inputs(w, NOW + 15, after=900)["decode"], "no queue: held where it should move"


def test_a_pool_signal_that_stopped_is_stale_one_late_scrape_is_not() -> None:
    w = SignalWindows(3600)
    for pool, last in (("decode", NOW - 60), ("prefill", NOW - 15)):
        w.extend((last - 15 * i, f"pool/{pool}", name, 1.0) for i in range(10) for name in ("request_rate", "ttft_p95"))
    assert vanished_inputs(w, ["decode", "prefill", "kv"], NOW, after=37.5) == {
        "decode": {"request_rate": "no value of request_rate for 60s: its series stopped"}}
    # A latency quantile has no value while nothing finishes: not watched. A pool never seen has nothing to stop.


def state(stale: dict[str, str]) -> PoolState:
    return PoolState("decode", "decode", 3, 3, 1, 6, stale_inputs=stale)


def test_the_finding_names_each_stale_input_and_resolves_when_all_are_fresh() -> None:
    policy = StaleInputs()
    key = FindingKey("stale_inputs", "pool/decode")
    stale = {"vllm": "target decode/decode-1/vllm is down (timeout)", "kv_cache_usage": "frozen"}
    result = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state(stale)}, {}))
    [finding] = result.findings
    assert finding.key == key and finding.severity is Severity.WARNING and finding.proposals == ()
    assert finding.evidence == {"inputs": stale} and "decode-1/vllm is down" in finding.cause
    open_ = {key: OpenFinding(key, NOW - 60, {})}
    result = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state({})}, open_))
    assert result.findings == [] and result.resolved == [(key, "its inputs are fresh again")]
    # the pool left the fleet file: nothing will report it fresh again
    result = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"prefill": state({})}, open_))
    assert result.resolved == [(key, "the pool is no longer in the fleet file")]


@given(st.lists(st.sampled_from([0.0, 1.0, 7.0]), min_size=1, max_size=40))
def test_the_unchanged_run_matches_a_plain_scan(values: list[float]) -> None:
    w = windows(values)
    value, seconds, n = w.unchanged("engine/decode/decode-0/0", "requests_running")  # type: ignore[misc]
    run = next((i for i, v in enumerate(reversed(values)) if v != values[-1]), len(values))
    assert (value, n, seconds) == (values[-1], run, 15.0 * (run - 1))
