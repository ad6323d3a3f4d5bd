"""vLLM family mapping: engines by the `engine` label, old names, pool aggregation, missing families."""

from __future__ import annotations

from typing import Any

import pytest

from collectors import families, vllm
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import Objectives, ScrapeResult, Target
from controlplane.demo import demo_fleet
from controlplane.sim.exporters import render_vllm

MODEL = 'model_name="m"'


def exposition(queries: float, hits: float, *, engine: str = "0", ttft: tuple[float, float, float] = (0, 0, 0),
               old_names: bool = False) -> str:
    prefix = "vllm:gpu_prefix_cache" if old_names else "vllm:prefix_cache"
    usage = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    lab = f'engine="{engine}",{MODEL}'
    b1, b2, binf = ttft
    return "\n".join([
        f"{prefix}_queries_total{{{lab}}} {queries}",
        f"{prefix}_hits_total{{{lab}}} {hits}",
        f"{usage}{{{lab}}} 0.5",
        f"vllm:num_requests_running{{{lab}}} 3",
        f"vllm:num_requests_waiting{{{lab}}} 1",
        f'vllm:request_success_total{{engine="{engine}",finished_reason="stop",{MODEL}}} {binf}',
        f'vllm:request_success_total{{engine="{engine}",finished_reason="error",{MODEL}}} 1',
        f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="0.1",{MODEL}}} {b1}',
        f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="1.0",{MODEL}}} {b2}',
        f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="+Inf",{MODEL}}} {binf}',
        f"vllm:time_to_first_token_seconds_sum{{{lab}}} {binf * 0.3}",
        f"vllm:time_to_first_token_seconds_count{{{lab}}} {binf}",
    ]) + "\n"


def test_reading_groups_by_engine_and_sums_extra_labels() -> None:
    text = exposition(100, 80, engine="0") + exposition(50, 10, engine="1")
    readings = vllm.read_engines(parse(text))
    assert set(readings) == {"0", "1"}
    assert readings["0"].counters["prefix_hits"] == 80
    assert readings["0"].counters["finished:error"] == 1  # split by finished_reason
    assert readings["0"].counters["finished:stop"] == 0
    assert readings["1"].gauges["kv_cache_usage"] == 0.5


def test_old_family_names_are_read() -> None:
    r = vllm.read_engines(parse(exposition(10, 5, old_names=True)))["0"]
    assert r.counters["prefix_queries"] == 10 and r.gauges["kv_cache_usage"] == 0.5


def test_current_name_wins_over_old_name() -> None:
    text = exposition(10, 5) + 'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 999\n'
    assert vllm.read_engines(parse(text))["0"].counters["prefix_hits"] == 5


def test_missing_families_are_reported() -> None:
    readings = vllm.read_engines(parse('vllm:num_requests_running{engine="0"} 1\n'))
    missing = families.missing_families(readings, vllm.FAMILIES)
    assert "vllm:prefix_cache_hits_total" in missing and "vllm:num_requests_running" not in missing


def _result(text: str, ts: float, pod: str = "p0") -> ScrapeResult:
    return ScrapeResult(Target("http://x", "prefill", pod), ts, ok=True, body=text)


def test_deriver_rates_quantiles_and_pool_rollup() -> None:
    d = SignalDeriver()
    d.derive([_result(exposition(1000, 800, ttft=(10, 20, 20)), 0.0),
              _result(exposition(1000, 100, ttft=(0, 10, 10)), 0.0, "p1")], 0.0)
    out = d.derive([_result(exposition(2000, 1700, ttft=(20, 40, 40)), 15.0),
                    _result(exposition(2000, 200, ttft=(0, 20, 20)), 15.0, "p1")], 15.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("engine/prefill/p0/0", "prefix_cache_hit_rate")] == pytest.approx(0.9)
    assert sig[("engine/prefill/p1/0", "prefix_cache_hit_rate")] == pytest.approx(0.1)
    # Pool = sum of increases over sum of increases, as sum(rate(hits))/sum(rate(queries)).
    assert sig[("pool/prefill", "prefix_cache_hit_rate")] == pytest.approx(0.5)
    assert sig[("pool/prefill", "prefix_cache_query_rate")] == pytest.approx(2000 / 15)
    # p0: 20 new observations, 10 of them under 0.1 s: rank 10 ends the first bucket -> 0.1.
    # p1: 10 new observations in (0.1, 1]: rank 5 is halfway through that bucket -> 0.55.
    assert sig[("engine/prefill/p0/0", "ttft_p50")] == pytest.approx(0.1)
    assert sig[("engine/prefill/p1/0", "ttft_p50")] == pytest.approx(0.55)
    assert sig[("pool/prefill", "targets_up")] == 2


