"""What an observation says of its pools: down targets, and targets the scrape round had no time for."""

from __future__ import annotations

from collectors.types import ScrapeResult, Target, TargetHealth
from controlplane.observe import DOWN_AFTER, Observation


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
