"""A throwaway real Prometheus for tests: own config, own storage, a free loopback port.

`RealPrometheus` writes a config with static scrape targets, starts the `prometheus` binary
(`PROMETHEUS_BIN` overrides the one on PATH; `scripts/ensure-prometheus.sh` installs it),
waits for `/-/ready`, answers instant queries over the HTTP API and stops the process when the
context exits. Its console output goes to a log file, quoted when it fails to start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from controlplane.lab.engine import free_port

__all__ = ["PrometheusNotAvailable", "RealPrometheus", "ScrapeTarget", "prometheus_binary"]


class PrometheusNotAvailable(RuntimeError):
    """No Prometheus binary, or it did not start."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One static target: `host:port` plus the target labels Prometheus attaches to its series."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)


def prometheus_binary() -> str:
    """Path of the Prometheus binary; raises PrometheusNotAvailable when there is none."""
    configured = os.environ.get("PROMETHEUS_BIN")
    found = configured if configured and os.access(configured, os.X_OK) else shutil.which("prometheus")
    if not found:
        raise PrometheusNotAvailable(
            "no prometheus binary (PATH or PROMETHEUS_BIN); run scripts/ensure-prometheus.sh, which installs "
            "Debian's prometheus package"
        )
    return found



class RealPrometheus:
    """A Prometheus process scraping `targets` every `scrape_interval_s`, storage under `workdir`."""

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        workdir: Path,
        *,
        scrape_interval_s: float = 1.0,
        job: str = "vllm",
        start_timeout_s: float = 30.0,
    ) -> None:
        self.targets = list(targets)
        self.workdir = workdir
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = workdir / "prometheus.log"
        self._http = httpx.Client(timeout=10.0)

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        """The generated prometheus.yml, as a mapping."""
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": "1m"},
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": [t.address], "labels": dict(t.labels)} for t in self.targets],
                }
            ],
        }

    def start(self) -> None:
        """Start the process and wait until it reports ready; a port taken meanwhile is retried."""
        binary = prometheus_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        last_error = ""
        for _ in range(3):
            self.port = free_port()
            with self._log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config_path}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--storage.tsdb.retention.time=1h",
                        "--log.level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,
                )
            last_error = self._wait_ready()
            if not last_error:
                return
            self.stop()
        raise PrometheusNotAvailable(f"Prometheus did not become ready: {last_error}\n{self.log_tail()}")

    def _wait_ready(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with status {self._proc.returncode}"
            try:
                if self._http.get(f"{self.url}/-/ready").status_code == 200:
                    return ""
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return f"not ready after {self.start_timeout_s:g}s"

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the process' console output."""
        if not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the process and release the HTTP client."""
        self.stop()
        self._http.close()

    def __enter__(self) -> RealPrometheus:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """Instant query evaluated at `at` (Unix seconds); the `result` list of the response."""
        resp = self._http.get(f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"})
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"query failed ({resp.status_code}): {body.get('error')}: {expr[:300]}")
        return list(body["data"]["result"])

    def wait_for_samples(self, metric: str, count: int, timeout_s: float = 15.0) -> None:
        """Wait until `metric` has a sample from `count` series (every target scraped once)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.query(metric, time.time())) >= count:
                return
            time.sleep(0.2)
        raise PrometheusNotAvailable(f"fewer than {count} series of {metric} after {timeout_s:g}s\n{self.log_tail()}")