def test_a_new_process_in_a_pod_is_one_restart_though_the_pod_was_gone_from_discovery_between() -> None:
    # A crash-looping pod leaves discovery (not Ready) while it restarts; its new process is told from the old by the
    # start it exports, which vLLM's API server does as every prometheus_client process does.
    def at(ts: float, started: float, pod: str = "p0") -> ScrapeResult:
        body = exposition(10, 5) + f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {started}\n"
        return _result(body, ts, pod)

    def restarts(out: Any) -> list[tuple[str, float]]:
        return [(s.subject, s.ts) for s in out.signals if s.name == "restarts"]

    d = SignalDeriver()
    assert restarts(d.derive([at(0.0, 1.7e9), at(0.0, 1.7e9, "p1")], 0.0)) == []
    assert restarts(d.derive([at(15.0, 1.7e9 + 0.004), at(15.0, 1.7e9, "p1")], 15.0)) == []  # rounded otherwise
    assert restarts(d.derive([at(30.0, 1.7e9, "p1")], 30.0)) == []  # p0 out of discovery
    assert restarts(d.derive([at(400.0, 1.7e9 + 350.0), at(400.0, 1.7e9, "p1")], 400.0)) == [
        ("target/prefill/p0/vllm", 400.0)]
    assert restarts(d.derive([at(415.0, 1.7e9 + 350.0)], 415.0)) == []
    # A pod gone for longer than an hour is forgotten: a pod of its name after that is no restart of it.
    d.derive([at(4100.0, 1.7e9 + 350.0, "p1")], 4100.0)
    assert restarts(d.derive([at(4115.0, 1.7e9 + 4000.0)], 4115.0)) == []
    # So is one read over an hour before, however few rounds came between (a replica that led again).
    assert restarts(d.derive([at(8000.0, 1.7e9 + 7000.0, "p1")], 8000.0)) == []
    # A new term forgets every start: another leader recorded the restarts meanwhile.
    d.new_term()
    assert restarts(d.derive([at(8015.0, 1.7e9 + 8000.0, "p1")], 8015.0)) == []


def test_a_pool_reports_its_share_of_requests_over_its_objectives() -> None:
    """The share over an objective on a bucket bound is exact (the p95 from the same buckets is not); pools without
    objectives, and the engines, get none."""
    d = SignalDeriver({"prefill": Objectives(ttft=0.1), "other": Objectives(ttft=1.0)})
    d.derive([_result(exposition(1000, 800, ttft=(10, 20, 20)), 0.0),
              _result(exposition(1000, 100, ttft=(0, 10, 10)), 0.0, "p1")], 0.0)
    out = d.derive([_result(exposition(2000, 1700, ttft=(20, 40, 40)), 15.0),
                    _result(exposition(2000, 200, ttft=(0, 20, 20)), 15.0, "p1")], 15.0)
    over = {(s.subject, s.name): s.value for s in out.signals if s.name.endswith("_over_slo")}
    # 30 new requests: p0's 20 (10 within 0.1 s), p1's 10 (none within): 20 of 30 over.
    assert over == {("pool/prefill", "ttft_over_slo"): pytest.approx(20 / 30)}
    assert not any(s.name.endswith("_over_slo") for s in SignalDeriver().derive(
        [_result(exposition(1000, 800, ttft=(10, 20, 20)), 30.0)], 30.0).signals)


def test_deriver_handles_counter_reset_and_failed_scrape() -> None:
    d = SignalDeriver()
    d.derive([_result(exposition(1000, 800), 0.0)], 0.0)
    failed = ScrapeResult(Target("http://x", "prefill", "p0"), 15.0, ok=False, error="timed out")
    out = d.derive([failed], 15.0)
    assert ("target/prefill/p0/vllm", "up", 0.0) in {(s.subject, s.name, s.value) for s in out.signals}
    # The pod restarted: counters start again from zero; the gap spans two intervals.
    out = d.derive([_result(exposition(100, 30), 30.0)], 30.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("engine/prefill/p0/0", "prefix_cache_hit_rate")] == pytest.approx(0.3)
    assert sig[("engine/prefill/p0/0", "prefix_cache_query_rate")] == pytest.approx(100 / 30)


