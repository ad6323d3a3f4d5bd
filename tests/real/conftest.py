"""Fixtures for the checks against a real Prometheus: one shared run of the simulated fleet.

The run takes about 40 s, so the agreement tests of the collectors and of the Prometheus API
source share it. Without a `prometheus` binary the fixture runs `scripts/ensure-prometheus.sh`
(Debian's package, as root); if that cannot provide one the tests fail. They are never skipped.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real.prometheus import PrometheusNotAvailable, prometheus_binary
from tests.real.scenario import Run, run_scenario

ENSURE_PROMETHEUS = Path(__file__).resolve().parents[2] / "scripts" / "ensure-prometheus.sh"


def _ensure_prometheus() -> None:
    try:
        prometheus_binary()
        return
    except PrometheusNotAvailable:
        pass
    done = subprocess.run([str(ENSURE_PROMETHEUS)], capture_output=True, text=True, timeout=600, check=False)
    try:
        prometheus_binary()
    except PrometheusNotAvailable as exc:
        pytest.fail(f"{exc}\n{ENSURE_PROMETHEUS.name} exited {done.returncode}:\n{done.stderr[-2000:]}")


@pytest.fixture(scope="session")
def prometheus_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The simulated fleet scraped by a real Prometheus and by our collectors over the same windows."""
    _ensure_prometheus()
    run, server = run_scenario(tmp_path_factory.mktemp("prometheus"))
    try:
        yield run
    finally:
        run.prometheus.close()
        server.close()
