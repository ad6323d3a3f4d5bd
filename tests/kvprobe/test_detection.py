"""End to end on the KV path: real NIXL transfers, the control loop scraping the probe, the
KV-transfer lag policy opening a finding when the decode side stops and resolving it after.

The loop runs on a virtual clock (15 s per tick) while the probe runs in real time between
ticks, so rates are scaled but quantiles, failure counts and the finding's lifecycle are real.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from controlplane.clock import VirtualClock
from controlplane.config import parse_config
from controlplane.kvprobe.agent import AgentProcess
from controlplane.kvprobe.probe import Peer
from controlplane.loop import ControlLoop, TickReport
from controlplane.runtime import build_loop
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from tests.kvprobe.test_probe import KIB, run_in_thread, start_target

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

SUBJECT = "kvpath/prefill-0->decode-0"


def fleet_file(metrics_url: str, db: str) -> str:
    return (
        f"mode: observe\nstore: {{url: '{db}'}}\nscrape: {{interval: 15s, timeout: 2s, spread: 0s}}\n"
        "pools: [{name: decode, role: decode, model: m, replicas: {min: 1, max: 4}}]\n"
        f"targets: [{{url: '{metrics_url}', pool: decode, pod: prefill-0, source: kvprobe}}]\n"
    )


@dataclass
class ProbedLoop:
    """A decode-side target, a probe thread and the control loop scraping it on a virtual clock."""

    target: AgentProcess
    loop: ControlLoop
    clock: VirtualClock
    interval: float

    async def tick(self, real_seconds: float) -> TickReport:
        await asyncio.sleep(real_seconds)  # the probe works in real time between two scrapes
        self.clock.advance(self.interval)
        return await self.loop.tick()


@asynccontextmanager
async def probed_loop(tmp_path: Path, store: SqlStore, deadline_s: float) -> AsyncIterator[ProbedLoop]:
    with ExitStack() as stack:
        target = start_target(stack, tmp_path, [256 * KIB])
        probe = run_in_thread(stack, [Peer("decode-0", target.metadata_url)], [256 * KIB], interval_s=0.05,
                              deadline_s=deadline_s)
        config = parse_config(fleet_file(probe.url, str(store.engine.url)))
        async with httpx.AsyncClient(timeout=2.0) as client:
            clock = VirtualClock()
            yield ProbedLoop(target, build_loop(config, ThreadedStore(store), client, clock=clock), clock, config.scrape.interval)


async def test_decode_side_stop_opens_and_recovery_resolves_the_finding(
    tmp_path: Path, sqlite_store: SqlStore
) -> None:
    async with probed_loop(tmp_path, sqlite_store, deadline_s=0.3) as p:
        for _ in range(12):  # a healthy baseline
            report = await p.tick(0.4)
            assert not report.opened and report.targets_up == 1
        assert p.loop.windows.latest(SUBJECT, "kv_transfer_p99") is not None

        os.kill(p.target.pid, signal.SIGSTOP)
        try:
            opened = []
            for _ in range(4):
                opened += (await p.tick(0.8)).opened
                if opened:
                    break
        finally:
            os.kill(p.target.pid, signal.SIGCONT)
        [finding] = opened
        assert finding.kind == "kv_transfer_lag" and finding.subject == SUBJECT
        assert finding.evidence["failing"] is True and finding.evidence["failures_per_s"] > 0
        assert "prefill-0->decode-0" in finding.cause

        resolved = []
        # Three clean intervals in a row resolve it; on a busy machine the first few after SIGCONT
        # still carry the stalled transfers and scheduler jitter, so give it room.
        for _ in range(25):
            resolved += (await p.tick(0.4)).resolved
            if resolved:
                break
        assert [f.id for f in resolved] == [finding.id]
        assert sqlite_store.open_findings() == []


async def test_decode_side_cpu_throttling_opens_a_tail_finding(tmp_path: Path, sqlite_store: SqlStore) -> None:
    from tests.kvprobe.test_probe import Throttle

    async with probed_loop(tmp_path, sqlite_store, deadline_s=2.0) as p:
        for _ in range(11):
            assert not (await p.tick(1.0)).opened
        opened = []
        # Stopped 100 ms at a time, as the probe's own throttling test does: a tail no stall of a shared machine makes.
        with Throttle(p.target.pid, stopped_s=0.1, running_s=0.1):
            for _ in range(5):
                opened += (await p.tick(1.0)).opened
                if opened:
                    break
        [finding] = opened
        assert finding.subject == SUBJECT and finding.evidence["slow"] is True
        assert finding.evidence["p99_s"] > 2 * finding.evidence["baseline_p99"]
        resolved = []
        for _ in range(25):  # the first intervals after SIGCONT still carry the stalled transfers: room, as above
            resolved += (await p.tick(1.0)).resolved
            if resolved:
                break
        assert [f.id for f in resolved] == [finding.id]


async def test_collectors_read_nixl_own_exporter_and_the_probe_side_by_side(tmp_path: Path) -> None:
    """NIXL's Prometheus exporter in the initiator process, and the probe's endpoint, in one scrape round."""
    import socket

    from collectors.pipeline import SignalDeriver
    from collectors.scraper import Scraper
    from collectors.types import Target
    from controlplane.kvprobe.agent import AgentProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nixl_port = s.getsockname()[1]
    telemetry = {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus",
                 "NIXL_TELEMETRY_PROMETHEUS_PORT": str(nixl_port), "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y"}
    with ExitStack() as stack:
        target = start_target(stack, tmp_path, [256 * KIB])
        initiator = AgentProcess.spawn(
            ["--role", "initiator", "--peer", f"decode-0={target.metadata_url}", "--block-sizes", "256KiB",
             "--interval", "0.05", "--deadline", "1"], tmp_path / "initiator.log", env=telemetry)
        stack.callback(initiator.stop)
        targets = [Target(f"http://127.0.0.1:{nixl_port}/metrics", "prefill", "prefill-0", source="nixl"),
                   Target(initiator.metrics_url, "prefill", "prefill-0", source="kvprobe")]
        deriver = SignalDeriver()
        async with httpx.AsyncClient(timeout=2.0) as client:
            scraper = Scraper(client)
            await asyncio.sleep(1.0)
            deriver.derive(await scraper.scrape(targets, 0.0), 0.0)
            await asyncio.sleep(2.0)
            out = deriver.derive(await scraper.scrape(targets, 2.0), 2.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    nixl = {name: v for (subject, name), v in sig.items() if subject.startswith("nixl/") and subject.endswith("/prefill-0")}
    assert nixl["nixl_tx_bytes_rate"] > 0 and nixl["nixl_tx_request_rate"] > 0
    assert 0 < nixl["nixl_xfer_time_p99"] < 1.0
    assert sig[(SUBJECT, "kv_transfer_rate")] > 0 and sig[(SUBJECT, "kv_failure_rate")] == 0
    # Both count the same WRITEs: NIXL's own request counter and the probe's transfers agree closely.
    assert abs(nixl["nixl_tx_request_rate"] - sig[(SUBJECT, "kv_transfer_rate")]) <= 0.2 * sig[(SUBJECT, "kv_transfer_rate")]
    assert out.missing_families == {} and out.parse_errors == {}
