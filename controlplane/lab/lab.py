"""The real lab: N vLLM engines behind a router, trace-driven load, and the control loop watching.

`Lab` starts the engines (prefix caching and ngram speculative decoding on, each bound to its own
CPU), the router in front of them and the load generator, and describes them as a fleet file
(one pool, one static target per engine) so the normal control loop scrapes them. `run_lab`
runs a timeline of traffic phases against it with the loop ticking on the wall clock, measures
each phase with the collectors, and stops every process it started, also when interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from collectors.pipeline import SignalDeriver
from collectors.scraper import Scraper, http_client
from collectors.types import Target, engine_subject, pool_subject
from controlplane.config import FleetConfig, parse_config
from controlplane.errors import FleetError
from controlplane.lab.engine import (
    DEFAULT_MODEL_DIR,
    LAB_ARGS,
    SERVED_MODEL_NAME,
    VllmEngine,
    ensure_model,
    free_port,
    lab_venv,
    venv_ready,
)
from controlplane.lab.loadgen import LoadGen, LoadSettings, PromptBuilder, Traffic, TrafficStats, lab_trace, single_token_words
from controlplane.lab.router import RoutePolicy, Router, RouterSettings, Upstream
from controlplane.loop import ControlLoop, TickReport
from controlplane.runtime import build_loop, scrape_client
from controlplane.store import migrate
from controlplane.store.threaded import ThreadedStore

__all__ = [
    "LAB_ENGINE_ARGS",
    "Lab",
    "LabError",
    "LabInterrupted",
    "LabReport",
    "LabSettings",
    "Phase",
    "PhaseResult",
    "TickView",
    "parse_phases",
    "run_lab",
]

log = logging.getLogger(__name__)

# Compact JSON under structured outputs: with whitespace allowed, the random-weight model fills
# records with blanks forever instead of writing them.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
# Eager mode: torch.compile adds 15-20 s to each engine's start and nothing the lab measures needs it.
LAB_ENGINE_ARGS: tuple[str, ...] = (*LAB_ARGS, "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
                                    "--enforce-eager")
"""Flags of every lab engine: the CPU lab flags (prefix caching, ngram speculation), compact JSON, eager mode."""

# Signals shown per phase and per tick.
PHASE_SIGNALS = (
    "prefix_cache_hit_rate", "prefix_cache_query_rate", "spec_yield", "spec_draft_rate", "spec_acceptance_rate",
    "spec_mean_acceptance_length", "request_rate", "generation_tokens_rate", "prompt_tokens_rate", "ttft_p95",
    "e2e_mean", "tpot_p95", "kv_cache_usage",
)



class LabError(FleetError):
    """The lab could not start or run: vLLM missing, an engine that would not serve, a bad trace."""

    exit_code = 6


class LabInterrupted(LabError):
    """Stopped by a signal (Ctrl-C, SIGTERM) before the phases were done."""

    exit_code = 130


@dataclass(frozen=True, slots=True)
class Phase:
    """One stretch of the timeline: a traffic mode for some seconds, optionally under another router policy."""

    traffic: Traffic
    seconds: float
    router: RoutePolicy | None = None  # None: the lab's configured policy

    @property
    def name(self) -> str:
        """How the phase is written on the command line."""
        if self.router is RoutePolicy.ROUND_ROBIN and self.traffic is Traffic.NORMAL:
            return "round_robin"
        return str(self.traffic) if self.router is None else f"{self.traffic}@{self.router}"


# Phase names accepted besides the traffic modes themselves.
_PHASE_ALIASES: dict[str, tuple[Traffic, RoutePolicy | None]] = {
    "unique_prefixes": (Traffic.UNIQUE, None),
    "random_sampling": (Traffic.RANDOM, None),
    "structured": (Traffic.JSON, None),
    "json_schema": (Traffic.JSON, None),
    "round_robin": (Traffic.NORMAL, RoutePolicy.ROUND_ROBIN),
    "rr": (Traffic.NORMAL, RoutePolicy.ROUND_ROBIN),
}


def parse_phases(text: str) -> list[Phase]:
    """Parse `MODE:SECONDS[,MODE:SECONDS...]`; MODE is a traffic mode, optionally `@prefix|@round_robin`,
    or `round_robin` (normal traffic with the router flipped to round-robin)."""
    phases = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        name, sep, secs = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"phase {i + 1} {item!r}: expected MODE:SECONDS, e.g. normal:60")
        try:
            seconds = float(secs)
        except ValueError:
            raise ValueError(f"phase {i + 1} {item!r}: {secs!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"phase {i + 1} {item!r}: seconds must be > 0")
        mode, _, policy = name.strip().lower().partition("@")
        try:
            traffic, router = _PHASE_ALIASES.get(mode) or (Traffic(mode), None)
            if policy:
                router = RoutePolicy(policy)
        except ValueError:
            modes = ", ".join([t.value for t in Traffic] + list(_PHASE_ALIASES))
            raise ValueError(f"phase {i + 1} {item!r}: unknown mode; use one of {modes}, "
                             f"optionally @{'|@'.join(p.value for p in RoutePolicy)}") from None
        phases.append(Phase(traffic, seconds, router))
    return phases


@dataclass(frozen=True, slots=True)
class LabSettings:
    """Everything the lab is made of."""

    engines: int = 2
    router: RoutePolicy = RoutePolicy.PREFIX
    trace: str = "mooncake"
    load: LoadSettings = field(default_factory=LoadSettings)
    router_settings: RouterSettings = field(default_factory=RouterSettings)
    pool: str = "lab"
    scrape_interval: float = 5.0
    db_url: str = "sqlite:///lab.db"
    venv: Path | None = None  # None: FLEET_VLLM_VENV or the default location
    model_dir: Path = DEFAULT_MODEL_DIR
    log_dir: Path | None = None  # engine logs; None: a fresh temporary folder
    startup_timeout_s: float = 300.0
    trace_requests: int = 5000  # trace rows read; the timeline wraps around them if it needs more
    bind_cpus: bool = True  # one CPU per engine (its processes and OpenMP threads), so engines do not fight over cores


@dataclass(slots=True)
class PhaseResult:
    """What one phase did, measured with the collectors between drained phase boundaries."""

    name: str
    traffic: str
    router: str
    started_at: float
    ended_at: float
    settled: bool  # every answered request was counted by the engines before the closing scrape
    pool: dict[str, float]
    engines: dict[str, dict[str, float]]  # pod -> signals
    traffic_stats: TrafficStats
    routed: dict[str, int]  # pod -> requests the router sent it


@dataclass(slots=True)
class TickView:
    """One control-loop tick as the progress display shows it."""

    ts: float
    elapsed_s: float
    phase: str
    targets: int
    targets_up: int
    signals: dict[str, float]  # the pool's signals this tick
    open_findings: list[str]  # "kind subject"
    opened: list[str]
    resolved: list[str]
    errors: dict[str, str]


@dataclass(slots=True)
class LabReport:
    """The whole run."""

    phases: list[PhaseResult] = field(default_factory=list)
    ticks: list[TickView] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    router: dict[str, Any] = field(default_factory=dict)
    traffic: TrafficStats = field(default_factory=TrafficStats)
    startup_s: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Plain data for `--json` and test artifacts."""
        def stats(s: TrafficStats) -> dict[str, Any]:
            return {"sent": s.sent, "ok": s.ok, "errors": s.errors, "error_kinds": s.error_kinds,
                    "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                    "mean_latency_s": s.mean_latency_s, "json_valid": s.json_valid, "json_invalid": s.json_invalid}

        return {
            "interrupted": self.interrupted,
            "startup_s": self.startup_s,
            "phases": [{"name": p.name, "traffic": p.traffic, "router": p.router, "seconds": p.ended_at - p.started_at,
                        "settled": p.settled, "pool": p.pool, "engines": p.engines, "routed": p.routed,
                        "traffic_stats": stats(p.traffic_stats)} for p in self.phases],
            "ticks": len(self.ticks),
            "findings": self.findings,
            "router": self.router,
            "traffic": stats(self.traffic),
        }


class _PhaseProbe:
    """Scrapes every engine with the collectors; each snapshot holds the signals since the previous one."""

    def __init__(self, client: httpx.AsyncClient, targets: Sequence[Target], pool: str) -> None:
        self.client = client
        self.targets = list(targets)
        self.pool = pool
        self.scraper = Scraper(client, timeout_s=10.0)
        self.deriver = SignalDeriver()

    async def snapshot(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """(pool signals, per-pod signals) since the previous snapshot; empty on the first."""
        now = time.time()
        results = await self.scraper.scrape(self.targets, now)
        failed = [f"{r.target.pod}: {r.error}" for r in results if not r.ok]
        if failed:
            raise LabError(f"scraping the lab engines failed: {'; '.join(failed)}")
        out = self.deriver.derive(results, now)
        pool = {s.name: s.value for s in out.signals if s.subject == pool_subject(self.pool)}
        pods = {t.pod: {s.name: s.value for s in out.signals if s.subject == engine_subject(self.pool, t.pod, "0")}
                for t in self.targets}
        return pool, pods

    async def settle(self, answered: int, timeout_s: float = 5.0) -> bool:
        """Wait until the engines have counted `answered` finished requests in all: a request's last
        stats can land just after its response."""
        deadline = time.monotonic() + timeout_s
        while True:
            counted = 0.0
            for t in self.targets:
                try:
                    text = (await self.client.get(t.url)).text
                except httpx.HTTPError as exc:  # an engine that died during the phase: said, with its name
                    raise LabError(f"engine {t.pod} ({t.url}) stopped answering: {type(exc).__name__}: {exc}") from None
                counted += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("vllm:request_success_total{"))
            if counted >= answered:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)


