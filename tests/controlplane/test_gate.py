"""The canary gate around the judge: selectors, the three sources, the consult-every-step loop, the
registry the HTTP API runs, the reports CI reads, and the endpoints Argo Rollouts and Flagger call."""

from __future__ import annotations

import asyncio
import json
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from typing import Any, cast

import httpx
import pytest

from collectors import families
from collectors.derive import Histogram
from collectors.prometheus_api import Labels, PrometheusSource
from collectors.scraper import Scraper
from collectors.types import Signal
from controlplane.actuators.base import StaticTargets
from controlplane.clock import VirtualClock
from controlplane.errors import GateError, GateInputError, StoreUnavailable
from controlplane.gate import (
    ArmSelector,
    GateBook,
    GateKey,
    GateSession,
    PromGateSource,
    StoreGateSource,
    TargetsGateSource,
    dists_of,
    report,
    rerun_after,
    run_gate,
    tpot_spelling,
)
from controlplane.lab.engine import free_port
from controlplane.loop import ControlLoop
from controlplane.server import start_server
from controlplane.sim.fleet import SimFleet
from controlplane.sim.server import SimServer, SimTargets
from controlplane.store.memory import MemoryStore
from controlplane.store.records import NewVerdict
from policies.canary import Dist, GateSettings, Interval, MetricRule, Outcome, Verdict

TPOT_ONLY = GateSettings(metrics=(MetricRule(name="tpot", critical=True),), max_window=1200)


# selectors -------------------------------------------------------------------------------------------


def test_selectors_match_labels_and_regexes_and_become_promql() -> None:
    sel = ArmSelector.parse("pool=decode,pod=~decode-canary-.*,role in (decode,unified)")
    assert sel.matches({"pool": "decode", "pod": "decode-canary-0", "role": "decode"})
    assert not sel.matches({"pool": "decode", "pod": "decode-1", "role": "decode"})
    assert not sel.matches({"pool": "decode", "pod": "xdecode-canary-0", "role": "decode"})  # matched in full
    assert sel.promql() == [("pool", "=", "decode"), ("role", "=~", "decode|unified"), ("pod", "=~", "decode-canary-.*")]
    assert ArmSelector.parse("pod!~decode-canary-.*,!version").matches({"pod": "decode-1"})


@pytest.mark.parametrize(("text", "why"), [("", "selects every pod"), ("pod=~a**", "not a regular expression"),
                                           ("pod=~(", "unbalanced"), ("a in (b", "unbalanced"),
                                           ("pod=~(?=x)y", "RE2, as PromQL"),  # no lookahead in PromQL either
                                           ("pod=~x\\1", "not a regular expression")])
def test_bad_selectors_are_refused_naming_them(text: str, why: str) -> None:
    with pytest.raises(GateError, match=why):
        ArmSelector.parse(text)


def test_a_regex_that_backtracks_exponentially_is_matched_all_the_same() -> None:
    # A backtracking engine would not finish this in the age of the universe (Python's `re` takes minutes on 40
    # characters): the test's timeout is what fails it there.
    sel = ArmSelector.parse("pod=~(.|.|.)*!")
    assert not sel.matches({"pod": "a" * 5000}) and sel.matches({"pod": "ab!"})


# the simulated fleet, scraped over HTTP -------------------------------------------------------------


@pytest.fixture
def rollout(request: pytest.FixtureRequest) -> Iterator[tuple[SimFleet, SimServer, VirtualClock]]:
    """The demo's fleet with a third of its decode pool rolled out as `canary`, `param` times slower."""
    from controlplane.demo import demo_fleet

    clock = VirtualClock()
    fleet = demo_fleet(now=clock.now())
    fleet.advance_to(clock.now() + 300)
    clock.advance(300)
    fleet.rollout("decode", "canary", 0.34, slowdown=request.param)
    clock.advance(fleet.pool_specs["decode"].startup_s + 1)  # the canary starts
    fleet.advance_to(clock.now())
    server = SimServer(fleet, gpu=False, nixl=False)
    server.sync()
    yield fleet, server, clock
    server.close()


async def _gate_over_http(fleet: SimFleet, server: SimServer, clock: VirtualClock) -> tuple[Outcome, float]:
    async with httpx.AsyncClient(timeout=2.0) as client:
        scraper = Scraper(client, timeout_s=2.0)
        base, can = ArmSelector.parse("pool=decode,pod!~decode-canary-.*"), ArmSelector.parse("pod=~decode-canary-.*")
        source = TargetsGateSource(scraper, SimTargets(server), base, can, TPOT_ONLY.metrics)
        session = GateSession(source, TPOT_ONLY, clock.now())
        await source.interval(clock.now() - 30, clock.now())  # the first scrape is the baseline of the deltas
        while True:
            clock.advance(30)
            fleet.advance_to(clock.now())
            server.sync()
            verdict = await session.consult(clock.now())
            if verdict.decided:
                return verdict.outcome, verdict.ended_at - verdict.started_at


@pytest.mark.parametrize("rollout", [1.3], indirect=True)
async def test_a_slower_canary_fails_from_the_pods_own_metrics(rollout: tuple[SimFleet, SimServer, VirtualClock]) -> None:
    outcome, after = await _gate_over_http(*rollout)
    assert outcome is Outcome.FAIL and after <= 600


@pytest.mark.parametrize("rollout", [1.0], indirect=True)
async def test_the_same_version_as_a_canary_does_not_fail(rollout: tuple[SimFleet, SimServer, VirtualClock]) -> None:
    outcome, _ = await _gate_over_http(*rollout)
    assert outcome in (Outcome.PASS, Outcome.INCONCLUSIVE)


# the store -------------------------------------------------------------------------------------------


async def test_the_store_source_reads_tpot_as_the_inter_token_latency_where_an_arm_lacks_the_per_request_one(
        ) -> None:
    # The baseline runs a vLLM before the per-request TPOT histogram (its stored TPOT is the inter-token latency), the
    # canary one after it: same speed per token, but a per-request mean of short and long answers reads 3x higher.
    store = MemoryStore()
    signals = []
    for ts in (100.0, 115.0, 130.0):
        for pod, tpot, per_request in (("decode-0", 0.02, 0.0), ("decode-canary-0", 0.06, 1.0)):
            subject = f"engine/decode/{pod}/0"
            signals += [Signal(ts, subject, "request_rate", 2.0), Signal(ts, subject, "tpot_mean", tpot),
                        Signal(ts, subject, "tpot_per_request", per_request), Signal(ts, subject, "itl_mean", 0.02),
                        Signal(ts, subject, "generation_tokens_rate", 100.0)]
    await store.write_signals(signals)
    src = StoreGateSource(store, "decode", ArmSelector.parse("pod!~.*canary.*"), ArmSelector.parse("pod=~.*canary.*"),
                          (MetricRule(name="tpot"),))
    iv = await src.interval(100.0, 130.0)
    assert iv.baseline["tpot"].statistic("mean") == iv.canary["tpot"].statistic("mean") == pytest.approx(0.02)
    assert iv.canary["tpot"].count == pytest.approx(2 * 100.0 * 15), "weighted by tokens, as the latency is"


