"""Stores for the dashboard tests: the demo's, and the demo's with the rest of a fleet added.

The demo simulates only vLLM engines. `add_fleet_extras` writes, over the demo's last minutes,
what the other pages read: an expert-parallel pool, KV-path probe and NIXL connector signals,
speculative decoding, GPUs with an XID, an EPLB signal and canary verdicts.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from collectors.types import Signal
from controlplane.demo import run_demo
from controlplane.store.records import NewAdvice, NewVerdict
from controlplane.store.writer import SqlStore
from policies.canary import Dist, GateSettings, Interval, Verdict, judge

DEMO_MINUTES = 0.4


@pytest.fixture(autouse=True)
def main_module_kept() -> Iterator[None]:
    """Put back the `__main__` module a Streamlit app test replaces with the page it ran: a process spawned later in
    the same worker (an evaluation's runs) would run that page again as its main module, and die."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


def copy_store(src: Path, dst: Path) -> None:
    """Copy a SQLite store with its WAL files, if any."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")


def add_fleet_extras(url: str) -> None:
    """Add EP, KV-transfer, speculative-decoding, GPU and canary data over the store's last 24 minutes."""
    store = SqlStore.open(url)
    try:
        end = store.load_signals(0.0, names=["targets"])[-1].ts
        times = [end - 1440.0 + 15.0 * i for i in range(97)]
        out: list[Signal] = []

        def series(subject: str, name: str, base: float, wave: float = 0.1) -> None:
            for i, ts in enumerate(times):
                out.append(Signal(ts, subject, name, base * (1.0 + wave * math.sin(i / 7.0 + len(subject)))))

        for pod in range(2):
            for rank in range(4):
                subject = f"engine/moe-decode/moe-decode-{pod}/{rank}"
                hot = 1.7 if rank == 2 else 1.0
                series(subject, "requests_running", 6.0 * hot)
                series(subject, "generation_tokens_rate", 250.0 * hot)
                series(subject, "itl_mean", 0.02 * hot)
        series("pool/moe-decode", "eplb_balancedness", 0.82)
        for subject, n in (("pool/moe-decode", 8), ("pool/decode", 3)):
            series(subject, "request_rate", 2.0 * n)
            series(subject, "engines_reporting", float(n), wave=0.0)
        for name, base in (("spec_acceptance_rate", 0.6), ("spec_mean_acceptance_length", 2.5), ("spec_yield", 0.45),
                           ("spec_acceptance_pos_0", 0.8), ("spec_acceptance_pos_1", 0.55), ("spec_acceptance_pos_2", 0.35)):
            series("pool/decode", name, base)
        for p in range(2):
            for d in range(2):
                path = f"kvpath/prefill-{p}->decode-{d}"
                series(path, "kv_transfer_p50", 0.003 * (1 + p + d))
                series(path, "kv_transfer_p99", 0.009 * (1 + p + 2 * d))
                series(path, "kv_failure_rate", 0.01 * d, wave=1.0)
                series(path, "kv_transfer_rate", 1.5)
        for e in range(3):
            subject = f"engine/decode/decode-{e}/0"
            series(subject, "nixl_xfer_time_p50", 0.004)
            series(subject, "nixl_xfer_time_p99", 0.012 * (1 + e))
            series(subject, "nixl_failed_transfer_rate", 0.02 * e, wave=1.0)
            series(subject, "nixl_transfer_rate", 2.0)
        for name, base in (("nixl_xfer_time_p50", 0.004), ("nixl_xfer_time_p95", 0.01), ("nixl_xfer_time_p99", 0.02),
                           ("nixl_failed_transfer_rate", 0.03), ("nixl_transfer_rate", 6.0)):
            series("pool/decode", name, base)
        for host in ("gpu-node-a", "gpu-node-b"):
            for g in range(4):
                subject = f"gpu/{host}/{g}"
                series(subject, "gpu_utilization", 0.5 + 0.1 * g)
                series(subject, "gpu_memory_used_bytes", 60e9)
                series(subject, "gpu_memory_free_bytes", 20e9)
                series(subject, "gpu_tensor_active", 0.4)
                series(subject, "gpu_temperature_celsius", 60.0 + 3 * g, wave=0.02)
                series(subject, "gpu_power_watts", 450.0)
                series(subject, "gpu_xid_errors", 0.0, wave=0.0)
        out.append(Signal(times[-10], "gpu/gpu-node-b/3", "gpu_xid_errors", 2.0))
        out = [s for s in out if not (s.subject == "gpu/gpu-node-b/3" and s.name == "gpu_xid_errors" and s.ts == times[-10]
                                      and s.value == 0.0)]
        out.append(Signal(times[-10], "gpu/gpu-node-b/3", "gpu_xid_last", 79.0))
        store.write_signals(out)
        for i in range(3):  # verdicts as the gate records them: the judge's own output
            verdict = _verdict(slow=(1.0, 1.2, 1.03)[i])
            store.record_verdict(NewVerdict("rollout", "decode", "v1", f"v{2 + i}", times[0] + 300 * i,
                                            times[0] + 300 * i + 240, verdict.outcome.value, verdict.score,
                                            verdict.as_dict()))
        # The advisor's advice: one open, one followed and scored.
        _, spec = store.record_advice([
            NewAdvice("kv_precision", "decode", True, "serve decode with --kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"},
                      "engines_needed", 6.0, 4.0, 168.0, 0.8, {"bf16": {"engines": 6}, "fp8": {"engines": 4}}),
            NewAdvice("speculation", "prefill", True, "disable speculative decoding on prefill",
                      {"speculative": {"method": "none"}}, "engines_needed", 5.0, 4.0, 84.0, 0.7, {})], times[-20])
        store.follow_advice(spec.id, times[-10])
        store.score_advice(spec.id, 4.4, 0.1, times[-1])
    finally:
        store.close()


def _verdict(slow: float) -> Verdict:
    """The default gate on twenty steps of a canary `slow` times slower than its baseline."""
    steps = [Interval(30.0 * k, 30.0 * (k + 1),
                      {m: Dist(100.0, 100.0 * v * (1 + 0.01 * (k % 3))) for m, v in (("ttft", 0.2), ("tpot", 0.02),
                                                                                    ("e2e", 3.0))}
                      | {"error_rate": Dist.of_events(0, 100)},
                      {m: Dist(40.0, 40.0 * v * slow * (1 + 0.01 * (k % 2))) for m, v in (("ttft", 0.2), ("tpot", 0.02),
                                                                                          ("e2e", 3.0))}
                      | {"error_rate": Dist.of_events(0, 60)})
             for k in range(20)]
    return judge(steps, GateSettings(), final=True)


@pytest.fixture(scope="session")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo store, made once per test run (do not write to it)."""
    path = tmp_path_factory.mktemp("demo") / "demo.db"
    summary = asyncio.run(run_demo(DEMO_MINUTES, f"sqlite:///{path}", Console(quiet=True), pace=False))
    assert summary.ok
    return path


@pytest.fixture(scope="session")
def full_db(demo_db: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo store plus `add_fleet_extras`, made once per test run."""
    path = tmp_path_factory.mktemp("full") / "full.db"
    copy_store(demo_db, path)
    add_fleet_extras(f"sqlite:///{path}")
    return path
