"""`fleetctl probe kv`: start a decode-side agent process, probe it from this process for a while, and report
per-block-size latency percentiles, throughput, failures and the metadata exchange.

Progress goes to stderr while it runs. With `as_json` nothing is printed on stdout (the caller prints the
returned object); without it a short table is printed there.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from controlplane.goals import all_hold, at_least, equal, goals_json
from controlplane.kvprobe.agent import AgentProcess
from controlplane.kvprobe.nixlapi import load_nixl
from controlplane.kvprobe.probe import Peer, ProbeMetrics, Prober
from controlplane.kvprobe.stats import TransferRecord, percentile, summarize

__all__ = ["render", "run_probe"]

SRC = "prefill-0"
DST = "decode-0"
DEADLINE_S = 1.0
PROGRESS_EVERY_S = 1.0


class _Progress:
    """One stderr line per `PROGRESS_EVERY_S` with the counts so far and the last period's percentiles."""

    def __init__(self, duration_s: float, stream: TextIO) -> None:
        self.duration_s = duration_s
        self.stream = stream
        self.transfers = 0
        self.failures = 0
        self._window: list[float] = []
        self._reasons: dict[str, int] = {}
        self._last = 0.0

    def round(self, records: list[TransferRecord], elapsed: float) -> None:
        for r in records:
            self.transfers += 1
            if r.ok:
                if r.xfer_s is not None:
                    self._window.append(r.xfer_s)
            else:
                self.failures += 1
                self._reasons[r.reason or "error"] = self._reasons.get(r.reason or "error", 0) + 1
        if elapsed - self._last < PROGRESS_EVERY_S:
            return
        self._last = elapsed
        p50, p99 = percentile(self._window, 0.5), percentile(self._window, 0.99)
        lat = "no transfers done" if p50 is None or p99 is None else f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self._reasons.items()))
        print(f"kvprobe: {elapsed:5.1f}/{self.duration_s:g} s  {self.transfers} transfers, {self.failures} failed"
              f"{f' ({reasons})' if reasons else ''}; last {PROGRESS_EVERY_S:g} s: {lat}", file=self.stream, flush=True)
        self._window.clear()


def run_probe(duration_s: float, block_sizes: list[int], interval_s: float, as_json: bool) -> dict[str, Any]:
    """Probe a freshly started decode-side agent process for `duration_s`; the report as a dict.

    `ok` is true when transfers succeeded and none failed (the caller's exit 0; 1 otherwise).
    """
    load_nixl()  # fail before starting anything when NIXL is missing
    sizes = list(dict.fromkeys(block_sizes))
    err = sys.stderr
    records: list[TransferRecord] = []
    with tempfile.TemporaryDirectory(prefix="kvprobe-") as tmp:
        print(f"kvprobe: starting the decode-side agent ({', '.join(str(s) for s in sizes)} byte blocks)", file=err,
              flush=True)
        target = AgentProcess.target(sizes, Path(tmp) / "target.log", name=DST)
        try:
            print(f"kvprobe: {target.name} ready (pid {target.pid}), metadata at {target.metadata_url}", file=err,
                  flush=True)
            metrics = ProbeMetrics(SRC)
            prober: Prober | None = None
            try:
                port = metrics.serve()
                prober = Prober(SRC, [Peer(target.name, target.metadata_url)], sizes, deadline_s=DEADLINE_S,
                                metrics=metrics, on_record=records.append)
                print(f"kvprobe: probing for {duration_s:g} s every {interval_s:g} s; "
                      f"metrics at http://127.0.0.1:{port}/metrics", file=err, flush=True)
                progress = _Progress(duration_s, err)
                start, end = prober.run(duration_s, interval_s, threading.Event(), progress.round)
                exchange = prober.exchanges[target.name]
            finally:
                if prober is not None:
                    prober.close()
                metrics.close()
        finally:
            target.stop()
    report: dict[str, Any] = {
        "src": SRC,
        "dst": DST,
        "interval_s": interval_s,
        "deadline_s": DEADLINE_S,
        "block_sizes": sizes,
        "finished_at": time.time(),
        "metadata_exchange": {"ok": bool(exchange.first_ok), "url": target.metadata_url, **exchange.as_dict()},
        **summarize(records, sizes, start, end),
    }
    report["goals"] = goals_json([at_least("transfers that succeeded", report["succeeded"], 1),
                                  equal("failed transfers", report["failures"], 0),
                                  equal("metadata exchange", bool(exchange.first_ok), True)])
    report["ok"] = all_hold(report["goals"])
    print(f"kvprobe: done: {report['succeeded']}/{report['transfers']} transfers succeeded", file=err, flush=True)
    if not as_json:
        print(render(report))
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def render(report: dict[str, Any]) -> str:
    """The report as a plain-text table (times in ms, rates in MB/s)."""
    ex = report["metadata_exchange"]
    state = (f"ok in {_ms(ex['first_seconds'])} ms" if ex["ok"] else f"FAILED: {ex['last_error']}")
    lines = [f"KV path {report['src']} -> {report['dst']}: metadata exchange {state}",
             f"{'block':>9} {'n':>5} {'fail':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'post p99':>8}"
             f" {'wall p99':>8} {'MB/s':>7} {'bw MB/s':>8}"]
    rows: Sequence[dict[str, Any]] = report["per_block"]
    for b in rows:
        t, p, w = b["transfer_seconds"], b["post_seconds"], b["wall_seconds"]
        lines.append(f"{b['block_bytes']:>9} {b['transfers']:>5} {b['failures']:>5} {_ms(t['p50']):>8} {_ms(t['p90']):>8}"
                     f" {_ms(t['p99']):>8} {_ms(p['p99']):>8} {_ms(w['p99']):>8}"
                     f" {_rate(b['throughput_bytes_per_s']):>7} {_rate(b['bandwidth_bytes_per_s']):>8}")
    reasons = ", ".join(f"{k} {v}" for k, v in report["failures_by_reason"].items() if v)
    lines.append(f"{report['succeeded']}/{report['transfers']} succeeded" + (f"; failures: {reasons}" if reasons else ""))
    for g in report.get("goals", []):
        lines.append(f"goal: {g['name']}: {g['value']} ({g['goal']}): {'holds' if g['holds'] else 'DOES NOT HOLD'}")
    return "\n".join(lines)