async def test_the_store_source_weights_each_engines_mean_by_its_requests() -> None:
    store = MemoryStore()
    signals = []
    for k, ts in enumerate((100.0, 115.0, 130.0)):
        for pod, rate, tpot in (("decode-0", 2.0, 0.010), ("decode-1", 4.0, 0.013), ("decode-canary-0", 1.0, 0.020)):
            subject = f"engine/decode/{pod}/0"
            signals += [Signal(ts, subject, "request_rate", rate), Signal(ts, subject, "tpot_mean", tpot + k * 0.001),
                        Signal(ts, subject, "request_error_rate", 0.1 if "canary" in pod else 0.0)]
    signals.append(Signal(130.0, "engine/prefill/decode-canary-0/0", "tpot_mean", 9.0))  # another pool: ignored
    await store.write_signals(signals)
    rules = (MetricRule(name="tpot"), MetricRule(name="error_rate", allowed=0.01))
    src = StoreGateSource(store, "decode", ArmSelector.parse("pod!~.*canary.*"), ArmSelector.parse("pod=~.*canary.*"),
                          rules)
    iv = await src.interval(100.0, 130.0)
    # two points in (100, 130], each 15 s of requests: baseline (2*15 at .011, 4*15 at .014) then (.012, .015)
    b = iv.baseline["tpot"]
    assert b.count == pytest.approx(2 * (2 + 4) * 15)
    assert b.statistic("mean") == pytest.approx((30 * 0.011 + 60 * 0.014 + 30 * 0.012 + 60 * 0.015) / 180)
    assert iv.canary["tpot"].statistic("mean") == pytest.approx(0.0215)
    assert iv.canary["error_rate"].statistic("mean") == pytest.approx(0.1) and iv.baseline["error_rate"].total == 0
    with pytest.raises(GateError, match="cannot be merged"):
        StoreGateSource(store, "decode", ArmSelector.parse("pod=a"), ArmSelector.parse("pod=b"),
                        (MetricRule(name="tpot", statistic="p95"),))
    with pytest.raises(GateError, match=r"\['kv_cache_usage'\] cannot be read"):
        StoreGateSource(store, "decode", ArmSelector.parse("pod=a"), ArmSelector.parse("pod=b"),
                        (MetricRule(name="kv_cache_usage"),))
    # The pool's role from the fleet file: a selector on it matches; one on a label the store does not know is refused
    # (it would match no pod, or all, and the gate wait its window for nothing).
    by_role = StoreGateSource(store, "decode", ArmSelector.parse("role=decode,pod!~.*canary.*"),
                              ArmSelector.parse("role=decode,pod=~.*canary.*"), rules, role="decode")
    assert (await by_role.interval(100.0, 130.0)).canary["tpot"].count > 0
    with pytest.raises(GateInputError, match="names role: the store knows the engines' pod, pool"):
        StoreGateSource(store, "decode", ArmSelector.parse("role=decode"), ArmSelector.parse("pod=b"), rules)
    with pytest.raises(GateInputError, match="names app"):
        StoreGateSource(store, "decode", ArmSelector.parse("app=vllm"), ArmSelector.parse("pod=b"), rules)

    class Down:
        async def load_signals(self, since: float, names: object = None, until: object = None) -> list[Signal]:
            raise StoreUnavailable("store postgresql://fleet@db/fleet: connection refused")

    with pytest.raises(GateError, match="connection refused") as failed:  # a failed step, which the gate's patience covers
        await StoreGateSource(Down(), "decode", ArmSelector.parse("pod=a"), ArmSelector.parse("pod=b"), rules).interval(
            100.0, 130.0)
    assert not isinstance(failed.value, StoreUnavailable)
    overlapping = StoreGateSource(store, "decode", ArmSelector.parse("pod=~decode-.*"),
                                  ArmSelector.parse("pod=~.*canary.*"), rules)
    with pytest.raises(GateInputError, match="decode-canary-0 matches both"):
        await overlapping.interval(100.0, 130.0)


async def test_the_store_source_skips_a_step_in_which_a_canary_pod_fails_its_scrapes() -> None:
    # The loop's scrapes of decode-canary-1 fail from 160 on: judged on decode-canary-0 alone, the canary would look
    # healthy. One that has not answered yet is starting; one no longer scraped (deleted, or out of discovery's Ready
    # pods) is not asked.
    store = MemoryStore()
    signals = []
    for ts in range(100, 250, 15):
        for pod in ("decode-0", "decode-canary-0", "decode-canary-1"):
            up = not (pod == "decode-canary-1" and (ts < 115 or 160 <= ts <= 190))
            if pod == "decode-canary-1" and ts > 190:
                continue  # deleted
            stamp = ts + 0.5 * len(pod)  # each target at its own offset within the tick
            signals.append(Signal(stamp, f"target/decode/{pod}/vllm", "up", float(up)))
            if up:
                signals += [Signal(stamp, f"engine/decode/{pod}/0", "request_rate", 2.0),
                            Signal(stamp, f"engine/decode/{pod}/0", "tpot_mean", 0.01)]
    signals.append(Signal(170.0, "target/decode/decode-0/lmcache", "up", 0.0))  # not the engine
    await store.write_signals(signals)
    rules = (MetricRule(name="tpot"),)
    src = StoreGateSource(store, "decode", ArmSelector.parse("pod!~.*canary.*"), ArmSelector.parse("pod=~.*canary.*"),
                          rules)
    outcomes = []
    for t in range(95, 250, 15):
        try:
            await src.interval(float(t), t + 15.0)
            outcomes.append("ok")
        except GateError as exc:
            assert "decode-canary-1 failing the control plane's scrapes" in str(exc)
            outcomes.append("down")
    # (95, 110]: not answered yet; (110, 155]: answering; (155, 200]: failing; then deleted: its last scrape failed,
    # which holds a step longer (a scrape stamped late in a step may be written after the step is read).
    assert outcomes == ["ok"] * 4 + ["down"] * 4 + ["ok"] * 3


async def test_the_store_source_counts_the_canarys_restarts_a_failed_step_included() -> None:
    # The loop's scrapes record a restart when a pod's process start moves on (`restarts`); the baseline's are no
    # canary's fault, and one recorded in a step that failed (another canary pod down) goes in the next step.
    store = MemoryStore()
    signals = []
    for ts in range(100, 200, 10):
        for pod in ("decode-0", "decode-canary-0", "decode-canary-1"):
            up = not (pod == "decode-canary-1" and 130 < ts <= 150)
            signals.append(Signal(ts, f"target/decode/{pod}/vllm", "up", float(up)))
            signals += [Signal(ts, f"engine/decode/{pod}/0", "request_rate", 2.0),
                        Signal(ts, f"engine/decode/{pod}/0", "tpot_mean", 0.01)]
    signals += [Signal(140.0, "target/decode/decode-canary-0/vllm", "restarts", 1.0),
                Signal(140.0, "target/decode/decode-0/vllm", "restarts", 1.0),
                Signal(170.0, "target/decode/decode-canary-1/vllm", "restarts", 1.0)]
    await store.write_signals(signals)
    src = StoreGateSource(store, "decode", ArmSelector.parse("pod!~.*canary.*"), ArmSelector.parse("pod=~.*canary.*"),
                          (MetricRule(name="tpot"),))
    assert (await src.interval(110.0, 130.0)).restarted == ()
    with pytest.raises(GateError, match="decode-canary-1 failing"):
        await src.interval(130.0, 150.0)
    assert (await src.interval(150.0, 170.0)).restarted == ("decode-canary-0", "decode-canary-1")
    assert (await src.interval(170.0, 190.0)).restarted == ()
    # A step the store failed to give: its restart is counted in the next step read.
    await store.write_signals([Signal(195.0, "target/decode/decode-canary-0/vllm", "restarts", 1.0)])
    down = StoreUnavailable("the database restarts")

    async def failing(*args: Any, **kwargs: Any) -> list[Signal]:
        raise down

    read, store.load_signals = store.load_signals, failing  # type: ignore[method-assign]
    with pytest.raises(GateError, match="the database restarts"):
        await src.interval(190.0, 210.0)
    store.load_signals = read  # type: ignore[method-assign]
    assert (await src.interval(210.0, 230.0)).restarted == ("decode-canary-0",)


# Prometheus ------------------------------------------------------------------------------------------


class FakePrometheus:
    """A `PrometheusConnect` stand-in that answers the gate's queries from canned numbers (a double: the
    real Prometheus is exercised by the collectors' agreement tests)."""

    def __init__(self, baseline_pods: tuple[str, ...] = ("decode-0", "decode-1"), down: tuple[str, ...] = (),
                 served: tuple[str, ...] = ("decode-canary-0",), samples: int = 2) -> None:
        self.queries: list[str] = []
        self.baseline_pods, self.down, self.served, self.samples = baseline_pods, down, served, samples
        self.started = dict.fromkeys(served, 1.7e9)  # each canary pod's process start

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
        self.queries.append(query)
        canary = 'pod=~".*canary.*"' in query
        if query.startswith("up{"):  # asked by instance: the canary's that served in this gate
            assert query.startswith('up{instance=~"') and query.endswith('"} == 0'), query
            return [{"metric": {"pod": p, "instance": f"{p}:8000"}, "value": [0, "0"]} for p in self.down
                    if f"{p}:8000" in query.replace("\\\\", "")]
        if query.startswith('max by (pod, instance) (process_start_time_seconds{instance=~"'):
            return [{"metric": {"pod": p, "instance": f"{p}:8000"}, "value": [0, str(t)]}
                    for p, t in self.started.items() if p not in self.down and f"{p}:8000" in query.replace("\\", "")]
        if query.startswith("group by (pod, instance) (last_over_time(vllm:num_requests_running{"):
            return [{"metric": {"pod": p, "instance": f"{p}:8000"}, "value": [0, "1"]}
                    for p in (self.served if canary else self.baseline_pods)]
        if query.startswith("max(count_over_time(vllm:num_requests_running{"):
            return [{"metric": {}, "value": [0, str(self.samples)]}]
        if query.startswith("count(last_over_time(vllm:request_time_per_output_token_seconds_count"):
            return [{"metric": {}, "value": [0, "3"]}]
        if query.startswith("count(last_over_time("):
            return []
        if "_bucket" in query:
            counts = (5, 40, 50) if canary else (50, 90, 100)
            return [{"metric": {"le": le}, "value": [0, str(c)]} for le, c in zip(("0.01", "0.025", "+Inf"), counts,
                                                                                    strict=True)]
        if "_sum" in query:
            return [{"metric": {}, "value": [0, "1.0" if canary else "1.5"]}]
        if "_count" in query:
            return [{"metric": {}, "value": [0, "50" if canary else "100"]}]
        if 'finished_reason="error"' in query:
            return [{"metric": {}, "value": [0, "1" if canary else "0"]}]
        if "request_success_total" in query:
            return [{"metric": {}, "value": [0, "50" if canary else "100"]}]
        raise AssertionError(query)

    def close(self) -> None:
        pass