def test_deriver_records_malformed_lines_and_keeps_the_rest() -> None:
    d = SignalDeriver()
    body = exposition(1000, 800) + "vllm:broken{engine=0} 1\n"
    out = d.derive([_result(body, 0.0)], 0.0)
    assert "prefill/p0/vllm" in out.parse_errors and "line 13" in out.parse_errors["prefill/p0/vllm"][0]
    out = d.derive([_result(exposition(2000, 1600), 15.0)], 15.0)
    assert any(s.name == "prefix_cache_hit_rate" for s in out.signals)


@pytest.mark.parametrize("unreadable", ["1.0e9x", "NaN"])
def test_a_counter_unreadable_in_an_engines_first_scrape_is_not_counted_from_zero_in_its_next(unreadable: str) -> None:
    """It was there with its whole history, not created since: 1,000,015,000 prompt tokens are not one interval's."""
    d = SignalDeriver()
    d.derive([_result(finished(100) + f'vllm:prompt_tokens_total{{engine="0",{MODEL}}} {unreadable}\n', 0.0)], 0.0)
    out = d.derive([_result(finished(100) + f'vllm:prompt_tokens_total{{engine="0",{MODEL}}} 1000015000\n', 15.0)],
                   15.0)
    assert not any(s.name == "prompt_tokens_rate" for s in out.signals)
    out = d.derive([_result(finished(100) + f'vllm:prompt_tokens_total{{engine="0",{MODEL}}} 1000030000\n', 30.0)],
                   30.0)
    assert {(s.subject, s.name): s.value for s in out.signals}[("pool/prefill", "prompt_tokens_rate")] == 1000.0


@pytest.mark.parametrize("unreadable", ["1.0e6x", "NaN"])
def test_a_split_counter_unreadable_in_an_engines_first_scrape_is_not_counted_from_zero_in_its_next(
        unreadable: str) -> None:
    """A malformed line names its family, not the split key (`finished:length`) of its series: read as new next time,
    the engine's million requests finished by length were one interval's, 66,666 a second."""
    d = SignalDeriver()

    def body(length: str) -> str:
        return (finished(100) + f'vllm:request_success_total{{engine="0",finished_reason="length",{MODEL}}} {length}\n')

    d.derive([_result(body(unreadable), 0.0)], 0.0)
    out = d.derive([_result(body("1000000"), 15.0)], 15.0)
    rate = {(s.subject, s.name): s.value for s in out.signals}.get(("pool/prefill", "request_rate"))
    assert rate in (None, 0.0)


@pytest.mark.parametrize("junk", ["", 'my_sidecar_info{version="1.2} 1\n'])
def test_an_engines_first_errors_count_whatever_else_its_scrape_could_not_read(junk: str) -> None:
    """A series created at its first event counts from zero, a malformed line of another family beside it or not;
    one of the same key that could not be read, and reads now, had its history before."""
    def body(errors: str | None) -> str:
        out = finished(100) + junk
        return out + (f'vllm:request_success_total{{engine="0",finished_reason="error",{MODEL}}} {errors}\n'
                      if errors is not None else "")

    def errors(first: str | None) -> float:
        d = SignalDeriver()
        rates = []
        for i, value in enumerate([None, first, "3", "3"]):
            out = d.derive([_result(body(value), 15.0 * i)], 15.0 * i)
            rates += [s.value for s in out.signals if s.name == "request_error_rate" and s.subject == "pool/prefill"]
        return sum(rates) * 15

    assert errors(None) == pytest.approx(3.0), "the first three errored requests"
    assert errors("NaN") == pytest.approx(0.0), "unread, then 3: not three new ones"


