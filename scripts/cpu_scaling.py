"""How the CPU kernels scale with threads on one long text: forward time of mean, max and attention pooling (one head,
and heads 64 wide) on 1 x 32768 x 1024 (--shape), in float32 and bfloat16, at each thread count, against
hidden.sum() at the same count (timed in turns, lmk_ops.bench.time_together). Prints a table; --json also writes
the figures. scripts/gpu_check.sh runs it on the GPU machine's 16 cores.

    python scripts/cpu_scaling.py [--threads 1,4,16] [--shape 1x32768x1024] [--json PATH]
"""
import argparse
import json
import os

import torch

import lmk_ops
from lmk_ops.bench import time_together


def ops(hidden, mask):
    gen, dim = torch.Generator().manual_seed(1), hidden.shape[-1]
    one_head = torch.randn(dim, generator=gen).to(hidden.dtype)
    narrow_heads = torch.randn(dim // 64, 64, generator=gen).to(hidden.dtype)
    return {"mean_pool": lambda: lmk_ops.mean_pool(hidden, mask), "max_pool": lambda: lmk_ops.max_pool(hidden, mask),
            "attention_pool@1h": lambda: lmk_ops.attention_pool(hidden, mask, one_head),
            "attention_pool@64d": lambda: lmk_ops.attention_pool(hidden, mask, narrow_heads)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ",".join(str(t) for t in sorted({1, min(4, os.cpu_count()), os.cpu_count()}))
    parser.add_argument("--threads", default=default, help=f"thread counts (default here: {default})")
    parser.add_argument("--shape", default="1x32768x1024", help="B x L x D; D a multiple of 64")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split("x"))
    rows, threads_before = [], torch.get_num_threads()
    print(f"{'op':<20} {'dtype':<9} {'threads':>7} {'lmk_ops ms':>10} {'floor ms':>9} {'x floor':>8} {'speed-up':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        mask = torch.ones(shape[:2], dtype=torch.bool)
        single = {}
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            with torch.no_grad():
                times = time_together({"floor": lambda: hidden.sum(), **ops(hidden, mask)}, "cpu")
            for op, ms in times.items():
                if op == "floor":
                    continue
                single.setdefault(op, ms)
                row = {"op": op, "dtype": str(dtype)[6:], "threads": threads, "ms": ms, "floor_ms": times["floor"]}
                rows.append(row)
                print(f"{op:<20} {row['dtype']:<9} {threads:>7} {ms:>10.3f} {times['floor']:>9.3f} "
                      f"{ms / times['floor']:>7.2f}x {single[op] / ms:>7.2f}x")
    torch.set_num_threads(threads_before)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "cpu_count": os.cpu_count(), "build_info": lmk_ops.build_info(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