def arms(prom: PrometheusSource, rules: tuple[MetricRule, ...]) -> PromGateSource:
    """The decode pool's canary pods against the others, read from `prom`."""
    return PromGateSource(prom, ArmSelector.parse("pool=decode,pod!~.*canary.*"),
                          ArmSelector.parse("pool=decode,pod=~.*canary.*"), rules)


async def test_the_prometheus_source_reads_bucket_sum_and_count_increases_per_arm() -> None:
    fake = FakePrometheus()
    prom = PrometheusSource("http://prometheus.invalid", client=fake)
    rules = (MetricRule(name="tpot"), MetricRule(name="error_rate", allowed=0.01))
    src = PromGateSource(prom, ArmSelector.parse('pool=decode,pod!~.*canary.*'),
                         ArmSelector.parse('pool=decode,pod=~.*canary.*,team=~a"b'), rules)
    iv = await src.interval(0.0, 30.0)
    assert iv.canary["tpot"].statistic("mean") == pytest.approx(0.02) and iv.baseline["tpot"].count == 100
    assert iv.canary["tpot"].buckets[-1] == (math.inf, 50.0)
    assert iv.canary["error_rate"].statistic("mean") == pytest.approx(0.02)
    assert any('team=~"a\\"b"' in q for q in fake.queries)  # label values escaped
    assert all("[30s]" in q for q in fake.queries if not q.startswith(("up{", "max by (pod, instance) (process_")))
    # the spelling each arm has is looked up once and kept
    assert sum(q.startswith("count(last_over_time(") for q in fake.queries) == 2
    await src.interval(30.0, 60.0)
    assert sum(q.startswith("count(last_over_time(") for q in fake.queries) == 2


async def test_a_step_no_longer_than_prometheus_scrape_interval_is_refused_at_once() -> None:
    # One sample of each series a step: increase() has nothing to go on, and every step would read empty.
    prom = PrometheusSource("http://prometheus.invalid", client=FakePrometheus(samples=1))
    src = arms(prom, (MetricRule(name="tpot"),))
    with pytest.raises(GateInputError, match="holds 1 sample of the baseline's series in a step of 30s"):
        await src.interval(0.0, 30.0)


async def test_arms_that_overlap_are_refused_at_once() -> None:
    # A baseline regex that also matches the canary's pods: the canary diluted into its own baseline reads a
    # regression smaller than it is, so the gate stops (exit 3) on the first step rather than judge it.
    fake = FakePrometheus(baseline_pods=("decode-0", "decode-canary-0"))
    prom = PrometheusSource("http://prometheus.invalid", client=fake)
    rules = (MetricRule(name="tpot"),)
    src = PromGateSource(prom, ArmSelector.parse("pool=decode,pod=~decode-.*"),
                         ArmSelector.parse("pool=decode,pod=~.*canary.*"), rules)
    session = GateSession(src, GateSettings(metrics=rules), 0.0)
    with pytest.raises(GateInputError, match="decode-canary-0 match both"):
        await session.consult(30.0)
    with pytest.raises(GateInputError, match="are the same"):
        PromGateSource(prom, ArmSelector.parse("pool=decode"), ArmSelector.parse("pool=decode"), rules)


async def test_the_fleet_files_selector_and_label_names_narrow_every_query() -> None:
    # One Prometheus holding staging and production, and a pod label relabelled: the gate reads only what the fleet
    # file's prometheus section reads, under its label names.
    seen: list[str] = []

    class Recording:
        def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
            seen.append(query)
            return []

        def close(self) -> None:
            pass

    prom = PrometheusSource("http://prometheus.invalid", client=Recording(), selector={"namespace": "llm"},
                            labels=Labels(pool="llm_pool", pod="kubernetes_pod_name"))
    src = arms(prom, (MetricRule(name="tpot"),))
    await src.interval(0.0, 30.0)
    assert seen and all('namespace="llm"' in q and 'llm_pool="decode"' in q for q in seen)
    assert any('kubernetes_pod_name=~".*canary.*"' in q for q in seen)
    assert not any("pod=" in q.replace("kubernetes_pod_name", "") or "pool=" in q.replace("llm_pool", "") for q in seen)


def test_a_prometheus_url_given_on_the_command_line_keeps_the_fleet_files_selector_and_labels() -> None:
    # `fleetctl gate --fleet F --prometheus-url U` (a port-forward, say) reads the same series the fleet file's section
    # names, at another address: before, the URL dropped the selector and mixed staging into production's baseline.
    from controlplane.config import parse_config
    from controlplane.runtime import prometheus_source

    cfg = parse_config("pools: [{name: decode, role: decode, model: m, replicas: {min: 1, max: 2}}]\n"
                       "prometheus: {url: 'http://prometheus.llm:9090', selector: {namespace: llm}, "
                       "pod_label: kubernetes_pod_name, pool_label: llm_pool}\n")
    prom = prometheus_source(cfg, url="http://127.0.0.1:9090")
    try:
        assert prom.url == "http://127.0.0.1:9090" and prom.matchers == [("namespace", "=", "llm")]
        assert (prom.labels.pod, prom.labels.pool) == ("kubernetes_pod_name", "llm_pool")
    finally:
        prom.close()


async def test_a_step_with_a_canary_pod_down_does_not_count() -> None:
    # Its requests fail before vLLM counts them, and it drops out of the arm's sums: judged on the healthy pods alone,
    # a crash-looping canary would pass. The step is a failed read; five in a row stop the gate (exit 3).
    fake = FakePrometheus(down=("decode-canary-1",), served=())  # still loading its model: starting, not down
    rules = (MetricRule(name="tpot"),)
    src = arms(PrometheusSource("http://prometheus.invalid", client=fake), rules)
    await src.interval(0.0, 30.0)
    fake.down, fake.served = (), ("decode-canary-0", "decode-canary-1")
    await src.interval(30.0, 60.0)
    fake.down, fake.served = ("decode-canary-1",), ("decode-canary-0",)  # served before, gone from this step's series
    with pytest.raises(GateError, match="decode-canary-1 not answering"):
        await src.interval(60.0, 90.0)
    session = GateSession(src, GateSettings(metrics=rules), 0.0)
    with pytest.raises(GateError, match="5 steps in a row without data"):
        await session.consult(300.0)


async def test_the_prometheus_source_counts_a_canary_pods_restarts_a_failed_step_included() -> None:
    # A canary that crash-loops serves its requests between crashes as fast as the baseline: its restarts fail the
    # gate. One read in a step that failed (another canary pod down) counts in the next step read.
    fake = FakePrometheus(served=("decode-canary-0", "decode-canary-1"))
    src = arms(PrometheusSource("http://prometheus.invalid", client=fake), (MetricRule(name="tpot"),))
    assert (await src.interval(0.0, 30.0)).restarted == ()
    fake.started["decode-canary-0"] += 95.0
    fake.down = ("decode-canary-1",)
    with pytest.raises(GateError, match="decode-canary-1 not answering"):
        await src.interval(30.0, 60.0)
    fake.down = ()
    fake.started["decode-canary-1"] += 0.004  # the same process, read at another rounding
    assert (await src.interval(60.0, 90.0)).restarted == ("decode-canary-0",)
    assert (await src.interval(90.0, 120.0)).restarted == ()
    assert 'max by (pod, instance) (process_start_time_seconds{instance=~"decode-canary-0:8000|decode-canary-1:8000"})' \
        in fake.queries


