"""One run of the simulated fleet scraped by a real Prometheus and by our collectors, side by side.

The simulated engines publish a new state every `period_s` (2 s) of wall time: the fleet is
advanced to the scheduled instant `u_k` and the expositions are swapped in one `sync()`; between
two swaps every `/metrics` answer is identical. Prometheus scrapes every target every second (each
target at its own fixed phase), so it samples each published state once or twice. Our scraper
reads each state once, at `s_k = u_k + offset`, where `offset` (between 1.1 s and 1.9 s after the
swap) is chosen as far as possible from every target's Prometheus scrape phase. Hence:

* the state our scrape k read is exactly the one in Prometheus' latest sample at or before `s_k`
  (checked sample by sample on `vllm:prompt_tokens_total`);
* two of our scrapes bound the window (s_{k-1}, s_k], of `period_s` seconds; Prometheus holds the
  same pair of states in the same window.

Halfway through, one prefill engine restarts: its counters and histograms go back to zero and
its `_created` time moves, as a restarted vLLM process would show on the same port.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.scraper import Scraper
from collectors.types import Objectives, Target, engine_subject
from collectors.vllm import read_engines
from controlplane.demo import demo_scenario
from controlplane.sim.fleet import SimFleet
from controlplane.sim.server import SimServer
from tests.real.prometheus import RealPrometheus, ScrapeTarget

__all__ = ["TOLERANCE", "Run", "Window", "rel_diff", "run_scenario"]

TOLERANCE = 0.01  # agreement required between Prometheus and our collectors, relative
PERIOD_S = 2.0
PROMETHEUS_INTERVAL_S = 1.0
WINDOWS = 13  # compared windows; one more scrape opens the first
RESTART_AT = 7  # the window in which one engine restarts
# Objectives on vLLM's bucket bounds, for the pools' share of requests over them.
OBJECTIVES = {"prefill": Objectives(ttft=0.25, tpot=0.025), "decode": Objectives(ttft=0.25, tpot=0.025)}


@dataclass(frozen=True, slots=True)
class Window:
    """One of our scrape intervals: (ts - seconds, ts]."""

    k: int
    ts: float
    seconds: float
    restart: bool


@dataclass
class Run:
    """Everything the agreement tests compare, with the Prometheus still running."""

    prometheus: RealPrometheus
    targets: list[Target]
    by_instance: dict[str, Target]
    windows: list[Window]
    scrape_ts: list[float] = field(default_factory=list)  # our scrape k happened at scrape_ts[k]
    ours: dict[tuple[int, str, str], float] = field(default_factory=dict)  # (k, subject, name) -> value
    read: dict[tuple[int, str], float] = field(default_factory=dict)  # (k, instance) -> prompt tokens our scrape read
    restarted: str = ""  # instance of the restarted engine
    sync_lag_s: list[float] = field(default_factory=list)  # swap k completed this long after u_k
    scrape_offset_s: float = 0.0
    phase_margin_s: float = 0.0  # distance of our scrape instants from the nearest Prometheus scrape

    @property
    def restart_k(self) -> int:
        """The window in which the engine restarted."""
        return next(w.k for w in self.windows if w.restart)

    def subject(self, instance: str) -> str:
        """Engine subject of a Prometheus instance label."""
        t = self.by_instance[instance]
        return engine_subject(t.pool, t.pod, "0")


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 when both are 0."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def _address(target: Target) -> str:
    return target.url.split("/")[2]


def _phases(prom: RealPrometheus, instances: list[str]) -> dict[str, float]:
    """Each target's Prometheus scrape phase within the second, from its raw samples."""
    phases: dict[str, float] = {}
    for series in prom.query("vllm:num_requests_running[5s]", time.time()):
        stamps = [float(v[0]) for v in series["values"]]
        phases[series["metric"]["instance"]] = stamps[-1] % 1.0
    missing = set(instances) - set(phases)
    assert not missing, f"Prometheus has not scraped {sorted(missing)}"
    return phases


def _best_offset(phases: list[float]) -> tuple[float, float]:
    """The scrape offset in [1.1, 1.9] s after a swap farthest from every scrape phase (mod 1 s)."""
    best, margin = 1.5, -1.0
    for step in range(0, 81):
        offset = 1.1 + step * 0.01
        d = min(min(abs((offset - p) % 1.0), abs((p - offset) % 1.0)) for p in phases)
        if d > margin:
            best, margin = offset, d
    return best, margin


async def _run(prom: RealPrometheus, fleet: SimFleet, server: SimServer, run: Run, u0: float) -> None:
    deriver = SignalDeriver(OBJECTIVES)
    restarted = fleet.members["prefill"][1]
    async with httpx.AsyncClient(timeout=2.0) as client:
        scraper = Scraper(client, timeout_s=1.0)
        for k in range(WINDOWS + 1):
            u_k = u0 + k * PERIOD_S
            await asyncio.sleep(max(0.0, u_k - time.time()))
            fleet.advance_to(u_k)
            if k == RESTART_AT:
                restarted.engine.restart(u_k)  # a fresh process on the same port
            server.sync()
            run.sync_lag_s.append(time.time() - u_k)
            s_k = u_k + run.scrape_offset_s
            await asyncio.sleep(max(0.0, s_k - time.time()))
            # Running late does not change what our scrape reads (the next swap waits for it), only
            # whether Prometheus sampled the state before s_k; the identity test checks that.
            results = await scraper.scrape(run.targets, now=s_k)
            run.scrape_ts.append(s_k)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            for r in results:
                [reading] = read_engines(parse(r.body)).values()
                run.read[(k, _address(r.target))] = reading.counters["prompt_tokens"]
            out = deriver.derive(results, ts=s_k)
            for sig in out.signals:
                if math.isfinite(sig.value):
                    run.ours[(k, sig.subject, sig.name)] = sig.value
            if k:
                run.windows.append(Window(k, s_k, PERIOD_S, restart=k == RESTART_AT))
        # Let Prometheus take the samples of the last state before anything else changes.
        await asyncio.sleep(max(0.0, u0 + (WINDOWS + 1) * PERIOD_S - time.time()))
    run.restarted = _address(next(t for t in run.targets if t.pod == restarted.pod))


def run_scenario(workdir: Path) -> tuple[Run, SimServer]:
    """Start the fleet and Prometheus, run the schedule; the caller closes both."""
    start = time.time()
    scenario = demo_scenario()  # fault-free: only its fleet and traffic, 8 times faster than recorded
    scenario = scenario.model_copy(update={"trace": scenario.trace.model_copy(update={"speedup": 8.0})})
    fleet = SimFleet(scenario.fleet_spec(), scenario.requests(), now=start)
    server = SimServer(fleet, gpu=False, nixl=False)
    server.sync()
    targets = server.targets()
    prom = RealPrometheus(
        [ScrapeTarget(_address(t), {"pool": t.pool, "pod": t.pod}) for t in targets],
        workdir,
        scrape_interval_s=PROMETHEUS_INTERVAL_S,
    )
    try:
        prom.start()
        prom.wait_for_samples("vllm:num_requests_running", len(targets))
        time.sleep(1.2)  # a second sample per target, for the phases
        run = Run(prom, targets, {_address(t): t for t in targets}, [])
        run.scrape_offset_s, run.phase_margin_s = _best_offset(list(_phases(prom, list(run.by_instance)).values()))
        u0 = float(math.ceil(time.time()))  # swaps on whole seconds: phases below are taken mod 1 s
        asyncio.run(_run(prom, fleet, server, run, u0))
    except BaseException:
        prom.close()
        server.close()
        raise
    return run, server
