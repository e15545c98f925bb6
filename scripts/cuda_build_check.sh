#!/usr/bin/env bash
# Proves that the CUDA build compiles and imports, on any machine (no GPU needed): builds lmk_ops with
# LMK_OPS_CUDA=ON against the CUDA build of torch 2.13.0 in a cached environment, imports it, and checks that every
# op has a CUDA kernel registered. Running the kernels needs a GPU: the test suite does that where one is present.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda_env.sh  # sets cuda_py: the cached environment with the CUDA build of torch 2.13.0 (made once)
py="$cuda_py"

# No GPU here to detect: the architectures are named (Hopper by default; TORCH_CUDA_ARCH_LIST overrides).
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
"$py" -m pip install -q --no-build-isolation --no-deps --force-reinstall \
  -C cmake.define.LMK_OPS_CUDA=ON -C "build-dir=build/cuda-{wheel_tag}" .

# Outside the checkout, so that the installed package (not python/lmk_ops) is imported.
cd /
"$py" - <<'PY'
import torch
import lmk_ops

info = lmk_ops.build_info()
assert info["cuda"], f"lmk_ops was built without CUDA: {info}"
pooling = ["mean_pool", "max_pool", "landmark_mean", "landmark_gather", "attention_pool"]
ops = [f"{op}{suffix}" for op in pooling for suffix in ("", "_backward")]
ops += ["token_pool", "valid_mask", "packed_offsets"]
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"lmk_ops::{op}", "CUDA")]
assert not missing, f"no CUDA kernel registered for: {missing}"
print(f"cuda_build_check: lmk_ops {info['version']} built against torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}); CUDA kernels registered for all {len(ops)} ops; "
      f"GPU present: {torch.cuda.is_available()}")
PY
