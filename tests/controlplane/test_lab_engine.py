"""`VllmEngine`'s process handling without vLLM: a stand-in server shows where its process tree may run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from controlplane.lab.engine import VllmEngine, free_port

# A server that, like vLLM's API server, starts a child (its engine core) a moment after it launches;
# both write the cores they may run on to the log.
STAND_IN = (
    "import os, subprocess, sys, time; time.sleep(0.3); "
    "print('server', sorted(os.sched_getaffinity(0)), flush=True); "
    "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", sorted(os.sched_getaffinity(0)), flush=True)']); "
    "time.sleep(30)"
)


class _StandIn(VllmEngine):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN]


def _venv(tmp_path: Path) -> Path:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    return tmp_path / "venv"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one core of one says nothing")
def test_cpus_pin_the_server_and_every_process_it_starts(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    log = tmp_path / "engine.log"
    engine = _StandIn(_venv(tmp_path), tmp_path, free_port(), log_path=log, cpus=(cpu,))
    try:
        assert engine.env["VLLM_CPU_OMP_THREADS_BIND"] == str(cpu), "the model's threads go to the same core"
        engine.launch()
        assert engine.pid is not None and os.sched_getaffinity(engine.pid) == {cpu}
        for _ in range(100):
            if "child" in log.read_text():
                break
            time.sleep(0.05)
        assert log.read_text().split() == ["server", f"[{cpu}]", "child", f"[{cpu}]"], log.read_text()
    finally:
        engine.stop()


def test_without_cpus_the_server_keeps_the_callers_cores(tmp_path: Path) -> None:
    engine = _StandIn(_venv(tmp_path), tmp_path, free_port(), log_path=tmp_path / "engine.log")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine.env
    try:
        engine.launch()
        assert engine.pid is not None and os.sched_getaffinity(engine.pid) == os.sched_getaffinity(0)
    finally:
        engine.stop()
