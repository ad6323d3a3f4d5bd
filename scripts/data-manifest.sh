#!/usr/bin/env bash
# Rewrite controlplane/data/SHA256SUMS after adding or replacing a shipped data file.
set -euo pipefail
cd "$(dirname "$0")/../controlplane/data"
find . -type f ! -name SHA256SUMS ! -name NOTICE.md ! -name '*.py' ! -path '*/__pycache__/*' -printf '%P\n' \
  | LC_ALL=C sort | xargs sha256sum > SHA256SUMS
echo "controlplane/data/SHA256SUMS: $(wc -l < SHA256SUMS) files"
