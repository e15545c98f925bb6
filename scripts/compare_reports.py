"""Two reports of `python -m lmk_ops.bench --json` side by side: for every row both hold (op, dtype, shape or packed
batch, mode), lmk_ops' time in each, the new over the old, and each one's time over its floor (the report's x_floor:
hidden.sum() on the same tensor in the same run, forward rows). scripts/gpu_check.sh runs it after the report against
the last committed report of the same GPU model, so that a GPU run says at once what a kernel change did. Device time
is scarce and reports of two runs differ by their machine's state too: read a ratio against the floors' own ratio.

Usage: python scripts/compare_reports.py OLD.json NEW.json
"""

from __future__ import annotations

import json
import sys


def keyed_rows(report: dict) -> dict:
    """(section, op, dtype, shape or batch, mode) -> row, for the padded and the packed rows. (Packed rows had no
    mode before they had forward+backward ones: those are forward rows.)"""
    rows = {("padded", r["op"], r["dtype"], r["shape"], r.get("mode", "forward")): r for r in report["rows"]}
    rows.update({("packed", r["op"], r["dtype"], r["batch"], r.get("mode", "forward")): r
                 for r in report.get("packed_rows", [])})
    return rows


def load(path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as error:
        raise SystemExit(f"compare_reports: cannot read {path} as a report: {error}") from error
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise SystemExit(f"compare_reports: expected a report of python -m lmk_ops.bench --json in {path}, got "
                         f"{type(report).__name__}{' without rows' if isinstance(report, dict) else ''}")
    return report


def x_floor(row: dict) -> str:
    """The row's own x_floor, as the report wrote it (forward rows only)."""
    value = row.get("x_floor")
    return f"{value:7.2f}x" if value is not None else ""


def compare(old: dict, new: dict) -> list[str]:
    lines = [f"old: {old.get('machine')} | torch {old.get('torch')} | {old.get('command')}",
             f"new: {new.get('machine')} | torch {new.get('torch')} | {new.get('command')}"
             + ("" if new.get("complete", True) else " (incomplete: cut short)")]
    if old.get("machine") != new.get("machine"):
        lines.append("(the two reports come from different machines)")
    old_rows, new_rows = keyed_rows(old), keyed_rows(new)
    shared = [key for key in new_rows if key in old_rows]
    lines.append(f"{'op':<20} {'dtype':<9} {'shape / batch':<22} {'mode':<16} {'old ms':>9} {'new ms':>9} "
                 f"{'new/old':>8} {'old/floor':>9} {'new/floor':>9}")
    for key in shared:
        was, now = old_rows[key], new_rows[key]
        _, op, dtype, shape, mode = key
        lines.append(f"{op:<20} {dtype:<9} {shape:<22} {mode:<16} {was['lmk_ops_ms']:9.3f} {now['lmk_ops_ms']:9.3f} "
                     f"{now['lmk_ops_ms'] / was['lmk_ops_ms']:7.2f}x {x_floor(was):>9} {x_floor(now):>9}".rstrip())
    only_new = len(new_rows) - len(shared)
    lines.append(f"{len(shared)} rows in both" + (f"; {only_new} only in the new one" if only_new else "")
                 + (f"; {len(old_rows) - len(shared)} only in the old one" if len(old_rows) > len(shared) else ""))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    print("\n".join(compare(load(argv[0]), load(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
