"""What each CUDA op does per call, by torch.profiler: the kernels it launches with their device time, and the host
side (ATen calls made through the dispatcher, CUDA runtime calls: launches, copies, synchronisations, allocations)
with its time. Where the report's figure is far above the kernels' sum, these say which host work sets it.

Cases: every report op at 64x512x1024 in float32 and bfloat16, forward and forward+backward; one long text
(1x32768x1024 bfloat16) forward of mean and of attention with heads 64 wide; packed mean and first-token pooling of
32 short texts. Usage: python scripts/cuda_trace.py [--rows N] > trace.log (--device cpu --small: the same on tiny
shapes, which the tests run)."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import lmk_ops
from lmk_ops import bench

OPS = ["mean_pool", "max_pool", "landmark_mean@32", "attention_pool@1h", "attention_pool@64d", "first_token_pool"]
CALLS = 10


def trace(title: str, fn, rows: int, device: str) -> None:
    per_call = bench.time_ms(fn, device) * 1e3  # the report's figure: back-to-back calls, median of samples
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(CALLS):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / CALLS
    print(f"\n=== {title}: {per_call:.1f} us a call back to back (median); kernels {device_us:.1f} us a call",
          flush=True)
    print(f"{'calls':>6s} {'host us':>9s} {'device us':>9s}  name (per call of the op)")
    for e in sorted(events, key=lambda e: -(e.self_device_time_total + e.self_cpu_time_total))[:rows]:
        print(f"{e.count / CALLS:6.1f} {e.self_cpu_time_total / CALLS:9.1f} {e.self_device_time_total / CALLS:9.1f}  "
              f"{e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=18, help="rows of each case's table")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a check that the script runs)")
    args = parser.parse_args()
    device, (padded, long_text, feature) = args.device, (
        ((2, 40, 64), (1, 300, 64), 64) if args.small else ((64, 512, 1024), (1, 32768, 1024), 768))
    cases = [(op, d, padded) for d in ("float32", "bfloat16") for op in OPS]
    cases += [("mean_pool", "bfloat16", long_text), ("attention_pool@64d", "bfloat16", long_text)]
    for op, dtype_name, shape in cases:
        case = bench.case_inputs(op, dtype_name, shape, device, 0.0)
        fn = bench.implementations(op)["lmk_ops"]
        name = f"{case.row_name} {dtype_name} {'x'.join(map(str, shape))}"
        with torch.no_grad():
            trace(f"{name} forward", lambda: fn(case.hidden, case.second), args.rows, device)
        hidden, second = case.with_grad()
        trace(f"{name} forward+backward",
              lambda: bench.forward_backward(fn, hidden, second, case.grad), args.rows, device)
    lengths = torch.randint(20, 120, (32,), generator=torch.Generator().manual_seed(3))
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device, torch.int32)
    packed = torch.randn(int(lengths.sum()), feature, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        trace("packed mean_pool bfloat16 32 texts", lambda: lmk_ops.mean_pool(packed, cu_seqlens=offsets), args.rows,
              device)
        trace("packed first_token_pool bfloat16 32 texts",
              lambda: lmk_ops.first_token_pool(packed, cu_seqlens=offsets), args.rows, device)


if __name__ == "__main__":
    main()
