"""The KV-path probe against real NIXL: a decode-side agent process, a prefill-side initiator (a process of its own,
or a thread of the test where the test needs to steer it), real UCX WRITEs DRAM to DRAM, and the `/metrics` the
initiator serves. Trouble is injected for real: SIGSTOP/SIGCONT and SIGKILL of the decode side, larger blocks,
busy loops on the decode side's core, and metadata that is missing, garbage or stale.

These tests need NIXL (`scripts/ensure-nixl.sh`); without it they fail, they are never skipped.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from collectors import families, kvprobe
from collectors.exposition import parse
from collectors.types import Sample
from controlplane.kvprobe.agent import AgentProcess, TargetAgent
from controlplane.kvprobe.cli import render, run_probe
from controlplane.kvprobe.metadata import MetadataServer
from controlplane.kvprobe.nixlapi import NixlUnavailable, load_nixl
from controlplane.kvprobe.probe import Peer, ProbeMetrics, Prober
from controlplane.kvprobe.stats import TransferRecord, percentile
from controlplane.lab.engine import free_port

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

KIB = 1024
MIB = 1024 * KIB
PATH = "prefill-0->decode-0"


@pytest.fixture(scope="module", autouse=True)
def _nixl() -> None:
    try:
        load_nixl()
    except NixlUnavailable as exc:
        pytest.fail(f"real NIXL is required for the KV-path probe tests: {exc}")


# --- helpers ------------------------------------------------------------------------------------------------


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return list(parse(resp.read().decode()))


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 15.0, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def signals_between(before: list[Sample], after: list[Sample], seconds: float) -> dict[str, float]:
    """The collector's signals for the probed path between two scrapes of the initiator."""
    d = families.delta(kvprobe.read_paths(before)[PATH], kvprobe.read_paths(after)[PATH], seconds)
    assert d is not None
    return {s.name: s.value for s in kvprobe.signals(d, 0.0, f"kvpath/{PATH}")}



