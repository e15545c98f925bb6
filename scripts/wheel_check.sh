#!/usr/bin/env bash
# CI: builds the CPU wheel (scripts/build_wheels.sh), checks that it is manylinux-tagged and carries nothing but
# the lmk_ops package (no torch, c10 or other library grafted in), then installs it into a fresh environment with
# torch 2.13.0 and nothing else and pools a batch there.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bash scripts/build_wheels.sh "$tmp/dist" cpu
wheel="$(ls "$tmp"/dist/cpu/*.whl)"
case "$(basename "$wheel")" in
  lmk_ops-*-manylinux_*_x86_64.whl) ;;
  *) echo "wheel_check: expected a manylinux x86_64 wheel, got $(basename "$wheel")" >&2; exit 1 ;;
esac
strays="$(.venv/bin/python -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' | grep -v -E '^lmk_ops/|^lmk_ops-[^/]*\.dist-info/' || true)"
[ -z "$strays" ] || { echo "wheel_check: files outside the package in the wheel: $strays" >&2; exit 1; }
"${PYTHON:-python3}" -m venv "$tmp/env"
"$tmp/env/bin/pip" install -q "torch==2.13.0" numpy "$wheel"
cd "$tmp"
"$tmp/env/bin/python" - <<'PY'
import torch
import lmk_ops

hidden, mask = torch.randn(3, 7, 16), torch.rand(3, 7) > 0.3
mask[:, 0] = True
expected = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
torch.testing.assert_close(lmk_ops.mean_pool(hidden, mask), expected)
print(f"wheel_check: lmk_ops {lmk_ops.__version__} from the wheel pools on torch {torch.__version__}:",
      lmk_ops.build_info())
PY
echo "wheel_check: $(basename "$wheel") holds only lmk_ops"
