#!/usr/bin/env bash
# CI: builds the CPU wheel (scripts/build_wheels.sh), checks that it is manylinux-tagged and carries nothing but the
# lmk_ops package (no torch, c10 or other library grafted in), then installs that one wheel into environments with
# other torch versions (default: 2.13.0, the torch it is built against, and 2.10.0, the oldest the stable ABI build
# supports; LMK_OPS_WHEEL_TORCH overrides) and runs the whole test suite in each. The environments are cached in
# ~/.cache/lmk_ops/wheel-torch-VERSION: torch 2.10.0 comes from the registry as a CUDA build (about 4 GB with its
# CUDA libraries, a few minutes on the first run only); its CUDA tests are skipped here, where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cached_env.sh
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bash scripts/build_wheels.sh "$tmp/dist" cpu
wheel="$(ls "$tmp"/dist/cpu/*.whl)"
bash scripts/check_wheel.sh "$wheel"

for version in ${LMK_OPS_WHEEL_TORCH:-2.13.0 2.10.0}; do
  started=$SECONDS
  torch_test_env "$version"
  "$env_py" -m pip install -q --force-reinstall --no-deps "$wheel"
  # From the checkout's root the installed wheel is imported (the sources live under python/).
  "$env_py" -c "import lmk_ops, torch; print('wheel_check: torch', torch.__version__, lmk_ops.build_info())"
  "$env_py" -m pytest -q tests bench --benchmark-disable -p no:cacheprovider
  echo "wheel_check: the suite passes with the wheel on torch $version ($((SECONDS - started)) s with the environment)"
done
