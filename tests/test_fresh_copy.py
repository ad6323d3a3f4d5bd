"""A copy of the checkout with nothing beside it runs the demo and an evaluation.

`git archive HEAD` into an empty temporary folder (no `shared` folder anywhere above it), then
the copy's own code, with the packages already installed and nothing new, runs `fleetctl demo
--minutes 0.2` and `fleetctl eval --scenario router-flip`. This is what a user's fresh clone does.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed tree, unpacked where no `shared` folder lies beside or above it."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.fail(f"git archive failed in {ROOT} ({archive.stderr.decode().strip()}): this test needs a git checkout")
    folder = tmp_path_factory.mktemp("fresh") / "fleet-controlplane"
    folder.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    for above in (folder, *folder.parents):
        assert not (above / "shared").exists(), f"{above / 'shared'} would hide a missing file"
    return folder


def run(copy: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # The copy's packages come first on the path; the installed dependencies serve as they are.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET")}
    env["PYTHONPATH"] = str(copy)
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_copy_imports_its_own_code(copy: Path) -> None:
    res = run(copy, "-c", "import controlplane, collectors, policies, controlplane.data as d; "
                          "print(controlplane.__file__, collectors.__file__, policies.__file__, d.DATA_DIR)", timeout=60)
    assert res.returncode == 0, res.stderr
    assert all(path.startswith(str(copy)) for path in res.stdout.split()), res.stdout


@pytest.mark.slow
def test_the_copy_runs_the_demo(copy: Path) -> None:
    res = run(copy, "-m", "controlplane.cli", "demo", "--minutes", "0.2", "--db", f"sqlite:///{copy / 'demo.db'}",
              "--json", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["findings"] and summary["actions"], summary


@pytest.mark.slow
def test_the_copy_evaluates_a_scenario(copy: Path) -> None:
    res = run(copy, "-m", "controlplane.cli", "eval", "--scenario", "router-flip", "--workdir", str(copy / ".eval"),
              "--json", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert [s["name"] for s in report["scenarios"]] == ["router-flip"], report.keys()
