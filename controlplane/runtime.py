"""Composition root: build a control loop from a fleet file and its collaborators."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence

import httpx

from collectors.prometheus_api import Labels, PrometheusSource
from collectors.scraper import Scraper
from collectors.types import Target
from controlplane.actuators.base import Actuator, StaticTargets, TargetSource
from controlplane.actuators.dryrun import DryRunActuator
from controlplane.alerting import AlertNotifier
from controlplane.clock import Clock, WallClock
from controlplane.config import FleetConfig
from controlplane.errors import ConfigError
from controlplane.loop import ControlLoop
from controlplane.observe import MetricSource, PrometheusApiSource, PrometheusTargets, ScrapeSource
from controlplane.server import start_server
from controlplane.store.base import Store
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from controlplane.telemetry import Telemetry
from policies.ep_imbalance import EpImbalance, EpImbalanceSettings
from policies.gpu_health import GpuHealth, GpuHealthSettings
from policies.kv_transfer import KvTransferLag, KvTransferSettings
from policies.prefix_cache import PrefixCacheHitDrop, PrefixCacheSettings
from policies.saturation import Saturation, SaturationSettings
from policies.slo_burn import BurnWindow, SloBurn, SloBurnSettings
from policies.spec_decode import SpecDecodeCollapse, SpecDecodeSettings
from policies.types import Policy, Severity

__all__ = ["build_loop", "build_policies", "run_forever", "scrape_client", "static_targets"]

log = logging.getLogger(__name__)


def scrape_client(config: FleetConfig) -> httpx.AsyncClient:
    """The HTTP client the scraper uses: pool sized to the scrape concurrency."""
    n = config.scrape.concurrency
    # vLLM's server drops idle connections after 5 s, httpx's default keep-alive: a scrape every
    # 5 s could reuse a connection the engine is closing. Expire ours well before.
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=config.scrape.timeout, limits=limits)


def prometheus_source(config: FleetConfig) -> PrometheusSource:
    """The Prometheus API client described by the fleet file's `prometheus` section."""
    p = config.prometheus
    assert p is not None
    return PrometheusSource(p.url, timeout=p.timeout, selector=p.selector, mode=p.mode,
                            labels=Labels(pool=p.pool_label, pod=p.pod_label))


def build_policies(config: FleetConfig) -> list[Policy]:
    """The enabled policies with the fleet file's settings."""
    policies: list[Policy] = []
    pc = config.policies.prefix_cache_hit_drop
    if pc.enabled:
        policies.append(
            PrefixCacheHitDrop(
                PrefixCacheSettings(
                    baseline_s=pc.baseline, min_abs_drop=pc.min_abs_drop, min_rel_drop=pc.min_rel_drop,
                    kv_pressure_usage=pc.kv_pressure_usage,
                )
            )
        )
    kv = config.policies.kv_transfer_lag
    if kv.enabled:
        policies.append(
            KvTransferLag(KvTransferSettings(baseline_s=kv.baseline, tail_ratio=kv.tail_ratio, min_abs_s=kv.min_abs))
        )
    sd = config.policies.spec_decode_collapse
    if sd.enabled:
        policies.append(SpecDecodeCollapse(SpecDecodeSettings(
            baseline_s=sd.baseline, min_abs_drop=sd.min_abs_drop, min_rel_drop=sd.min_rel_drop, tpot_rise=sd.tpot_rise,
            min_position_acceptance=sd.min_position_acceptance,
        )))
    sb = config.policies.slo_burn
    if sb.enabled:
        policies.append(SloBurn(SloBurnSettings(budget=sb.budget, windows=(
            BurnWindow("fast", sb.fast_window, sb.fast_short_window, sb.fast_burn, Severity.CRITICAL),
            BurnWindow("slow", sb.slow_window, sb.slow_short_window, sb.slow_burn, Severity.WARNING),
        ))))
    sat = config.policies.saturation
    if sat.enabled:
        policies.append(Saturation(SaturationSettings(
            min_waiting_per_engine=sat.min_waiting_per_engine, min_growth_per_engine=sat.min_growth_per_engine,
            kv_full=sat.kv_full, error_share=sat.error_share,
        )))
    gh = config.policies.gpu_health
    if gh.enabled:
        policies.append(GpuHealth(GpuHealthSettings(
            thermal_share=gh.thermal_share, power_share=gh.power_share, fault_hold_s=gh.fault_hold,
            node_pools=dict(gh.node_pools),
        )))
    ep = config.policies.ep_imbalance
    if ep.enabled:
        policies.append(EpImbalance(EpImbalanceSettings(
            skew_ratio=ep.skew_ratio, gpu_skew_ratio=ep.gpu_skew_ratio, resolve_ratio=ep.resolve_ratio,
            persist_s=ep.persist, redundant_experts_per_rank=ep.redundant_experts_per_rank,
            eplb_enabled=dict(ep.eplb_enabled), pod_hosts=dict(ep.pod_hosts), pod_host=ep.pod_host,
        )))
    return policies


