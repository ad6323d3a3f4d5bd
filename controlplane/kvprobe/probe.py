"""The prefill-side half of the KV-path probe: a NIXL agent that fetches each decode-side peer's metadata, WRITEs
KV-block-sized buffers into the peer's registered memory on a schedule, records every slot's outcome and
exports `fleet_kvprobe_*` metrics from its own registry.

Every scheduled slot (one peer, one block size) ends as a success or as exactly one failure reason:
`timeout` (not DONE within the deadline; the request is released), `error` (ERR state or a NIXL error),
`metadata_exchange_failed` (no usable metadata: the service answered with nothing loadable, or never
answered a peer that was never reached) and `peer_unreachable` (a peer reached before is gone: NIXL reports
the remote disconnected, or its metadata service no longer answers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.metrics_core import Metric

from controlplane.kvprobe.metadata import MetadataDoc, MetadataExchangeError, fetch_metadata
from controlplane.kvprobe.nixlapi import failure_reason, make_agent
from controlplane.kvprobe.stats import REASONS, TransferRecord

__all__ = ["BUCKETS", "ExchangeStats", "Peer", "ProbeMetrics", "Prober"]

log = logging.getLogger(__name__)

# Sub-millisecond loopback writes up to multi-second stalls of a congested or stopped peer.
BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.0002, 0.00035, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015,
    0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)
_US = 1e-6
_SPIN_CHECKS = 20
_MAX_POLL_SLEEP_S = 0.001


@dataclass(frozen=True, slots=True)
class Peer:
    """A decode-side agent to probe: the `dst` label and its metadata URL."""

    name: str
    url: str


@dataclass(slots=True)
class ExchangeStats:
    """Metadata exchanges with one peer: attempts, outcomes and the last error."""

    attempts: int = 0
    succeeded: int = 0
    failed: int = 0
    first_ok: bool | None = None
    first_seconds: float | None = None
    last_seconds: float | None = None
    last_error: str | None = None
    instance: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"attempts": self.attempts, "succeeded": self.succeeded, "failed": self.failed, "first_ok": self.first_ok,
                "first_seconds": self.first_seconds, "last_seconds": self.last_seconds,
                "last_error": self.last_error, "instance": self.instance}


class _SlotRegistry(CollectorRegistry):
    """A registry rendered under `lock`: a slot's outcome spans several families (the transfer, its bytes, its
    times), and a scrape must see it in all of them or in none, or bytes per transfer read wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            families = list(super().collect())
        yield from families


class ProbeMetrics:
    """The probe's Prometheus metrics in a registry of their own, optionally served on a loopback port."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.registry = _SlotRegistry()
        pair = ["src", "dst", "block_bytes"]
        self.transfer = Histogram("fleet_kvprobe_transfer_seconds", "NIXL transfer time of a probe WRITE (telemetry)",
                                  pair, buckets=BUCKETS, registry=self.registry)
        self.post = Histogram("fleet_kvprobe_post_seconds", "NIXL post time of a probe WRITE (telemetry)",
                              pair, buckets=BUCKETS, registry=self.registry)
        self.wall = Histogram("fleet_kvprobe_transfer_wall_seconds",
                              "Wall clock from posting a probe WRITE to seeing it DONE, polling included",
                              pair, buckets=BUCKETS, registry=self.registry)
        self.transfers = Counter("fleet_kvprobe_transfers", "Probe slots attempted, failed ones included", pair,
                                 registry=self.registry)
        self.failures = Counter("fleet_kvprobe_failures", "Probe slots that failed, by reason", [*pair, "reason"],
                                registry=self.registry)
        self.bytes = Counter("fleet_kvprobe_bytes", "Bytes the probe moved", pair, registry=self.registry)
        self.up = Gauge("fleet_kvprobe_up", "1 when every slot of the last round to dst succeeded", ["src", "dst"],
                        registry=self.registry)
        self.exchanges = Counter("fleet_kvprobe_metadata_exchanges", "Metadata exchanges with dst, by result",
                                 ["src", "dst", "result"], registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def prepare(self, dst: str, block_sizes: Sequence[int]) -> None:
        """Create every series of one peer at zero, so a scrape never confuses absent with none."""
        for size in block_sizes:
            labels = (self.src, dst, str(size))
            for fam in (self.transfer, self.post, self.wall, self.transfers, self.bytes):
                fam.labels(*labels)
            for reason in REASONS:
                self.failures.labels(*labels, reason)
        for result in ("ok", "failed"):
            self.exchanges.labels(self.src, dst, result)
        self.up.labels(self.src, dst).set(0)

    def observe(self, rec: TransferRecord) -> None:
        """Count one slot's outcome."""
        labels = (self.src, rec.dst, str(rec.block_bytes))
        with self.registry.lock:
            self.transfers.labels(*labels).inc()
            if not rec.ok:
                self.failures.labels(*labels, rec.reason or "error").inc()
                return
            self.bytes.labels(*labels).inc(rec.bytes)
            if rec.xfer_s is not None:
                self.transfer.labels(*labels).observe(rec.xfer_s)
            if rec.post_s is not None:
                self.post.labels(*labels).observe(rec.post_s)
            if rec.wall_s is not None:
                self.wall.labels(*labels).observe(rec.wall_s)

    def set_up(self, dst: str, up: bool) -> None:
        """Mark the path to dst up or down."""
        self.up.labels(self.src, dst).set(1 if up else 0)

    def exchanged(self, dst: str, ok: bool) -> None:
        """Count one metadata exchange."""
        self.exchanges.labels(self.src, dst, "ok" if ok else "failed").inc()

    def exposition(self) -> str:
        """The current text exposition."""
        return generate_latest(self.registry).decode()

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve `/metrics` on host:port (0 picks a free port); returns the port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


