"""Whole-path benchmark: HTTP scrape, parse, derive and store for N simulated single-engine pods.

The pods are served by `bench.simserve` in another process. This process runs the same
collectors and store the loop uses and reports its own CPU seconds per 15 s interval and its
peak memory: the cost of one control-plane process at that fleet size.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from rich.console import Console

from collectors.pipeline import SignalDeriver
from collectors.scraper import Scraper
from collectors.types import Target
from controlplane.goals import at_most, equal, goals_json
from controlplane.store import migrate
from controlplane.store.threaded import ThreadedStore

__all__ = ["run_scrape_bench"]

INTERVAL_S = 15.0
MEMORY_GOAL_MIB = 1024  # one process for 5,000 pods in at most 1 GiB
CONCURRENCY = int(os.environ.get("FLEET_BENCH_CONCURRENCY", "16"))  # the fleet file's default


def _targets(ports: list[int], pods: int) -> list[Target]:
    return [Target(f"http://127.0.0.1:{ports[i % len(ports)]}/pods/{i}/metrics", f"pool-{i % 8}", f"pod-{i}")
            for i in range(pods)]


async def _measure(pods: int, ticks: int, ports: list[int], db_url: str, progress: Console) -> dict[str, Any]:
    store = ThreadedStore.open(db_url)  # as the loop writes: on the store's own thread
    deriver = SignalDeriver()
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    per_tick: list[dict[str, float]] = []
    async with httpx.AsyncClient(limits=limits, timeout=10.0) as client:
        scraper = Scraper(client, concurrency=CONCURRENCY, timeout_s=10.0)
        targets = _targets(ports, pods)
        control = f"http://127.0.0.1:{ports[0]}/advance"
        now = time.time()
        for tick in range(ticks + 1):  # the first tick only primes counters (no rates yet)
            await client.post(control)
            now += INTERVAL_S
            cpu0, wall0 = time.process_time(), time.perf_counter()
            results = await scraper.scrape(targets, now)
            cpu1 = time.process_time()
            out = deriver.derive(results, now)
            cpu2 = time.process_time()
            await store.write_signals(out.signals)
            cpu3, wall3 = time.process_time(), time.perf_counter()
            up = sum(1 for r in results if r.ok)
            if tick:
                per_tick.append({"cpu_s": cpu3 - cpu0, "scrape_cpu_s": cpu1 - cpu0, "derive_cpu_s": cpu2 - cpu1,
                                 "store_cpu_s": cpu3 - cpu2, "wall_s": wall3 - wall0, "signals": len(out.signals),
                                 "up": up})
            progress.print(f"  tick {tick}: {up}/{pods} up, {len(out.signals):,} signals, "
                           f"cpu {cpu3 - cpu0:.2f}s, wall {wall3 - wall0:.2f}s")
    store.close()
    worst = max(per_tick, key=lambda t: t["cpu_s"])
    mean = {k: sum(t[k] for t in per_tick) / len(per_tick) for k in per_tick[0]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "pods": pods, "interval_s": INTERVAL_S, "ticks": ticks,
        "cpu_s_per_interval": mean["cpu_s"], "cpu_s_per_interval_worst": worst["cpu_s"],
        "scrape_cpu_s": mean["scrape_cpu_s"], "derive_cpu_s": mean["derive_cpu_s"], "store_cpu_s": mean["store_cpu_s"],
        "wall_s_per_interval": mean["wall_s"], "signals_per_interval": mean["signals"],
        "targets_up": min(t["up"] for t in per_tick),
        "core_share": mean["cpu_s"] / INTERVAL_S,
        "peak_rss_bytes": peak,
        "sustains_one_core": worst["cpu_s"] < INTERVAL_S and min(t["up"] for t in per_tick) == pods,
        "goals": goals_json([
            at_most(f"CPU s per {INTERVAL_S:g} s interval, worst tick ({pods:,} pods; one core)", worst["cpu_s"], INTERVAL_S),
            equal("targets up", min(t["up"] for t in per_tick), pods),
            at_most("peak memory, MiB", round(peak / 2**20), MEMORY_GOAL_MIB),
        ]),
    }


def run_scrape_bench(*, pods: int, ticks: int, progress: Console) -> dict[str, Any]:
    """Start the pod server, run the measurement, stop the server."""
    server = subprocess.Popen([sys.executable, "-m", "bench.simserve", "--ports", "16"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert server.stdout is not None
        ports = [int(p) for p in server.stdout.readline().split()]
        with tempfile.TemporaryDirectory() as tmp:
            db_url = f"sqlite:///{tmp}/scrape.db"
            migrate.upgrade(db_url)
            progress.print(f"scraping {pods:,} simulated pods, {ticks} intervals ...")
            return asyncio.run(_measure(pods, ticks, ports, db_url, progress))
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout:
            server.stdout.close()