async def test_tpot_is_read_from_the_inter_token_latency_for_both_arms_where_one_lacks_it() -> None:
    class OldBaseline(FakePrometheus):  # the baseline on a vLLM before the per-request TPOT histogram
        def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
            if 'pod=~".*canary.*"' not in query and "request_time_per_output_token" in query:
                self.queries.append(query)
                return []
            if query.startswith("count(last_over_time(vllm:inter_token_latency_seconds_count"):
                self.queries.append(query)
                return [{"metric": {}, "value": [0, "1"]}]
            return super().custom_query(query, params)

    fake = OldBaseline()
    src = arms(PrometheusSource("http://prometheus.invalid", client=fake), (MetricRule(name="tpot"),))
    iv = await src.interval(0.0, 30.0)
    assert iv.baseline["tpot"].count == 100 and iv.canary["tpot"].count == 50
    read = [q for q in fake.queries if "_bucket" in q]
    assert len(read) == 2 and all("vllm:inter_token_latency_seconds_bucket" in q for q in read), read


async def test_tpot_is_not_read_until_both_arms_export_it_then_read_the_same_way_throughout() -> None:
    # The canary not serving yet: the baseline's TPOT is not read as the inter-token latency meanwhile, which would
    # merge into the first block beside the canary's per-request TPOT.
    class Late(FakePrometheus):
        serving = False

        def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
            if 'pod=~".*canary.*"' in query and not self.serving and not query.startswith(("group by", "up{")):
                self.queries.append(query)
                return []
            return super().custom_query(query, params)

    fake = Late()
    src = arms(PrometheusSource("http://prometheus.invalid", client=fake), (MetricRule(name="tpot"),))
    early = await src.interval(0.0, 30.0)
    assert "tpot" not in early.baseline and not any("inter_token" in q and "_bucket" in q for q in fake.queries)
    fake.serving = True
    later = await src.interval(30.0, 60.0)
    assert later.baseline["tpot"].count == 100 and later.canary["tpot"].count == 50


async def test_each_arm_is_read_in_the_histogram_spelling_it_exports() -> None:
    class Mixed(FakePrometheus):  # the baseline on an older vLLM: its inter-token latency has the old name
        def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
            self.queries.append(query)
            canary = 'pod=~".*canary.*"' in query
            has = "vllm:inter_token_latency_seconds" if canary else "vllm:time_per_output_token_seconds"
            if has not in query:
                return []
            if query.startswith("count("):
                return [{"metric": {}, "value": [0, "1"]}]
            return super().custom_query(query.replace(has, "x"), params)

    prom = PrometheusSource("http://prometheus.invalid", client=Mixed())
    src = arms(prom, (MetricRule(name="itl"),))
    iv = await src.interval(0.0, 30.0)
    assert iv.baseline["itl"].count == 100 and iv.canary["itl"].count == 50


def test_both_arms_read_tpot_from_the_same_histogram() -> None:
    def engine(*hists: str) -> families.Delta:
        return families.Delta(30.0, histograms={h: Histogram(((0.01, 5.0), (math.inf, 10.0)), 0.1, 10.0) for h in hists})

    old, new = [engine("itl")], [engine("tpot", "itl")]
    assert tpot_spelling([*new, *new]) == {}
    assert tpot_spelling([*old, *new]) == {"tpot": "itl"}, "a per-request mean is not compared with a token-weighted one"
    assert dists_of(new, ["tpot"], tpot_spelling([*old, *new]))["tpot"].count == 10.0
    assert dists_of(new, ["tpot"]) == dists_of(new, ["tpot"], {})


# the loop, the registry, the reports ------------------------------------------------------------------


class Scripted:
    """A gate source that answers from a list of intervals, failing where an entry is None."""

    def __init__(self, intervals: Sequence[Interval | None], settle: float = 0.0) -> None:
        self.intervals = list(intervals)
        self.calls = 0
        self.settle = settle

    async def interval(self, start: float, end: float) -> Interval:
        self.calls += 1
        nxt = self.intervals.pop(0) if self.intervals else self.make(1.0)
        if nxt is None:
            raise GateError("target down")
        return Interval(start, end, nxt.baseline, nxt.canary)

    @staticmethod
    def make(ratio: float) -> Interval:
        return Interval(0, 30, {"tpot": Dist(100.0, 100.0 * 0.01)}, {"tpot": Dist(30.0, 30.0 * 0.01 * ratio)})


def jittered(ratio: float, n: int) -> list[Interval | None]:
    return [Scripted.make(ratio * (1 + 0.01 * ((i * 7) % 5 - 2))) for i in range(n)]


async def test_run_gate_consults_every_step_and_stops_at_the_first_decision() -> None:
    clock = VirtualClock()
    seen: list[Outcome] = []
    verdict = await run_gate(Scripted(jittered(1.2, 60)), TPOT_ONLY, clock, on_step=lambda v: seen.append(v.outcome))
    assert verdict.outcome is Outcome.FAIL and verdict.decided
    assert seen[-1] is Outcome.FAIL and all(o is Outcome.INCONCLUSIVE for o in seen[:-1]) and len(seen) >= 6
    assert clock.now() - verdict.started_at == pytest.approx(30 * len(seen))


async def test_a_catch_up_answers_as_a_gate_asked_every_step_would() -> None:
    # Six steps of a canary 20 % slower, then a better one: asked every step, the gate fails it at the sixth. A replica
    # first asked twenty minutes in (another one started the gate), or a past start, must not pass it on the whole.
    steps = [*jittered(1.2, 6), *jittered(0.8, 40)]
    live = GateSession(Scripted(list(steps)), TPOT_ONLY, 0.0)
    for k in range(1, 41):
        asked = await live.consult(30.0 * k)
        if asked.decided:
            break
    assert asked.outcome is Outcome.FAIL and asked.ended_at == 180.0
    late = await GateSession(Scripted(list(steps)), TPOT_ONLY, 0.0).consult(1200.0)
    assert (late.outcome, late.ended_at) == (Outcome.FAIL, 180.0)
    past = await run_gate(Scripted(list(steps)), TPOT_ONLY, VirtualClock(1200.0), start=0.0)
    assert (past.outcome, past.ended_at) == (Outcome.FAIL, 180.0)


async def test_a_step_is_read_only_once_its_scrapes_are_written() -> None:
    # The loop stamps a scrape when its round starts and writes it when the round ends: read at the step's end, the
    # store would lack the last round's points, and the next step, which starts there, would never read them.
    source = Scripted(jittered(1.2, 60), settle=15.0)
    session = GateSession(source, TPOT_ONLY, 0.0)
    assert (await session.consult(30.0)).reason == "no step has produced data yet" and source.calls == 0
    await session.consult(45.0)
    assert source.calls == 1 and session.next_step_at == 75.0
    clock = VirtualClock(0.0)
    verdict = await run_gate(Scripted(jittered(1.2, 60), settle=15.0), TPOT_ONLY, clock)
    assert clock.now() == verdict.ended_at + 15.0


async def test_a_source_down_for_a_while_is_tolerated_and_one_that_stays_down_is_an_error() -> None:
    flaky = Scripted([None, None, None, *jittered(1.0, 80)])
    verdict = await run_gate(flaky, TPOT_ONLY, VirtualClock())
    assert verdict.outcome is Outcome.PASS
    with pytest.raises(GateError, match="5 steps in a row without data: target down"):
        await run_gate(Scripted([None] * 10), TPOT_ONLY, VirtualClock())


async def test_a_past_start_judges_the_history_at_once() -> None:
    clock = VirtualClock()
    verdict = await run_gate(Scripted(jittered(1.2, 60)), TPOT_ONLY, clock, start=clock.now() - 1800)
    assert verdict.outcome is Outcome.FAIL and clock.now() == pytest.approx(1_767_225_600.0)


async def test_the_gate_book_keeps_one_session_per_rollout_and_records_the_decision_once() -> None:
    recorded: list[NewVerdict] = []

    async def record(v: NewVerdict) -> int:
        recorded.append(v)
        return len(recorded)

    sources: list[Scripted] = []

    def make(pool: str, base: ArmSelector, can: ArmSelector, rules: Sequence[MetricRule]) -> Scripted:
        sources.append(Scripted(jittered(1.2, 100)))
        return sources[-1]

    book = GateBook(make, TPOT_ONLY, record)
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t = 1000.0
    first = await book.consult(key, t)
    assert first.outcome is Outcome.INCONCLUSIVE and not first.decided and len(sources) == 1
    while not (v := await book.consult(key, t)).decided:
        t += 30
    assert v.outcome is Outcome.FAIL and len(sources) == 1
    assert (await book.consult(key, t + 30)).outcome is Outcome.FAIL  # an answer lost, asked again
    assert (await book.consult(key, t + 600, reruns=False)).outcome is Outcome.FAIL  # Flagger's hooks, late
    assert len(recorded) == 1 and recorded[0].result == "fail" and recorded[0].details["revision"] == "rev-2"
    await book.consult(GateKey("decode", "pod=a", "pod=b", "rev-3"), t)  # a new revision: a new gate
    assert len(sources) == 2
    with pytest.raises(GateError, match="selects every pod"):
        await book.consult(GateKey("decode", "", "pod=b"), t)
    for i in range(100):  # requests that start nothing leave nothing behind
        with pytest.raises(GateError):
            await book.consult(GateKey("decode", "", f"pod=b{i}"), t)
    assert len(book._locks) == len(book._sessions) == 2