class Lab:
    """N real vLLM engines, a router in front, and a load generator aimed at the router."""

    def __init__(self, settings: LabSettings | None = None) -> None:
        self.settings = settings or LabSettings()
        if self.settings.engines < 1:
            raise ValueError(f"the lab needs at least one engine, got {self.settings.engines}")
        self.engines: list[VllmEngine] = []
        self.pods: list[str] = []
        self.router: Router | None = None
        self.loadgen: LoadGen | None = None
        self.log_dir = self.settings.log_dir or Path(tempfile.mkdtemp(prefix="fleet-lab-"))

    # lifecycle ------------------------------------------------------------------------------

    async def start(self, stop: asyncio.Event | None = None) -> None:
        """Start engines, router and load generator (not yet sending); LabInterrupted if `stop` is set meanwhile."""
        s = self.settings
        stop = stop or asyncio.Event()
        venv = s.venv or lab_venv()
        if not venv_ready(venv):
            raise LabError(f"vLLM is not installed in {venv}: run scripts/setup-vllm-lab.sh (or set FLEET_VLLM_VENV)")
        try:
            model = await asyncio.to_thread(ensure_model, venv, s.model_dir)
            words = single_token_words(model)
            requests = lab_trace(s.trace, s.trace_requests)
        except (RuntimeError, ValueError, OSError, KeyError) as exc:
            raise LabError(f"lab setup failed: {exc}") from None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(s.engines):
            engine = VllmEngine(venv, model, free_port(), LAB_ENGINE_ARGS, log_path=self.log_dir / f"vllm-{i}.log",
                                cpus=(cpus[i % len(cpus)],) if s.bind_cpus else None)
            self.engines.append(engine)
            self.pods.append(f"vllm-{i}")
        for engine in self.engines:
            engine.launch()
        await self._wait_ready(stop)
        await self._check_tokenizer(words)
        upstreams = [Upstream(pod, e.base_url) for pod, e in zip(self.pods, self.engines, strict=True)]
        self.router = await Router(upstreams, s.router, s.router_settings).start()
        self.loadgen = LoadGen(self.router.url, requests, PromptBuilder(words, s.load.block_tokens, s.load.seed), s.load)

    async def _wait_ready(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        waiting = dict(zip(self.pods, self.engines, strict=True))
        async with httpx.AsyncClient(timeout=2.0) as client:
            while waiting:
                if stop.is_set():
                    raise LabInterrupted(f"interrupted while {len(waiting)} engine(s) were starting")
                for pod, engine in list(waiting.items()):
                    code = engine.exit_code()
                    if code is not None:
                        raise LabError(f"engine {pod}: {engine.startup_failed(f'exited with code {code} during startup')}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(engine.health_url)).status_code == 200:
                            engine.mark_ready()
                            del waiting[pod]
                if waiting and time.monotonic() > deadline:
                    pod, engine = next(iter(waiting.items()))
                    why = f"did not answer {engine.health_url} within {self.settings.startup_timeout_s:g} s"
                    raise LabError(f"engine {pod}: {engine.startup_failed(why)}")
                if waiting:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.5)

    async def _check_tokenizer(self, words: list[str]) -> None:
        """Prompt blocks must be exactly one KV block of tokens, or shared prefixes stop lining up with the cache."""
        bt = self.settings.load.block_tokens
        text = PromptBuilder(words, bt).text([PromptBuilder(words, bt).block("check")])
        body = {"model": SERVED_MODEL_NAME, "prompt": text}
        async with httpx.AsyncClient(timeout=30.0) as client:
            try:
                resp = await client.post(f"{self.engines[0].base_url}/tokenize", json=body)
                count = int(resp.json()["count"])
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                raise LabError(f"engine {self.pods[0]}: /tokenize failed: {exc}") from None
        if count not in (bt, bt + 1):  # +1: the BOS token
            raise LabError(f"a prompt block of {bt} single-token words came to {count} tokens on {self.pods[0]}; "
                           f"the model's tokenizer does not match {self.settings.model_dir}")

    async def close(self) -> None:
        """Stop the router and every engine (SIGTERM to each process group, then SIGKILL after a grace period)."""
        if self.router is not None:
            await self.router.close()
        for engine in self.engines:
            engine.terminate()  # all at once: they shut down in parallel
        await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in self.engines))

    async def __aenter__(self) -> Lab:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # the fleet as the control plane sees it ---------------------------------------------------

    def targets(self) -> list[Target]:
        """One vLLM scrape target per engine."""
        return [Target(url=e.metrics_url, pool=self.settings.pool, pod=pod) for pod, e in zip(self.pods, self.engines,
                                                                                               strict=True)]

    def fleet_document(self) -> dict[str, Any]:
        """The fleet file for the running lab, as data."""
        s = self.settings
        interval = s.scrape_interval
        return {
            "mode": "observe",  # nothing here can scale real CPU engines
            "store": {"url": s.db_url},
            "scrape": {"interval": interval, "timeout": min(5.0, interval / 2), "spread": min(1.0, interval / 5)},
            "pools": [{"name": s.pool, "role": "unified", "model": SERVED_MODEL_NAME,
                       "replicas": {"min": 1, "max": max(1, len(self.engines))}}],
            "targets": [{"url": t.url, "pool": t.pool, "pod": t.pod} for t in self.targets()],
        }

    def fleet_yaml(self) -> str:
        """The fleet file for the running lab, as YAML (usable with `fleetctl run --config`)."""
        return str(yaml.safe_dump(self.fleet_document(), sort_keys=False))

    def fleet_config(self) -> FleetConfig:
        """The fleet file for the running lab, validated."""
        return parse_config(self.fleet_yaml(), "lab fleet")

    # the timeline ---------------------------------------------------------------------------

    async def run_phases(self, phases: Sequence[Phase], stop: asyncio.Event | None = None,
                         on_phase: Callable[[PhaseResult], None] | None = None,
                         on_start: Callable[[Phase], None] | None = None) -> list[PhaseResult]:
        """Run each phase for its seconds, draining the load between phases and measuring each one."""
        if self.loadgen is None or self.router is None:
            raise RuntimeError("start the lab first")
        stop = stop or asyncio.Event()
        gen, router = self.loadgen, self.router
        results: list[PhaseResult] = []
        stop_load = asyncio.Event()
        gen.pause()
        sender = asyncio.create_task(gen.run(stop_load))
        try:
            async with http_client(concurrency=16, timeout_s=10.0) as client:
                probe = _PhaseProbe(client, self.targets(), self.settings.pool)
                await probe.snapshot()
                for phase in phases:
                    if stop.is_set():
                        break
                    router.set_policy(phase.router or self.settings.router)
                    gen.set_traffic(phase.traffic)
                    before = gen.total.copy()
                    routed_before = {n: st.requests for n, st in router.stats.items()}
                    started = time.time()
                    if on_start is not None:
                        on_start(phase)
                    gen.resume()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), phase.seconds)
                    drained = await gen.drain()
                    answered = sum(st.ok for st in router.stats.values())
                    settled = drained and await probe.settle(answered)
                    pool, pods = await probe.snapshot()
                    result = PhaseResult(
                        name=phase.name, traffic=str(phase.traffic), router=str(router.policy), started_at=started,
                        ended_at=time.time(), settled=settled, pool=pool, engines=pods,
                        traffic_stats=gen.total.minus(before),
                        routed={n: st.requests - routed_before[n] for n, st in router.stats.items()},
                    )
                    results.append(result)
                    if on_phase is not None:
                        on_phase(result)
        finally:
            stop_load.set()
            gen.resume()
            await sender
        return results


