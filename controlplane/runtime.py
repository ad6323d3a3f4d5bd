"""Composition root: build a control loop from a fleet file and its collaborators."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collectors.prometheus_api import Labels, PrometheusSource
from collectors.scraper import Scraper, http_client
from collectors.types import Objectives, Target
from controlplane.actuators.base import Actuator, StaticTargets, TargetSource
from controlplane.actuators.dryrun import DryRunActuator
from controlplane.alerting import AlertNotifier
from controlplane.clock import Clock, WallClock
from controlplane.config import FleetConfig
from controlplane.errors import FleetError
from controlplane.killswitch import AnySwitch, KillSwitch, StoreSwitch
from controlplane.leadership import AlwaysLeader, Leadership
from controlplane.loop import ControlLoop
from controlplane.observe import MetricSource, PrometheusApiSource, PrometheusTargets, ScrapeSource
from controlplane.server import start_server, store_gates
from controlplane.store.base import Store
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from controlplane.telemetry import Telemetry
from policies.autoscale import Sizer
from policies.canary_rollout import CanaryRegression
from policies.ep_imbalance import EpImbalance
from policies.gpu_health import GpuHealth
from policies.inputs import StaleInputs
from policies.kv_transfer import KvTransferLag
from policies.pool_at_max import PoolAtMax
from policies.prefix_cache import PrefixCacheHitDrop
from policies.saturation import Saturation
from policies.settling import PoolStalled
from policies.slo_burn import SloBurn
from policies.spec_decode import SpecDecodeCollapse
from policies.types import Policy

if TYPE_CHECKING:
    import httpx

__all__ = ["POLICIES", "build_loop", "build_policies", "objectives", "run_forever", "scrape_client", "static_targets"]

log = logging.getLogger(__name__)

GATE_WRITES_GRACE_S = 5.0  # how long a stop waits for the gates' verdicts still being written


def scrape_client(config: FleetConfig) -> httpx.AsyncClient:
    """The HTTP client the scraper uses: pool sized to the scrape concurrency."""
    return http_client(config.scrape.concurrency, config.scrape.timeout)


def prometheus_source(config: FleetConfig, url: str | None = None) -> PrometheusSource:
    """The Prometheus API client described by the fleet file's `prometheus` section (at `url` instead of its own)."""
    p = config.prometheus
    assert p is not None
    return PrometheusSource(url or p.url, timeout=p.timeout, selector=p.selector, mode=p.mode,
                            labels=Labels(pool=p.pool_label, pod=p.pod_label))


# Each policy by the name of its section in the fleet file; the section is the policy's settings.
POLICIES: dict[str, Callable[[Any], Policy]] = {
    "prefix_cache_hit_drop": PrefixCacheHitDrop,
    "kv_transfer_lag": KvTransferLag,
    "spec_decode_collapse": SpecDecodeCollapse,
    "slo_burn": SloBurn,
    "saturation": Saturation,
    "gpu_health": GpuHealth,
    "ep_imbalance": EpImbalance,
    "stale_inputs": StaleInputs,
    "pool_stalled": PoolStalled,
    "pool_at_max": PoolAtMax,
    "canary_regression": CanaryRegression,
}


def build_policies(config: FleetConfig) -> list[Policy]:
    """The enabled policies with the fleet file's settings."""
    return [POLICIES[name](settings) for name, settings in config.policies.enabled().items()]


def static_targets(config: FleetConfig) -> list[Target]:
    """Targets listed in the fleet file, with their pool's role."""
    return [Target(url=t.url, pool=t.pool, pod=t.pod, role=config.pool(t.pool).role, source=t.source)
            for t in config.targets]


def objectives(config: FleetConfig) -> dict[str, Objectives]:
    """Every pool's latency objectives, for the share of its requests over them."""
    return {p.name: Objectives(p.slo.ttft_p95, p.slo.tpot_p95) for p in config.pools}


def build_loop(
    config: FleetConfig,
    store: Store,
    client: httpx.AsyncClient,
    *,
    targets: TargetSource | None = None,
    actuator: Actuator | None = None,
    clock: Clock | None = None,
    telemetry: Telemetry | None = None,
    policies: Sequence[Policy] | None = None,
    switch: KillSwitch | None = None,
    leading: Callable[[], bool] | None = None,
    term: Callable[[], int] | None = None,
    sizer: Sizer | None = None,
) -> ControlLoop:
    """Wire a loop; defaults are the live ones (static targets, dry-run actuator, wall clock).

    With `prometheus` in the fleet file the loop reads Prometheus' HTTP API instead of scraping.
    """
    clock = clock or WallClock()
    source: MetricSource
    if config.prometheus is not None and targets is None:
        api = prometheus_source(config)
        source = PrometheusApiSource(api, config.prometheus.window, objectives=objectives(config))
        targets = PrometheusTargets(api, clock.now, {p.name: p.role for p in config.pools})
    else:
        targets = targets or StaticTargets(static_targets(config))
        scraper = Scraper(
            client, concurrency=config.scrape.concurrency, timeout_s=config.scrape.timeout,
            backoff_base_s=config.scrape.interval, backoff_max_s=config.scrape.backoff_max,
            spread_s=config.scrape.spread, round_s=config.scrape.round_s,
            sleep=clock.sleep, clock=clock.now,
        )
        source = ScrapeSource(targets, scraper, objectives(config))
    return ControlLoop(
        config=config,
        source=source,
        store=store,
        policies=list(policies) if policies is not None else build_policies(config),
        actuator=actuator or DryRunActuator(targets, [p.name for p in config.pools]),
        clock=clock,
        telemetry=telemetry or Telemetry(config.telemetry),
        switch=switch or StoreSwitch(store),
        leading=leading,
        term=term,
        sizer=sizer,
    )


