#!/usr/bin/env bash
# Install NVIDIA Dynamo's planner in its own virtual environment for the autoscaling shoot-out.
#
# The venv lives at $FLEET_DYNAMO_VENV (default ~/.cache/fleet-controlplane/dynamo-venv), apart from the
# control plane's: Dynamo pins pydantic and kubernetes versions the product does not use. Idempotent: a
# stamp file records a finished install of these requirements, so a second run returns at once.
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
REQS=$HERE/bench/dynamo/requirements.txt
DEPS=$HERE/bench/dynamo/requirements-deps.txt
VENV=${FLEET_DYNAMO_VENV:-$HOME/.cache/fleet-controlplane/dynamo-venv}
PYTHON=${FLEET_DYNAMO_BASE_PYTHON:-python3.11}
STAMP=$VENV/.fleet-dynamo-bench
WANT=$(cat "$REQS" "$DEPS" | sha256sum | cut -c1-16)

say() { echo "setup-dynamo-bench: $*" >&2; }
pip() {
  "$VENV/bin/python" -m pip "$@" 2>&1 | sed '/is ignored: it is neither a file nor a directory/d' >&2
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  say "ready at $VENV"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  say "ready at $VENV, installed by a concurrent run"
  exit 0
fi
started=$(date +%s)
if ! command -v "$PYTHON" >/dev/null; then
  say "$PYTHON not found; set FLEET_DYNAMO_BASE_PYTHON to a Python 3.11-3.13 interpreter"
  exit 1
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sys" 2>/dev/null; then
  say "creating virtual environment $VENV with $("$PYTHON" --version 2>&1)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
say "installing Dynamo's planner (a few minutes, about 1.4 GB)"
pip install -q --upgrade pip
# The Dynamo wheels without their declared dependencies: see requirements.txt.
pip install -q --no-deps -r "$REQS"
pip install -q -r "$DEPS"
"$VENV/bin/python" -c "import dynamo.planner.offline.replay_adapter, aiconfigurator_core.sdk" \
  || { say "the planner does not import in $VENV"; exit 1; }
echo "$WANT" > "$STAMP"
say "ready at $VENV after $(( $(date +%s) - started )) s"
