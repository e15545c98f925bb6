# Sourced by scripts/gpu_check.sh: steps that keep to a deadline, for a machine lent by the minute. Needs
# `results` (the folder the logs go to). GPU_CHECK_SECONDS (default 540): the deadline, from when this is sourced;
# GPU_CHECK_SKIP: step keys to leave out. tests/test_gpu_check_steps.py checks it with stub steps.
summary=()
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-540}))
skip=" ${GPU_CHECK_SKIP:-} "
reserve=10  # seconds kept for the summary
least=20    # a step with less time left than this is not started

# step KEY CAP NAME LOG COMMAND...: runs the command (an exported function or a program) with its output in
# RESULTS_DIR/LOG, for at most CAP seconds and never past the deadline (less the reserve), and notes how it ended:
# ok, FAILED, TIMEOUT, or not run (skipped by GPU_CHECK_SKIP, or too little time left).
step() {
  local key="$1" cap="$2" name="$3" log="$results/$4"
  shift 4
  local left=$((deadline - SECONDS - reserve)) start=$SECONDS rc status
  if [[ "$skip" == *" $key "* ]] || ((left < least)); then
    status="$([[ "$skip" == *" $key "* ]] && echo skipped || echo "no time")"
    summary+=("$(printf '%-34s %-8s %4ss  %s' "$name" "$status" 0 "(not run)")")
    return 1
  fi
  ((cap > left)) && cap=$left
  echo "== $name (at most ${cap} s)"
  timeout -k 10 "$cap" bash -c '"$@"' step "$@" >"$log" 2>&1
  rc=$?
  tail -n 5 "$log"
  case $rc in
    0) status=ok ;;
    124 | 137) status=TIMEOUT ;;
    *) status=FAILED ;;
  esac
  summary+=("$(printf '%-34s %-8s %4ss  %s' "$name" "$status" $((SECONDS - start)) "$(basename "$log")")")
  return $rc
}

# Prints one line per step; fails if a step failed or ran out of its time (steps not run do not fail it).
print_summary() {
  printf '%s\n' "${summary[@]}"
  ! printf '%s\n' "${summary[@]}" | grep -qE "FAILED|TIMEOUT"
}
