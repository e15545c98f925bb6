#!/usr/bin/env bash
# Usage: check_wheel.sh WHEEL. Fails unless WHEEL is a manylinux x86-64 wheel that holds the lmk_ops package and
# nothing else (no torch, c10 or CUDA library grafted in by the repair: the user's torch provides those).
set -euo pipefail
wheel="$1"
case "$(basename "$wheel")" in
  lmk_ops-*-manylinux_*_x86_64.whl) ;;
  *) echo "check_wheel: expected a manylinux x86_64 wheel, got $(basename "$wheel")" >&2; exit 1 ;;
esac
strays="$(python3 -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' | grep -v -E '^lmk_ops/|^lmk_ops-[^/]*\.dist-info/' || true)"
[ -z "$strays" ] || { echo "check_wheel: files outside the package in the wheel: $strays" >&2; exit 1; }
echo "check_wheel: $(basename "$wheel") is manylinux-tagged and holds only lmk_ops"