class Fixed:
    """A gate source whose canary is 20 % slower until `fixed_at`, then as fast as the baseline: time-driven, as two
    replicas reading one store see it."""

    settle = 0.0

    def __init__(self, fixed_at: float) -> None:
        self.fixed_at = fixed_at

    async def interval(self, start: float, end: float) -> Interval:
        ratio = 1.2 if start < self.fixed_at else 1.0
        step = Scripted.make(ratio * (1 + 0.01 * ((round(start / 30) * 7) % 5 - 2)))
        return Interval(start, end, step.baseline, step.canary)


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_retried_rollout_of_the_same_revision_is_judged_afresh(replicas: int) -> None:
    # Aborted on a fail, then `kubectl argo rollouts retry` minutes later, the node's noisy neighbour gone: the same
    # pod-template hash, so the same gate key. Answering the old fail would abort the retry at once.
    store = MemoryStore()
    recorded: list[NewVerdict] = []

    async def record(v: NewVerdict) -> int:
        recorded.append(v)
        return len(recorded)

    source = Fixed(fixed_at=1600.0)
    books = [GateBook(lambda *_: source, TPOT_ONLY, record, claim=store.claim if replicas > 1 else None)
             for _ in range(replicas)]
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t, asked = 1000.0, 0

    async def ask() -> Verdict:
        nonlocal asked
        asked += 1
        return await books[asked % replicas].consult(key, t)  # the Service alternates between replicas

    while not (v := await ask()).decided:
        t += 30
    assert v.outcome is Outcome.FAIL and t < 1600.0
    t += 30
    assert (await ask()).outcome is Outcome.FAIL, "an answer lost and asked again at the next step: the same run"
    t = max(t + rerun_after(TPOT_ONLY) + 30, 1600.0)
    retried = await ask()
    assert not retried.decided and retried.started_at == t
    while not (v := await ask()).decided:
        t += 30
    assert v.outcome is Outcome.PASS and v.started_at == retried.started_at >= 1600.0
    assert [r.result for r in recorded] == ["fail", "pass"], "each run recorded once"
    # A pass stays the answer however late it is asked: it promoted, and a person reading it starts nothing.
    t += 1200.0
    assert (await ask()).outcome is Outcome.PASS and len(recorded) == 2


class ServesFrom:
    """The canary gets no traffic until `served_from`, then serves as fast as the baseline."""

    settle = 0.0

    def __init__(self, served_from: float) -> None:
        self.served_from = served_from

    async def interval(self, start: float, end: float) -> Interval:
        k = round(start / 30)
        canary = {"tpot": Dist(100.0, 1.0 + 0.01 * ((k * 7) % 5 - 2))} if start >= self.served_from else {}
        return Interval(start, end, {"tpot": Dist(100.0, 1.0)}, canary)


@pytest.mark.parametrize("claim", [False, True])
async def test_a_retry_after_an_inconclusive_analysis_is_judged_afresh(claim: bool) -> None:
    """An analysis that ended Inconclusive (no traffic reached the canary) pauses the rollout; retried, same revision,
    the gate answered the old run's decided inconclusive at every measurement, whatever the canary then did."""
    store = MemoryStore()
    settings = GateSettings(metrics=(MetricRule(name="tpot", critical=True),), max_window=1800)
    book = GateBook(lambda *_: ServesFrom(3000.0), settings, claim=store.claim if claim else None)
    key = GateKey("decode", "pod=~decode-aaa-.*", "pod=~decode-bbb-.*", "bbb")
    t = 0.0
    while not (v := await book.consult(key, t)).decided:
        t += 30
    assert v.outcome is Outcome.INCONCLUSIVE
    t += 600  # paused; a person retries ten minutes later, and traffic now reaches the canary
    retried = t
    answers = []
    for _ in range(61):
        answers.append(await book.consult(key, t))
        t += 30
    assert answers[0].started_at == retried and any(a.outcome is Outcome.PASS for a in answers)


@pytest.mark.parametrize("first", [1, 2])
async def test_a_retry_after_an_inconclusive_analysis_is_a_new_run_on_every_replica(first: int) -> None:
    """Two replicas: the one Argo asked to the end decided Inconclusive; the other, asked at the start only, holds
    the run undecided, and a third has never held it. Retried, the retry reaching either joined the old run, whose
    window was over: it answered Inconclusive at once, whatever the canary did."""
    store = MemoryStore()
    settings = GateSettings(metrics=(MetricRule(name="tpot", critical=True),), max_window=1800)
    books = [GateBook(lambda *_: ServesFrom(3000.0), settings, claim=store.claim) for _ in range(3)]
    key = GateKey("decode", "pod=~decode-aaa-.*", "pod=~decode-bbb-.*", "bbb")
    assert not (await books[1].consult(key, 0.0)).decided
    t = 30.0
    while not (v := await books[0].consult(key, t)).decided:
        t += 30
    await books[0].settled()
    assert v.outcome is Outcome.INCONCLUSIVE
    t += 600  # paused; a person retries ten minutes later, and traffic now reaches the canary
    for book in (books[first], books[3 - first]):
        retried = await book.consult(key, t)
        assert not retried.decided and retried.started_at == t


async def test_a_retry_is_told_from_the_same_run_though_the_store_refused_to_mark_the_fail() -> None:
    store = MemoryStore()
    refused: list[str] = []

    async def claim(key: str, value: float, stale_before: float) -> tuple[float, bool]:
        if key.startswith("gate-failed:") and value > 0 and not refused:
            refused.append(key)
            raise StoreUnavailable("the store is down")
        return await store.claim(key, value, stale_before)

    book = GateBook(lambda *_: Fixed(fixed_at=1600.0), TPOT_ONLY, claim=claim)
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t = 1000.0
    while not (v := await book.consult(key, t)).decided:
        t += 30
    assert v.outcome is Outcome.FAIL and refused
    retried = await book.consult(key, t + rerun_after(TPOT_ONLY) + 30)
    assert not retried.decided and retried.started_at == t + rerun_after(TPOT_ONLY) + 30


async def test_a_replica_that_never_held_a_long_analysis_joins_it_and_a_later_rollout_starts_afresh() -> None:
    # Flagger's hooks ask past two windows (its own analysis is longer); a replica restarted meanwhile gets the next
    # question. It is the same run, not an earlier rollout's under the same key.
    store = MemoryStore()
    books = [GateBook(lambda *_: Scripted(jittered(1.0, 400)), TPOT_ONLY, claim=store.claim) for _ in range(2)]
    key = GateKey("decode", "pod=a", "pod=b", "ns/decode@7f")
    t = 1000.0
    while t < 1000.0 + 2 * TPOT_ONLY.max_window + 300:
        first = await books[0].consult(key, t, reruns=False)
        await books[0].settled()  # its mark, written beside the answer
        t += 60
    joined = await books[1].consult(key, t, reruns=False)
    assert joined.started_at == first.started_at == 1000.0 and joined.outcome is first.outcome
    # Nobody asked for two windows: the same key again is a later rollout's, judged from then.
    later = t + 2 * TPOT_ONLY.max_window + 60
    assert (await GateBook(lambda *_: Scripted(jittered(1.0, 400)), TPOT_ONLY, claim=store.claim).consult(
        key, later, reruns=False)).started_at == later


async def test_a_replica_first_asked_late_joins_the_run_that_began_at_time_zero() -> None:
    store = MemoryStore()
    books = [GateBook(lambda *_: Scripted(jittered(1.0, 200)), TPOT_ONLY, claim=store.claim) for _ in range(2)]
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    await books[0].consult(key, 0.0)
    assert (await books[1].consult(key, 400.0)).started_at == 0.0


async def test_a_gate_that_fails_while_its_analysis_asks_less_often_than_its_step_is_not_rerun_within_it() -> None:
    # Argo asking every 2 minutes, the gate's step 30 s: a fail asked again a minute later is the same run.
    store = MemoryStore()
    book = GateBook(lambda *_: Fixed(fixed_at=10_000.0), TPOT_ONLY, claim=store.claim)
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t = 1000.0
    while not (v := await book.consult(key, t)).decided:
        t += 120
    again = await book.consult(key, t + 120)
    assert v.outcome is again.outcome is Outcome.FAIL and again.started_at == v.started_at


