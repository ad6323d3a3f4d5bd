"""The control loop end to end on the simulated fleet, in virtual time, over loopback HTTP.

Covers: detection and action in `act` mode with the audit log and outcome; `observe` never
acts; `propose` waits for approval; interrupted actions become `unknown` on restart; a dead
target and a malformed exposition are recorded while the loop goes on; self-metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from collectors.types import Target, TargetHealth
from controlplane.actions import ActionState
from controlplane.actuators.base import StaticTargets
from controlplane.clock import VirtualClock, WallClock
from controlplane.config import Mode
from controlplane.demo import demo_config
from controlplane.errors import StoreUnavailable
from controlplane.loop import ControlLoop
from controlplane.runtime import build_loop
from controlplane.sim.actuator import SimActuator
from controlplane.sim.fleet import SimFleet
from controlplane.sim.routing import RouterKind as Router
from controlplane.sim.server import SimServer, SimTargets
from controlplane.store.memory import MemoryStore
from controlplane.store.records import NewAction
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from controlplane.telemetry import Telemetry
from policies.autoscale import PoolPlan, Unplanned
from policies.types import PolicyInput, PoolState
from policies.windows import HISTORY_S


@dataclass
class Harness:
    loop: ControlLoop
    fleet: SimFleet
    server: SimServer
    clock: VirtualClock
    store: SqlStore

    async def ticks(self, n: int) -> list:
        reports = []
        for _ in range(n):
            self.clock.advance(self.loop.config.scrape.interval)
            self.fleet.advance_to(self.clock.now())
            self.server.sync()
            reports.append(await self.loop.tick())
        return reports



@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=2.0) as c:
        yield c


def harness(mode: Mode, sim: tuple, store: SqlStore, client: httpx.AsyncClient,
            telemetry: Telemetry | None = None) -> Harness:
    fleet, server, clock = sim
    cfg = demo_config(str(store.engine.url))
    cfg = cfg.model_copy(update={"mode": mode})
    loop = build_loop(cfg, ThreadedStore(store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, telemetry=telemetry)
    return Harness(loop, fleet, server, clock, store)


async def test_act_mode_detects_acts_and_judges_the_outcome(sim: tuple, sqlite_store: SqlStore,
                                                            client: httpx.AsyncClient) -> None:
    spans = InMemorySpanExporter()
    h = harness(Mode.ACT, sim, sqlite_store, client, Telemetry(span_exporter=spans))
    await h.loop.start()
    baseline = await h.ticks(20)
    assert all(r.targets == r.targets_up == 15 for r in baseline)  # 6 vLLM, 6 dcgm, 3 NIXL exporters
    assert not any(r.opened for r in baseline)
    h.fleet.set_router(Router.ROUND_ROBIN)
    reports = await h.ticks(4)
    opened = [f for r in reports for f in r.opened]
    assert [f.kind for f in opened] == ["prefix_cache_hit_drop"]
    delay = next(i for i, r in enumerate(reports) if r.opened) + 1
    assert delay <= 2, "detected within two scrape intervals"
    # The cause, not the symptom: the router changed just before the drop, so it is rolled back.
    actions = [a for r in reports for a in r.actions]
    assert [(a.kind, a.pool, a.params["change"]) for a in actions] == [
        ("rollback", "prefill", {"type": "RollBack", "workload": "router"})]
    assert h.fleet.router_kind is Router.CACHE_AWARE and h.fleet.desired["prefill"] == 3
    resolved = [f for r in await h.ticks(6) for f in r.resolved]
    assert [f.id for f in resolved if f.kind == "prefix_cache_hit_drop"] == [opened[0].id]
    # Ten minutes after it ran, the outcome is judged: the hit rate is back.
    later = await h.ticks(36)
    outcomes = [o for r in later for o in r.outcomes]
    assert outcomes == [(actions[0].id, "recovered")]
    action = next(a for a in h.store.actions() if a.id == actions[0].id)
    assert (action.state, action.outcome, action.actuator) == ("succeeded", "recovered", "simulator")
    names = {span.name for span in spans.get_finished_spans()}
    assert {"tick", "observe", "store.signals", "policy.prefix_cache_hit_drop", "action"} <= names


async def test_observe_mode_never_acts_and_scores_what_act_would_have_done(
        sim: tuple, sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    h = harness(Mode.OBSERVE, sim, sqlite_store, client)
    await h.ticks(20)
    h.fleet.set_router(Router.ROUND_ROBIN)
    reports = await h.ticks(4)
    assert any(r.opened for r in reports)
    [advice] = h.store.actions()
    assert (advice.state, advice.kind, advice.mode, advice.actuator) == ("advisory", "rollback", "observe", None)
    assert h.fleet.router_kind is Router.ROUND_ROBIN and h.fleet.desired["prefill"] == 3, "nothing was changed"
    await h.ticks(4)
    assert len(h.store.actions()) == 1, "the advisory counts for the cooldown as the action would have"
    later = await h.ticks(40)
    [(advice_id, outcome)] = [o for r in later for o in r.outcomes]
    assert advice_id == advice.id and outcome == "not_recovered", "left alone, the hit rate stayed down"


async def test_propose_mode_waits_for_approval(sim: tuple, sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    h = harness(Mode.PROPOSE, sim, sqlite_store, client)
    await h.ticks(20)
    h.fleet.set_router(Router.ROUND_ROBIN)
    await h.ticks(4)
    [proposal] = h.store.actions()
    assert proposal.state == "proposed" and h.fleet.router_kind is Router.ROUND_ROBIN
    await h.ticks(2)
    assert len(h.store.actions()) == 1, "an awaiting proposal blocks new ones for the pool"
    h.store.decide(proposal.id, approve=True, by="alice", now=h.clock.now(), via="test")
    await h.ticks(1)
    assert h.fleet.router_kind is Router.CACHE_AWARE
    assert h.store.actions()[0].state == "succeeded"


async def test_interrupted_action_becomes_unknown_on_restart(sim: tuple, sqlite_store: SqlStore,
                                                             client: httpx.AsyncClient) -> None:
    h = harness(Mode.ACT, sim, sqlite_store, client)
    a = h.store.create_action(NewAction(None, "scale_pool", "prefill", {"replicas": 4}, "act", "x"), h.clock.now())
    h.store.transition(a.id, ActionState.PROPOSED, ActionState.APPROVED, h.clock.now())
    h.store.transition(a.id, ActionState.APPROVED, ActionState.STARTED, h.clock.now())
    await h.loop.start()
    [after] = h.store.actions()
    assert after.state == "unknown"
    assert h.fleet.desired["prefill"] == 3  # never retried blindly


async def test_dead_target_and_malformed_exposition_are_recorded(sqlite_store: SqlStore,
                                                                 client: httpx.AsyncClient) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "bad":
            return httpx.Response(200, text="vllm:num_requests_running{engine=0} 1\nok_metric 1\n")
        raise httpx.ConnectError("refused", request=request)

    cfg = demo_config(str(sqlite_store.engine.url))
    targets = StaticTargets([Target("http://dead/metrics", "prefill", "dead"), Target("http://bad/metrics", "prefill", "bad")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        loop = build_loop(cfg, MemoryStore(), mock, targets=targets, clock=VirtualClock())
        report = await loop.tick()
    assert report.targets == 2 and report.targets_up == 1
    assert "ConnectError" in report.errors["prefill/dead/vllm"]
    assert "line 1" in report.errors["prefill/bad/vllm"]
    metrics = generate_latest(loop.telemetry.registry).decode()
    assert 'fleet_controlplane_scrape_errors_total{target="prefill/dead/vllm"} 1.0' in metrics
    assert 'fleet_controlplane_parse_errors_total{target="prefill/bad/vllm"} 1.0' in metrics
    assert "fleet_controlplane_ticks_total 1.0" in metrics


async def test_a_pool_whose_workload_recreates_its_pods_under_their_names_is_said_so(client: httpx.AsyncClient) -> None:
    """A StatefulSet's or a LeaderWorkerSet's pods come back under their names as it rolls out: a new process there
    may be the rollout's, not a crash, and the rollout policy must know which pools those are."""
    from controlplane.config import Workload
    from policies.types import PolicyResult

    seen: list[PolicyInput] = []

    class Reads:
        kind, reads = "reads", ()

        def evaluate(self, inp: PolicyInput) -> PolicyResult:
            seen.append(inp)
            return PolicyResult()

    cfg = demo_config("sqlite://")
    kinds = {"prefill": "StatefulSet", "decode": "Deployment"}
    cfg = cfg.model_copy(update={"pools": [p.model_copy(update={"workload": Workload(kind=kinds[p.name], name=p.name)})
                                           if p.name in kinds else p for p in cfg.pools]})
    loop = build_loop(cfg, MemoryStore(), client, targets=StaticTargets([]), clock=VirtualClock(), policies=[Reads()])
    await loop.tick()
    [inp] = seen
    assert {name: pool.keeps_names for name, pool in inp.pools.items()} == {
        p.name: p.name == "prefill" for p in cfg.pools}


