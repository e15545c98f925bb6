#!/usr/bin/env bash
# The CPU twin of the CUDA op layer. Builds lmk_ops with LMK_OPS_CPU_TWIN=ON, in which CPU tensors take the
# device-generic paths a CUDA build runs instead of the host loops (csrc/common/host_path.h), into
# build/cpu-twin-pkg (the .venv install is left alone), and runs the test suite against it: the op-layer code that
# CUDA runs is so checked on a machine without a GPU. It links libstdc++ statically, as the GPU machine's toolchain
# does: a copy of libstdc++ inside the module must not be mixed with the process's (CMakeLists.txt, --exclude-libs),
# and the suite's error messages, which format numbers, show it. Needs .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
target="$PWD/build/cpu-twin-pkg"
rm -rf "$target"
.venv/bin/pip install -q --no-build-isolation --no-deps --target "$target" \
  --config-settings=build-dir=build/cpu-twin --config-settings=cmake.define.LMK_OPS_CPU_TWIN=ON \
  --config-settings=cmake.define.CMAKE_MODULE_LINKER_FLAGS=-static-libstdc++ .
export PYTHONPATH="$target"
# ldd's output taken whole first: under pipefail, grep -q quitting at its match could fail ldd's write (SIGPIPE).
linked=$(ldd "$target"/lmk_ops/_C*.so)
if grep -q 'libstdc++' <<<"$linked"; then
  echo "cpu_twin_check: expected the twin module to carry its own libstdc++, but it links libstdc++.so" >&2
  exit 1
fi
.venv/bin/python -c "
import lmk_ops
info = lmk_ops.build_info()
assert lmk_ops.__file__.startswith('$target') and info['cpu_twin'], (lmk_ops.__file__, info)
print('lmk_ops CPU twin', info)"
source scripts/test_sets.sh
.venv/bin/python -m pytest -q "${pytest_workers[@]}" tests -p no:cacheprovider "${without_static_checks[@]}" "$@"