async def test_a_verdict_the_store_refused_is_still_the_answer_and_is_recorded_at_a_later_consultation() -> None:
    recorded: list[NewVerdict] = []
    refusals = [StoreUnavailable("the store is down")]
    store_back = asyncio.Event()

    async def record(v: NewVerdict) -> int:
        if refusals:
            raise refusals.pop()
        await store_back.wait()  # the store hangs until it is back
        recorded.append(v)
        return len(recorded)

    store = MemoryStore()
    book = GateBook(lambda *_: Scripted(jittered(1.2, 100)), TPOT_ONLY, record, claim=store.claim)
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t = 1000.0
    while not (v := await book.consult(key, t)).decided:
        t += 30
    assert v.outcome is Outcome.FAIL and recorded == [] and not refusals
    # The rollout aborted on its fail and asks no more: another rollout's consultation has it recorded, beside its
    # own answer, which a hanging store does not hold up.
    other = await book.consult(GateKey("prefill", "pod=a", "pod=b", "rev-9"), t + 30)
    assert not other.decided and recorded == []
    store_back.set()
    await book.settled()
    assert len(recorded) == 1 and recorded[0].result == "fail" and recorded[0].pool == "decode"
    await book.consult(key, t + 60)
    await book.settled()
    assert len(recorded) == 1


class Timed:
    """A gate source whose every step's numbers follow from the step's time, as two replicas reading one store see."""

    settle = 0.0

    async def interval(self, start: float, end: float) -> Interval:
        step = Scripted.make(1.2 * (1 + 0.01 * ((round(start / 30) * 7) % 5 - 2)))
        return Interval(start, end, step.baseline, step.canary)


async def test_replicas_behind_one_service_judge_a_rollout_alike_and_record_it_once() -> None:
    store = MemoryStore()
    recorded: list[NewVerdict] = []

    async def record(v: NewVerdict) -> int:
        recorded.append(v)
        return len(recorded)

    books = [GateBook(lambda *_: Timed(), TPOT_ONLY, record, claim=store.claim) for _ in range(2)]
    key = GateKey("decode", "pod=a", "pod=b", "rev-2")
    t = 1020.0
    verdicts = []
    while not verdicts or not verdicts[-1].decided:
        verdicts.append(await books[len(verdicts) % 2].consult(key, t))  # the Service alternates between replicas
        t += 30
    other = await books[len(verdicts) % 2].consult(key, t - 30)
    assert verdicts[-1].outcome is other.outcome is Outcome.FAIL
    assert other.started_at == verdicts[-1].started_at == 1020.0 and other.as_dict() == verdicts[-1].as_dict()
    assert len(recorded) == 1, "one replica records the verdict"


def test_reports_for_ci() -> None:
    ivs = [Interval(30.0 * i, 30.0 * (i + 1), {"tpot": Dist(100.0, 1.0)}, {"tpot": Dist(30.0, 0.36 + 0.003 * (i % 3))})
           for i in range(10)]
    from policies.canary import judge

    v = judge(ivs, TPOT_ONLY)
    args = {"gate": "ci", "pool": "decode", "baseline": "pod=a", "canary": "pod=b"}
    suite = ET.fromstring(report(v, "junit", **args))
    assert suite.get("failures") == "2" and suite.get("tests") == "2", "the metric's and the gate's verdict"
    assert "tpot: canary" in suite.find("testcase[@name='tpot']/failure").get("message", "")  # type: ignore[union-attr]
    assert suite.find("testcase[@name='verdict']/failure").get("type") == "fail"  # type: ignore[union-attr]
    # An inconclusive gate (too little traffic) is no green build: its verdict is a failure, its metric skipped.
    unsure = ET.fromstring(report(judge(ivs[:2], TPOT_ONLY, final=True), "junit", **args))
    assert (unsure.get("failures"), unsure.get("skipped")) == ("1", "1")
    assert unsure.find("testcase[@name='verdict']/failure").get("type") == "inconclusive"  # type: ignore[union-attr]
    passed = ET.fromstring(report(judge([Interval(30.0 * i, 30.0 * (i + 1), {"tpot": Dist(100.0, 1.0)},
                                                  {"tpot": Dist(100.0, 1.0 + 0.001 * (i % 3))}) for i in range(10)],
                                        TPOT_ONLY), "junit", **args))
    assert passed.get("failures") == "0" and passed.find("testcase[@name='verdict']/failure") is None
    data = json.loads(report(v, "json", **args))
    assert data["result"] == "fail" and data["metrics"][0]["lower"] > 1 and data["pool"] == "decode"
    md = report(v, "markdown", **args)
    assert "**fail**" in md and "| tpot (critical) | fail |" in md
    with pytest.raises(GateError, match="report format 'xml'"):
        report(v, "xml", **args)


# the HTTP endpoints -------------------------------------------------------------------------------------


