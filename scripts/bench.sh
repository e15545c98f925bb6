#!/usr/bin/env bash
# Fresh machine to benchmark report: sets everything up, then runs `python -m lmk_ops.bench` (arguments pass on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m lmk_ops.bench "$@"
