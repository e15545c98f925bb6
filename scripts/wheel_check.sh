#!/usr/bin/env bash
# CI: builds the CPU wheel (scripts/build_wheels.sh), checks that it is manylinux-tagged and carries nothing but the
# lmk_ops package (no torch, c10 or other library grafted in), then installs that one wheel into environments with
# other torch versions (default: 2.13.0, the torch it is built against, and 2.10.0, the oldest the stable ABI build
# supports; LMK_OPS_WHEEL_TORCH overrides) and runs the whole test suite under each torch but the one it was built
# against; under that one, whose suite scripts/test.sh ran on the same sources, the kernel tests show that the
# installed wheel (auditwheel's copy, in an environment of its own) loads and computes. The environments are cached in
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

source scripts/test_sets.sh
built_against=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
for version in ${LMK_OPS_WHEEL_TORCH:-2.13.0 2.10.0}; do
  started=$SECONDS
  torch_test_env "$version"
  "$env_py" -m pip install -q --force-reinstall --no-deps "$wheel"
  # From the checkout's root the installed wheel is imported (the sources live under python/).
  "$env_py" -c "import lmk_ops, torch; print('wheel_check: torch', torch.__version__, lmk_ops.build_info())"
  if [ "$version" = "$built_against" ]; then
    tests=("${kernel_tests[@]}")
    what="the kernel tests pass"
  else
    tests=(tests bench --benchmark-disable)
    what="the suite passes"
  fi
  "$env_py" -m pytest -q "${pytest_workers[@]}" -p no:cacheprovider "${tests[@]}"
  echo "wheel_check: $what with the wheel on torch $version ($((SECONDS - started)) s with the environment)"
done
