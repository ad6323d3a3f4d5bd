"""The side environments' shared steps (`scripts/lib/side-venv.sh`): install once, then return at once.

`make test` runs the vLLM lab's and Dynamo's setup scripts on every machine, new or not; both rest
on these steps. A stand-in setup script sources them with this interpreter and installs nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = f"""set -euo pipefail
NAME=stand-in
VENV=$1
PYTHON=${{STAND_IN_PYTHON:-{sys.executable}}}
PYTHON_HINT="STAND_IN_PYTHON to a Python interpreter"
STAMP=$VENV/.stand-in
WANT=$2
. {ROOT}/scripts/lib/side-venv.sh
side_venv_begin
say "installing $WANT"
side_venv_done
"""


def setup(tmp: Path, want: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "setup.sh"
    script.write_text(SETUP)
    return subprocess.run(["bash", str(script), str(tmp / "venv"), want], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120, check=False)


def test_installs_once_then_returns_at_once_until_what_is_wanted_changes(tmp_path: Path) -> None:
    first = setup(tmp_path, "v1")
    assert first.returncode == 0, first.stderr
    assert "creating virtual environment" in first.stderr and "installing v1" in first.stderr
    assert (tmp_path / "venv" / ".stand-in").read_text().strip() == "v1"
    again = setup(tmp_path, "v1")
    assert again.returncode == 0 and "ready at" in again.stderr and "installing" not in again.stderr
    newer = setup(tmp_path, "v2")
    assert "installing v2" in newer.stderr and "creating" not in newer.stderr, "the venv is kept, the install redone"
    assert (tmp_path / "venv" / ".stand-in").read_text().strip() == "v2"


def test_a_missing_interpreter_names_the_variable_to_set(tmp_path: Path) -> None:
    out = setup(tmp_path, "v1", STAND_IN_PYTHON="python-none-such")
    assert out.returncode == 1
    assert "python-none-such not found; set STAND_IN_PYTHON to a Python interpreter" in out.stderr
    assert not (tmp_path / "venv" / ".stand-in").exists()