def test_a_histogram_without_its_inf_bucket_is_no_reading_and_is_reported() -> None:
    """Its requests above the highest bound would vanish from the pool's merge, and every quantile read low."""
    def ttft(slow: int) -> str:
        series = f'vllm:time_to_first_token_seconds_bucket{{engine="0",{MODEL},le="0.1"}} 50\n'
        return finished(100) + series + (f'vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} {50 + slow}\n'
                                          f'vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} {50 + slow}\n')
    d = SignalDeriver()
    d.derive([_result(ttft(0), 0.0)], 0.0)
    out = d.derive([_result(ttft(50), 15.0)], 15.0)
    assert "vllm:time_to_first_token_seconds (no +Inf bucket: 0)" in out.missing_families["prefill/p0/vllm"]
    assert not any(s.name.startswith("ttft") for s in out.signals)


def test_after_an_outage_longer_than_a_series_lives_the_first_good_scrape_is_a_new_baseline() -> None:
    """The engine crash-looped for an hour and came back serving: its counts since the restart are not the hour's."""
    target = Target("http://a", "p", "a")
    d = SignalDeriver()
    d.derive([ScrapeResult(target, 0.0, ok=True, body=finished(50_000))], 0.0)
    for i in range(1, 240):
        d.derive([ScrapeResult(target, 15.0 * i, ok=False, error="connection refused")], 15.0 * i)
    back = d.derive([ScrapeResult(target, 3600.0, ok=True, body=finished(1500))], 3600.0)
    assert not any(s.name == "request_rate" for s in back.signals)
    later = d.derive([ScrapeResult(target, 3615.0, ok=True, body=finished(3000))], 3615.0)
    assert {(s.subject, s.name): s.value for s in later.signals}[("pool/p", "request_rate")] == 100.0


def finished(n: float) -> str:
    """An engine's exposition of `n` requests finished, and nothing else."""
    return f'vllm:request_success_total{{engine="0",finished_reason="stop",{MODEL}}} {n}\n'


def test_a_pool_rate_is_the_sum_of_its_engines_rates_when_one_missed_scrapes() -> None:
    a, b = Target("http://a", "p", "a"), Target("http://b", "p", "b")
    d = SignalDeriver()
    d.derive([ScrapeResult(a, 0.0, ok=True, body=finished(0)), ScrapeResult(b, 0.0, ok=True, body=finished(0))], 0.0)
    for i in range(1, 6):  # b misses five scrapes; its next delta spans 60 s, a's 10 s
        d.derive([ScrapeResult(a, 10.0 * i, ok=True, body=finished(100 * i)),
                  ScrapeResult(b, 10.0 * i, ok=False, error="timed out")], 10.0 * i)
    out = d.derive([ScrapeResult(a, 60.0, ok=True, body=finished(600)), ScrapeResult(b, 60.0, ok=True, body=finished(600))],
                   60.0)
    rates = {s.subject: s.value for s in out.signals if s.name == "request_rate"}
    assert rates == {"engine/p/a/0": 10.0, "engine/p/b/0": 10.0, "pool/p": pytest.approx(20.0)}


def test_a_target_the_round_had_no_time_for_is_neither_up_nor_down_and_its_next_read_spans_the_gap() -> None:
    a, b = Target("http://a", "p", "a"), Target("http://b", "p", "b")
    d = SignalDeriver()
    d.derive([ScrapeResult(a, 0.0, ok=True, body=finished(0)), ScrapeResult(b, 0.0, ok=True, body=finished(0))], 0.0)
    out = d.derive([ScrapeResult(a, 15.0, ok=True, body=finished(150)),
                    ScrapeResult(b, 15.0, ok=False, error="not scraped this round: x", late=True)], 15.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert ("target/p/b/vllm", "up") not in sig and sig[("target/p/a/vllm", "up")] == 1.0
    assert sig[("pool/p", "targets")] == 1 and sig[("pool/p", "targets_up")] == 1
    out = d.derive([ScrapeResult(a, 30.0, ok=True, body=finished(300)), ScrapeResult(b, 30.0, ok=True, body=finished(300))],
                   30.0)
    rates = {s.subject: s.value for s in out.signals if s.name == "request_rate"}
    assert rates["engine/p/b/0"] == pytest.approx(10.0)


def test_a_bucket_bound_that_is_no_number_costs_that_line_only() -> None:
    d = SignalDeriver()
    bad = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="abc",model_name="m"} 1\n'
    d.derive([_result(exposition(1000, 800), 0.0)], 0.0)
    out = d.derive([_result(exposition(2000, 1600) + bad, 15.0)], 15.0)
    [error] = out.parse_errors["prefill/p0/vllm"]
    assert "line 13" in error and "bucket bound le='abc' is not a number" in error
    assert any(s.name == "prefix_cache_hit_rate" for s in out.signals), "the rest of the target is read"