async def run_lab(
    settings: LabSettings,
    phases: Sequence[Phase],
    *,
    stop: asyncio.Event | None = None,
    on_tick: Callable[[TickView], None] | None = None,
    on_phase: Callable[[PhaseResult], None] | None = None,
    on_ready: Callable[[Lab], None] | None = None,
) -> LabReport:
    """Start the lab, run the phases with the control loop ticking every scrape interval, stop everything.

    Setting `stop` ends the run early (the report says `interrupted`); during startup it raises
    LabInterrupted. Engines are stopped on every way out.
    """
    if not phases:
        raise ValueError("the lab needs at least one phase")
    stop = stop or asyncio.Event()
    report = LabReport()
    lab = Lab(settings)
    store: ThreadedStore | None = None
    try:
        await lab.start(stop)
        report.startup_s = {pod: round(e.startup_s or 0.0, 1) for pod, e in zip(lab.pods, lab.engines, strict=True)}
        if on_ready is not None:
            on_ready(lab)
        config = lab.fleet_config()
        await asyncio.to_thread(migrate.upgrade, settings.db_url)
        store = ThreadedStore.open(settings.db_url)
        started = time.time()
        current = [phases[0].name]
        async with scrape_client(config) as client:
            loop = build_loop(config, store, client)
            await loop.start()
            done = asyncio.Event()
            ticker = asyncio.create_task(_tick(loop, store, settings.pool, done, started, current, report, on_tick))
            try:
                report.phases = await lab.run_phases(phases, stop, on_phase,
                                                     on_start=lambda p: current.__setitem__(0, p.name))
            finally:
                done.set()
                await ticker
        report.findings = [_finding_dict(f) for f in store.sql.findings_since(started)]
        assert lab.router is not None and lab.loadgen is not None
        report.router = lab.router.snapshot()
        report.traffic = lab.loadgen.total.copy()
        report.interrupted = stop.is_set()
        return report
    finally:
        await lab.close()
        if store is not None:
            store.close()


