#!/usr/bin/env bash
# The one command for a GPU machine (one H100 or H200, no network, see ../shared/GPU.md): builds lmk_ops with its
# CUDA kernels against the torch installed there, using every core; runs tests/test_cuda.py (stopping at the first
# failure), then the rest of the suite's CUDA cases; then compute-sanitizer's memcheck on
# scripts/cuda_kernel_tour.py, which launches every kernel; then the CUDA benchmark report, the forward's host launch
# time against its kernels' (scripts/cuda_profile.py), each op's kernels and host calls by torch.profiler
# (scripts/cuda_trace.py) and Nsight Compute's figures for each kernel of the issue's target cases; then
# compute-sanitizer's racecheck, synccheck and initcheck on the same tour, the CPU kernels' thread scaling on one
# long text (scripts/cpu_scaling.py: 1, 4 and all cores) and
# bench/end_to_end.py (a BERT-base training step and inference, lmk_ops against sentence-transformers' pooling).
# Each step's log, the JUnit results and the JSON go to RESULTS_DIR, and a summary is printed at the end. Usage:
#   bash scripts/gpu_check.sh RESULTS_DIR
# The build here is against this machine's torch (2.11), and is on the stable ABI like every build. To show that one
# wheel serves several torch versions on a GPU too, LMK_OPS_CUDA_WHEEL may name a CUDA wheel built elsewhere against
# another torch (scripts/build_wheels.sh: dist/cu130/, against torch 2.13.0); tests/test_cuda.py then runs with it too.
# (Through a tool that returns only a few files, bundle the folder: tar -C RESULTS_DIR -czf bundle.tgz .)
# Device time is scarce, so the run keeps to a deadline: GPU_CHECK_SECONDS (default 540) from its start. Steps run
# in order of what they prove (build, kernel tests, the suite's CUDA cases, memcheck, the report, the profiles that
# say what limits the report's figures, the other sanitizers, which have found nothing in three runs, then the CPU
# scaling and the end-to-end step), each under its own time cap cut to what is
# left; a step the deadline leaves no room for is listed as not run. GPU_CHECK_SKIP names steps to leave out, e.g.
# on a second call: GPU_CHECK_SKIP="suite racecheck synccheck initcheck" (keys: build test_cuda prebuilt suite
# memcheck bench compare racecheck synccheck initcheck launch trace ncu scaling end_to_end; without build, the previous
# call's build folder on a still-warm machine is reused by pip and rebuilds in seconds, so build is never skipped).
# After the report, scripts/compare_reports.py sets it beside the last committed report of the same GPU model
# (bench/results/cuda-h100.json, cuda-h200.json), where there is one.
set -uo pipefail
results="${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR}"
mkdir -p "$results"
results="$(cd "$results" && pwd)"
cd "$(dirname "$0")/.."
root="$(pwd)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
# Tests that need an optional package (the real model, absent on the GPU machine) skip without it, but fail with CI
# set (tests/packages.py: CI's setup installs them): this is not CI.
unset CI
site="$(mktemp -d)"
# step, and the deadline it keeps to (GPU_CHECK_SECONDS, GPU_CHECK_SKIP).
source "$root/scripts/deadline_steps.sh"

build() {
  # A wheel installed into a private directory: the machine's Python may refuse installs into itself.
  "$py" -m pip wheel -v --no-build-isolation --no-deps -C cmake.define.LMK_OPS_CUDA=ON \
    -C build-dir=build/gpu-check -w "$site/wheel" . &&
    "$py" -m pip install -q --no-deps --target "$site/lib" "$site"/wheel/lmk_ops-*.whl &&
    PYTHONPATH="$site/lib" "$py" -c \
      "import lmk_ops, torch; print(torch.__version__, torch.cuda.get_device_name(), lmk_ops.build_info())" &&
    # Whether this toolchain linked libstdc++ into the module (CMakeLists.txt: --exclude-libs keeps that copy private).
    { ldd "$site"/lib/lmk_ops/_C*.so | grep 'libstdc++' || echo "libstdc++: linked statically"; }
}

# Tests run from outside the checkout, so the built package (not python/lmk_ops) is imported.
in_site() {
  (cd "$site" && PYTHONPATH="$site/lib:$root/tests" "$@")
}