def discovered_targets(config: FleetConfig, stack: contextlib.ExitStack) -> TargetSource | None:
    """The Kubernetes pod target source when the fleet file has `discovery`, else None."""
    d = config.discovery
    if d is None:
        return None
    from controlplane.discovery import KubernetesPodTargets
    from controlplane.kube import api_client

    api = stack.enter_context(api_client(d.kubeconfig, "discovery"))
    return KubernetesPodTargets.connect(
        api, namespace=d.namespace, selector=d.selector, pool_label=d.pool_label,
        role_label=d.role_label, port=d.port, path=d.path, source=d.source,
        pool_roles={p.name: p.role for p in config.pools}, max_stale_failures=d.max_stale_failures,
        timeout_s=d.timeout, reuse_s=1.0,
    )


@dataclass
class Acting:
    """How a live control plane changes the fleet: its actuator, kill switch and leadership."""

    actuator: Actuator | None = None  # None: the dry run
    switch: KillSwitch | None = None  # None: the store's (fleetctl pause)
    leadership: Leadership = field(default_factory=AlwaysLeader)


def kubernetes_acting(config: FleetConfig, store: Store, stack: contextlib.ExitStack, clock: Clock) -> Acting:
    """The Kubernetes actuator, the ConfigMap kill switch and the Lease when the fleet file has
    `kubernetes`; otherwise the dry run, the store's switch and a lone leader."""
    k = config.kubernetes
    if k is None:
        return Acting()
    from controlplane.actuators.kubernetes import ConfigMapSwitch, KubernetesActuator
    from controlplane.kube import api_client
    from controlplane.lease import LeaseLeadership

    api = stack.enter_context(api_client(k.kubeconfig, "kubernetes"))
    workloads = {p.name: p.workload for p in config.pools if p.workload is not None}
    actuator = KubernetesActuator(api, k, workloads, clock=clock.now)
    switch: KillSwitch = StoreSwitch(store)
    if k.switch is not None:
        switch = AnySwitch(switch, ConfigMapSwitch(api, k.switch, k.timeout))
    leadership: Leadership = AlwaysLeader()
    if k.leader_election is not None:
        leadership = LeaseLeadership(api, k.leader_election, timeout=k.leader_election.call_timeout(k.timeout))
    return Acting(actuator, switch, leadership)


async def run_forever(config: FleetConfig, store: SqlStore, *, once: bool = False, sizer: Sizer | None = None) -> None:
    """`fleetctl run`: the loop (with `sizer` setting replica counts, if given) plus its HTTP server until
    SIGTERM or SIGINT."""
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    with contextlib.ExitStack() as stack:
        targets = discovered_targets(config, stack)
        threaded = ThreadedStore(store)
        try:
            acting = kubernetes_acting(config, threaded, stack, WallClock())
            async with scrape_client(config) as client:
                await _serve(config, threaded, client, targets, acting, stop, once, sizer)
        finally:
            threaded.close()


async def _serve(config: FleetConfig, store: Store, client: httpx.AsyncClient, targets: TargetSource | None,
                 acting: Acting, stop: asyncio.Event, once: bool, sizer: Sizer | None) -> None:
    leader = acting.leadership
    loop = build_loop(config, store, client, targets=targets, actuator=acting.actuator, switch=acting.switch,
                      leading=leader.leading, term=lambda: leader.term, sizer=sizer)
    notifier = None
    if config.alerting is not None:
        notifier = AlertNotifier(config.alerting, registry=loop.telemetry.registry)
        loop.on_report = notifier.on_report
        loop.on_take_over = notifier.restore
    gates = store_gates(loop)
    server = start_server(loop, config.server.host, config.server.port, gates=gates)
    log.info("serving /metrics, /healthz, /readyz on %s:%d", config.server.host, config.server.port)
    contending = asyncio.create_task(_contend(leader, stop))
    try:
        await leader.contend()
        while not stop.is_set():
            if not leader.leading():
                loop.telemetry.leader.set(0)  # however it stopped leading (a failed take-over included)
                await _sleep_or_stop(stop, leader.retry_period)
                continue
            loop.telemetry.leader.set(1)
            try:
                await loop.start()
            except FleetError as exc:
                # A store outage at the take-over: taken over again once the store answers, as a tick is tried again.
                loop.telemetry.tick_failures.inc()
                log.error("taking over failed: %s; trying again in %gs", exc, config.scrape.interval)
                await _sleep_or_stop(stop, config.scrape.interval)
                continue
            if once:
                await loop.tick()
                break
            await loop.run(stop)  # returns at stop, or when leadership is lost
            loop.telemetry.leader.set(0)
            if not stop.is_set():
                log.warning("no longer leading: standing by")
                if notifier is not None:
                    notifier.hand_over()  # the next leader restores only what is still open
    finally:
        contending.cancel()
        await asyncio.gather(contending, return_exceptions=True)
        await leader.release()
        server.stop()
        with contextlib.suppress(TimeoutError):  # the gates' last writes, before the store closes
            await asyncio.wait_for(gates.settled(), GATE_WRITES_GRACE_S)
        if notifier is not None:
            await notifier.aclose()
        loop.telemetry.shutdown()
        log.info("stopped cleanly")


async def _contend(leader: Leadership, stop: asyncio.Event) -> None:
    """Keep taking or renewing leadership every retry period, beside the loop."""
    while not stop.is_set():
        await _sleep_or_stop(stop, leader.retry_period)
        if stop.is_set():  # no renewal or take-over begun after the stop: the release follows
            break
        # The Lease write runs on in its thread when this task is cancelled at the stop: waited for, so that the
        # release after it is made on the version it left, or releases the take-over it made.
        call = asyncio.ensure_future(leader.contend())
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await call
            raise


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
