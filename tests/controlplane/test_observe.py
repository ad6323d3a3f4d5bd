"""What an observation says of its pools: down targets, and targets the scrape round had no time for."""

from __future__ import annotations

from typing import cast

from collectors.prometheus_api import ApiOutput, Malformed, PrometheusSource
from collectors.types import ScrapeResult, Signal, Target, TargetHealth
from controlplane.observe import DOWN_AFTER, Observation, PrometheusApiSource


def _target(pod: str) -> Target:
    return Target(f"http://{pod}:8000/metrics", "decode", pod)


def test_a_late_target_leaves_its_pool_unfit_this_tick_but_still_counts_as_answering() -> None:
    late, good = _target("decode-0"), _target("decode-1")
    obs = Observation(
        results=[ScrapeResult(late, 10.0, ok=False, error="not scraped this round: every slot was taken", late=True),
                 ScrapeResult(good, 10.0, ok=True)],
        health={late.key: TargetHealth(), good.key: TargetHealth()})
    unfit = obs.unfit_inputs(["decode"])
    assert unfit == {"decode": {"vllm": "target decode/decode-0/vllm: not scraped this round: every slot was taken"}}
    # Not seen down: a drain still waits for its requests.
    assert obs.answering_engines() == {"decode": {"decode-0", "decode-1"}}


def test_a_down_target_outweighs_a_late_one_in_the_same_pool() -> None:
    late, down = _target("decode-0"), _target("decode-1")
    obs = Observation(
        results=[ScrapeResult(late, 10.0, ok=False, error="not scraped this round: x", late=True),
                 ScrapeResult(down, 10.0, ok=False, error="connection refused")],
        health={late.key: TargetHealth(), down.key: TargetHealth(consecutive_failures=DOWN_AFTER)})
    assert obs.unfit_inputs(["decode"])["decode"]["vllm"] == "target decode/decode-1/vllm is down (connection refused)"
    assert obs.answering_engines() == {"decode": {"decode-0"}}


def test_a_target_with_malformed_lines_leaves_its_pool_unfit() -> None:
    a, b = _target("decode-0"), _target("decode-1")
    obs = Observation(
        results=[ScrapeResult(a, 10.0, ok=True), ScrapeResult(b, 10.0, ok=True)],
        health={a.key: TargetHealth(), b.key: TargetHealth()},
        parse_errors={a.key: ["line 7: value '7x' is not a number: 'vllm:num_requests_waiting{engine=\"1\"} 7x'"]})
    assert obs.unfit_inputs(["decode"])["decode"]["vllm"].startswith("decode-0: 1 malformed line(s)")


async def test_every_malformed_line_is_counted_not_only_the_sample_kept() -> None:
    from collectors.scraper import Scraper
    from controlplane.observe import ScrapeSource

    target = _target("decode-0")

    class Listed:
        stale = False

        async def targets(self) -> list[Target]:
            return [target]

    class Broken(Scraper):
        def __init__(self) -> None:
            self.health = {}

        async def scrape(self, targets: list[Target], now: float) -> list[ScrapeResult]:
            body = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1x\n' for i in range(500))
            return [ScrapeResult(target, now, ok=True, body=body)]

    obs = await ScrapeSource(Listed(), Broken()).observe(0.0)
    assert obs.errors[target.key].startswith("500 malformed line(s)")
    assert obs.parse_error_counts == {target.key: 500} and len(obs.parse_errors[target.key]) == 20


async def test_a_query_prometheus_did_not_answer_leaves_its_signal_unfit_in_the_pools_it_covers() -> None:
    class OneRefused:
        url = "http://prometheus:9090"

        def signals(self, *args: object) -> ApiOutput:
            return ApiOutput(signals=[Signal(1.0, "pool/decode", "request_rate", 3.0)], queries=40, failed=[
                Malformed("ttft_p95", "pool", "its query failed: HTTP 422: too many samples", "histogram_quantile(...)"),
                Malformed("kv_cache_usage", "pool/prefill", "its query failed: timed out", "avg(...)")])

    obs = await PrometheusApiSource(cast(PrometheusSource, OneRefused()), 15.0).observe(1.0)
    unfit = obs.unfit_inputs(["prefill", "decode"])
    assert set(unfit["decode"]) == {"ttft_p95"} and set(unfit["prefill"]) == {"ttft_p95", "kv_cache_usage"}
    assert "too many samples" in unfit["decode"]["ttft_p95"]
    assert [s.name for s in obs.signals] == ["request_rate"] and "prometheus/pool" in obs.errors
