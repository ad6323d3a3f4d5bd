"""The vLLM install the real-engine tests need: `scripts/setup-vllm-lab.sh`, run first and failing loudly.

The script returns at once when its stamp is in place and reinstalls after a version bump, so it
is always run; a missing or broken install fails the test, it never skips it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from controlplane.lab.engine import lab_venv, venv_ready

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup-vllm-lab.sh"


def ensure_vllm() -> Path:
    """The ready vLLM virtual environment (installing it if needed); fails the test otherwise."""
    venv = lab_venv()
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1500, check=False)
    if proc.returncode != 0 or not venv_ready(venv):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        pytest.fail(f"{SETUP} could not install vLLM in {venv} (exit {proc.returncode}):\n{tail}")
    return venv
