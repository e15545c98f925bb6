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
