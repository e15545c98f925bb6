# Sourced by cuda_build_check.sh and build_wheels.sh: sets cuda_py to the Python of a cached virtual environment
# holding the CUDA build of torch 2.13.0 (and the build and test tools), creating it on first use. The environment
# lives in $LMK_OPS_CUDA_ENV (default ~/.cache/lmk_ops/cuda-torch-2.13.0), so only the first run downloads torch
# (about 2.8 GB). No GPU is needed to build against it.
command -v nvcc >/dev/null || { echo "cuda_env: nvcc is not on PATH" >&2; exit 1; }
source "$(dirname "${BASH_SOURCE[0]}")/cached_env.sh"
cuda_env_dir="${LMK_OPS_CUDA_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lmk_ops/cuda-torch-2.13.0}"
# This machine's pip configuration adds a local CPU wheel of torch 2.13.0 (find-links), which would win over the
# registry's CUDA build of the same version: install without it.
(
  unset PIP_FIND_LINKS
  export PIP_CONFIG_FILE=/dev/null
  cached_env "$cuda_env_dir" "__import__('torch').version.cuda and __import__('torch').__version__.startswith('2.13.0') \
and __import__('hypothesis')" \
    "torch==2.13.0" "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.26" ninja numpy "pytest>=8" "hypothesis>=6.100"
)
cuda_py="$cuda_env_dir/bin/python"