async def test_a_take_over_forgets_the_process_starts_read_while_it_last_led() -> None:
    """Another leader scraped the pod's new process meanwhile and recorded its restart: read against the start this
    replica read before, it was recorded a second time, stamped at the take-over (a canary's second restart)."""
    started = {"t": 1.7e9}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text='vllm:num_requests_running{engine="0",model_name="m"} 1\n'
                                        f"process_start_time_seconds {started['t']}\n")

    cfg = demo_config("sqlite://")
    store = MemoryStore()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        loop = build_loop(cfg, store, mock, targets=StaticTargets([Target("http://p0/metrics", "prefill", "p0")]),
                          clock=VirtualClock())
        await loop.start()
        await loop.tick()
        started["t"] += 300.0  # restarted while another replica led, which recorded it
        await loop.start()
        await loop.tick()
        assert not [s for s in await store.load_signals(0.0) if s.name == "restarts"]
        started["t"] += 300.0  # and again while this one leads
        loop.clock.advance(15.0)  # type: ignore[attr-defined]
        await loop.tick()
    assert [s.subject for s in await store.load_signals(0.0) if s.name == "restarts"] == ["target/prefill/p0/vllm"]


async def test_a_round_with_no_time_left_for_a_target_leaves_its_pool_unfit_not_its_target_down(
        sqlite_store: SqlStore) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host in ("slow", "queued"):
            await asyncio.sleep(3600)
        return httpx.Response(200, text="vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n")

    cfg = demo_config(str(sqlite_store.engine.url))
    cfg = cfg.model_copy(update={"scrape": cfg.scrape.model_copy(update={"interval": 0.5, "timeout": 0.3,
                                                                         "spread": 0.0, "concurrency": 1})})
    store = MemoryStore()
    targets = StaticTargets([Target("http://slow/metrics", "prefill", "slow"),
                             Target("http://queued/metrics", "prefill", "queued")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        loop = build_loop(cfg, store, mock, targets=targets, clock=WallClock())  # a round's end is real time
        report = await loop.tick()
    # The round ends 0.4 s in (four fifths of the interval): the slow read took its whole timeout, and the one queued
    # behind it had 0.1 s left, too little to say anything of it.
    assert report.targets == 2 and report.targets_up == 0
    assert report.errors["prefill/slow/vllm"] == "timed out after 0.3s"
    assert "not scraped this round" in report.errors["prefill/queued/vllm"]
    # The slow one failed once (noise, not down yet); the queued one says nothing of itself, but its pool's sums
    # lack it.
    assert "queued/vllm: not scraped this round" in loop._unfit["prefill"]["vllm"]
    assert loop._answering["prefill"] == {"slow", "queued"}
    metrics = generate_latest(loop.telemetry.registry).decode()
    assert 'scrape_errors_total{target="prefill/slow/vllm"} 1.0' in metrics and "queued" not in metrics
    assert 'targets{state="late"} 1.0' in metrics and 'targets{state="down"} 1.0' in metrics
    assert list(store.targets) == ["prefill/slow/vllm"]  # nothing known of the queued one: no state recorded


async def test_a_target_state_the_store_refused_is_written_next_tick(client: httpx.AsyncClient) -> None:
    """Only changes of a target's state are written: one the store refused must not count as written."""

    class RefusesTargets(MemoryStore):
        refuse = 1

        async def record_targets(self, results, live=None):  # type: ignore[no-untyped-def]
            if self.refuse:
                self.refuse -= 1
                raise StoreUnavailable("record_targets: connection reset")
            await super().record_targets(results, live)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    cfg = demo_config("sqlite://")
    store, clock = RefusesTargets(), VirtualClock()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        loop = build_loop(cfg, store, mock, targets=StaticTargets([Target("http://dead/metrics", "prefill", "dead")]),
                          clock=clock)
        with pytest.raises(StoreUnavailable):
            await loop.tick()
        clock.advance(15.0)
        await loop.tick()
    target, _, up, _ = store.targets["prefill/dead/vllm"]
    assert target.pod == "dead" and up is False


async def test_the_store_forgets_targets_that_are_gone(sqlite_store: SqlStore) -> None:
    """A pool scaled from three pods to one: the dashboard must not count the two gone as up for good, nor may a
    leader that takes over keep the targets its predecessor knew of and it never sees."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text='vllm:num_requests_running{engine="0",model_name="m"} 1\n')

    from controlplane.store.queries import ReadStore

    def known() -> set[str]:
        read = ReadStore(sqlite_store.engine)
        return {t["key"] for t in read.targets()}

    targets = StaticTargets([Target(f"http://p{i}/metrics", "prefill", f"p{i}") for i in range(3)])
    cfg, clock = demo_config(str(sqlite_store.engine.url)), VirtualClock()
    store = ThreadedStore(sqlite_store)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        loop = build_loop(cfg, store, mock, targets=targets, clock=clock)
        await loop.tick()
        assert known() == {"prefill/p0/vllm", "prefill/p1/vllm", "prefill/p2/vllm"}
        targets._targets = targets._targets[:1]
        clock.advance(15.0)
        await loop.tick()
        assert known() == {"prefill/p0/vllm"}
        # Another leader led meanwhile and wrote a target this one never saw; this one leads again.
        sqlite_store.record_targets([(Target("http://p9/metrics", "prefill", "p9"), TargetHealth(), True, 1.0)])
        await loop.start()
        clock.advance(15.0)
        await loop.tick()
        assert known() == {"prefill/p0/vllm"}
        # A leader that lost the Lease mid-tick knows the targets of then: it forgets none of the new leader's.
        sqlite_store.record_targets([(Target("http://p9/metrics", "prefill", "p9"), TargetHealth(), True, 1.0)])
        targets._targets = [*targets._targets, Target("http://p1/metrics", "prefill", "p1")]
        loop.leading = lambda: False
        clock.advance(15.0)
        await loop.tick()
        assert known() == {"prefill/p0/vllm", "prefill/p9/vllm", "prefill/p1/vllm"}


class FlakyStore(SqlStore):
    """The real store, except that writing signals fails while `down` is set (an outage)."""

    down = False

    def write_signals(self, signals):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("write_signals: connection refused")
        return super().write_signals(signals)


async def test_a_store_outage_skips_ticks_and_the_loop_goes_on(sim: tuple, sqlite_url: str,
                                                               client: httpx.AsyncClient) -> None:
    from controlplane.store import migrate

    migrate.upgrade(sqlite_url)
    store = FlakyStore.open(sqlite_url)
    h = harness(Mode.OBSERVE, sim, store, client)
    await h.ticks(2)
    store.down = True
    with pytest.raises(StoreUnavailable):
        await h.ticks(1)
    store.down = False
    before = store.count_signals()
    await h.ticks(1)
    assert store.count_signals() > before
    store.close()


async def test_run_survives_a_failing_tick_and_stops_on_request(sim: tuple, sqlite_url: str,
                                                                client: httpx.AsyncClient) -> None:
    import asyncio

    from controlplane.store import migrate

    migrate.upgrade(sqlite_url)
    store = FlakyStore.open(sqlite_url)
    store.down = True
    h = harness(Mode.OBSERVE, sim, store, client)
    registry = h.loop.telemetry.registry
    stop = asyncio.Event()
    runner = asyncio.create_task(h.loop.run(stop))  # virtual clock: intervals pass at once
    while (registry.get_sample_value("fleet_controlplane_tick_failures_total") or 0) < 2:
        await asyncio.sleep(0.01)
    assert h.loop.last_tick_at is None
    store.down = False
    while h.loop.last_tick_at is None:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(runner, timeout=5)
    assert store.count_signals() > 0
    store.close()


class TakeOverBlip(MemoryStore):
    """A store that drops its connection once, at the first read of a take-over (a database failover)."""

    failures = 1
    reads = 0

    async def load_signals(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("connection reset (database failover)")
        return await super().load_signals(*args, **kwargs)


async def test_a_store_outage_at_the_take_over_is_tried_again_not_the_end_of_the_process() -> None:
    from controlplane.config import parse_config
    from controlplane.lab.engine import free_port
    from controlplane.runtime import Acting, _serve

    config = parse_config(f"""
mode: act
scrape: {{interval: 1s, timeout: 500ms, spread: 100ms}}
server: {{port: {free_port()}}}
pools: [{{name: prefill, role: prefill, model: m, replicas: {{min: 1, max: 8}}}}]
""")
    stop, store = asyncio.Event(), TakeOverBlip()
    async with httpx.AsyncClient() as client:
        serving = asyncio.create_task(_serve(config, store, client, None, Acting(), stop, False, None))
        for _ in range(100):
            if store.reads >= 2 or serving.done():
                break
            await asyncio.sleep(0.1)
        assert not serving.done(), "one failed read at the take-over ended the control plane"
        assert store.reads >= 2, "taken over again once the store answered"
        stop.set()
        await asyncio.wait_for(serving, 10)


async def test_a_replica_whose_take_over_failed_and_that_lost_the_lease_reports_it_does_not_lead() -> None:
    """Else two replicas report 1 (the split-brain alert fires) and, the real leader gone, none reports 0."""
    from controlplane.config import parse_config
    from controlplane.lab.engine import free_port
    from controlplane.runtime import Acting, _serve

    class Lapsing:
        identity, retry_period, term = "a", 0.1, 1
        lead = True

        def leading(self) -> bool:
            return self.lead

        async def contend(self) -> bool:
            return self.lead

        async def release(self) -> None:
            return None

    lease = Lapsing()

    class Hangs(MemoryStore):
        async def load_signals(self, *args: Any, **kwargs: Any) -> Any:
            lease.lead = False  # lost while the take-over's read hung, which then failed
            raise StoreUnavailable("connection reset")

    port = free_port()
    config = parse_config(f"""
mode: act
scrape: {{interval: 1s, timeout: 500ms, spread: 100ms}}
server: {{port: {port}}}
pools: [{{name: prefill, role: prefill, model: m, replicas: {{min: 1, max: 8}}}}]
""")
    stop = asyncio.Event()
    async with httpx.AsyncClient() as client:
        serving = asyncio.create_task(_serve(config, Hangs(), client, None, Acting(leadership=lease), stop, False, None))
        await asyncio.sleep(1.5)
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        stop.set()
        await asyncio.wait_for(serving, 10)
    assert "fleet_controlplane_leader 0.0" in text


async def test_prometheus_api_mode_feeds_the_same_loop(sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    """With `prometheus` in the fleet file the loop reads the API; its failures are failed ticks."""
    from collectors.prometheus_api import PrometheusSource, PrometheusUnavailable
    from controlplane.observe import MetricSourceUnavailable, PrometheusApiSource
    from tests.collectors.test_prometheus_api import FakeClient, _answer

    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    api = PrometheusSource("http://prometheus:9090", client=FakeClient(_answer))
    loop = build_loop(cfg, MemoryStore(), client, clock=VirtualClock())
    loop.source = PrometheusApiSource(api, window_s=60.0)
    report = await loop.tick()
    assert report.signals > 0 and report.targets == 0
    assert loop.windows.latest("pool/prefill", "request_rate") is not None

    def refuse(query: str) -> None:
        raise PrometheusUnavailable("connection refused", query=query)

    loop.source = PrometheusApiSource(PrometheusSource("http://prometheus:9090", client=FakeClient(refuse)), 60.0)
    with pytest.raises(MetricSourceUnavailable, match="prometheus:9090"):
        await loop.tick()


async def test_an_unreadable_prometheus_histogram_is_a_tick_error_not_a_failed_tick(
        sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    from collectors.prometheus_api import PrometheusSource
    from collectors.types import Objectives
    from controlplane.observe import PrometheusApiSource
    from tests.collectors.test_prometheus_api import FakeClient, _answer, _row

    def answer(query: str) -> list[dict[str, Any]]:
        if "_bucket" in query and "sum by (pool, le)" in query and "histogram_quantile" not in query:
            return [_row(90.0, pool="prefill", le="soon"), _row(100.0, pool="prefill", le="+Inf")]
        return _answer(query)

    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    loop = build_loop(cfg, MemoryStore(), client, clock=VirtualClock())
    loop.source = PrometheusApiSource(PrometheusSource("http://prometheus:9090", client=FakeClient(answer)), 60.0,
                                      objectives={"prefill": Objectives(ttft=0.5)})
    report = await loop.tick()
    assert report.signals > 0
    assert "le='soon'" in report.errors["prometheus/pool/prefill"]
    assert loop.windows.latest("pool/prefill", "ttft_over_slo") is None
    # Absent this tick, the share's last value would stand for now's: nothing rests on it meanwhile.
    [stale] = [f for f in report.opened if f.kind == "stale_inputs" and f.subject == "pool/prefill"]
    assert "le='soon'" in stale.evidence["inputs"]["ttft_over_slo"]


async def test_a_target_down_in_prometheus_makes_its_pools_inputs_stale(sqlite_store: SqlStore,
                                                                       client: httpx.AsyncClient) -> None:
    """The pool's sums lack a down engine's series and read as less load: as when the loop scrapes it itself."""
    from collectors.prometheus_api import PrometheusSource
    from controlplane.observe import PrometheusApiSource
    from tests.collectors.test_prometheus_api import FakeClient, _answer, _row

    down: list[dict[str, Any]] = []

    def answer(query: str) -> list[dict[str, Any]]:
        return down if query.startswith("group by (instance, pod, pool) ((last_over_time(up") else _answer(query)

    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    loop = build_loop(cfg, MemoryStore(), client, clock=VirtualClock())
    loop.source = PrometheusApiSource(PrometheusSource("http://prometheus:9090", client=FakeClient(answer)), 60.0)

    async def prefill_stale() -> dict[str, str]:
        report = await loop.tick()
        found = [f for f in (*report.opened, *report.updated) if f.kind == "stale_inputs" and f.subject == "pool/prefill"]
        return found[0].evidence["inputs"] if found else {}

    assert "vllm" not in await prefill_stale()
    down.append(_row(1, instance="10.0.0.2:8000", pod="p-1", pool="prefill"))
    loop.clock.advance(15.0)  # type: ignore[attr-defined]
    assert "10.0.0.2:8000 is down in Prometheus" in (await prefill_stale())["vllm"]


async def test_an_engine_prometheus_scrapes_twice_makes_its_pools_sums_unfit(sqlite_store: SqlStore,
                                                                            client: httpx.AsyncClient) -> None:
    """Two jobs scraping one pod (a PodMonitor and a ServiceMonitor, say): the pool's sums count that engine twice,
    and a pool read at twice its load would be scaled for it. Series no pool is given to are a tick error."""
    from collectors.prometheus_api import PrometheusSource
    from controlplane.observe import PrometheusApiSource
    from tests.collectors.test_prometheus_api import FakeClient, _answer, _engines, _row

    def answer(query: str) -> list[dict[str, Any]]:
        rows = _answer(query)
        if _engines(query):
            rows = [*rows, _row(2.0, pool="prefill", pod="p-0", instance="10.0.0.1:9400", engine="0")]
        return rows

    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    loop = build_loop(cfg, MemoryStore(), client, clock=VirtualClock())
    loop.source = PrometheusApiSource(PrometheusSource("http://prometheus:9090", client=FakeClient(answer)), 60.0)
    report = await loop.tick()
    [stale] = [f for f in report.opened if f.kind == "stale_inputs" and f.subject == "pool/prefill"]
    assert "served by both 10.0.0.1:8000 and 10.0.0.1:9400" in stale.evidence["inputs"]["vllm"]
    assert "count it twice" in stale.evidence["inputs"]["vllm"]
    assert report.errors["prometheus/unattributed"].startswith(
        "series of 2 engine(s) or pool(s) left out of the signals, first: orphan")


async def test_a_pools_series_that_stop_make_its_inputs_stale(sqlite_store: SqlStore,
                                                               client: httpx.AsyncClient) -> None:
    """A pool whose series stop (its PodMonitor no longer matches, say) while other pools' go on is named by no
    query: its last values would be read as now's. Two late scrapes in a row make them stale."""
    from collectors.prometheus_api import PrometheusSource
    from controlplane.observe import PrometheusApiSource
    from tests.collectors.test_prometheus_api import FakeClient, _answer

    gone: list[bool] = []

    def answer(query: str) -> list[dict[str, Any]]:
        return [] if gone and "pool" in query else _answer(query)

    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    clock = VirtualClock()
    # The dry-run actuator counts a pool's engines from its targets: prefill has one (a pool at zero has no series).
    store = MemoryStore()
    loop = build_loop(cfg, store, client, clock=clock,
                      targets=StaticTargets([Target("http://10.0.0.1:8000/metrics", "prefill", "p-0")]))
    loop.source = PrometheusApiSource(PrometheusSource("http://prometheus:9090", client=FakeClient(answer)), 60.0)
    reports = [await loop.tick()]
    gone.append(True)
    for _ in range(3):
        clock.advance(15.0)
        reports.append(await loop.tick())
    stale = [f for r in reports for f in (*r.opened, *r.updated) if f.kind == "stale_inputs" and f.subject == "pool/prefill"]
    assert "its series stopped" in stale[-1].evidence["inputs"]["request_rate"]
    assert not any("request_rate" in f.evidence["inputs"] for r in reports[:3] for f in (*r.opened, *r.updated)
                   if f.kind == "stale_inputs" and f.subject == "pool/prefill"), "one or two late scrapes are noise"
    # Its engines gone from discovery too (the dry-run actuator counts targets): a pool that may not scale to zero is
    # down, not idle, and stays stale; one that may, and is at zero, has no series to stop.
    loop.actuator = build_loop(cfg, MemoryStore(), client, clock=clock).actuator  # no targets: every pool at zero

    async def prefill_stale() -> bool:
        clock.advance(15.0)
        report = await loop.tick()
        return any(f.kind == "stale_inputs" and f.subject == "pool/prefill" and "request_rate" in f.evidence["inputs"]
                   for f in (*report.opened, *report.updated))

    assert await prefill_stale()
    clock.advance(HISTORY_S)  # the history no longer holds its last values: stopped still, not unknown
    assert await prefill_stale()
    # Nor for a leader that takes over now (a restart, say): the open finding says the series stopped.
    actuator, source = loop.actuator, loop.source
    loop = build_loop(cfg, store, client, clock=clock)
    loop.actuator, loop.source = actuator, source
    await loop.start()
    assert await prefill_stale()
    loop.config = cfg.model_copy(update={"pools": [
        p.model_copy(update={"replicas": p.replicas.model_copy(update={"min": 0})}) if p.name == "prefill" else p
        for p in cfg.pools]})
    assert not await prefill_stale()


async def test_fleet_file_prometheus_section_builds_an_api_source(sqlite_store: SqlStore,
                                                                 client: httpx.AsyncClient) -> None:
    from controlplane.config import parse_config
    from controlplane.observe import PrometheusApiSource

    cfg = parse_config(
        "prometheus: {url: 'http://prometheus:9090', window: 1m, selector: {job: vllm}}\n"
        "pools: [{name: prefill, role: prefill, model: m, replicas: {min: 1, max: 2}}]\n"
    )
    loop = build_loop(cfg, MemoryStore(), client, clock=VirtualClock())
    assert isinstance(loop.source, PrometheusApiSource) and loop.source.window_s == 60.0


class AskFor:
    """A sizer that wants one pool at a fixed size."""

    name = "ask"

    def __init__(self, pool: str, replicas: int) -> None:
        self.pool, self.replicas = pool, replicas

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan | Unplanned:
        if pool.name != self.pool:
            return Unplanned(pool.name, "not this test's pool")
        return PoolPlan(pool.name, pool.desired, pool.ready, self.replicas, self.replicas,
                        f"{pool.name} wants {self.replicas}", {"planned_for": 12.5})


class BreaksOn(AskFor):
    """`AskFor`, but its sizing of another pool raises, as a sizer bug on odd numbers would."""

    def __init__(self, broken: str, pool: str, replicas: int) -> None:
        super().__init__(pool, replicas)
        self.broken = broken

    def plan_pool(self, inp: PolicyInput, pool: PoolState) -> PoolPlan | Unplanned:
        if pool.name == self.broken:
            raise ZeroDivisionError("float division by zero")
        return super().plan_pool(inp, pool)


async def test_the_sizer_owns_replica_counts_through_the_rails_and_its_plans_are_signals(
        sim: tuple, sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    fleet, server, clock = sim
    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.ACT})
    cfg = cfg.model_copy(update={"rails": cfg.rails.model_copy(update={"max_step": 4})})
    loop = build_loop(cfg, ThreadedStore(sqlite_store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, sizer=AskFor("decode", 5))
    h = Harness(loop, fleet, server, clock, sqlite_store)
    await h.loop.start()
    [report] = await h.ticks(1)
    [action] = report.actions
    assert (action.kind, action.finding_id, action.params["replicas"], action.state) == ("scale_pool", None, 5, "approved")
    assert fleet.desired["decode"] == 5 and [p.target for p in report.plans] == [5]
    later = await h.ticks(3)
    assert not [a for r in later for a in r.actions], "one scale in flight per pool: the pool settles first"
    signals = {(s.name, s.value) for s in sqlite_store.load_signals(0.0) if s.subject == "pool/decode"}
    assert {("replicas_desired", 5.0), ("autoscale_target_replicas", 5.0), ("autoscale_forecast_rate", 12.5)} <= signals
    assert ("replicas_ready", 3.0) in signals, "the new engines are still starting"


async def test_a_pool_that_breaks_the_sizer_keeps_its_size_and_the_rest_of_the_tick_runs(
        sim: tuple, sqlite_store: SqlStore, client: httpx.AsyncClient) -> None:
    fleet, server, clock = sim
    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.ACT})
    loop = build_loop(cfg, ThreadedStore(sqlite_store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, sizer=BreaksOn("prefill", "decode", 4))
    h = Harness(loop, fleet, server, clock, sqlite_store)
    prefill = fleet.desired["prefill"]
    await h.loop.start()
    [report] = await h.ticks(1)
    assert [(a.pool, a.params["replicas"]) for a in report.actions] == [("decode", 4)], "the other pool is still sized"
    assert report.errors == {"sizing prefill": "ZeroDivisionError: float division by zero"}
    assert fleet.desired["prefill"] == prefill and [p.pool for p in report.plans] == ["decode"]
    registry = loop.telemetry.registry
    assert registry.get_sample_value("fleet_controlplane_sizing_failures_total", {"pool": "prefill"}) == 1
    assert not registry.get_sample_value("fleet_controlplane_tick_failures_total")
    assert registry.get_sample_value("fleet_controlplane_ticks_total") == 1


class Raises:
    """A policy that cannot read this tick's numbers."""

    kind = "broken_policy"

    def evaluate(self, inp: PolicyInput) -> Any:
        raise ValueError("a baseline needs at least one value")


async def test_a_policy_that_raises_leaves_the_rest_of_the_tick(sim: tuple, sqlite_store: SqlStore,
                                                                client: httpx.AsyncClient) -> None:
    fleet, server, clock = sim
    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.ACT})
    loop = build_loop(cfg, ThreadedStore(sqlite_store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, sizer=AskFor("decode", 4))
    loop.policies = [Raises(), *loop.policies]  # type: ignore[list-item]
    h = Harness(loop, fleet, server, clock, sqlite_store)
    await h.loop.start()
    [report] = await h.ticks(1)
    assert [(a.pool, a.params["replicas"]) for a in report.actions] == [("decode", 4)], "sized and acted on"
    assert report.errors == {"policy broken_policy": "ValueError: a baseline needs at least one value"}
    registry = loop.telemetry.registry
    assert registry.get_sample_value("fleet_controlplane_policy_failures_total", {"policy": "broken_policy"}) == 1
    assert registry.get_sample_value("fleet_controlplane_ticks_total") == 1


class RefusesEnds(SqlStore):
    """The real store, except that recording how an action ended fails `refuse` times (an outage at that moment)."""

    refuse = 0

    def transition(self, action_id, expected, to, now, detail=None, **fields):  # type: ignore[no-untyped-def]
        if self.refuse and to in (ActionState.SUCCEEDED, ActionState.FAILED):
            self.refuse -= 1
            raise StoreUnavailable("transition: connection reset")
        return super().transition(action_id, expected, to, now, detail, **fields)


async def an_end_refused(sim: tuple, sqlite_url: str, client: httpx.AsyncClient) -> tuple[Harness, RefusesEnds]:
    """A leading loop whose scale of decode to 4 landed on the fleet while the store refused to record its end."""
    from controlplane.store import migrate

    migrate.upgrade(sqlite_url)
    store = RefusesEnds.open(sqlite_url)
    fleet, server, clock = sim
    cfg = demo_config(sqlite_url).model_copy(update={"mode": Mode.ACT})
    loop = build_loop(cfg, ThreadedStore(store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, sizer=AskFor("decode", 4))
    h = Harness(loop, fleet, server, clock, store)
    await h.loop.start()
    store.refuse = 1
    with pytest.raises(StoreUnavailable):  # the fleet changed; its record did not land
        await h.ticks(1)
    return h, store


async def test_an_end_the_store_refused_is_recorded_next_tick(sim: tuple, sqlite_url: str,
                                                              client: httpx.AsyncClient) -> None:
    h, store = await an_end_refused(sim, sqlite_url, client)
    assert h.fleet.desired["decode"] == 4
    [started] = store.actions()
    assert started.state == "started", "it holds its pool until its end is recorded"
    await h.ticks(1)
    [action] = store.actions()
    assert (action.id, action.state) == (started.id, "succeeded"), "recorded once, not carried out again"
    store.close()


async def test_an_end_the_store_refused_is_recorded_when_leadership_comes_back(sim: tuple, sqlite_url: str,
                                                                              client: httpx.AsyncClient) -> None:
    """Leadership lost and won back while an end waited to be recorded: the end this replica knows is written, not
    guessed at by a take-over (the simulator's actuator cannot tell whether a change landed: it would be unknown)."""
    h, store = await an_end_refused(sim, sqlite_url, client)
    await h.loop.start()
    [action] = store.actions()
    assert action.state == "succeeded"
    assert "taken_over" not in [e.event for e in store.action_events(action.id)]
    store.close()


async def test_an_end_kept_is_dropped_where_another_leader_took_the_action_over(sim: tuple, sqlite_url: str,
                                                                                client: httpx.AsyncClient) -> None:
    """Another leader took the action over meanwhile (redid it, or drained for it): the end this replica kept is of
    before that, and would close the action over the other leader's work."""
    h, store = await an_end_refused(sim, sqlite_url, client)
    [started] = store.actions()
    store.note(started.id, "taken_over", h.clock.now() + 5, {"redo": "not applied before the stop"})
    h.clock.advance(30)
    await h.loop.start()
    [action] = store.actions()
    assert action.state == "unknown", "taken over again from what the fleet shows, not closed with the old end"
    store.close()


async def test_observing_the_sizer_advises_each_target_once(sim: tuple, sqlite_store: SqlStore,
                                                             client: httpx.AsyncClient) -> None:
    fleet, server, clock = sim
    cfg = demo_config(str(sqlite_store.engine.url)).model_copy(update={"mode": Mode.OBSERVE})
    sizer = AskFor("decode", 4)
    loop = build_loop(cfg, ThreadedStore(sqlite_store), client, targets=SimTargets(server), actuator=SimActuator(fleet),
                      clock=clock, sizer=sizer)
    h = Harness(loop, fleet, server, clock, sqlite_store)
    await h.loop.start()
    await h.ticks(12)  # three minutes: past the scale cooldown twice over
    [advice] = sqlite_store.actions()
    assert (advice.state, advice.params["replicas"], fleet.desired["decode"]) == ("advisory", 4, 3)
    sizer.replicas = 5
    await h.ticks(5)
    assert [a.params["replicas"] for a in sqlite_store.actions()] == [4, 5], "a new target is advised again"
    sizer.replicas = 9  # further than max_step (2): the rails advise a step towards it, once
    await h.ticks(12)
    assert [(a.params["replicas"], a.params["asked_replicas"]) for a in sqlite_store.actions()][2:] == [(5, 9)]
