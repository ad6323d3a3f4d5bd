"""The KV-path probe's processes: `python -m controlplane.kvprobe.agent --role target|initiator ...`.

The target is the decode side: it registers KV-block-sized buffers with a NIXL agent, publishes its metadata
on a loopback HTTP service and drives NIXL progress, counting the notifications the prefill side's WRITEs
carry. The initiator is the prefill side (`controlplane.kvprobe.probe`) with its `/metrics` endpoint. Each
prints one JSON line on stdout when ready (`{"event": "ready", ...}`); the initiator prints a summary line
when it stops. Logs go to stderr. SIGTERM or SIGINT stops either cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np

from controlplane.errors import FleetError
from controlplane.kvprobe.metadata import BufferDesc, MetadataDoc, MetadataServer
from controlplane.kvprobe.nixlapi import NixlUnavailable, make_agent
from controlplane.kvprobe.stats import TransferRecord, parse_block_size, summarize

__all__ = ["METADATA_MODES", "AgentProcess", "AgentStartError", "TargetAgent", "main"]

log = logging.getLogger(__name__)

# serve: the real document; garbage: a well-formed document whose NIXL blob is random bytes (a publisher bug
# or version skew); absent: the service is up but has nothing published (404), as before registration.
METADATA_MODES = ("serve", "garbage", "absent")
DEFAULT_BLOCK_SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
# A probe WRITE carries a notification, and the initiator sees it DONE only once this side has progressed
# that notification (a stopped decode process stalls the WRITE; at 50 ms between polls a 1 MiB WRITE took
# 50 ms). The cadence stands in for an engine's step loop and bounds what the probe can measure below it.
PROGRESS_INTERVAL_S = 0.002
# Slots the initiator's exit summary covers, the newest (a run until stopped probes for days; the metrics count all).
SUMMARY_SLOTS = 100_000


class TargetAgent:
    """The decode side: registered KV buffers, a metadata service and a progress loop."""

    def __init__(self, name: str, block_sizes: Sequence[int], *, slots: int = 4, metadata_mode: str = "serve",
                 host: str = "127.0.0.1", port: int = 0) -> None:
        if metadata_mode not in METADATA_MODES:
            raise ValueError(f"metadata mode {metadata_mode!r} not in {METADATA_MODES}")
        self.name = name
        self.instance = uuid.uuid4().hex
        self.metadata_mode = metadata_mode
        self.notifications = 0
        self._lock = threading.Lock()
        self._agent: Any = make_agent(name, telemetry=False)
        self._buffers: dict[int, np.ndarray] = {}
        descs = []
        regions = []
        for size in dict.fromkeys(block_sizes):
            buf = np.empty(size * slots, dtype=np.uint8)
            buf.fill(0)  # fault the pages in now, not during the first probe WRITE
            self._buffers[size] = buf
            descs.append(BufferDesc(size, buf.ctypes.data, slots))
            regions.append((buf.ctypes.data, buf.nbytes, 0, ""))
        self._registered = self._agent.register_memory(regions, "DRAM")
        blob = self._agent.get_agent_metadata()
        if metadata_mode == "garbage":
            blob = os.urandom(len(blob))
        self._doc = MetadataDoc(name, self.instance, os.getpid(), time.time(), blob, tuple(descs)).to_json()
        self._server = MetadataServer(self._document, self.health, host, port)

    @property
    def metadata_url(self) -> str:
        """Where the initiator fetches this agent's metadata."""
        return self._server.url

    def _document(self) -> bytes | None:
        return None if self.metadata_mode == "absent" else self._doc

    def health(self) -> dict[str, Any]:
        """The agent's own view: identity and notifications received."""
        with self._lock:
            notes = self.notifications
        return {"agent": self.name, "instance": self.instance, "pid": os.getpid(), "notifications": notes,
                "written_blocks": self.written_blocks()}

    def written_blocks(self) -> int:
        """Slots whose first byte a WRITE has changed from the zero fill."""
        return sum(int(np.count_nonzero(buf[:: size])) for size, buf in self._buffers.items())

    def poll(self) -> int:
        """Drive NIXL progress once and count new notifications; returns how many arrived."""
        notifs = self._agent.get_new_notifs()
        n = sum(len(v) for v in notifs.values())
        if n:
            with self._lock:
                self.notifications += n
        return n

    def run(self, stop: threading.Event, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        """Poll until `stop` is set."""
        while not stop.wait(interval_s):
            self.poll()

    def close(self) -> None:
        """Stop serving metadata, deregister memory, drop the agent."""
        self._server.close()
        if self._agent is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:
                log.debug("kvprobe target: deregistering memory: %s", exc)
            self._agent = None


class AgentStartError(FleetError):
    """A probe agent process did not become ready; the probe could not run (inconclusive)."""

    exit_code = 2


class AgentProcess:
    """One side of the probe running as its own process, as in a fleet: `spawn` or `target` start it (and wait
    for its ready line), `stop` ends it and keeps what it printed after the ready line in `output`."""

    def __init__(self, proc: subprocess.Popen[bytes], ready: dict[str, Any], log_path: Path, log_file: IO[bytes]) -> None:
        self.proc = proc
        self.ready = ready
        self.log_path = log_path
        self.output = b""
        self._log_file = log_file

    @property
    def pid(self) -> int:
        """The process id (for signals)."""
        return self.proc.pid

    @property
    def name(self) -> str:
        """The agent's NIXL name."""
        return str(self.ready["agent"])

    @property
    def metadata_url(self) -> str:
        """A target's metadata service."""
        return str(self.ready["metadata_url"])

    @property
    def metrics_url(self) -> str:
        """An initiator's `/metrics`."""
        return str(self.ready["metrics_url"])

    @classmethod
    def spawn(cls, argv: Sequence[str], log_path: Path, *, ready_timeout_s: float = 60.0,
              python: str = sys.executable, env: Mapping[str, str] | None = None) -> AgentProcess:
        """Start `python -m controlplane.kvprobe.agent ARGV` (stderr to `log_path`) and wait until it is ready.

        `env` adds variables, e.g. NIXL's own telemetry exporter (NIXL_TELEMETRY_ENABLE, ..._EXPORTER).
        """
        cmd = [python, "-m", "controlplane.kvprobe.agent", *argv]
        log_file = log_path.open("ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        try:
            ready = _read_ready(proc, ready_timeout_s)
        except BaseException:
            _end(proc, 5.0)
            log_file.close()
            raise
        if ready is None:
            code = _end(proc, 5.0)
            log_file.close()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise AgentStartError(f"kvprobe agent did not become ready (exit {code}); log {log_path}:\n{tail}")
        return cls(proc, ready, log_path, log_file)

    @classmethod
    def target(cls, block_sizes: Sequence[int], log_path: Path, *, name: str = "decode-0", metadata_mode: str = "serve",
               port: int = 0, slots: int = 4, progress_interval_s: float = PROGRESS_INTERVAL_S,
               ready_timeout_s: float = 60.0) -> AgentProcess:
        """Start a decode-side target agent process."""
        argv = ["--role", "target", "--name", name, "--block-sizes", ",".join(str(s) for s in block_sizes),
                "--metadata-mode", metadata_mode, "--metadata-port", str(port), "--slots", str(slots),
                "--progress-interval", str(progress_interval_s)]
        return cls.spawn(argv, log_path, ready_timeout_s=ready_timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (after SIGCONT, in case it was stopped), SIGKILL after `timeout_s`; the exit status. Idempotent."""
        try:
            return _end(self.proc, timeout_s, self)
        finally:
            self._log_file.close()


def _read_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any] | None:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            # Unbuffered reads: a buffered reader could hold the ready line where select cannot see it.
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                if isinstance(msg, dict) and msg.get("event") == "ready":
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            pending += chunk


def _end(proc: subprocess.Popen[bytes], timeout_s: float, keep: AgentProcess | None = None) -> int:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        except ProcessLookupError:
            pass
    code = proc.wait()
    if proc.stdout is not None and not proc.stdout.closed:
        rest = proc.stdout.read()
        if keep is not None:
            keep.output = rest
        proc.stdout.close()
    return code


def _sizes(text: str) -> list[int]:
    try:
        return [parse_block_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _peer(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"peer must be NAME=URL, got {text!r}")
    return name, url


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m controlplane.kvprobe.agent", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("target", "initiator"), required=True)
    p.add_argument("--name", help="NIXL agent name (default decode-0 / prefill-0)")
    p.add_argument("--block-sizes", type=_sizes, default=list(DEFAULT_BLOCK_SIZES),
                   help="comma-separated block sizes, e.g. 256KiB,1MiB,4MiB")
    p.add_argument("--host", default="127.0.0.1")
    target = p.add_argument_group("target")
    target.add_argument("--metadata-port", type=int, default=0)
    target.add_argument("--metadata-mode", choices=METADATA_MODES, default="serve")
    target.add_argument("--slots", type=int, default=4, help="blocks registered per block size")
    target.add_argument("--progress-interval", type=float, default=PROGRESS_INTERVAL_S,
                        help="seconds between progress polls")
    init = p.add_argument_group("initiator")
    init.add_argument("--peer", type=_peer, action="append", default=[], help="NAME=METADATA_URL (repeatable)")
    init.add_argument("--interval", type=float, default=0.25, help="seconds between probe rounds")
    init.add_argument("--deadline", type=float, default=1.0, help="seconds before a transfer counts as timed out")
    init.add_argument("--metrics-port", type=int, default=0)
    init.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until SIGTERM)")
    return p


def _ready(**fields: Any) -> None:
    print(json.dumps({"event": "ready", **fields}), flush=True)


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _run_target(args: argparse.Namespace, stop: threading.Event) -> int:
    agent = TargetAgent(args.name or "decode-0", args.block_sizes, slots=args.slots,
                        metadata_mode=args.metadata_mode, host=args.host, port=args.metadata_port)
    try:
        _ready(role="target", agent=agent.name, instance=agent.instance, pid=os.getpid(),
               metadata_url=agent.metadata_url)
        agent.run(stop, args.progress_interval)
    finally:
        agent.close()
    return 0


def _run_initiator(args: argparse.Namespace, stop: threading.Event) -> int:
    from controlplane.kvprobe.probe import Peer, ProbeMetrics, Prober

    if not args.peer:
        print("kvprobe: the initiator needs at least one --peer NAME=URL", file=sys.stderr)
        return 3
    src = args.name or "prefill-0"
    records: deque[TransferRecord] = deque(maxlen=SUMMARY_SLOTS)
    slots = 0

    def record(rec: TransferRecord) -> None:
        nonlocal slots
        slots += 1
        records.append(rec)

    metrics = ProbeMetrics(src)
    prober = Prober(src, [Peer(n, u) for n, u in args.peer], args.block_sizes, deadline_s=args.deadline,
                    metrics=metrics, on_record=record)
    try:
        port = metrics.serve(args.host, args.metrics_port)
        _ready(role="initiator", agent=src, pid=os.getpid(), metrics_url=f"http://{args.host}:{port}/metrics")
        start, end = prober.run(args.duration, args.interval, stop)
        kept = list(records)
        if slots > len(kept):  # a long run kept its newest slots: the summary covers them, from when the first began
            start = kept[0].started_at
        summary = summarize(kept, args.block_sizes, start, end)
        summary["slots"] = {"summarized": len(kept), "run": slots}
        summary["metadata_exchange"] = {name: s.as_dict() for name, s in prober.exchanges.items()}
        print(json.dumps({"event": "summary", **summary}), flush=True)
    finally:
        prober.close()
        metrics.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one side of the probe until stopped; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        return _run_target(args, stop) if args.role == "target" else _run_initiator(args, stop)
    except NixlUnavailable as exc:
        print(f"kvprobe: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
