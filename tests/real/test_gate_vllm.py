"""The canary gate against real vLLM engines (CPU build, tiny model): one engine is the baseline; the
canary is first an identical engine (the gate must pass it) and then one started with a heavier
configuration, admitting one sequence at a time (`--max-num-seqs 1`), which it must fail.

Both arms get the same closed-loop traffic (the same prompts, the same concurrency, as a 50 % canary
share), the gate scrapes both engines' `/metrics` with the collectors' scraper every 5 s and judges
from the first step, as `fleetctl gate --source targets` does. Verdicts and reports go to
`tests/artifacts/gate-vllm-*.json`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from catalog.fleet import Role
from collectors.scraper import Scraper
from collectors.types import Target
from controlplane.actuators.base import StaticTargets
from controlplane.clock import WallClock
from controlplane.gate import ArmSelector, TargetsGateSource, report, run_gate
from controlplane.lab.engine import LAB_ARGS, VllmEngine, ensure_model, free_port
from policies.canary import GateSettings, MetricRule, Outcome, Scale, Verdict
from tests.real.vllm_setup import ensure_vllm

pytestmark = [pytest.mark.slow, pytest.mark.exclusive, pytest.mark.timeout(1500)]

ARTIFACTS = Path(__file__).resolve().parents[2] / "tests" / "artifacts"
WORDS = "the a of to and in is that for on with cache prefix token engine request decode model pool fleet".split()
# One core per engine on a two-core machine that also runs the test (traffic, scrapes), each engine's
# whole process tree pinned to it. Binding only the model's OpenMP threads left the API servers and
# engine cores floating: whichever core they crowded onto starved its engine, the two arms' TTFTs swapped
# places by 20x within a minute and no interval narrowed (the heavier canary came out inconclusive). Pinned,
# one arm's TTFT varies by a few per cent from one 5 s step to the next; the margin allows for the cores
# being unequal, as pods on unequal nodes are.
SETTINGS = GateSettings(
    metrics=(MetricRule(name="ttft", critical=True, allowed=0.5, margin=0.5, min_count=8),
             MetricRule(name="tpot", critical=True, allowed=0.5, margin=0.5, min_count=8),
             MetricRule(name="error_rate", scale=Scale.DIFFERENCE, allowed=0.05, critical=True, min_count=8)),
    step=5.0, max_window=150.0, min_blocks=6, target_blocks=12)
# The heavier canary serves one request at a time, so its TTFT holds the requests queued ahead of it.
# That wait only shows when the queue stays full: with short answers (24 tokens, ~70 ms serially) the
# clients' own pause between requests emptied it. Longer answers and four clients keep ~3 requests
# ahead of each arrival: 0.38 s against the baseline's 0.0065 s here.
CONCURRENCY = 4
MAX_TOKENS = 64


async def _traffic(url: str, stop: asyncio.Event, seed: int) -> int:
    """Closed-loop completions from `CONCURRENCY` clients until `stop`; returns how many were answered."""
    answered = 0

    async def client(i: int) -> None:
        nonlocal answered
        rng = random.Random(seed * 100 + i)
        async with httpx.AsyncClient(timeout=60.0) as http:
            while not stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
                r = await http.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                                   "max_tokens": MAX_TOKENS, "temperature": 0.0})
                answered += r.status_code == 200

    await asyncio.gather(*(client(i) for i in range(CONCURRENCY)))
    return answered


async def _gate(baseline: VllmEngine, canary: VllmEngine) -> tuple[Verdict, list[int]]:
    stop = asyncio.Event()
    load = [asyncio.create_task(_traffic(e.base_url, stop, seed=1)) for e in (baseline, canary)]
    try:
        await asyncio.sleep(10)  # warm both engines before the first step
        async with httpx.AsyncClient(timeout=5.0) as http:
            scraper = Scraper(http, timeout_s=5.0)
            found = StaticTargets([Target(baseline.metrics_url, "lab", "vllm-base", Role.UNIFIED),
                                   Target(canary.metrics_url, "lab", "vllm-canary", Role.UNIFIED)])
            source = TargetsGateSource(scraper, found, ArmSelector.parse("pod=vllm-base"),
                                       ArmSelector.parse("pod=vllm-canary"), SETTINGS.metrics)
            clock = WallClock()
            await source.interval(clock.now() - SETTINGS.step, clock.now())  # the deltas' first reading
            verdict = await run_gate(source, SETTINGS, clock)
    finally:
        stop.set()
        answered = list(await asyncio.gather(*load))
    return verdict, answered


def _engine(venv: Path, model: Path, name: str, extra: Sequence[str], cpu: int) -> VllmEngine:
    return VllmEngine(venv, model, free_port(), (*LAB_ARGS, "--enforce-eager", *extra),
                      log_path=ARTIFACTS / f"gate-vllm-{name}.log", cpus=(cpu,))


def _keep(name: str, verdict: Verdict, answered: list[int]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    text = report(verdict, "json", gate=name, pool="lab", baseline="vllm-base", canary="vllm-canary")
    (ARTIFACTS / f"gate-vllm-{name}.json").write_text(json.dumps({**json.loads(text), "answered": answered}, indent=2))


async def test_the_gate_fails_a_heavier_canary_and_not_an_identical_one(tmp_path: Path) -> None:
    venv = ensure_vllm()
    model = ensure_model(venv, tmp_path / "tiny-llama")
    cpus = sorted(os.sched_getaffinity(0))
    baseline = _engine(venv, model, "baseline", (), cpus[0])
    same = _engine(venv, model, "identical", (), cpus[-1])
    try:
        await asyncio.gather(asyncio.to_thread(baseline.start, 300), asyncio.to_thread(same.start, 300))
        verdict, answered = await _gate(baseline, same)
        _keep("identical", verdict, answered)
        assert min(answered) > 50, answered
        assert verdict.outcome is Outcome.PASS, verdict.reason
        # The same canary restarted (a crash, an OOM kill) is a new process to the gate, told by vLLM's own
        # exposition; its latency alone would read as before.
        async with httpx.AsyncClient(timeout=5.0) as http:
            found = StaticTargets([Target(baseline.metrics_url, "lab", "vllm-base", Role.UNIFIED),
                                   Target(same.metrics_url, "lab", "vllm-canary", Role.UNIFIED)])
            source = TargetsGateSource(Scraper(http, timeout_s=5.0), found, ArmSelector.parse("pod=vllm-base"),
                                       ArmSelector.parse("pod=vllm-canary"), SETTINGS.metrics)
            assert (await source.interval(0.0, 5.0)).restarted == ()
            same.stop()
            await asyncio.to_thread(same.start, 300)
            assert (await source.interval(5.0, 10.0)).restarted == ("vllm-canary",)
        same.stop()

        heavy = _engine(venv, model, "heavier", ("--max-num-seqs", "1"), cpus[-1])
        try:
            await asyncio.to_thread(heavy.start, 300)
            started = time.monotonic()
            verdict, answered = await _gate(baseline, heavy)
            _keep("heavier", verdict, answered)
        finally:
            heavy.stop()
        assert verdict.outcome is Outcome.FAIL, verdict.reason
        assert time.monotonic() - started < 10 + SETTINGS.max_window + 30
        ttft = next(m for m in verdict.metrics if m.name == "ttft")
        assert ttft.outcome is Outcome.FAIL and ttft.lower is not None and ttft.lower > 1.5
    finally:
        same.stop()
        baseline.stop()