async def _tick(loop: ControlLoop, store: ThreadedStore, pool: str, done: asyncio.Event, started: float, current: list[str],
                report: LabReport, on_tick: Callable[[TickView], None] | None) -> None:
    """The control loop's ticks, one per scrape interval until `done`; each tick shown as a TickView."""
    interval = loop.config.scrape.interval
    while not done.is_set():
        began = time.monotonic()
        try:
            tick = await loop.tick()
        except FleetError as exc:
            # As the loop's own run(): a store hiccup costs one tick, not the lab.
            log.error("tick failed: %s", exc)
            tick = TickReport(ts=loop.clock.now(), errors={"tick": str(exc)})
        try:
            open_now = [f"{f.kind} {f.subject}" for f in await store.open_findings()]
        except FleetError as exc:
            log.error("open findings unavailable: %s", exc)
            open_now = []
        view = _view(loop, open_now, pool, tick, started, current[0])
        report.ticks.append(view)
        if on_tick is not None:
            on_tick(view)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, interval - (time.monotonic() - began)))


def _view(loop: ControlLoop, open_findings: list[str], pool: str, tick: TickReport, started: float, phase: str) -> TickView:
    subject = pool_subject(pool)
    signals = {}
    for name in PHASE_SIGNALS:
        points = loop.windows.series(subject, name, since=tick.ts)
        if points:
            signals[name] = points[-1][1]
    return TickView(
        ts=tick.ts, elapsed_s=tick.ts - started, phase=phase, targets=tick.targets, targets_up=tick.targets_up,
        signals=signals, open_findings=open_findings,
        opened=[f"{f.kind} {f.subject}" for f in tick.opened], resolved=[f"{f.kind} {f.subject}" for f in tick.resolved],
        errors=dict(tick.errors),
    )


def _finding_dict(f: Any) -> dict[str, Any]:
    return {"id": f.id, "kind": f.kind, "subject": f.subject, "state": f.state, "severity": f.severity,
            "summary": f.summary, "cause": f.cause, "opened_at": f.opened_at, "resolved_at": f.resolved_at}
