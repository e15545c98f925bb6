#!/usr/bin/env bash
# The CPU kernels under AddressSanitizer and UndefinedBehaviorSanitizer, as gpu_check.sh runs the CUDA kernels under
# compute-sanitizer. Builds lmk_ops with -fsanitize=address,undefined,float-cast-overflow into build/sanitize-pkg (the
# .venv install is left alone) and runs the test suite against it with the sanitizers' runtimes preloaded. Python
# and torch are not instrumented, but every allocation goes through ASan's malloc, so a kernel that reads or writes
# outside a tensor's storage or its own buffers stops the run with a report, as does undefined behaviour in lmk_ops'
# code (a signed index that overflows, a shift too wide, a misaligned access, a float converted to an integer that
# cannot hold it). The suite runs once with this CPU's kernels, then its kernel tests again with each narrower
# kernel set (ATEN_CPU_CAPABILITY=avx2, default), so that the AVX2 and the plain C++ kernels are checked on an
# AVX-512 machine too (on an AVX2 machine the plain C++ kernels only); each of those runs compiles into a cache
# folder of its own, since torch's compile cache is not keyed by the capability (code generated for AVX-512 and
# built for AVX2 computes wrong values). The tests run in worker processes (scripts/test_sets.sh). A test that asks
# operator new for more memory than exists on purpose is left out (the exhausts_memory marker): ASan's operator new
# aborts where the real one throws. Reports go to build/sanitize-reports; any report fails the check, but for ASan's
# note of a request it refused. Debug information is line tables only (-g1): a report still names file and line, and
# the build takes about 20% less time than with -g. Needs .venv (scripts/setup.sh); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
target="$PWD/build/sanitize-pkg"
reports="$PWD/build/sanitize-reports"
rm -rf "$target" "$reports" build/sanitize-inductor-*
mkdir -p "$reports"
sanitizers="-fsanitize=address,undefined,float-cast-overflow"
.venv/bin/pip install -q --no-build-isolation --no-deps --target "$target" \
  --config-settings=build-dir=build/sanitize --config-settings=cmake.build-type=RelWithDebInfo \
  "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  "--config-settings=cmake.define.CMAKE_CXX_FLAGS=$sanitizers -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  "--config-settings=cmake.define.CMAKE_MODULE_LINKER_FLAGS=$sanitizers" .
runtime() {  # the runtime library the build linked, as the compiler CMake used names it
  "${CXX:-c++}" -print-file-name="$1"
}
export PYTHONPATH="$target"
export LD_PRELOAD="$(runtime libasan.so) $(runtime libubsan.so)"
# No leak check: CPython and torch keep memory to the end of the process by design. allocator_may_return_null: a
# request too large to serve fails as it would without the sanitizer (torch raises) instead of aborting the run.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$reports/ubsan"
.venv/bin/python -c "
import lmk_ops
assert lmk_ops.__file__.startswith('$target'), lmk_ops.__file__
print('lmk_ops under ASan and UBSan', lmk_ops.build_info())"
linked=$(ldd "$target"/lmk_ops/_C*.so)  # whole first: see cpu_twin_check.sh
if ! grep -q libasan <<<"$linked"; then
  echo "cpu_sanitize_check: expected the module to link libasan, but it does not: the sanitizer flags were lost" >&2
  exit 1
fi
source scripts/test_sets.sh
checks=("${pytest_workers[@]}" -p no:cacheprovider -m "not exhausts_memory")
status=0
.venv/bin/python -m pytest -q tests "${checks[@]}" "${without_static_checks[@]}" "$@" || status=$?
native=$(.venv/bin/python -c "import lmk_ops; print(lmk_ops.build_info()['cpu_capability'])")
case "$native" in
  AVX512*) narrower=(avx2 default) ;;
  AVX2) narrower=(default) ;;
  *) narrower=() ;;
esac
for capability in "${narrower[@]}"; do
  if [ "$status" -eq 0 ]; then
    echo "cpu_sanitize_check: the kernel tests with ATEN_CPU_CAPABILITY=$capability"
    ATEN_CPU_CAPABILITY=$capability TORCHINDUCTOR_CACHE_DIR="$PWD/build/sanitize-inductor-$capability" \
      .venv/bin/python -m pytest -q "${kernel_tests[@]}" "${checks[@]}" "$@" \
      || status=$?
  fi
done
# The only line a report file may hold: ASan's note that it refused a request too large to serve (the suite's
# failed-allocation tests make such requests on purpose, and check the error that follows).
refused='^==[0-9]+==WARNING: AddressSanitizer failed to allocate 0x[0-9a-f]+ bytes$'
if compgen -G "$reports/*" > /dev/null && [ -n "$(grep -v -h -E "$refused" "$reports"/* || true)" ]; then
  echo "cpu_sanitize_check: the sanitizers reported (in $reports):" >&2
  cat "$reports"/* >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "cpu_sanitize_check: pytest failed (exit $status)" >&2
  exit "$status"
fi
echo "cpu_sanitize_check: no sanitizer report"
