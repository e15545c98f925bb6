#!/usr/bin/env bash
# Proves that the CUDA build compiles, packages and imports, on any machine (no GPU needed): builds the CUDA wheel
# (scripts/build_wheels.sh: against the CUDA build of torch 2.13.0 in a cached environment, kernels for sm_80 and
# sm_90), checks its manylinux tag, contents and +cu130 version label, installs it there, checks that every op has a
# CUDA kernel registered and that the extension references no libtorch/libc10 C++ symbol (tests/test_stable_abi.py).
# Running the kernels needs a GPU: the test suite does that where one is present.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
source scripts/cuda_env.sh  # sets cuda_py: the cached environment with the CUDA build of torch 2.13.0 (made once)
py="$cuda_py"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bash scripts/build_wheels.sh "$tmp/dist" cuda
wheel="$(ls "$tmp"/dist/cu130/*.whl)"
bash scripts/check_wheel.sh "$wheel"
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"

# Outside the checkout, so that the installed package (not python/lmk_ops) is imported.
cd /
"$py" - <<'PY'
import torch
import lmk_ops

info = lmk_ops.build_info()
assert info["cuda"], f"lmk_ops was built without CUDA: {info}"
assert info["version"].endswith("+cu130"), f"expected the CUDA wheel's version with the local label +cu130: {info}"
pooling = ["mean_pool", "max_pool", "landmark_mean", "landmark_gather", "attention_pool"]
ops = [f"{op}{suffix}" for op in pooling for suffix in ("", "_backward")]
# insert_landmarks runs on the host only (its CPU kernel)
ops += ["token_pool", "landmark_positions", "valid_mask", "packed_offsets"]
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"lmk_ops::{op}", "CUDA")]
assert not missing, f"no CUDA kernel registered for: {missing}"
print(f"cuda_build_check: lmk_ops {info['version']} built against torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}); CUDA kernels registered for all {len(ops)} ops; "
      f"GPU present: {torch.cuda.is_available()}")
PY
"$py" -m pytest -q -p no:cacheprovider "$root/tests/test_stable_abi.py"
