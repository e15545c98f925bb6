# Sourced by cuda_build_check.sh and build_wheels.sh: sets cuda_py to the Python of a cached virtual environment
# holding the CUDA build of torch 2.13.0 (and the build tools), creating it on first use. The environment lives in
# $LMK_OPS_CUDA_ENV (default ~/.cache/lmk_ops/cuda-torch-2.13.0), so only the first run downloads torch (about
# 2.8 GB). No GPU is needed to build against it.
cuda_env_dir="${LMK_OPS_CUDA_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lmk_ops/cuda-torch-2.13.0}"
cuda_py="$cuda_env_dir/bin/python"
command -v nvcc >/dev/null || { echo "cuda_env: nvcc is not on PATH" >&2; exit 1; }
if ! "$cuda_py" -c "import torch, sys; sys.exit(not (torch.__version__.startswith('2.13.0') and torch.version.cuda))" \
    2>/dev/null; then
  rm -rf "$cuda_env_dir"
  "${PYTHON:-python3}" -m venv "$cuda_env_dir"
  # This machine's pip configuration adds a local CPU wheel of torch 2.13.0 (find-links), which would win over the
  # registry's CUDA build of the same version: install without it.
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$cuda_py" -m pip install -q "torch==2.13.0" \
    "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.26" ninja numpy
fi