class _Loop:
    """What the gate endpoints use of the loop: its clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock


def test_the_api_judges_with_the_fleet_files_gate_rules() -> None:
    # Argo's and Flagger's gates and the loop's own canary judge apply the same rules; before, the API ran the defaults
    # whatever `policies.canary_regression.gate` said.
    from types import SimpleNamespace

    from controlplane.config import parse_config
    from controlplane.server import store_gates

    cfg = parse_config("pools: [{name: decode, role: decode, model: m, replicas: {min: 1, max: 2}}]\n"
                       "policies: {canary_regression: {gate: {step: 45s, max_window: 20m, "
                       "metrics: [{name: tpot, allowed: 0.02}]}}}\n")
    book = store_gates(cast(ControlLoop, SimpleNamespace(config=cfg, store=MemoryStore())))
    assert book.settings == cfg.policies.canary_regression.gate
    assert (book.settings.step, book.settings.max_window, book.settings.metrics[0].allowed) == (45.0, 1200.0, 0.02)
    assert book._interval == cfg.scrape.interval == 15.0  # a step override is checked against it


async def test_the_api_refuses_a_pool_the_fleet_file_lacks_at_the_first_consultation() -> None:
    """Read as no data, the Rollout's name given for the pool was answered inconclusive for the whole window, and the
    rollout paused; `fleetctl gate --fleet` refuses it at once."""
    from types import SimpleNamespace

    from controlplane.config import parse_config
    from controlplane.server import store_gates

    cfg = parse_config("pools: [{name: decode, role: decode, model: m, replicas: {min: 1, max: 2}}]\n")
    book = store_gates(cast(ControlLoop, SimpleNamespace(config=cfg, store=MemoryStore())))
    with pytest.raises(GateInputError, match="pool 'decode-rollout' is not in the fleet file"):
        await book.consult(GateKey("decode-rollout", "pod=~decode-rollout-aaa-.*", "pod=~decode-rollout-bbb-.*"), 0.0)


async def test_a_gate_whose_step_is_shorter_than_the_scrape_interval_is_refused_from_any_settings() -> None:
    book = GateBook(lambda *_: Scripted(jittered(1.0, 200)), GateSettings(step=10.0), scrape_interval=15.0)
    key = GateKey("decode", "pod=old", "pod=new")
    for settings in (None, GateSettings(step=10.0, max_window=600.0)):  # the book's own, or a max_window override
        with pytest.raises(GateInputError, match="step 10s is shorter than the scrape interval"):
            await book.consult(key, 0.0, settings)
    started = await book.consult(key, 0.0, GateSettings(step=30.0))
    # A running gate keeps its settings: a later consultation's are not read, so not refused.
    assert started == await book.consult(key, 0.0, GateSettings(step=5.0))


async def test_argo_and_flagger_endpoints() -> None:
    clock = VirtualClock()
    made: list[str] = []

    def make(pool: str, base: ArmSelector, can: ArmSelector, rules: Sequence[MetricRule]) -> Scripted:
        made.append(can.text)
        return Scripted(jittered(1.3 if "slow" in can.text else 1.0, 200))

    book = GateBook(make, TPOT_ONLY, scrape_interval=15.0)
    port = free_port()
    http = start_server(cast(ControlLoop, _Loop(clock)), "127.0.0.1", port, token=None, gates=book)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            params = {"pool": "decode", "baseline": "pod=old", "canary": "pod=slow", "revision": "abc"}
            r = await c.get("/api/v1/gate", params=params)
            assert r.status_code == 200 and r.json()["result"] == "inconclusive" and r.json()["decided"] is False
            hook = {"name": "decode", "namespace": "llm", "phase": "Progressing", "checksum": "7f",
                    "metadata": {"pool": "decode", "baseline": "pod=old", "canary": "pod=fine"}}
            for _ in range(40):
                clock.advance(30)
                argo = (await c.post("/api/v1/gate", json=params)).json()
                rollback = await c.post("/api/v1/gate/flagger/rollback", json=hook)
                promote = await c.post("/api/v1/gate/flagger/promotion", json=hook)
            assert argo["result"] == "fail" and argo["metrics"][0]["name"] == "tpot" and argo["revision"] == "abc"
            assert rollback.status_code == 403 and promote.status_code == 200 and promote.json()["result"] == "pass"
            bad = await c.get("/api/v1/gate", params={"pool": "decode"})
            assert bad.status_code == 400 and "missing baseline, canary" in bad.json()["error"]
            worse = await c.get("/api/v1/gate", params={**params, "canary": "pod=~a**"})
            assert worse.status_code == 400 and "not a regular expression" in worse.json()["error"]
            nometa = await c.post("/api/v1/gate/flagger/rollback", json={"name": "x"})
            assert nometa.status_code == 400
            short = await c.get("/api/v1/gate", params={**params, "revision": "new", "step": "10s"})
            assert short.status_code == 400 and short.json()["error"] == (
                "step 10s is shorter than the scrape interval (15s): steps without a scrape hold no data")
            # Another window for the same rollout is a gate of its own: no caller fixes the rollout's gate for Argo.
            other = await c.get("/api/v1/gate", params={**params, "max_window": "5m"})
            assert other.status_code == 200 and other.json()["decided"] is False
            assert (await c.post("/api/v1/gate", json=params)).json()["result"] == "fail"
    finally:
        http.stop()
    assert made.count("pod=slow") == 2  # one session for the Argo rollout however often it asked, one for the other


async def test_gate_endpoints_refuse_what_would_hold_memory_or_never_be_recorded_and_may_need_a_token() -> None:
    clock = VirtualClock()
    book = GateBook(lambda *_: Scripted(jittered(1.0, 200)), TPOT_ONLY, scrape_interval=15.0)
    port = free_port()
    http = start_server(cast(ControlLoop, _Loop(clock)), "127.0.0.1", port, token=None, gates=book,
                        gate_token="gate-secret")
    params = {"pool": "decode", "baseline": "pod=old", "canary": "pod=new"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            anonymous = await c.get("/api/v1/gate", params=params)
            flagger = await c.post("/api/v1/gate/flagger/rollback", json={"metadata": params})
            assert anonymous.status_code == flagger.status_code == 401 and book._sessions == {}
            c.headers["Authorization"] = "Bearer gate-secret"
            assert (await c.get("/api/v1/gate", params=params)).status_code == 200
            deep = await c.post("/api/v1/gate", content=b"[" * 20_000)
            assert deep.status_code == 400 and deep.json()["error"] == "the body is not JSON"
            with pytest.raises(httpx.ReadError):  # refused before it is read: the connection is closed
                await c.post("/api/v1/gate", content=b"{" + b" " * 100_000 + b"}")
            long_pool = await c.get("/api/v1/gate", params={**params, "pool": "p" * 129})
            assert long_pool.status_code == 400 and "a pool is at most 128 characters" in long_pool.json()["error"]
    finally:
        http.stop()


async def test_a_full_book_makes_room_by_forgetting_a_gate_no_one_asks_any_more() -> None:
    book = GateBook(lambda *_: Scripted(jittered(1.0, 200)), TPOT_ONLY, max_sessions=2)
    old, live, new = (GateKey("decode", "pod=a", "pod=b", rev) for rev in ("r1", "r2", "r3"))
    await book.consult(old, 0.0)
    await book.consult(live, 0.0)
    with pytest.raises(GateError, match="2 gates are running"):
        await book.consult(new, 30.0)  # both were asked within two steps
    await book.consult(live, 90.0)
    await book.consult(new, 90.0)  # `old` was last asked three steps ago
    assert set(book._sessions) == {live, new}


# the loop rolls a failed canary back --------------------------------------------------------------------


@pytest.mark.slow
async def test_the_loop_rolls_back_a_failed_canary_and_keeps_its_verdict(tmp_path: Any) -> None:
    from controlplane.sim.run import run_scenario
    from controlplane.sim.scenario import load_scenario
    from controlplane.store import migrate
    from controlplane.store.queries import ReadStore

    db = f"sqlite:///{tmp_path / 'canary.db'}"
    migrate.upgrade(db)
    scenario = load_scenario("canary-tpot-regression").model_copy(update={"duration": 1380.0})
    run = await run_scenario(scenario, db, mode="act")
    store = ReadStore.open(db)
    rollbacks = [a for a in store.actions() if a["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["pool"] == "decode" and rollbacks[0]["state"] == "succeeded"
    finding = store.finding(rollbacks[0]["finding_id"])
    assert finding is not None and finding["kind"] == "canary_regression" and finding["state"] == "resolved"
    assert not [m for m in run.fleet.members["decode"] if m.version != "stable" and not m.draining]
    [verdict] = store.verdicts()
    assert verdict["gate"] == "rollout" and verdict["result"] == "fail" and "decode-canary-0" in verdict["canary"]
    assert any(m["name"] == "tpot" and m["result"] == "fail" for m in verdict["details"]["metrics"])


async def test_a_malformed_exposition_line_is_skipped_and_the_rest_counts(caplog: pytest.LogCaptureFixture) -> None:
    import tornado.web
    from tornado.httpserver import HTTPServer

    from tests.collectors.expositions import histogram

    bodies = {"base": [0.01] * 40, "can": [0.012] * 40}
    calls = {"n": 0}

    class Metrics(tornado.web.RequestHandler):
        def get(self, arm: str) -> None:
            if arm == "flaky":  # a canary pod that answers once, then crash-loops
                calls["flaky"] = calls.get("flaky", 0) + 1
                if calls["flaky"] > 1:
                    raise tornado.web.HTTPError(503)
                arm = "can"
            n = calls["n"] = calls["n"] + 1
            obs = tuple(bodies[arm] * n)
            self.set_header("Content-Type", "text/plain; version=0.0.4")
            self.write(histogram("vllm:request_time_per_output_token_seconds", {}, ("0.01", "0.05"), obs)
                       + "vllm:broken_line{ 1\n")

    port = free_port()
    server = HTTPServer(tornado.web.Application([(r"/(base|can|flaky)/metrics", Metrics)]))
    server.listen(port, "127.0.0.1")
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            from collectors.types import Target

            scraper = Scraper(client, timeout_s=2.0)
            base = Target(f"http://127.0.0.1:{port}/base/metrics", "decode", "decode-0")
            can = Target(f"http://127.0.0.1:{port}/can/metrics", "decode", "decode-canary-0")
            arms = ArmSelector.parse("pod=decode-0"), ArmSelector.parse("pod=~decode-canary-.*")
            source = TargetsGateSource(scraper, StaticTargets([base, can]), *arms, TPOT_ONLY.metrics)
            await source.interval(0, 30)
            iv = await source.interval(30, 60)
            # A second canary pod that has not answered yet is starting (loading its model): the step counts.
            starting = Target(f"http://127.0.0.1:{free_port()}/metrics", "decode", "decode-canary-1")
            await TargetsGateSource(scraper, StaticTargets([base, can, starting]), *arms, TPOT_ONLY.metrics).interval(
                60, 90)
            # One that answered, then stopped (crash-looping): no step counts while it is down.
            flaky = Target(f"http://127.0.0.1:{port}/flaky/metrics", "decode", "decode-canary-2")
            listed = [base, can, flaky]

            class Discovered:
                stale = False

                async def targets(self) -> list[Target]:
                    return listed

            two = TargetsGateSource(scraper, Discovered(), *arms, TPOT_ONLY.metrics)
            await two.interval(90, 120)
            with pytest.raises(GateError, match=rf"canary pod\(s\) not answering: {re.escape(flaky.url)}"):
                await two.interval(120, 150)
            # Once discovery no longer lists it (deleted, or not Ready: out of routing as well), it is not asked.
            listed.remove(flaky)
            assert (await two.interval(150, 180)).canary["tpot"].count > 0
    finally:
        server.stop()
    assert iv.canary["tpot"].statistic("mean") == pytest.approx(0.012)
    assert iv.baseline["tpot"].count > 0
    assert "malformed exposition line" in caplog.text


async def test_the_pods_source_keeps_one_tpot_reading_for_the_whole_gate() -> None:
    # The baseline has one pod on a vLLM before the per-request TPOT histogram: TPOT is read from the inter-token
    # latency for both arms, also in a step that pod's scrape fails. Re-decided each step, that step would read the
    # per-request mean, and the gate's blocks mix a per-request mean with a token-weighted one. Nor is it decided
    # without that pod when its first scrape failed: its second is its first reading, which tells its histograms.
    from collectors.types import ScrapeResult, Target
    from tests.collectors.expositions import histogram

    new, old = "vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds"
    pods = {"decode-0": (new, old), "decode-old": (old,), "decode-canary-0": (new, old)}
    down = {"decode-old"}
    seconds = {new: 0.04, old: 0.02}  # the per-request means differ from the token-weighted mean

    class Pods:  # each engine serves 10 tokens a step
        async def scrape(self, targets: Sequence[Target], now: float) -> list[ScrapeResult]:
            return [ScrapeResult(t, now, False, error="refused") if t.pod in down else
                    ScrapeResult(t, now, True, "".join(histogram(f, {}, ("0.01", "0.05"), (seconds[f],) * int(now // 3))
                                                       for f in pods[t.pod])) for t in targets]

    found = StaticTargets([Target(f"http://{p}:8000/metrics", "decode", p) for p in pods])
    source = TargetsGateSource(cast(Scraper, Pods()), found, ArmSelector.parse("pod!~.*canary.*"),
                               ArmSelector.parse("pod=~.*canary.*"), TPOT_ONLY.metrics)
    await source.interval(0, 30)
    down.clear()
    early = await source.interval(30, 60)  # decode-old's first reading: no delta yet, but its histograms known
    first = await source.interval(60, 90)
    down.add("decode-old")
    second = await source.interval(90, 120)
    assert early.baseline["tpot"].count == 10 and first.baseline["tpot"].count == 20
    assert second.baseline["tpot"].count == 10
    for step in (early, first, second):
        assert step.baseline["tpot"].statistic("mean") == step.canary["tpot"].statistic("mean") == pytest.approx(0.02)


async def test_the_pods_source_follows_the_rollout_as_it_moves_pods_between_the_arms() -> None:
    # Argo's next step scales the canary up and the stable down: the canary's new pod counts from its second scrape,
    # and the stable pod that left is not scraped (nor read as down).
    from collectors.types import ScrapeResult, Target
    from tests.collectors.expositions import histogram

    listed = [Target(f"http://{p}:8000/metrics", "decode", p) for p in ("decode-0", "decode-1", "decode-canary-0")]
    scraped: list[str] = []

    class Pods:  # each engine serves 10 tokens a step
        async def scrape(self, targets: Sequence[Target], now: float) -> list[ScrapeResult]:
            scraped.extend(t.pod for t in targets)
            body = histogram("vllm:request_time_per_output_token_seconds", {}, ("0.05",), (0.02,) * int(now // 3))
            return [ScrapeResult(t, now, True, body) for t in targets]

    class Discovered:
        async def targets(self) -> list[Target]:
            return listed

    source = TargetsGateSource(cast(Scraper, Pods()), Discovered(), ArmSelector.parse("pod!~.*canary.*"),
                               ArmSelector.parse("pod=~.*canary.*"), TPOT_ONLY.metrics)
    await source.interval(0, 30)
    await source.interval(30, 60)
    listed[1:2] = [Target("http://decode-canary-1:8000/metrics", "decode", "decode-canary-1")]
    before = await source.interval(60, 90)
    after = await source.interval(90, 120)
    assert (before.baseline["tpot"].count, before.canary["tpot"].count) == (10, 10)
    assert (after.baseline["tpot"].count, after.canary["tpot"].count) == (10, 20)
    assert scraped.count("decode-1") == 2 and scraped.count("decode-canary-1") == 2


async def test_the_pods_source_fails_a_canary_that_restarts_while_out_of_routing_and_not_the_baseline() -> None:
    # A crash-looping pod leaves its Service's routing between crashes (not Ready), so discovery stops listing it;
    # it comes back a new process, its counters begun again. Its start is remembered across the gap, and the gate
    # fails on it while its latency reads as the baseline's. A baseline pod's restart is no canary's fault.
    from collectors.types import ScrapeResult, Target
    from tests.collectors.expositions import histogram

    pods = ("decode-0", "decode-canary-0")
    started = dict.fromkeys(pods, 1.7e9)
    listed = [Target(f"http://{p}:8000/metrics", "decode", p) for p in pods]

    class Pods:  # each engine serves 10 tokens a step, counted from its own start
        async def scrape(self, targets: Sequence[Target], now: float) -> list[ScrapeResult]:
            return [ScrapeResult(t, now, True,
                                 histogram("vllm:request_time_per_output_token_seconds", {}, ("0.05",),
                                           (0.02,) * int((now - started[t.pod] + 1.7e9) // 3))
                                 + f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {started[t.pod]}\n")
                    for t in targets]

    class Discovered:
        stale = False

        async def targets(self) -> list[Target]:
            return list(listed)

    source = TargetsGateSource(cast(Scraper, Pods()), Discovered(), ArmSelector.parse("pod!~.*canary.*"),
                               ArmSelector.parse("pod=~.*canary.*"), TPOT_ONLY.metrics)
    session = GateSession(source, TPOT_ONLY, 0.0)
    assert not (await session.consult(60.0)).decided
    canary = listed.pop()
    await session.consult(90.0)  # restarting: not Ready, not listed
    started["decode-canary-0"] = 1.7e9 + 80.0
    started["decode-0"] = 1.7e9 + 85.0
    listed.append(canary)
    verdict = await session.consult(150.0)
    assert verdict.outcome is Outcome.FAIL and verdict.decided
    assert "the canary's pods restarted 1 time within the gate (decode-canary-0 1 time)" in verdict.reason
    assert [iv.restarted for iv in session.intervals] == [(), (), ("decode-canary-0",)]  # the step it was out failed


async def test_after_the_first_step_a_failed_pod_listing_or_an_empty_arm_is_a_failed_step() -> None:
    # The Kubernetes API down for a minute, or the canary's pods all restarting at once: the gate's patience covers
    # it, where before its first step the same is an error of its own (exit 4) or a wrong selector (exit 3).
    from collectors.types import ScrapeResult, Target
    from controlplane.discovery import DiscoveryError
    from tests.collectors.expositions import histogram

    listed: list[Target] | None = [Target(f"http://{p}:8000/metrics", "decode", p) for p in ("decode-0", "decode-c")]

    class Discovered:
        async def targets(self) -> list[Target]:
            if listed is None:
                raise DiscoveryError("listing pods in llm: 503 Service Unavailable")
            return listed

    class Pods:
        async def scrape(self, targets: Sequence[Target], now: float) -> list[ScrapeResult]:
            body = histogram("vllm:request_time_per_output_token_seconds", {}, ("0.05",), (0.02,) * int(now // 3))
            return [ScrapeResult(t, now, True, body) for t in targets]

    def source() -> TargetsGateSource:
        return TargetsGateSource(cast(Scraper, Pods()), Discovered(), ArmSelector.parse("pod=decode-0"),
                                 ArmSelector.parse("pod=decode-c"), TPOT_ONLY.metrics)

    src = source()
    await src.interval(0, 30)
    all_listed, listed = listed, None
    with pytest.raises(GateError, match="listing the pods: listing pods in llm: 503") as failed:
        await src.interval(30, 60)
    assert not isinstance(failed.value, GateInputError)
    listed = all_listed[:1]
    with pytest.raises(GateError, match="no canary target matches its selector 'pod=decode-c' now") as failed:
        await src.interval(60, 90)
    assert not isinstance(failed.value, GateInputError)
    listed = None
    with pytest.raises(DiscoveryError):
        await source().arms()


async def test_a_pod_in_both_arms_or_an_arm_without_pods_is_refused_at_the_first_step() -> None:
    from collectors.types import Target

    shared = Target("http://decode-0:8000/metrics", "decode", "decode-0")
    both = TargetsGateSource(cast(Scraper, None), StaticTargets([shared]), ArmSelector.parse("pool=decode"),
                             ArmSelector.parse("pod=~decode-.*"), TPOT_ONLY.metrics)
    with pytest.raises(GateInputError, match="decode/decode-0/vllm match both"):
        await both.interval(0, 30)
    none = TargetsGateSource(cast(Scraper, None), StaticTargets([shared]), ArmSelector.parse("pool=decode"),
                             ArmSelector.parse("pod=~.*canary.*"), TPOT_ONLY.metrics)
    with pytest.raises(GateInputError, match=r"no canary target matches its selector 'pod=~\.\*canary\.\*'"):
        await none.interval(0, 30)