@dataclass(slots=True)
class _PeerState:
    peer: Peer
    remote: str | None = None
    doc: MetadataDoc | None = None
    ever_connected: bool = False
    descs: dict[int, list[Any]] | None = None  # block size -> remote xfer descriptor list per slot
    seq: dict[int, int] = field(default_factory=dict)  # block size -> transfers posted


class Prober:
    """The initiator: owns a NIXL agent, its source buffers and the per-peer connection state.

    Not thread-safe: one thread runs `run` or `probe_round`; `close` after that thread has finished.
    """

    def __init__(self, src: str, peers: Sequence[Peer], block_sizes: Sequence[int], *, deadline_s: float = 1.0,
                 fetch_timeout_s: float = 1.0, metrics: ProbeMetrics | None = None,
                 on_record: Callable[[TransferRecord], None] | None = None) -> None:
        if not peers:
            raise ValueError("no peers to probe")
        if not block_sizes:
            raise ValueError("no block sizes to probe")
        self.src = src
        self.block_sizes = list(dict.fromkeys(block_sizes))
        self.deadline_s = deadline_s
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = metrics
        self.on_record = on_record
        self.exchanges: dict[str, ExchangeStats] = {p.name: ExchangeStats() for p in peers}
        self._peers = [_PeerState(p) for p in peers]
        self._stuck: list[Any] = []
        self._agent: Any = make_agent(src, telemetry=True)
        self._buffers: dict[int, np.ndarray] = {}
        self._local: dict[int, Any] = {}
        regions = []
        for size in self.block_sizes:
            # A recognisable, non-zero pattern: the decode side can tell a written block from a fresh one.
            buf = np.full(size, 0xA5, dtype=np.uint8)
            self._buffers[size] = buf
            regions.append((buf.ctypes.data, size, 0, ""))
            self._local[size] = self._agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        self._registered = self._agent.register_memory(regions, "DRAM")
        if metrics is not None:
            for p in peers:
                metrics.prepare(p.name, self.block_sizes)

    # metadata ---------------------------------------------------------------------------------------------

    def _connect(self, st: _PeerState) -> tuple[str, str] | None:
        """Fetch and load a peer's metadata; None when connected, else (reason, detail)."""
        stats = self.exchanges[st.peer.name]
        stats.attempts += 1
        started = time.monotonic()
        try:
            doc = fetch_metadata(st.peer.url, self.fetch_timeout_s)
            missing = [s for s in self.block_sizes if doc.buffer(s) is None]
            if missing:
                raise MetadataExchangeError(f"peer {doc.agent} registered no buffer for block sizes {missing}")
            self._forget(st)
            # NIXL keys loaded agents by name: a second peer publishing a name already loaded is refused with a bare
            # NOT_ALLOWED, and which of the two fails depends on who connected first.
            if clash := next((other.peer.name for other in self._peers
                              if other is not st and other.remote == doc.agent), None):
                raise MetadataExchangeError(f"peer {st.peer.name} publishes the NIXL agent name {doc.agent!r}, which "
                                            f"peer {clash} already has: each agent needs a name of its own")
            try:
                remote = self._agent.add_remote_agent(doc.nixl_metadata)
            except Exception as exc:
                # A blob NIXL cannot parse, or one of an agent that no longer listens (stale).
                raise MetadataExchangeError(f"NIXL could not load the metadata of {doc.agent}: "
                                            f"{type(exc).__name__}: {exc}") from None
            st.remote = remote.decode() if isinstance(remote, bytes) else str(remote)
            st.descs = {}
            try:
                for size in self.block_sizes:
                    region = doc.buffer(size)
                    if region is not None:
                        st.descs[size] = [self._agent.get_xfer_descs([(region.slot_addr(i), size, region.dev)], "DRAM")
                                          for i in range(region.slots)]
            except Exception as exc:  # whatever NIXL refuses of one peer's buffers is that peer's failure alone
                self._forget(st)
                raise MetadataExchangeError(f"NIXL refused the buffers of {doc.agent}: {type(exc).__name__}: {exc}"
                                            ) from None
            st.doc = doc
        except MetadataExchangeError as exc:
            elapsed = time.monotonic() - started
            self._exchanged(stats, False, elapsed, str(exc), st.peer.name)
            reason = "peer_unreachable" if exc.unreachable and st.ever_connected else "metadata_exchange_failed"
            return reason, str(exc)
        elapsed = time.monotonic() - started
        self._exchanged(stats, True, elapsed, None, st.peer.name)
        stats.instance = doc.instance
        st.ever_connected = True
        log.info("kvprobe: loaded metadata of %s (instance %s) in %.1f ms", st.remote, doc.instance, elapsed * 1e3)
        # The first WRITE on a new connection pays for the lazy transport setup (10-20 ms on loopback, with or
        # without make_connection); it belongs to connecting, not to the path's steady state: not a probe slot.
        warm = self._transfer(st, self.block_sizes[0])
        if not warm.ok:
            log.info("kvprobe: warm-up transfer to %s failed: %s %s", st.peer.name, warm.reason, warm.detail)
        return None

    def _exchanged(self, stats: ExchangeStats, ok: bool, seconds: float, error: str | None, dst: str) -> None:
        if stats.first_ok is None:
            stats.first_ok, stats.first_seconds = ok, seconds
        stats.last_seconds = seconds
        if ok:
            stats.succeeded += 1
            stats.last_error = None  # the failures stay counted; an error beside a fresh success reads as now
        else:
            stats.failed += 1
            stats.last_error = error
        if self.metrics is not None:
            self.metrics.exchanged(dst, ok)

    def _forget(self, st: _PeerState) -> None:
        """Drop a peer's loaded metadata (it disconnected, or a new instance replaces it)."""
        if st.remote is not None:
            try:
                self._agent.remove_remote_agent(st.remote)
            except Exception as exc:
                log.debug("kvprobe: removing remote agent %s: %s", st.remote, exc)
        st.remote, st.doc, st.descs = None, None, None

    # transfers --------------------------------------------------------------------------------------------

    def _transfer(self, st: _PeerState, size: int) -> TransferRecord:
        """One WRITE of one block into the peer's next slot, polled to DONE, ERR or the deadline."""
        assert st.remote is not None and st.descs is not None
        dst = st.peer.name
        slots = st.descs[size]
        seq = st.seq[size] = st.seq.get(size, 0) + 1
        notif = f"kvprobe/{self.src}/{size}/{seq}".encode()
        started = time.monotonic()
        try:
            handle = self._agent.initialize_xfer("WRITE", self._local[size], slots[seq % len(slots)], st.remote,
                                                 notif)
        except Exception as exc:
            return TransferRecord(dst, size, started, False, failure_reason(exc), detail=f"prepare: {exc!r}")
        state = "ERR"
        checks = 0
        sleep_s = 0.00002
        posted = time.monotonic()
        try:
            state = self._agent.transfer(handle, notif)
            while state == "PROC":
                if time.monotonic() - posted >= self.deadline_s:
                    break
                checks += 1
                if checks > _SPIN_CHECKS:
                    time.sleep(sleep_s)
                    sleep_s = min(sleep_s * 2, _MAX_POLL_SLEEP_S)
                state = self._agent.check_xfer_state(handle)
            done = time.monotonic()
        except Exception as exc:
            self._release(handle, "ERR")
            return TransferRecord(dst, size, started, False, failure_reason(exc), posted, detail=f"transfer: {exc!r}")
        if state != "DONE":
            self._release(handle, state)
            if state == "PROC":
                return TransferRecord(dst, size, started, False, "timeout", posted,
                                      detail=f"not DONE within {self.deadline_s:g} s")
            return TransferRecord(dst, size, started, False, "error", posted, detail="transfer state ERR")
        wall = done - posted
        post_s: float | None = None
        xfer_s: float | None = wall
        moved = size
        try:
            # Only read after DONE: for an unfinished request NIXL returns uninitialised fields.
            tel = self._agent.get_xfer_telemetry(handle)
            post_s, xfer_s, moved = tel.postDuration * _US, tel.xferDuration * _US, int(tel.totalBytes) or size
        except Exception as exc:
            log.debug("kvprobe: no telemetry for a transfer to %s: %s", dst, exc)
        self._release(handle, state)
        return TransferRecord(dst, size, started, True, posted_at=posted, post_s=post_s, xfer_s=xfer_s, wall_s=wall,
                              bytes=moved)

    def _release(self, handle: Any, state: str) -> None:
        try:
            handle.release()
        except Exception as exc:
            # An in-flight request NIXL could not cancel: keep it and retry once it settles.
            log.debug("kvprobe: deferring release of a %s transfer: %s", state, exc)
            self._stuck.append(handle)

    def _retry_stuck(self) -> None:
        keep = []
        for handle in self._stuck:
            try:
                if self._agent.check_xfer_state(handle) == "PROC":
                    keep.append(handle)
                    continue
            except Exception:
                pass
            try:
                handle.release()
            except Exception:
                keep.append(handle)
        self._stuck = keep[-1000:]

    def _emit(self, rec: TransferRecord) -> TransferRecord:
        if self.metrics is not None:
            self.metrics.observe(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    def probe_round(self) -> list[TransferRecord]:
        """One slot per peer and block size; returns their records."""
        if self._stuck:
            self._retry_stuck()
        records: list[TransferRecord] = []
        for st in self._peers:
            failed: tuple[str, str] | None = None
            if st.remote is None:
                failed = self._connect(st)
            round_ok = failed is None
            for size in self.block_sizes:
                if failed is not None:
                    rec = TransferRecord(st.peer.name, size, time.monotonic(), False, failed[0], detail=failed[1])
                else:
                    rec = self._transfer(st, size)
                    if rec.reason == "peer_unreachable":
                        log.warning("kvprobe: %s disconnected: %s", st.peer.name, rec.detail)
                        self._forget(st)
                        failed = ("peer_unreachable", rec.detail)
                    elif rec.reason == "timeout":
                        # A stalled peer would hold the round a deadline per block size, and every other path's
                        # slots with it: its other sizes this round count as timed out, unposted.
                        failed = ("timeout", f"not posted: {size} bytes to {st.peer.name} timed out this round")
                round_ok = round_ok and rec.ok
                records.append(self._emit(rec))
            if self.metrics is not None:
                self.metrics.set_up(st.peer.name, round_ok)
        return records

    def run(self, duration_s: float, interval_s: float, stop: threading.Event | None = None,
            on_round: Callable[[list[TransferRecord], float], None] | None = None) -> tuple[float, float]:
        """Probe every `interval_s` until `duration_s` passed (0: until `stop` is set); returns (start, end).

        A round that overruns its interval (timeouts) delays the next one instead of bunching slots up.
        """
        stop = stop or threading.Event()
        start = time.monotonic()
        next_at = start
        while not stop.is_set():
            now = time.monotonic()
            if duration_s > 0 and now - start >= duration_s:
                break
            if now < next_at:
                wait = next_at - now
                if duration_s > 0:
                    wait = min(wait, start + duration_s - now)
                stop.wait(wait)
                continue
            records = self.probe_round()
            if on_round is not None:
                on_round(records, time.monotonic() - start)
            next_at = max(next_at + interval_s, time.monotonic())
        return start, time.monotonic()

    def close(self) -> None:
        """Release requests, forget peers, deregister memory and drop the agent."""
        if self._agent is None:
            return
        self._retry_stuck()
        for st in self._peers:
            self._forget(st)
        try:
            self._agent.deregister_memory(self._registered)
        except Exception as exc:
            log.debug("kvprobe: deregistering memory: %s", exc)
        self._agent = None
        self._local.clear()
