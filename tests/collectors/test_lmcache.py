"""LMCache mapping: workers and roles, hit rates from token counters, seconds from ms, counter spellings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from collectors import families, lmcache, sources
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Target
from tests.collectors.expositions import fmt, histogram

GIB = 1 << 30
TIME_BOUNDS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "1.0", "10.0")
REMOTE_MS_BOUNDS = ("1", "5", "10", "50", "100", "1000", "10000")


@dataclass(frozen=True)
class Worker:
    """Cumulative LMCache state of one worker; histograms as their observations."""

    retrieves: int = 0
    stores: int = 0
    lookups: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    stored_tokens: int = 0
    lookup_tokens: int = 0
    lookup_hits: int = 0
    retrieve_hit_gauge: float = 0.0
    lookup_hit_gauge: float = 0.0
    local_cache_bytes: int = 0
    retrieve_s: tuple[float, ...] = ()
    store_s: tuple[float, ...] = ()
    remote_get_ms: tuple[float, ...] = ()


def exposition(w: Worker, *, worker_id: str = "0", role: str | None = "worker", counters: bool = True,
               suffix: str = "_total") -> str:
    """One worker as `prometheus_client` exposes LMCache's registry (`suffix=""`: the declared counter names)."""
    labels = {"model_name": "meta-llama/Llama-3.1-8B", "worker_id": worker_id}
    if role is not None:
        labels |= {"role": role, "served_model_name": "llama"}
    out = []
    if counters:
        for name, value in (("num_retrieve_requests", w.retrieves), ("num_store_requests", w.stores),
                            ("num_lookup_requests", w.lookups), ("num_requested_tokens", w.requested_tokens),
                            ("num_hit_tokens", w.hit_tokens), ("num_stored_tokens", w.stored_tokens),
                            ("num_lookup_tokens", w.lookup_tokens), ("num_lookup_hits", w.lookup_hits)):
            out.append(f"# TYPE lmcache:{name} counter\nlmcache:{name}{suffix}{{{fmt(labels)}}} {value}\n")
            out.append(f"lmcache:{name}_created{{{fmt(labels)}}} 1.7e9\n")
    out.append(f"lmcache:retrieve_hit_rate{{{fmt(labels)}}} {w.retrieve_hit_gauge}\n")
    out.append(f"lmcache:lookup_hit_rate{{{fmt(labels)}}} {w.lookup_hit_gauge}\n")
    out.append(f"lmcache:local_cache_usage{{{fmt(labels)}}} {w.local_cache_bytes}\n")
    out.append(histogram("lmcache:time_to_retrieve", labels, TIME_BOUNDS, w.retrieve_s))
    out.append(histogram("lmcache:time_to_store", labels, TIME_BOUNDS, w.store_s))
    out.append(histogram("lmcache:remote_time_to_get", labels, REMOTE_MS_BOUNDS, w.remote_get_ms))
    return "".join(out)


def read(text: str) -> dict[str, families.Reading]:
    return lmcache.SOURCE.read(parse(text))


def signal_map(prev_text: str, cur_text: str, entity: str = "0", seconds: float = 10.0) -> dict[str, float]:
    d = families.delta(read(prev_text)[entity], read(cur_text)[entity], seconds)
    assert d is not None
    return {s.name: s.value for s in lmcache.signals(d, 100.0, f"lmcache/prefill/p0/{entity}")}


# 10 s apart: 20 retrieves asking 8000 tokens, 6000 hit; 5 stores; lookups hit 900 of 1000 tokens.
PREV = Worker(retrieves=100, stores=50, lookups=100, requested_tokens=40000, hit_tokens=10000, stored_tokens=50000,
              lookup_tokens=10000, lookup_hits=2000, retrieve_hit_gauge=0.99, lookup_hit_gauge=0.01,
              local_cache_bytes=2 * GIB, retrieve_s=(0.003,) * 100, store_s=(0.05,) * 50, remote_get_ms=(3.0,) * 10)
CUR = dataclasses.replace(
    PREV, retrieves=120, stores=55, lookups=110, requested_tokens=48000, hit_tokens=16000, stored_tokens=55000,
    lookup_tokens=11000, lookup_hits=2900, local_cache_bytes=3 * GIB,
    retrieve_s=PREV.retrieve_s + (0.015,) * 20, store_s=PREV.store_s + (0.07,) * 5,
    remote_get_ms=PREV.remote_get_ms + (20.0,) * 4,
)


@pytest.mark.parametrize("suffix", [pytest.param("_total", id="exposed-with-total"),
                                    pytest.param("", id="declared-name")])
def test_counter_spellings_give_the_same_signals(suffix: str) -> None:
    sig = signal_map(exposition(PREV, suffix=suffix), exposition(CUR, suffix=suffix))
    # From the token counters, not from the gauges (0.99 and 0.01) LMCache set at its last log.
    assert sig["lmcache_retrieve_hit_rate"] == pytest.approx(0.75)
    assert sig["lmcache_lookup_hit_rate"] == pytest.approx(0.9)
    assert sig["lmcache_store_rate"] == pytest.approx(0.5)
    assert sig["lmcache_retrieve_rate"] == pytest.approx(2.0)
    assert sig["lmcache_lookup_rate"] == pytest.approx(1.0)
    assert sig["lmcache_stored_tokens_rate"] == pytest.approx(500.0)
    assert sig["lmcache_hit_tokens_rate"] == pytest.approx(600.0)