def test_a_value_that_is_no_number_is_no_reading_not_a_poisoned_sum() -> None:
    # One engine of a pod exposes NaN for its KV usage: the pod's and the pool's usage come from the other engine,
    # and the family still counts as exposed.
    two = exposition(1000, 800, engine="0") + exposition(1000, 800, engine="1").replace(
        'vllm:kv_cache_usage_perc{engine="1",' + MODEL + "} 0.5", 'vllm:kv_cache_usage_perc{engine="1",' + MODEL + "} NaN")
    assert "NaN" in two
    readings = vllm.read_engines(parse(two))
    assert "kv_cache_usage" not in readings["1"].gauges and "vllm:kv_cache_usage_perc" in readings["1"].families
    d = SignalDeriver()
    d.derive([_result(two, 0.0)], 0.0)
    out = d.derive([_result(two, 15.0)], 15.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("pool/prefill", "kv_cache_usage")] == pytest.approx(0.5)
    # But the pool's numbers lack engine 1's, as they would if it exposed no KV usage at all: said, not silent.
    assert "vllm:kv_cache_usage_perc (a value that is no number: 1)" in out.missing_families["prefill/p0/vllm"]


def test_one_series_restarting_resets_only_its_own_histogram() -> None:
    # Two series of one engine's TTFT (a label the entity does not split by, e.g. two LoRA adapters' processes): one
    # restarts, its counts fall; the other's 10 new requests still count, and the restarted one's 2, not its history.
    def ttft(a: tuple[int, int], b: tuple[int, int]) -> str:
        lines = []
        for worker, (fast, total) in (("a", a), ("b", b)):
            lab = f'engine="0",worker="{worker}",{MODEL}'
            lines += [f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.1"}} {fast}',
                      f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {total}',
                      f"vllm:time_to_first_token_seconds_sum{{{lab}}} {total * 0.2}",
                      f"vllm:time_to_first_token_seconds_count{{{lab}}} {total}"]
        return "\n".join(lines) + "\n"

    before, after = vllm.read_engines(parse(ttft((500, 1000), (50, 100))))["0"], vllm.read_engines(
        parse(ttft((505, 1010), (1, 2))))["0"]
    d = families.delta(before, after, 15.0)
    assert d is not None and d.histograms["ttft"].count == 12
    assert dict(d.histograms["ttft"].buckets) == {0.1: 6.0, float("inf"): 12.0}


def test_a_series_missing_from_one_scrape_is_diffed_against_its_last_value_when_it_comes_back() -> None:
    # Two series of one engine's request counter (stop and length), 1e6 requests each since start: the `length` line
    # is malformed in the middle scrape. Counted from zero on its return it would add its million at once.
    def body(stop: float, length: float | str) -> str:
        lab = f'engine="0",{MODEL}'
        return (f'vllm:request_success_total{{{lab},finished_reason="stop"}} {stop}\n'
                f'vllm:request_success_total{{{lab},finished_reason="length"}} {length}\n')

    d = SignalDeriver()
    d.derive([_result(body(1e6, 1e6), 0.0)], 0.0)
    middle = d.derive([_result(body(1e6 + 150, "1e6x"), 15.0)], 15.0)
    assert middle.parse_errors and {s.name: s.value for s in middle.signals
                                    if s.subject == "engine/prefill/p0/0"}["request_rate"] == pytest.approx(10.0)
    back = d.derive([_result(body(1e6 + 300, 1e6 + 600), 30.0)], 30.0)
    rate = {s.name: s.value for s in back.signals if s.subject == "engine/prefill/p0/0"}["request_rate"]
    # stop: 150 in 15 s; length: 600 over the 30 s since it was last read, of which this interval's half.
    assert rate == pytest.approx((150 + 300) / 15)