prebuilt() {
  "$py" -m pip install -q --no-deps --target "$site/prebuilt" "$LMK_OPS_CUDA_WHEEL" &&
    (cd "$site" && PYTHONPATH="$site/prebuilt:$root/tests" "$py" -m pytest -q -x -p no:cacheprovider \
      --junitxml="$results/test_cuda_prebuilt.xml" "$root/tests/test_cuda.py")
}

sanitize() {
  in_site compute-sanitizer --tool "$1" --error-exitcode 1 --print-limit 20 "$py" "$root/scripts/cuda_kernel_tour.py"
}

# The steps run in a child bash (under timeout): it needs these functions and variables.
export -f build in_site prebuilt sanitize
export py site root results
nvidia-smi -L >"$results/gpu.txt" 2>&1
if step build 300 "build (torch on this machine)" build.log build; then
  step test_cuda 240 "tests/test_cuda.py (-x)" test_cuda.log in_site "$py" -m pytest -q -x -p no:cacheprovider \
    --junitxml="$results/test_cuda.xml" "$root/tests/test_cuda.py"
  if [ -n "${LMK_OPS_CUDA_WHEEL:-}" ]; then
    step prebuilt 180 "tests/test_cuda.py, prebuilt wheel" test_cuda_prebuilt.log prebuilt
  fi
  parallel=()
  "$py" -c "import xdist" 2>/dev/null && parallel=(-n 8)
  step suite 300 "suite, CUDA cases" test_suite_cuda.log in_site "$py" -m pytest -q -p no:cacheprovider \
    "${parallel[@]}" -k cuda --junitxml="$results/test_suite_cuda.xml" "$root/tests" \
    --ignore="$root/tests/test_cuda.py"
  step memcheck 150 "compute-sanitizer memcheck" sanitizer_memcheck.log sanitize memcheck
  step bench 300 "benchmark report (CUDA)" bench.log in_site "$py" -m lmk_ops.bench --device cuda \
    --shapes 64x512x1024,8x8192x1024,1x32768x1024 --json "$results/bench-cuda.json"
  # The report (what it finished, if cut short) against the last committed one of this GPU model, if any.
  model="$(grep -oE '\b[A-Z][0-9]{3}\b' "$results/gpu.txt" | head -n 1 | tr '[:upper:]' '[:lower:]')"
  last="$root/bench/results/cuda-$model.json"
  if [ -n "$model" ] && [ -f "$last" ] && [ -f "$results/bench-cuda.json" ]; then
    step compare 30 "report vs bench/results/cuda-$model.json" compare.log "$py" "$root/scripts/compare_reports.py" \
      "$last" "$results/bench-cuda.json"
  fi
  step launch 120 "host launches vs kernels (forward)" launch_overhead.log in_site "$py" "$root/scripts/cuda_profile.py"
  # Each op's kernels (which instance: VEC in the name) and host calls, forward and forward+backward.
  step trace 90 "torch.profiler trace of every op" cuda_trace.log in_site "$py" "$root/scripts/cuda_trace.py"
  # One row per kernel of the target cases: time, DRAM throughput (% of peak), occupancy, grid and registers.
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size
  metrics+=,launch__registers_per_thread
  step ncu 240 "ncu: kernels of the target cases" ncu.log in_site ncu --clock-control none --csv \
    --metrics "$metrics" "$py" "$root/scripts/cuda_profile.py" --once
  for tool in racecheck synccheck initcheck; do
    step "$tool" 150 "compute-sanitizer $tool" "sanitizer_$tool.log" sanitize "$tool"
  done
  step scaling 180 "CPU thread scaling (1, 4, all cores)" cpu_scaling.log in_site "$py" \
    "$root/scripts/cpu_scaling.py" --json "$results/cpu-scaling.json"
  step end_to_end 240 "end to end: BERT-base train step, inference" end_to_end.log in_site "$py" \
    "$root/bench/end_to_end.py" --device cuda --json "$results/end_to_end.json"
fi

echo
echo "gpu_check summary ($(head -n 1 "$results/gpu.txt"); logs in $results; $SECONDS s)"
print_summary
