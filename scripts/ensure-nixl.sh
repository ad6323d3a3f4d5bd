#!/usr/bin/env bash
# Make sure NIXL (the real library, CPU memory over UCX) imports in a virtual environment.
# Usage: scripts/ensure-nixl.sh [VENV]   (default .venv)
# nixl-cu12 declares torch as a dependency but imports it only for type checking; letting pip
# resolve it would download a multi-GB CUDA torch, so both NIXL wheels go in with --no-deps and
# numpy, their one runtime need, is installed on its own. Idempotent: does nothing when
# `import nixl_cu12` already works there.
set -euo pipefail

venv="${1:-.venv}"
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "ensure-nixl: no Python at $py; create the virtual environment first (make test does)" >&2
  exit 1
fi
if "$py" -c 'import nixl_cu12' >/dev/null 2>&1; then
  echo "ensure-nixl: nixl_cu12 already importable in $venv" >&2
  exit 0
fi
echo "ensure-nixl: installing numpy into $venv" >&2
"$py" -m pip install -q numpy
echo "ensure-nixl: installing nixl and nixl-cu12 into $venv with --no-deps (no torch)" >&2
"$py" -m pip install -q --no-deps nixl nixl-cu12
if ! "$py" -c 'import nixl_cu12' >/dev/null 2>&1; then
  echo "ensure-nixl: installed, but 'import nixl_cu12' still fails in $venv:" >&2
  "$py" -c 'import nixl_cu12' >&2 || true
  exit 1
fi
version="$("$py" -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))')"
echo "ensure-nixl: nixl-cu12 $version importable in $venv" >&2
