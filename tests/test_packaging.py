"""What an installed copy carries: every file the packages read beside their code is package data."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Read from a checkout only, by the script that builds the side environment, never by the installed package.
CHECKOUT_ONLY = {"bench/dynamo/requirements.txt", "bench/dynamo/requirements-deps.txt"}


def test_every_file_beside_the_code_is_package_data() -> None:
    # A scenario directory added without its glob works from the checkout and breaks from a wheel (`fleetctl advise
    # eval` did: its scenarios were not in it).
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config["packages"]["find"]["include"]
    data = config["package-data"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    carried = {str(p.relative_to(ROOT)) for pkg, globs in data.items() for g in globs for p in (ROOT / pkg).glob(g)}
    tops = {p.rstrip("*") for p in packages}
    beside = {f for f in tracked if f.split("/")[0] in tops and "/" in f and not f.endswith(".py")}
    assert sorted(beside - carried - CHECKOUT_ONLY) == []