def test_a_rank_missing_from_a_pods_exposition_is_named_and_diffed_on_its_return() -> None:
    """A data-parallel rank absent from a scrape its pod answered: the pool's rate read half with nothing saying so, and
    the rank's baseline was dropped, so its return had no rate either."""
    from controlplane.observe import Observation

    def body(n: float, ranks: tuple[str, ...] = ("0", "1")) -> str:
        return "".join(f'vllm:request_success_total{{engine="{r}",finished_reason="stop",{MODEL}}} {n}\n'
                       for r in ranks)

    d = SignalDeriver()

    def step(ts: float, text: str) -> tuple[dict[tuple[str, str], float], dict[str, dict[str, str]]]:
        res = _result(text, ts)
        out = d.derive([res], ts)
        obs = Observation(out.signals, [res], {}, {}, out.parse_errors, out.missing_families)
        return {(s.subject, s.name): s.value for s in out.signals}, obs.unfit_inputs(["prefill"])

    step(0.0, body(0))
    sig, _ = step(15.0, body(150))
    assert sig[("pool/prefill", "request_rate")] == pytest.approx(20.0)
    sig, unfit = step(30.0, body(300, ranks=("0",)))
    assert "the series of 1, which it reported before" in unfit["prefill"]["vllm"]
    sig, _ = step(45.0, body(450))
    assert sig[("engine/prefill/p0/1", "request_rate")] == pytest.approx(10.0)  # 300 over the 30 s since it was read
    assert sig[("pool/prefill", "request_rate")] == pytest.approx(20.0)


def test_a_pool_mid_upgrade_reads_tpot_from_what_every_engine_has() -> None:
    """An older engine has no per-request TPOT, only the inter-token latency: the pool's TPOT was the upgraded
    engines' alone, every request within the objective, where half of them, the older engine's, were not."""
    a, b = Target("http://a", "prefill", "a"), Target("http://b", "prefill", "b")

    def hist(name: str, n: int, value: float) -> str:
        lines = [f'{name}_bucket{{engine="0",{MODEL},le="{le}"}} {n if value <= le else 0}' for le in (0.05, 0.1, 0.5)]
        return "\n".join([*lines, f'{name}_bucket{{engine="0",{MODEL},le="+Inf"}} {n}',
                          f'{name}_sum{{engine="0",{MODEL}}} {n * value}', f'{name}_count{{engine="0",{MODEL}}} {n}'])

    def older(n: int) -> str:
        return finished(n) + hist("vllm:time_per_output_token_seconds", n, 0.2) + "\n"

    def newer(n: int) -> str:
        return (finished(n) + hist("vllm:inter_token_latency_seconds", n, 0.02) + "\n"
                + hist("vllm:request_time_per_output_token_seconds", n, 0.02) + "\n")

    d = SignalDeriver({"prefill": Objectives(tpot=0.1)})
    d.derive([ScrapeResult(a, 0.0, ok=True, body=older(0)), ScrapeResult(b, 0.0, ok=True, body=newer(0))], 0.0)
    out = d.derive([ScrapeResult(a, 15.0, ok=True, body=older(150)), ScrapeResult(b, 15.0, ok=True, body=newer(150))],
                   15.0)
    sig = {(s.subject, s.name): s.value for s in out.signals if s.subject == "pool/prefill"}
    assert sig[("pool/prefill", "tpot_per_request")] == 0.0  # the inter-token latency, which both have
    assert sig[("pool/prefill", "tpot_over_slo")] == pytest.approx(0.5)


def test_a_histogram_whose_bucket_line_was_dropped_is_no_baseline_for_the_next_scrape() -> None:
    """The clean scrape after one with a bucket line dropped diffed over the bounds both had: every request took 0.3 s,
    and its p95 read 0.725 s, half of them over a 0.5 s objective."""
    bounds = ("0.1", "0.25", "0.5", "0.75", "1.0", "+Inf")

    def body(n: int, bad: str | None = None) -> str:
        lab = f'engine="0",{MODEL}'
        lines = [f'vllm:time_to_first_token_seconds_bucket{{{lab},le="{le}"}} '
                 f'{n if le == "+Inf" or float(le) >= 0.3 else 0}{"x" if le == bad else ""}' for le in bounds]
        return finished(n) + "\n".join([*lines, f"vllm:time_to_first_token_seconds_sum{{{lab}}} {0.3 * n}",
                                         f"vllm:time_to_first_token_seconds_count{{{lab}}} {n}"]) + "\n"

    d = SignalDeriver({"prefill": Objectives(ttft=0.5)})
    d.derive([_result(body(1000), 0.0)], 0.0)
    assert d.derive([_result(body(1150, bad="0.5"), 15.0)], 15.0).parse_errors
    out = d.derive([_result(body(1300), 30.0)], 30.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("pool/prefill", "ttft_over_slo")] == pytest.approx(0.0)
    assert 0.25 < sig[("pool/prefill", "ttft_p95")] <= 0.5