def static_targets(config: FleetConfig) -> list[Target]:
    """Targets listed in the fleet file, with their pool's role."""
    return [Target(url=t.url, pool=t.pool, pod=t.pod, role=config.pool(t.pool).role, source=t.source)
            for t in config.targets]


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
) -> ControlLoop:
    """Wire a loop; defaults are the live ones (static targets, dry-run actuator, wall clock).

    With `prometheus` in the fleet file the loop reads Prometheus' HTTP API instead of scraping.
    """
    clock = clock or WallClock()
    source: MetricSource
    if config.prometheus is not None and targets is None:
        api = prometheus_source(config)
        source = PrometheusApiSource(api, config.prometheus.window)
        targets = PrometheusTargets(api, clock.now, {p.name: p.role for p in config.pools})
    else:
        targets = targets or StaticTargets(static_targets(config))
        scraper = Scraper(
            client, concurrency=config.scrape.concurrency, timeout_s=config.scrape.timeout,
            backoff_base_s=config.scrape.interval, backoff_max_s=config.scrape.backoff_max,
            spread_s=config.scrape.spread, sleep=clock.sleep,
        )
        source = ScrapeSource(targets, scraper)
    return ControlLoop(
        config=config,
        source=source,
        store=store,
        policies=list(policies) if policies is not None else build_policies(config),
        actuator=actuator or DryRunActuator(targets, [p.name for p in config.pools]),
        clock=clock,
        telemetry=telemetry or Telemetry(config.telemetry),
    )


def discovered_targets(config: FleetConfig, stack: contextlib.ExitStack) -> TargetSource | None:
    """The Kubernetes pod target source when the fleet file has `discovery`, else None."""
    d = config.discovery
    if d is None:
        return None
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    from controlplane.discovery import KubernetesPodTargets

    cfg = kclient.Configuration()
    try:
        if d.kubeconfig:
            kconfig.load_kube_config(config_file=d.kubeconfig, client_configuration=cfg)
        else:
            kconfig.load_incluster_config(client_configuration=cfg)
    except (kconfig.ConfigException, OSError) as exc:
        where = d.kubeconfig or "the in-cluster service account"
        raise ConfigError("discovery", [f"cannot load Kubernetes credentials from {where}: {exc}"]) from None
    cfg.retries = 0  # the loop retries next tick; client retries would only multiply the timeout
    api = stack.enter_context(kclient.ApiClient(cfg))
    return KubernetesPodTargets(
        kclient.CoreV1Api(api), namespace=d.namespace, selector=d.selector, pool_label=d.pool_label,
        role_label=d.role_label, port=d.port, path=d.path, source=d.source,
        pool_roles={p.name: p.role for p in config.pools}, max_stale_failures=d.max_stale_failures,
        timeout_s=d.timeout, reuse_s=1.0,
    )


async def run_forever(config: FleetConfig, store: SqlStore, *, once: bool = False) -> None:
    """`fleetctl run`: the loop plus its HTTP server until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    with contextlib.ExitStack() as stack:
        targets = discovered_targets(config, stack)
        threaded = ThreadedStore(store)
        try:
            async with scrape_client(config) as client:
                await _serve(config, threaded, client, targets, stop, once)
        finally:
            threaded.close()


async def _serve(config: FleetConfig, store: Store, client: httpx.AsyncClient, targets: TargetSource | None,
                 stop: asyncio.Event, once: bool) -> None:
    loop = build_loop(config, store, client, targets=targets)
    notifier = None
    if config.alerting is not None:
        notifier = AlertNotifier(config.alerting, registry=loop.telemetry.registry)
        loop.on_report = notifier.on_report
    server = start_server(loop, config.server.host, config.server.port)
    log.info("serving /metrics, /healthz, /readyz on %s:%d", config.server.host, config.server.port)
    try:
        await loop.start()
        if notifier is not None:
            notifier.restore(await store.open_findings(), loop.clock.now())
        if once:
            await loop.tick()
        else:
            await loop.run(stop)
    finally:
        server.stop()
        if notifier is not None:
            await notifier.aclose()
        loop.telemetry.shutdown()
        log.info("stopped cleanly")
