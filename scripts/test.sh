#!/usr/bin/env bash
# Fresh machine to green suite: sets everything up, then runs the tests and a smoke run of the benchmark suites.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/test_sets.sh
.venv/bin/python -m pytest -q "${pytest_workers[@]}" tests bench --benchmark-disable "$@"