def test_a_histogram_without_its_count_line_counts_its_inf_bucket() -> None:
    # The `_count` line dropped as malformed: TTFT still has its quantiles and mean, from the +Inf bucket's count.
    def body(n: int) -> str:
        return "".join(line for line in exposition(100, 50, ttft=(n // 2, n, n)).splitlines(keepends=True)
                       if "_count" not in line)

    d = families.delta(vllm.read_engines(parse(body(10)))["0"], vllm.read_engines(parse(body(30)))["0"], 15.0)
    assert d is not None and d.histograms["ttft"].count == 20
    sig = {s.name: s.value for s in vllm.signals(d, 15.0, "engine/prefill/p0/0")}
    assert sig["ttft_mean"] == pytest.approx(0.3) and "ttft_p50" in sig


def test_a_histogram_without_its_sum_line_is_no_reading_and_the_next_one_spans_the_gap() -> None:
    # TTFT's `_sum` malformed in the middle scrape: read as 0 it would make a mean of minus the whole history.
    def body(n: int, *, sum_line: bool = True) -> str:
        return "".join(line for line in exposition(100, 50, ttft=(n // 2, n, n)).splitlines(keepends=True)
                       if sum_line or "_sum" not in line)

    d = SignalDeriver()
    d.derive([_result(body(1000), 0.0)], 0.0)
    middle = d.derive([_result(body(1010, sum_line=False), 15.0)], 15.0)
    assert not any(s.name == "ttft_mean" for s in middle.signals)
    back = d.derive([_result(body(1020), 30.0)], 30.0)
    means = [s.value for s in back.signals if s.name == "ttft_mean" and s.subject == "engine/prefill/p0/0"]
    assert means == [pytest.approx(0.3)]


def test_a_family_back_after_the_horizon_gives_no_reading_for_that_interval() -> None:
    # Gone for longer than five minutes: what it did meanwhile is not known, so its return is no rate (as on a first
    # scrape), never its whole history at once.
    lab = f'engine="0",{MODEL}'
    d = SignalDeriver()
    d.derive([_result(f"vllm:prompt_tokens_total{{{lab}}} 1e6\nvllm:num_requests_running{{{lab}}} 1\n", 0.0)], 0.0)
    for k in range(1, 25):  # six minutes without the family
        d.derive([_result(f"vllm:num_requests_running{{{lab}}} 1\n", 15.0 * k)], 15.0 * k)
    back = d.derive([_result(f"vllm:prompt_tokens_total{{{lab}}} 1000150\nvllm:num_requests_running{{{lab}}} 1\n",
                             375.0)], 375.0)
    assert "prompt_tokens_rate" not in {s.name for s in back.signals if s.subject == "engine/prefill/p0/0"}


def test_tpot_says_whether_it_is_per_request_or_an_older_engines_inter_token_latency() -> None:
    fleet = demo_fleet(now=1000.0)
    decode = fleet.members["decode"][0]
    bodies = []
    for t in (1030.0, 1060.0):
        fleet.advance_to(t)
        bodies.append(render_vllm(decode, "m").decode())

    def marks(keep: bool) -> list[float]:
        d = SignalDeriver()
        out = []
        for k, body in enumerate(bodies):
            text = "".join(line for line in body.splitlines(keepends=True)
                           if keep or "request_time_per_output_token" not in line)
            out += [s.value for s in d.derive([_result(text, 30.0 * k)], 30.0 * k).signals
                    if s.name == "tpot_per_request" and s.subject.startswith("engine/")]
        return out

    assert marks(keep=True) == [1.0] and marks(keep=False) == [0.0]
