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
NAME=setup-dynamo-bench
VENV=${FLEET_DYNAMO_VENV:-$HOME/.cache/fleet-controlplane/dynamo-venv}
PYTHON=${FLEET_DYNAMO_BASE_PYTHON:-python3.11}
PYTHON_HINT="FLEET_DYNAMO_BASE_PYTHON to a Python 3.11-3.13 interpreter"
STAMP=$VENV/.fleet-dynamo-bench
WANT=$(cat "$REQS" "$DEPS" | sha256sum | cut -c1-16)
# shellcheck source=lib/side-venv.sh
. "$HERE/scripts/lib/side-venv.sh"

side_venv_begin
say "installing Dynamo's planner (a few minutes, about 1.4 GB)"
side_venv_pip install -q --upgrade pip
# The Dynamo wheels without their declared dependencies: see requirements.txt.
side_venv_pip install -q --no-deps -r "$REQS"
side_venv_pip install -q -r "$DEPS"
"$VENV/bin/python" -c "import dynamo.planner.offline.replay_adapter, aiconfigurator_core.sdk" \
  || { say "the planner does not import in $VENV"; exit 1; }
side_venv_done