def test_times_in_seconds() -> None:
    sig = signal_map(exposition(PREV), exposition(CUR))
    # 20 retrieves in (0.01, 0.02]: rank 19 of 20 -> 0.01 + 0.01 * 19/20.
    assert sig["lmcache_retrieve_time_p95"] == pytest.approx(0.0195)
    assert sig["lmcache_retrieve_time_p50"] == pytest.approx(0.015)
    assert sig["lmcache_retrieve_time_mean"] == pytest.approx(0.015)
    # 5 stores in (0.06, 0.08]: rank 4.75 of 5.
    assert sig["lmcache_store_time_p95"] == pytest.approx(0.06 + 0.02 * 4.75 / 5)
    # Remote gets are exposed in ms: 4 in (10, 50] ms -> p50 at 30 ms.
    assert sig["lmcache_remote_get_time_p50"] == pytest.approx(0.030)
    assert sig["lmcache_remote_get_time_mean"] == pytest.approx(0.020)
    assert sig["lmcache_local_cache_usage"] == 3 * GIB


@pytest.mark.parametrize(
    ("counters", "expected"),
    [
        pytest.param(True, {"lmcache_retrieve_hit_rate": 0.75, "lmcache_lookup_hit_rate": 0.9}, id="token-counters"),
        pytest.param(False, {"lmcache_retrieve_hit_rate": 0.99, "lmcache_lookup_hit_rate": 0.01}, id="gauges-only"),
    ],
)
def test_hit_rate_source(counters: bool, expected: dict[str, float]) -> None:
    sig = signal_map(exposition(PREV, counters=counters), exposition(CUR, counters=counters))
    assert {k: sig[k] for k in expected} == pytest.approx(expected)


def test_an_idle_interval_has_no_hit_rate_even_with_a_stale_gauge() -> None:
    sig = signal_map(exposition(PREV), exposition(PREV))
    assert "lmcache_retrieve_hit_rate" not in sig and "lmcache_lookup_hit_rate" not in sig
    assert sig["lmcache_retrieve_rate"] == 0
    assert not any(k.startswith("lmcache_retrieve_time") for k in sig)


def test_counter_reset_after_a_worker_restart() -> None:
    restarted = Worker(retrieves=4, requested_tokens=1000, hit_tokens=250, lookup_tokens=10, lookup_hits=5)
    sig = signal_map(exposition(CUR), exposition(restarted))
    assert sig["lmcache_retrieve_hit_rate"] == pytest.approx(0.25)
    assert sig["lmcache_retrieve_rate"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("layout", "entities"),
    [
        pytest.param([("0", "worker"), ("1", "worker")], {"0", "1"}, id="two-workers"),
        pytest.param([("0", "worker"), ("0", "scheduler")], {"0", "0/scheduler"}, id="scheduler-kept-apart"),
        pytest.param([("0", None)], {"0"}, id="no-role-label"),
    ],
)
def test_entities_are_workers(layout: list[tuple[str, str | None]], entities: set[str]) -> None:
    readings = read("".join(exposition(CUR, worker_id=w, role=r) for w, r in layout))
    assert set(readings) == entities
    assert all(r.counters["hit_tokens"] == 16000 for r in readings.values())
    assert readings["0"].attrs["model_name"] == "meta-llama/Llama-3.1-8B"


def test_created_series_are_not_counters() -> None:
    reading = read(exposition(CUR))["0"]
    assert "lmcache:num_hit_tokens_created" not in reading.families
    assert reading.counters["hit_tokens"] == 16000


@pytest.mark.parametrize(
    ("counters", "missing"),
    [
        pytest.param(True, [], id="full-registry"),
        pytest.param(False, ["lmcache:num_hit_tokens_total", "lmcache:num_requested_tokens_total"], id="gauges-only"),
    ],
)
def test_missing_families_for_a_hit_rate_policy(counters: bool, missing: list[str]) -> None:
    policy = dataclasses.replace(lmcache.FAMILIES, expected=(
        "lmcache:num_hit_tokens_total", "lmcache:num_requested_tokens_total", "lmcache:time_to_retrieve"))
    assert families.missing_families(read(exposition(CUR, counters=counters)), policy) == missing


def test_missing_families_counts_the_declared_spelling() -> None:
    readings = read(exposition(CUR, suffix=""))
    assert families.missing_families(readings, lmcache.FAMILIES) == []


def test_pipeline_subjects_name_pool_pod_and_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCES, lmcache.SOURCE.name, lmcache.SOURCE)
    targets = [Target(f"http://{pod}:8000/metrics", "prefill", pod, source="lmcache") for pod in ("p0", "p1")]
    deriver = SignalDeriver()
    deriver.derive([ScrapeResult(t, 0.0, ok=True, body=exposition(PREV)) for t in targets], 0.0)
    out = deriver.derive([ScrapeResult(t, 10.0, ok=True, body=exposition(CUR)) for t in targets], 10.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    # Both pods have a worker 0: the pod keeps their signals apart.
    for pod in ("p0", "p1"):
        assert sig[(f"lmcache/prefill/{pod}/0", "lmcache_retrieve_hit_rate")] == pytest.approx(0.75)
    assert not any(subject == "pool/prefill" and name.startswith("lmcache_") for subject, name in sig)
