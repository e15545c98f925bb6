#!/usr/bin/env bash
# CI: builds lmk_ops from source against the oldest torch it supports (2.10), as `pip install --no-build-isolation .`
# does on a machine that has that torch, and runs the kernel tests with that build. Every other build here is
# against torch 2.13.0, whose headers declare more than older ones do (torch 2.10's HeaderOnlyArrayRef has no
# operator==: code using it built against 2.13 and not against 2.10, nor against the GPU machine's 2.11). The CUDA
# kernels are compiled against it too (not run: no GPU). Uses the torch 2.10.0 environment that wheel_check.sh caches
# (a CUDA build of torch for CUDA 12.8: its CMake files want a CUDA toolkit even for a CPU-only build, so they are
# pointed at this machine's, and at the nvrtc library that came with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
version=2.10.0
source scripts/cached_env.sh
torch_test_env "$version"
"$env_py" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.26" ninja
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
rm -rf build/min-torch-cpu build/min-torch-cuda  # a CMake cache of an earlier failed configure would stick

cuda_root="${CUDA_HOME:-/usr/local/cuda}"
[ -x "$cuda_root/bin/nvcc" ] || { echo "min_torch_build_check: no CUDA toolkit at $cuda_root (set CUDA_HOME)" >&2; exit 1; }
nvrtc="$("$env_py" -c "import glob, nvidia.cuda_nvrtc as m; print(sorted(glob.glob(m.__path__[0] + '/lib/libnvrtc.so*'))[0])")"
# build KIND CUDA(ON|OFF): a wheel built against torch $version into $tmp/KIND.
build() {
  CUDA_HOME="$cuda_root" TORCH_CUDA_ARCH_LIST=9.0 PATH="$(dirname "$env_py"):$cuda_root/bin:$PATH" \
    "$env_py" -m pip wheel -q --no-build-isolation --no-deps -C "cmake.define.LMK_OPS_CUDA=$2" \
    -C "cmake.define.CUDAToolkit_ROOT=$cuda_root" -C "cmake.define.CUDA_nvrtc_LIBRARY=$nvrtc" \
    -C "build-dir=build/min-torch-$1" -w "$tmp/$1" .
}

started=$SECONDS
build cpu OFF
"$env_py" -m pip install -q --no-deps --target "$tmp/lib" "$tmp"/cpu/*.whl
# From outside the checkout, so that the built package is imported (not python/lmk_ops).
source scripts/test_sets.sh
(cd "$tmp" && PYTHONPATH="$tmp/lib:$root/tests" "$env_py" -m pytest -q "${pytest_workers[@]}" -p no:cacheprovider \
  "${kernel_tests[@]/#/$root/}")
build cuda ON
echo "min_torch_build_check: built from source against torch $version (CPU, tested; CUDA sm_90, compiled)" \
  "in $((SECONDS - started)) s"
