"""Starting and stopping one real vLLM server (CPU build) as a subprocess, and building the tiny
model it serves.

vLLM lives in its own virtual environment (see `scripts/setup-vllm-lab.sh`); this module runs in
the control plane's and only needs the standard library and httpx.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DEFAULT_VENV",
    "LAB_ARGS",
    "EngineStartError",
    "VllmEngine",
    "ensure_model",
    "free_port",
    "lab_venv",
    "venv_ready",
]

_CACHE = Path.home() / ".cache" / "fleet-controlplane"
DEFAULT_VENV = _CACHE / "vllm-venv"
"""Where `scripts/setup-vllm-lab.sh` installs vLLM unless FLEET_VLLM_VENV says otherwise."""
DEFAULT_MODEL_DIR = _CACHE / "tiny-llama"
"""Where the tiny model is built by default."""
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
SERVED_MODEL_NAME = "tiny-llama"

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
LAB_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--enable-prefix-caching",
    "--speculative-config",
    json.dumps(SPECULATIVE_CONFIG),
)
"""Engine flags that work on the CPU build with the tiny model: prefix caching and ngram
speculative decoding on, so their metric families are exposed."""

LAB_ENV: Mapping[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a large share of the machine
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message ends with its log tail."""


def lab_venv() -> Path:
    """The vLLM virtual environment: FLEET_VLLM_VENV, else the default location."""
    return Path(os.environ.get("FLEET_VLLM_VENV") or DEFAULT_VENV)


def venv_ready(venv: Path) -> bool:
    """Whether the setup script finished an install in `venv` (its stamp file is there)."""
    return (venv / ".fleet-vllm-lab").is_file() and (venv / "bin" / "python").exists()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_complete(model_dir: Path) -> bool:
    stamp = model_dir / ".complete"
    if not stamp.is_file():
        return False
    return stamp.read_text().strip() == hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()


def ensure_model(venv: Path, model_dir: Path = DEFAULT_MODEL_DIR, *, timeout_s: float = 300.0) -> Path:
    """Build the tiny model in `model_dir` with the venv's Python unless it is already there
    (built by the current recipe); return the directory."""
    if _model_complete(model_dir):
        return model_dir
    python = venv / "bin" / "python"
    try:
        proc = subprocess.run(
            [str(python), str(TINY_MODEL_SCRIPT), str(model_dir)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **LAB_ENV},
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building the tiny model with {python} did not finish within {timeout_s:g}s") from None
    if proc.returncode != 0 or not _model_complete(model_dir):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"building the tiny model with {python} failed (exit {proc.returncode}):\n{tail}")
    return model_dir


class VllmEngine:
    """One `vllm.entrypoints.openai.api_server` process on 127.0.0.1:`port`.

    `start()` returns once `/health` answers 200; `stop()` sends SIGTERM to the server's process
    group (the API server and its engine-core child), then SIGKILL. Usable as a context manager.
    `cpus` keeps the server, every process it starts and the model's OpenMP threads on those cores.
    """

    def __init__(
        self,
        venv: Path,
        model_dir: Path,
        port: int,
        extra_args: Sequence[str] = LAB_ARGS,
        *,
        served_model_name: str = SERVED_MODEL_NAME,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.venv = Path(venv)
        self.model_dir = Path(model_dir)
        self.port = port
        self.extra_args = tuple(extra_args)
        self.served_model_name = served_model_name
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"fleet-vllm-{port}.log"
        self.cpus = tuple(cpus) if cpus else None
        # The model's OpenMP threads bound to the same cores (vLLM's CPU build binds them itself otherwise).
        bind = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.cpus))} if self.cpus else {}
        self.env = {**LAB_ENV, **bind, **(env or {})}
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched_at = 0.0

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The Prometheus exposition."""
        return f"{self.base_url}/metrics"

    @property
    def health_url(self) -> str:
        """200 once the engine serves."""
        return f"{self.base_url}/health"

    @property
    def openai_url(self) -> str:
        """The OpenAI-compatible API root (`/v1`)."""
        return f"{self.base_url}/v1"

    @property
    def pid(self) -> int | None:
        """The API server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        return [
            str(self.venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def launch(self) -> None:
        """Start the server process and return at once; `start()` also waits until it serves."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"engine on port {self.port} is already running (pid {self._proc.pid})")
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise EngineStartError(f"no Python at {python}; run scripts/setup-vllm-lab.sh")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launched_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # own process group: stop() reaches the engine core too
            )
        if self.cpus is not None:
            # The whole process tree, not only the model's OpenMP threads: the API server and the engine core
            # it spawns (seconds later, inheriting this) would otherwise float onto another engine's core.
            os.sched_setaffinity(self._proc.pid, self.cpus)

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited, else None (also when never launched)."""
        return self._proc.poll() if self._proc is not None else None

    def startup_failed(self, why: str) -> EngineStartError:
        """Stop the server and build the error that names it, `why` it failed and its log tail."""
        self.stop()
        return EngineStartError(f"vLLM on port {self.port} {why}; log {self.log_path}:\n{self.log_tail()}")

    def mark_ready(self) -> None:
        """Record the startup time once `/health` answered 200."""
        self.startup_s = time.monotonic() - self._launched_at

    def start(self, timeout_s: float = 180.0) -> VllmEngine:
        """Start the server and wait until `/health` answers 200 (or raise `EngineStartError`)."""
        self.launch()
        deadline = self._launched_at + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.exit_code()
                if code is not None:
                    raise self.startup_failed(f"exited with code {code} during startup")
                try:
                    if client.get(self.health_url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self.startup_failed(f"did not answer {self.health_url} within {timeout_s:g} s")
                time.sleep(0.5)
        self.mark_ready()
        return self

    def terminate(self) -> None:
        """Send SIGTERM to the server's process group without waiting (to stop several engines at once)."""
        if self._proc is not None and self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; return the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Children that outlived the server (the engine core) go too, and are waited for: a caller
        # that starts the next engine right away must not share the cores with a dying one.
        _signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _group_exists(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
