"""Where the CUDA forward time goes, for the GPU issue's target cases (mean, max, landmark mean at interval 32,
attention with one head and with heads 64 wide; float32 and bfloat16; 64x512x1024, 8x8192x1024, 1x32768x1024), on
the report's inputs (lmk_ops.bench.case_inputs).

Without arguments it prints, per case, one call timed alone (host launch latency included), back-to-back calls
(the report's figure) and hidden.sum() back to back: where the first is much the larger, the host's launches, not
the kernels, set the time. With --once it runs each case's forward once after a warm-up, for Nsight Compute to
profile every kernel (scripts/gpu_check.sh: ncu with --csv, one row per kernel and metric)."""

from __future__ import annotations

import argparse

import torch

from lmk_ops import bench

OPS = ["mean_pool", "max_pool", "landmark_mean@32", "attention_pool@1h", "attention_pool@64d"]
SHAPES = [(64, 512, 1024), (8, 8192, 1024), (1, 32768, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="run each forward once after a warm-up (for ncu)")
    args = parser.parse_args()
    if not args.once:
        print(f"{'op':20s} {'dtype':9s} {'shape':14s} {'alone ms':>9s} {'in a row':>9s} {'sum() ms':>9s}")
    for dtype_name in ("float32", "bfloat16"):
        for shape in SHAPES:
            for op in OPS:
                case = bench.case_inputs(op, dtype_name, shape, "cuda", 0.0)
                fn = bench.implementations(op)["lmk_ops"]
                with torch.no_grad():
                    forward = lambda: fn(case.hidden, case.second)  # noqa: E731
                    forward()
                    torch.cuda.synchronize()
                    if args.once:
                        torch.cuda.nvtx.range_push(f"{case.row_name} {dtype_name} {shape}")
                        forward()
                        case.hidden.sum()
                        torch.cuda.nvtx.range_pop()
                        torch.cuda.synchronize()
                        continue
                    alone = sorted(bench.call_ms(forward, "cuda") for _ in range(20))[10]
                    in_a_row = bench.time_ms(forward, "cuda")
                    floor = bench.time_ms(lambda: case.hidden.sum(), "cuda")
                print(f"{case.row_name:20s} {dtype_name:9s} {'x'.join(map(str, shape)):14s} {alone:9.3f} "
                      f"{in_a_row:9.3f} {floor:9.3f}", flush=True)


if __name__ == "__main__":
    main()