class Running:
    """A Prober in a background thread of the test, with its metrics served on a loopback port."""

    def __init__(self, peers: list[Peer], block_sizes: list[int], *, interval_s: float = 0.1, deadline_s: float = 0.5,
                 cpus: set[int] | None = None) -> None:
        self.records: list[TransferRecord] = []
        self.metrics = ProbeMetrics("prefill-0")
        self.prober = Prober("prefill-0", peers, block_sizes, deadline_s=deadline_s, fetch_timeout_s=1.0,
                             metrics=self.metrics, on_record=self.records.append)
        self.url = f"http://127.0.0.1:{self.metrics.serve()}/metrics"
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._cpus = cpus
        self.thread = threading.Thread(target=self._run, name="kvprobe-initiator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self._cpus:
                os.sched_setaffinity(0, self._cpus)  # this thread only
            self.prober.run(0, self._interval_s, self._stop)
        except BaseException as exc:
            self.error = exc

    def scrape(self) -> list[Sample]:
        return scrape(self.url)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the initiator did not stop"
        self.prober.close()
        self.metrics.close()
        if self.error is not None:
            raise AssertionError(f"the initiator crashed: {self.error!r}") from self.error


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as es:
        yield es


def start_target(stack: ExitStack, tmp_path: Path, sizes: list[int], **kwargs: Any) -> AgentProcess:
    name = str(kwargs.get("name", "decode-0"))
    target = AgentProcess.target(sizes, tmp_path / f"{name}-{time.monotonic_ns()}.log", **kwargs)
    stack.callback(target.stop)
    return target


def run_in_thread(stack: ExitStack, peers: list[Peer], sizes: list[int], **kwargs: Any) -> Running:
    running = Running(peers, sizes, **kwargs)
    stack.callback(running.close)
    return running


def healthz(target: AgentProcess) -> dict[str, Any]:
    with urllib.request.urlopen(target.metadata_url.replace("/metadata", "/healthz"), timeout=5) as resp:
        return dict(json.load(resp))


# --- two real agents in two processes ----------------------------------------------------------------------


def test_two_agent_processes_transfer_and_the_endpoint_counts(tmp_path: Path, stack: ExitStack) -> None:
    sizes = [256 * KIB, MIB]
    target = start_target(stack, tmp_path, sizes)
    initiator = AgentProcess.spawn(
        ["--role", "initiator", "--peer", f"decode-0={target.metadata_url}", "--block-sizes", "256KiB,1MiB",
         "--interval", "0.1", "--deadline", "1"], tmp_path / "initiator.log")
    stack.callback(initiator.stop)

    wait_for("20 probe transfers", lambda: value(scrape(initiator.metrics_url), "fleet_kvprobe_transfers_total") >= 20)
    samples = scrape(initiator.metrics_url)
    pair = {"src": "prefill-0", "dst": "decode-0"}
    for size in sizes:
        n = value(samples, "fleet_kvprobe_transfers_total", **pair, block_bytes=str(size))
        assert n > 0
        assert value(samples, "fleet_kvprobe_bytes_total", **pair, block_bytes=str(size)) == n * size
        # Metrics are updated slot by slot: the histogram holds every transfer the counter saw.
        assert value(samples, "fleet_kvprobe_transfer_seconds_count", **pair, block_bytes=str(size)) == n
    assert value(samples, "fleet_kvprobe_failures_total") == 0
    assert value(samples, "fleet_kvprobe_up", **pair) == 1
    assert value(samples, "fleet_kvprobe_metadata_exchanges_total", **pair, result="ok") == 1

    # The decode side saw the WRITEs: one notification each (plus the connection's warm-up) and changed blocks.
    health = healthz(target)
    assert health["notifications"] >= value(samples, "fleet_kvprobe_transfers_total")
    assert health["written_blocks"] == 8

    assert initiator.stop() == 0
    summary = json.loads(initiator.output.decode().strip().splitlines()[-1])
    assert summary["event"] == "summary" and summary["failures"] == 0 and summary["succeeded"] >= 20
    assert summary["metadata_exchange"]["decode-0"]["first_ok"] is True
    for block in summary["per_block"]:
        assert 0 < block["transfer_seconds"]["p50"] <= block["transfer_seconds"]["p99"] < 1.0
        assert block["post_seconds"]["p50"] <= block["transfer_seconds"]["p50"]


# --- the decode side stops, dies and comes back ------------------------------------------------------------


def test_sigstop_times_out_and_sigcont_recovers(tmp_path: Path, stack: ExitStack) -> None:
    target = start_target(stack, tmp_path, [256 * KIB])
    probe = run_in_thread(stack, [Peer("decode-0", target.metadata_url)], [256 * KIB], deadline_s=0.5)
    up = lambda: value(probe.scrape(), "fleet_kvprobe_up", dst="decode-0")  # noqa: E731
    wait_for("a healthy path", lambda: up() == 1 and sum(r.ok for r in probe.records) >= 5)

    stopped_at = time.monotonic()
    os.kill(target.pid, signal.SIGSTOP)
    try:
        wait_for("timeouts while the decode side is stopped",
                 lambda: value(probe.scrape(), "fleet_kvprobe_failures_total", reason="timeout") >= 2 and up() == 0)
        assert probe.thread.is_alive()
    finally:
        resumed_at = time.monotonic()
        os.kill(target.pid, signal.SIGCONT)
    done_before = sum(r.ok for r in probe.records)
    wait_for("the path back up after SIGCONT", lambda: up() == 1 and sum(r.ok for r in probe.records) >= done_before + 3)
    after = [r for r in probe.records if r.started_at >= resumed_at - 0.5 and r.ok]
    print(f"SIGSTOP for {resumed_at - stopped_at:.1f} s: "
          f"{sum(r.reason == 'timeout' for r in probe.records)} timeouts; first WRITE done after SIGCONT took "
          f"{(after[0].xfer_s or 0) * 1e3:.1f} ms (wall {(after[0].wall_s or 0) * 1e3:.1f} ms)")

    samples = probe.scrape()
    assert value(samples, "fleet_kvprobe_failures_total", reason="timeout") >= 2
    for reason in ("error", "peer_unreachable", "metadata_exchange_failed"):
        assert value(samples, "fleet_kvprobe_failures_total", reason=reason) == 0, reason
    assert value(samples, "fleet_kvprobe_metadata_exchanges_total", result="ok") == 1  # the connection survived


def test_a_stopped_peer_holds_a_round_one_deadline_not_one_per_block_size(tmp_path: Path, stack: ExitStack) -> None:
    """Slots run one after another: a stalled peer waited out the deadline at every block size, so one stopped decode
    worker cut every healthy path's slots eightfold, and five held a round past a scrape."""
    sizes = [256 * KIB, MIB, 4 * MIB]
    stopped, healthy = (start_target(stack, tmp_path, sizes, name=n) for n in ("decode-stopped", "decode-healthy"))
    prober = Prober("prefill-0", [Peer("stopped", stopped.metadata_url), Peer("healthy", healthy.metadata_url)], sizes,
                    deadline_s=1.0)
    stack.callback(prober.close)
    assert all(r.ok for r in prober.probe_round())
    os.kill(stopped.pid, signal.SIGSTOP)
    stack.callback(os.kill, stopped.pid, signal.SIGCONT)
    began = time.monotonic()
    records = prober.probe_round()
    took = time.monotonic() - began
    assert [r.reason for r in records if r.dst == "stopped"] == ["timeout"] * 3
    assert sum(r.posted_at is not None for r in records if r.dst == "stopped") == 1
    assert all(r.ok for r in records if r.dst == "healthy")
    assert took < 2.0, took  # one deadline, not three


def test_sigkill_is_peer_unreachable_and_a_restart_reconnects(tmp_path: Path, stack: ExitStack) -> None:
    port = free_port()
    target = AgentProcess.target([256 * KIB], tmp_path / "first.log", port=port)
    try:
        probe = run_in_thread(stack, [Peer("decode-0", target.metadata_url)], [256 * KIB], deadline_s=0.5)
        up = lambda: value(probe.scrape(), "fleet_kvprobe_up", dst="decode-0")  # noqa: E731
        wait_for("a healthy path", lambda: up() == 1 and sum(r.ok for r in probe.records) >= 5)
        first = healthz(target)["instance"]
        killed_at = time.monotonic()
        os.kill(target.pid, signal.SIGKILL)
        target.proc.wait(10)
        wait_for("the dead peer counted", lambda: value(
            probe.scrape(), "fleet_kvprobe_failures_total", reason="peer_unreachable") >= 3 and up() == 0)
        assert probe.thread.is_alive()
    finally:
        assert target.stop() == -signal.SIGKILL
    lost = [r for r in probe.records if not r.ok]
    print(f"SIGKILL: first failure {lost[0].reason} {lost[0].started_at - killed_at:.2f} s after the kill "
          f"({lost[0].detail[:90]})")

    # A restarted decode pod publishes new metadata on the same address; the probe loads it by itself.
    again = start_target(stack, tmp_path, [256 * KIB], port=port)
    restarted_at = time.monotonic()
    assert healthz(again)["instance"] != first
    wait_for("the path back up after the restart", lambda: up() == 1, timeout_s=20)
    print(f"reconnected {time.monotonic() - restarted_at:.2f} s after the new decode agent was ready; "
          f"{sum(r.reason == 'peer_unreachable' for r in probe.records)} slots were peer_unreachable")
    samples = probe.scrape()
    assert value(samples, "fleet_kvprobe_metadata_exchanges_total", result="ok") == 2
    assert value(samples, "fleet_kvprobe_failures_total", reason="metadata_exchange_failed") == 0
    assert value(samples, "fleet_kvprobe_failures_total", reason="error") == 0
    assert probe.prober.exchanges["decode-0"].instance == healthz(again)["instance"]


# --- slow transfers ------------------------------------------------------------------------------------------


def test_much_larger_blocks_raise_the_transfer_p99(tmp_path: Path, stack: ExitStack) -> None:
    # 128 MiB moves in tens of milliseconds; a 256 KiB block even on a loaded machine rarely takes that long.
    small, large = 256 * KIB, 128 * MIB
    target = start_target(stack, tmp_path, [small, large], slots=1)
    probe = run_in_thread(stack, [Peer("decode-0", target.metadata_url)], [small, large], interval_s=0.2,
                          deadline_s=2.0)
    before, t0 = probe.scrape(), time.monotonic()
    wait_for("25 transfers of each size", lambda: sum(r.ok and r.block_bytes == large for r in probe.records) >= 25,
             timeout_s=25)
    sig = signals_between(before, probe.scrape(), time.monotonic() - t0)
    p99_small, p99_large = sig["kv_transfer_p99_seconds_256kib"], sig["kv_transfer_p99_seconds_128mib"]
    print(f"p99 256KiB {p99_small * 1e3:.2f} ms, 128MiB {p99_large * 1e3:.2f} ms; "
          f"throughput {sig['kv_throughput_bytes_per_s'] / 1e6:.0f} MB/s")
    assert p99_large > 2 * p99_small and p99_large > 0.005
    assert sig["kv_failure_rate"] == 0


class Throttle:
    """CPU throttling of a process as a cgroup CPU quota applies it: stopped for `stopped_s` out of
    every `stopped_s + running_s`. Deterministic, unlike busy neighbours whose effect on a short
    sleeper depends on the scheduler's mood (measured here: 1.1x to 10x from run to run)."""

    def __init__(self, pid: int, stopped_s: float = 0.04, running_s: float = 0.04) -> None:
        self.pid, self.stopped_s, self.running_s = pid, stopped_s, running_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="throttle", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            time.sleep(self.stopped_s)
            os.kill(self.pid, signal.SIGCONT)
            self._stop.wait(self.running_s)

    def __enter__(self) -> Throttle:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        os.kill(self.pid, signal.SIGCONT)


def test_cpu_throttling_of_the_decode_side_raises_the_transfer_p99(tmp_path: Path, stack: ExitStack) -> None:
    target = start_target(stack, tmp_path, [256 * KIB])
    probe = run_in_thread(stack, [Peer("decode-0", target.metadata_url)], [256 * KIB], interval_s=0.05,
                          deadline_s=1.0)
    wait_for("a healthy path", lambda: sum(r.ok for r in probe.records) >= 5)

    def phase(seconds: float) -> tuple[list[float], dict[str, float]]:
        first = len(probe.records)
        before, t0 = probe.scrape(), time.monotonic()
        time.sleep(seconds)
        sig = signals_between(before, probe.scrape(), time.monotonic() - t0)
        return [r.xfer_s for r in probe.records[first:] if r.ok and r.xfer_s is not None], sig

    quiet, quiet_sig = phase(3.0)
    # The decode side's progress loop waits, and so do the WRITEs' completions. Stopped 100 ms at a time, a transfer
    # waits for far longer than the one stall a shared machine may give the quiet phase (14 ms seen).
    with Throttle(target.pid, stopped_s=0.1, running_s=0.1):
        busy, busy_sig = phase(3.0)
    quiet_p99, busy_p99 = percentile(quiet, 0.99), percentile(busy, 0.99)
    assert quiet_p99 is not None and busy_p99 is not None
    print(f"256KiB p50/p99 quiet {statistics.median(quiet) * 1e3:.2f}/{quiet_p99 * 1e3:.2f} ms, "
          f"throttled {statistics.median(busy) * 1e3:.2f}/{busy_p99 * 1e3:.2f} ms; from /metrics "
          f"{quiet_sig['kv_transfer_p99'] * 1e3:.2f} -> {busy_sig['kv_transfer_p99'] * 1e3:.2f} ms")
    assert busy_p99 > 3 * quiet_p99
    assert busy_sig["kv_transfer_p99"] > 2 * quiet_sig["kv_transfer_p99"]


# --- the metadata exchange ----------------------------------------------------------------------------------


def test_metadata_exchange_failures_are_their_own_kind(tmp_path: Path, stack: ExitStack) -> None:
    size = 256 * KIB
    # Stale: a registry still serving the metadata of an agent that has since gone away.
    gone = AgentProcess.target([size], tmp_path / "gone.log", name="decode-gone")
    try:
        with urllib.request.urlopen(gone.metadata_url, timeout=5) as resp:
            stale_doc = resp.read()
    finally:
        gone.stop()
    stale = MetadataServer(lambda: stale_doc, dict)
    stack.callback(stale.close)
    unreadable = MetadataServer(lambda: b"<html>502 Bad Gateway</html>", dict)
    stack.callback(unreadable.close)
    absent = start_target(stack, tmp_path, [size], name="decode-absent", metadata_mode="absent")
    garbage = start_target(stack, tmp_path, [size], name="decode-garbage", metadata_mode="garbage")
    live = start_target(stack, tmp_path, [size], name="decode-live")
    peers = [
        Peer("nobody", f"http://127.0.0.1:{free_port()}/metadata"),  # the decode side never served its metadata
        Peer("absent", absent.metadata_url),
        Peer("garbage", garbage.metadata_url),
        Peer("unreadable", unreadable.url),
        Peer("stale", stale.url),
        Peer("live", live.metadata_url),
    ]
    probe = run_in_thread(stack, peers, [size], interval_s=0.2)
    broken = [p.name for p in peers if p.name != "live"]
    wait_for("two rounds against every peer", lambda: all(
        value(probe.scrape(), "fleet_kvprobe_failures_total", dst=name, reason="metadata_exchange_failed") >= 2
        for name in broken) and sum(r.ok for r in probe.records) >= 2)

    samples = probe.scrape()
    for name in broken:
        assert value(samples, "fleet_kvprobe_up", dst=name) == 0, name
        assert value(samples, "fleet_kvprobe_metadata_exchanges_total", dst=name, result="failed") >= 2, name
        for reason in ("timeout", "error", "peer_unreachable"):
            assert value(samples, "fleet_kvprobe_failures_total", dst=name, reason=reason) == 0, (name, reason)
        assert value(samples, "fleet_kvprobe_bytes_total", dst=name) == 0, name
    assert value(samples, "fleet_kvprobe_up", dst="live") == 1
    assert value(samples, "fleet_kvprobe_failures_total", dst="live") == 0
    errors = {name: probe.prober.exchanges[name].last_error or "" for name in broken}
    assert "unreachable" in errors["nobody"]
    assert "HTTP 404" in errors["absent"]
    assert "NIXL could not load" in errors["garbage"]
    assert "not JSON" in errors["unreadable"]
    assert "NIXL could not load" in errors["stale"]


def test_one_peers_bad_metadata_is_its_own_failure_and_named(tmp_path: Path, stack: ExitStack) -> None:
    """Buffers NIXL cannot address, or a NIXL name another peer has, fail that peer alone, saying which (the first
    crashed the initiator for every peer); an error is cleared once the peer's exchange succeeds."""
    size = 256 * KIB
    first = start_target(stack, tmp_path, [size])
    twin = start_target(stack, tmp_path, [size])  # the same NIXL name, decode-0, as every pod left at the default
    with urllib.request.urlopen(first.metadata_url, timeout=5) as resp:
        doc = json.load(resp)
    doc["agent"], doc["buffers"][0]["addr"] = "decode-odd", -4096  # a pointer written as a signed integer
    odd = MetadataServer(lambda: json.dumps(doc).encode(), dict)
    stack.callback(odd.close)
    late = TargetAgent("decode-late", [size], metadata_mode="absent")  # in this process, to publish when told
    stack.callback(late.close)
    stop = threading.Event()
    progress = threading.Thread(target=late.run, args=(stop,), daemon=True)
    progress.start()
    stack.callback(progress.join, 5)
    stack.callback(stop.set)
    prober = Prober("prefill-0", [Peer("pod-a", first.metadata_url), Peer("pod-b", twin.metadata_url),
                                  Peer("odd", odd.url), Peer("late", late.metadata_url)], [size], deadline_s=0.5)
    stack.callback(prober.close)
    records = {r.dst: r for r in prober.probe_round()}  # raised for every peer before
    assert records["pod-a"].ok
    for name in ("pod-b", "odd", "late"):
        assert records[name].reason == "metadata_exchange_failed", name
    assert "pod-a" in (prober.exchanges["pod-b"].last_error or "")
    assert "cannot address" in (prober.exchanges["odd"].last_error or "")
    late.metadata_mode = "serve"
    assert {r.dst: r.ok for r in prober.probe_round()}["late"]
    stats = prober.exchanges["late"].as_dict()
    assert stats["failed"] == 1 and stats["succeeded"] == 1 and stats["last_error"] is None


# --- the fleetctl entry -----------------------------------------------------------------------------------------


def test_run_probe_reports_percentiles_per_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_probe(3.0, [256 * KIB, MIB], 0.2, as_json=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "kvprobe:" in err and "transfers" in err
    json.dumps(report)
    assert report["ok"] is True and report["failures"] == 0 and report["succeeded"] >= 20
    assert report["metadata_exchange"]["ok"] is True
    assert [b["block_bytes"] for b in report["per_block"]] == [256 * KIB, MIB]
    for block in report["per_block"]:
        t = block["transfer_seconds"]
        assert 0 < t["p50"] <= t["p90"] <= t["p99"] < 1.0
        assert block["post_seconds"]["p99"] is not None
        assert block["throughput_bytes_per_s"] > 0 and block["bandwidth_bytes_per_s"] > 0
    table = render(report)
    assert "metadata exchange ok" in table and "262144" in table and "1048576" in table
