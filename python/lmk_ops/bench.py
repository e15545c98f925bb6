"""The benchmark report: ``python -m lmk_ops.bench``.

For each op x dtype x shape it times, in one process, lmk_ops, the eager reference (lmk_ops.reference, the code
people write) and ``torch.compile`` of that reference, forward and forward+backward, and compares the forward
with the read floor: ``hidden.sum()`` on the same tensor in the same run, which reads every byte once. Then each
pooling entry on packed batches of mixed lengths (``cu_seqlens``), forward and forward+backward, against lmk_ops on
the same texts padded and plain-PyTorch contenders (``torch.segment_reduce``, ``index_add``).
Medians over repeated samples (after a warm-up call where a function compiles; a call slower than 100 ms is timed
once where it is a contender timed alone or more than 3x slower than the fastest of those it is timed beside); on
CUDA a sample is about 2 ms of back-to-back calls between two CUDA events (call_ms).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

import lmk_ops
from lmk_ops import reference

OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "mean_pool": (lmk_ops.mean_pool, reference.mean_pool), "max_pool": (lmk_ops.max_pool, reference.max_pool)}
# Report entries beyond OPS: landmark_mean at a landmark interval (its second argument is the landmark mask of the
# LMK layout at that interval), and insert_landmarks on a token batch of the case's B x L.
LANDMARK_ENTRIES = {"landmark_mean@32": 32, "landmark_mean@128": 128}
# attention_pool with one head, or with heads 64 features wide (12 at D = 768, 16 at D = 1024, as in BERT; one head
# where 64 does not divide D); the query is in hidden's dtype, and forward+backward differentiates it too. Rows are
# named by the heads used: attention_pool@12h.
ATTENTION_ENTRIES = {
    "attention_pool@1h": lambda dim: 1,
    "attention_pool@64d": lambda dim: dim // 64 if dim % 64 == 0 else 1,
}
REPORT_OPS = [*OPS, *LANDMARK_ENTRIES, *ATTENTION_ENTRIES, "first_token_pool", "insert_landmarks"]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DEFAULT_SHAPES = "32x512x768,8x4096x1024,1x32768x1024"  # the last: one long text
# Packed (cu_seqlens) rows: batches of B texts of mixed lengths (drawn uniformly from [lo, hi], seeded) and width D,
# written BxLO-HIxD: one of long and short texts, and a small one of short texts as a server packs a few queries
# (where a call's fixed costs, not its reads, decide packed against padded).
DEFAULT_PACKED = "120x16-2048x768,32x16-128x768"
PACKED_OPS = ["mean_pool", "max_pool", *LANDMARK_ENTRIES, "first_token_pool", *ATTENTION_ENTRIES]


def make_inputs(shape, dtype, device, padding=0.0, seed=0):
    """hidden [B, L, D] and an int64 attention mask whose last `padding` share of each row is padding."""
    batch, seq_len, _ = shape
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[:, seq_len - int(seq_len * padding):] = 0
    return hidden, mask.to(device)


def landmark_layout(mask: torch.Tensor, interval: int) -> torch.Tensor:
    """The landmark mask of the LMK layout [CLS] z1 [LMK] z2 [LMK] ...: a landmark after every `interval` tokens
    of each text's valid span, and at its last valid token."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = mask.long().cumsum(1).argmax(1, keepdim=True)
    return mask.bool() & (((positions % (interval + 1) == 0) & (positions > 0)) | (positions == last))


def _with_query(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn(hidden, mask, query) as f(hidden, (mask, query)), the two-argument form the report times."""
    return lambda hidden, mask_and_query: fn(hidden, *mask_and_query)


def implementations(op: str) -> dict:
    """The three contenders for an op: lmk_ops, the eager reference, and torch.compile of the reference."""
    ours: Callable[..., Any]
    ref: Callable[..., Any]
    if op in OPS:
        ours, ref = OPS[op]
    elif op in ATTENTION_ENTRIES:
        ours, ref = _with_query(lmk_ops.attention_pool), _with_query(reference.attention_pool)
    elif op == "first_token_pool":
        ours, ref = lmk_ops.first_token_pool, reference.first_token_pool
    else:
        ours, ref = lmk_ops.landmark_mean, reference.landmark_mean
    return {"lmk_ops": ours, "eager": ref, "compiled": torch.compile(ref, dynamic=False)}


def forward_backward(fn, hidden, second, grad):
    """The gradients of fn(hidden, second) w.r.t. hidden and any tensor of a tuple `second` that requires one."""
    extra = [t for t in second if isinstance(t, torch.Tensor) and t.requires_grad] if isinstance(second, tuple) else []
    return torch.autograd.grad(fn(hidden, second), [hidden, *extra], grad)


def call_ms(fn, device: str, calls: int = 1) -> float:
    """Milliseconds per call of `calls` calls of fn() in a row: CUDA events around them on a GPU, the wall clock on
    the CPU. On a GPU the host queues the next calls while the kernels run, as in a training loop, so that the
    launch overhead counts where it exceeds the kernels' time and not otherwise; one call between two events would
    add the host's launch latency to every op that launches more than one kernel."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def calls_per_sample(first_ms: float, device: str, sample_ms=2.0, most=100) -> int:
    """How many calls one timing sample takes: about sample_ms of them on a GPU (given one call's time), one on the
    CPU, whose calls are long enough to time alone."""
    if device != "cuda":
        return 1
    return max(1, min(most, int(sample_ms / max(first_ms, 1e-3))))


def time_ms(fn, device: str, min_time=0.1, min_reps=5, max_reps=100, slow_ms=100.0, warm_up=True) -> float:
    """Median milliseconds of fn() over repeated samples after one warm-up call (which compiles and allocates): at
    least min_reps, about min_time seconds in all. A call slower than slow_ms (the eager baselines on large shapes,
    many times slower than lmk_ops) is timed once after the warm-up: that is plenty precise for a ratio of many
    times, and the report keeps to its time. warm_up=False, for a function that compiles nothing: its first call is
    timed, and kept if slower than slow_ms (_first_call_ms)."""
    first = _first_call_ms(fn, device, warm_up)
    if first > slow_ms:
        return first
    calls = calls_per_sample(first, device)
    samples = [call_ms(fn, device, calls)]
    while len(samples) < min_reps or (sum(samples) * calls / 1e3 < min_time and len(samples) < max_reps):
        samples.append(call_ms(fn, device, calls))
    return statistics.median(samples)


def _first_call_ms(fn, device: str, warm_up: bool) -> float:
    """The time of fn's first timed call: the one after a warm-up call, or without warm_up the very first. A slow
    eager call (over the callers' slow_ms) needs no warm-up: it compiles nothing, its allocations are as fresh on
    every call (on a 2-core AMD EPYC Zen 3, max_pool's eager baseline at 1x32768x1024 took 993 and 1041 ms on first
    calls, 787-1210 on later ones), and timing such calls once took a report from 257-259 s to 212 s there."""
    if warm_up or device == "cuda":  # on a GPU a first call also loads kernels and creates library handles
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return call_ms(fn, device)


def time_together(fns: dict, device: str, min_time=0.3, min_rounds=3, block_ms=20.0, slow_ms=100.0, once_over=3.0,
                  between_rounds: Callable[[], None] | None = None, warm_up: Collection[str] | None = None,
                  in_turns: Collection[str] = ()) -> dict:
    """Median milliseconds of each function (None stays None), timed in turns: each round calls every function for
    about block_ms in a row, so that all see the same state of the machine (a ratio of two of them, lmk_ops over
    hidden.sum() or packed over padded, then holds where timings taken minutes apart drift by 10-30% on a shared
    machine), and each is timed warm, as time_ms times it, not right after another's cache-flushing pass.
    A function whose first call after the warm-up is slower than slow_ms and than once_over times the fastest
    function's first call keeps that one time, as time_ms would: one call of a contender several times slower than
    the fastest is precise enough for its ratio, and the report keeps to its time. One nearer the fastest is timed
    in turns like the rest, since its first call alone can be far off: lmk_ops' packed forward+backward, 61-72 ms
    over later calls, took 141 ms on one first call, which the report then set against its contenders' 73 ms.
    warm_up: the names of the functions that get an untimed call first (that compile, or whose calls fault in
    memory for all); None: every one. These calls all come before the first timed call of any: on a virtual
    machine that hands freed memory back to its host (free page reporting), the first few large allocations after a
    pause or after a process grows fault in pages about 4x slower (a 388 MB tensor on a 2-core AMD EPYC Zen 4: 570
    against 130 ms), and a first call timed on such memory, kept as a slow contender's one time, made lmk_ops'
    packed forward+backward 0.2x its contenders while 92b1a1b kept the packed batches in fixed memory. The others'
    first call is timed. in_turns: the names of the functions timed in turns however slow their first call
    (lmk_ops' own, whose times the row reports: a first call can still find cold memory). between_rounds, if given,
    runs between two rounds, untimed."""
    for name, fn in fns.items():  # on a GPU every function: a first call also loads kernels (_first_call_ms)
        if fn is not None and (warm_up is None or name in warm_up or device == "cuda"):
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    first = {name: call_ms(fn, device) for name, fn in fns.items() if fn is not None}
    fastest = min(first.values(), default=0.0)
    turns = {name: fns[name] for name, ms in first.items()
             if ms <= slow_ms or ms <= once_over * fastest or name in in_turns}
    calls = {name: calls_per_sample(first[name], device) for name in turns}
    samples: dict[str, list[float]] = {name: [] for name in turns}
    rounds, spent = 0, 0.0
    while turns and (rounds < min_rounds or spent < min_time * 1e3):
        if rounds > 0 and between_rounds is not None:
            between_rounds()
        for name, fn in turns.items():
            block = [call_ms(fn, device, calls[name])]
            while sum(block) * calls[name] < block_ms:
                block.append(call_ms(fn, device, calls[name]))
            samples[name] += block
            spent += sum(block) * calls[name]
        rounds += 1
    return {name: statistics.median(samples[name]) if name in samples else first.get(name) for name in fns}


@dataclass
class Row:
    op: str
    dtype: str
    shape: str
    mode: str  # "forward" or "forward+backward"
    lmk_ops_ms: float
    eager_ms: float
    compiled_ms: float | None  # None where torch.compile does not apply (insert_landmarks)
    floor_ms: float | None  # hidden.sum(), same tensor, same run
    read_gb_per_s: float | None  # forward only: GB of hidden read per second by lmk_ops
    mean_pool_ms: float | None = None  # landmark_mean forward: lmk_ops.mean_pool on the same tensor and mask

    @property
    def vs_eager(self) -> float:
        return self.eager_ms / self.lmk_ops_ms

    @property
    def vs_compiled(self) -> float | None:
        return self.compiled_ms / self.lmk_ops_ms if self.compiled_ms is not None else None

    @property
    def x_floor(self) -> float | None:
        return self.lmk_ops_ms / self.floor_ms if self.floor_ms is not None and self.mode == "forward" else None

    @property
    def vs_mean_pool(self) -> float | None:
        return self.mean_pool_ms / self.lmk_ops_ms if self.mean_pool_ms is not None else None


def token_batch(shape, device, padding=0.0, seed=0):
    """A [CLS] ... [SEP] token batch of B x L ids (BERT's special ids), the last `padding` share of rows padded."""
    batch, seq_len = shape[0], shape[1]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, seq_len), generator=gen)
    length = seq_len - int(seq_len * padding)
    ids[:, 0], ids[:, length - 1], ids[:, length:] = 101, 102, 0
    return ids.to(device), (ids != 0).long().to(device)


def bench_insert_landmarks(shape, device, padding) -> list[Row]:
    ids, mask = token_batch(shape, device, padding)
    options = {"landmark_id": 102, "interval": 32, "max_length": shape[1]}
    ours = time_ms(lambda: lmk_ops.insert_landmarks(ids, mask, **options), device)
    eager = time_ms(lambda: reference.insert_landmarks(ids, mask, **options), device)
    return [Row("insert_landmarks", "int64", f"{shape[0]}x{shape[1]}", "forward", ours, eager, None, None, None)]


@dataclass
class Case:
    """One report case's inputs, as bench_case times them and precompile compiles for them."""
    row_name: str
    hidden: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor  # the rows the op reads (the landmark mask for landmark_mean)
    second: object  # the op's second argument: rows, or (mask, query) for attention
    grad: torch.Tensor  # the output gradient of forward+backward

    def with_grad(self) -> tuple[torch.Tensor, Any]:
        """(hidden, second) for forward+backward: fresh leaves that require grad (hidden, and attention's query)."""
        second = (self.mask, self.second[1].clone().requires_grad_()) if isinstance(self.second, tuple) else self.second
        return self.hidden.clone().requires_grad_(), second


@functools.lru_cache(maxsize=8)
def shared_inputs(shape, dtype_name, device, padding) -> tuple[torch.Tensor, torch.Tensor]:
    """make_inputs, kept for the next op's case of the same shape and dtype (the cases go op by op over the same
    shapes; nothing writes to them): drawing a 1x32768x1024 hidden takes about 0.5 s, 14 s of a report."""
    return make_inputs(shape, DTYPES[dtype_name], device, padding)


def case_inputs(op, dtype_name, shape, device, padding) -> Case:
    dtype = DTYPES[dtype_name]
    hidden, mask = shared_inputs(tuple(shape), dtype_name, device, padding)
    rows = landmark_layout(mask, LANDMARK_ENTRIES[op]) if op in LANDMARK_ENTRIES else mask
    second: object = rows  # the op's second argument: rows, or (mask, query) for attention
    row_name = op
    if op in ATTENTION_ENTRIES:
        heads = ATTENTION_ENTRIES[op](shape[2])
        row_name = f"attention_pool@{heads}h"
        query = torch.randn(heads, shape[2] // heads, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        second = (mask, query)
    grad = torch.randn(shape[0], shape[2], generator=torch.Generator().manual_seed(2)).to(device, dtype)
    return Case(row_name, hidden, mask, rows, second, grad)


def _compile_cases(cases, device, padding, threads) -> None:
    """Compiles (and runs once) the torch.compile contender of each case, forward and forward+backward, with the
    report's thread count (inductor generates its CPU kernels for it, and a cache entry is only found again under
    the same count).

    In a spawned worker the report's main module, re-imported as __mp_main__, first goes to the end of sys.modules:
    torch's compile cache keys pickle each torch.memory_format through the first module in sys.modules that holds
    `torch` (the C pickler's whichmodule skips __main__ but not __mp_main__), which was __mp_main__ in the workers and
    torch._utils in the report's process, so every graph the workers compiled missed the cache there and was lowered
    again (torch 2.13; g++ was spared by its own cache). And each worker compiles in its own process: the workers are
    the parallelism, and inductor's pool of compile subprocesses per worker only added its start-up."""
    if "__mp_main__" in sys.modules:
        sys.modules["__mp_main__"] = sys.modules.pop("__mp_main__")
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    torch.set_num_threads(threads)
    for op, dtype_name, shape in cases:
        case = case_inputs(op, dtype_name, shape, device, padding)
        compiled = implementations(op)["compiled"]
        with torch.no_grad():
            compiled(case.hidden, case.second)
        hidden, second = case.with_grad()
        forward_backward(compiled, hidden, second, case.grad)
        torch._dynamo.reset()


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container may limit below os.cpu_count())."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def capability_compile_cache(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Gives the report's compiles a cache folder of their own where ATEN_CPU_CAPABILITY is set and
    TORCHINDUCTOR_CACHE_DIR is not, and returns it (None: nothing changed). torch's compile cache is not keyed by
    that variable: on an AVX-512 machine, max_pool's contender compiled by a plain report and loaded by one under
    ATEN_CPU_CAPABILITY=avx2 computed out-of-range indices in its backward (torch 2.13: "index 98369 is out of
    bounds for dimension 1 with size 512"), and the report stopped there."""
    capability = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability or environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    user = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"torchinductor_lmk_ops_bench_{user}_{capability}")
    environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def precompiled_marker(compiled, device, padding, threads) -> str | None:
    """A file in torch's compile cache that precompile leaves once it has compiled these contenders there, so that
    the next report skips its workers: with the cache warm they only spawn, import torch and trace every case
    again (28 s of a 257 s report on a 2-core AMD EPYC Zen 3). Its name hashes what the compiled code depends on:
    torch, Python, the reference and report code, the cases, the thread count and ATEN_CPU_CAPABILITY; a cache
    emptied takes it along. A marker that outlived its entries costs time (the report compiles them one by one),
    never a wrong figure. None where torch does not say where its cache is."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    sources = b"".join(pathlib.Path(path).read_bytes() for path in (reference.__file__, __file__))
    key = repr((torch.__version__, sys.version, os.environ.get("ATEN_CPU_CAPABILITY"), compiled, device, padding,
                threads)).encode()
    return os.path.join(cache_dir(), f"lmk_ops_bench_contenders_{hashlib.sha256(key + sources).hexdigest()[:32]}")


def precompile(cases, device, padding) -> None:
    """Fills torch's compile cache (on disk) with the contenders of the report's cases, compiled in one process per
    core, so that the report's own first calls load them. Compiling them one after the other was about 150 s of a
    fresh report's 294 s on a 2-core AMD EPYC; each compile is one process's work (tracing in Python, then g++),
    and two processes brought that report to 263 s. With the cache already warm for these cases it does nothing
    (precompiled_marker). CPU only: not tried on a GPU machine."""
    compiled = [(op, dt, shape) for op, dt, shape in cases if op != "insert_landmarks"]
    workers = min(len(compiled), usable_cores(), 8)
    if device != "cpu" or workers < 2:
        return
    threads = torch.get_num_threads()
    marker = precompiled_marker(compiled, device, padding, threads)
    if marker is not None and os.path.exists(marker):
        return
    print(f"  compiling the torch.compile contenders in {workers} processes ...", end="\r", file=sys.stderr,
          flush=True)
    share = [compiled[i::workers] for i in range(workers)]
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in [pool.submit(_compile_cases, part, device, padding, threads) for part in share]:
                done.result()
        if marker is not None:
            with open(marker, "w") as f:
                f.write("the torch.compile contenders of an lmk_ops.bench report, compiled into this cache\n")
    except Exception as error:  # e.g. a script calling main() without the __main__ guard that spawn needs
        print(f"\nprecompiling in {workers} processes failed ({type(error).__name__}: {error}); the report compiles "
              "each contender as it comes", file=sys.stderr)


def bench_case(op, dtype_name, shape, device, padding) -> list[Row]:
    if op == "insert_landmarks":
        return bench_insert_landmarks(shape, device, padding)
    case = case_inputs(op, dtype_name, shape, device, padding)
    hidden, mask, rows, second, row_name = case.hidden, case.mask, case.rows, case.second, case.row_name
    impls = implementations(op)
    valid_bytes = hidden.element_size() * shape[2] * int((rows != 0).sum())
    shape_str = "x".join(map(str, shape))
    results = []
    with torch.no_grad():
        # lmk_ops, the floor (and mean_pool beside landmark_mean) in turns; the contenders, much slower, after.
        together = time_together({"lmk_ops": lambda: impls["lmk_ops"](hidden, second), "floor": lambda: hidden.sum(),
                                  "mean_pool": (lambda: lmk_ops.mean_pool(hidden, mask)) if op in LANDMARK_ENTRIES
                                  else None}, device, warm_up=())
        times = {name: together["lmk_ops"] if name == "lmk_ops"
                 else time_ms(lambda f=f: f(hidden, second), device, warm_up=name == "compiled")
                 for name, f in impls.items()}
    floor, mean_pool_ms = together["floor"], together["mean_pool"]
    results.append(Row(row_name, dtype_name, shape_str, "forward", times["lmk_ops"], times["eager"], times["compiled"],
                       floor, valid_bytes / times["lmk_ops"] / 1e6, mean_pool_ms))
    h, second = case.with_grad()
    times = time_together({name: lambda f=f: forward_backward(f, h, second, case.grad) for name, f in impls.items()},
                          device, warm_up={"compiled"}, in_turns={"lmk_ops"})
    results.append(Row(row_name, dtype_name, shape_str, "forward+backward", times["lmk_ops"], times["eager"],
                       times["compiled"], floor, None))
    return results


def packed_lengths(spec) -> list[int]:
    batch, (lo, hi) = spec[0], spec[1]
    return torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()


def packed_contenders(op: str, offsets, landmarks) -> dict:
    """Plain-PyTorch ways of pooling the packed batch (lmk_ops.reference), as functions of hidden [T, D]: None where a
    contender has no version."""
    if op == "mean_pool":
        return {"segment_reduce": lambda h: reference.segment_mean(h, offsets),
                "index_add": lambda h: reference.index_add_mean(h, offsets),
                "index_add_fp32": lambda h: reference.index_add_mean(h, offsets, torch.float32)}
    if op == "max_pool":
        return {"segment_reduce": lambda h: reference.segment_max(h, offsets),
                "index_add": lambda h: reference.scatter_max(h, offsets), "index_add_fp32": None}
    if op in LANDMARK_ENTRIES:
        return {"segment_reduce": None,
                "index_add": lambda h: reference.index_add_mean(h, offsets, rows=landmarks),
                "index_add_fp32": lambda h: reference.index_add_mean(h, offsets, torch.float32, landmarks)}
    if op == "first_token_pool":  # sentence-transformers' flattened cls: the row at each text's start
        return {"segment_reduce": None, "index_add": lambda h: h[offsets[:-1].long()], "index_add_fp32": None}
    return {"segment_reduce": None, "index_add": None, "index_add_fp32": None}


@dataclass
class PackedRow:
    op: str
    dtype: str
    batch: str  # "B texts, T x D"
    mode: str  # "forward" or "forward+backward"
    lmk_ops_ms: float  # packed
    padded_ms: float  # lmk_ops on the same texts padded (right) to the longest
    segment_reduce_ms: float | None
    index_add_ms: float | None  # in hidden's dtype (sentence-transformers' flattened method; max: scatter_reduce)
    index_add_fp32_ms: float | None  # accumulating in float32 (vLLM's)
    floor_ms: float  # hidden.sum() on the packed [T, D]

    @property
    def x_floor(self) -> float | None:
        return self.lmk_ops_ms / self.floor_ms if self.mode == "forward" else None

    @property
    def vs_best(self) -> float | None:
        times = [t for t in (self.segment_reduce_ms, self.index_add_ms, self.index_add_fp32_ms) if t is not None]
        return min(times) / self.lmk_ops_ms if times else None

    @property
    def vs_padded(self) -> float:
        return self.padded_ms / self.lmk_ops_ms


@functools.lru_cache(maxsize=2)
def packed_inputs(spec, dtype_name, device) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """The packed batch `spec` (lengths, hidden [T, D], cu_seqlens) and the same texts padded (hidden, valid mask),
    kept for the next op's case (the cases go op by op, both dtypes; nothing writes to them): drawing and padding the
    120 texts' batch takes about 3 s, 40 s of a report on a 2-core AMD EPYC."""
    lengths = packed_lengths(spec)
    drawn = torch.randn(sum(lengths), spec[2], generator=torch.Generator().manual_seed(1))
    hidden = drawn.to(device=device, dtype=DTYPES[dtype_name])
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padded, valid, _, _ = reference.padded_view(hidden, None, offsets)
    return lengths, hidden, offsets, padded, valid


def bench_packed(op, dtype_name, spec, device) -> list[PackedRow]:
    """The forward and the forward+backward rows of op on the packed batch `spec`. Every contender is a function of
    (hidden, query): the packed [T, D] (for lmk_ops padded, the same texts padded) and attention's query (else
    None); forward+backward differentiates both, as the padded rows do."""
    lengths, hidden, offsets, padded, valid = packed_inputs(spec, dtype_name, device)
    dtype, dim = DTYPES[dtype_name], spec[2]
    tokens = sum(lengths)
    longest = max(lengths)
    packed_kw: dict[str, Any] = {"cu_seqlens": offsets, "max_seqlen": longest}
    landmarks = None  # the packed landmark mask, for landmark_mean's contenders
    query = None
    row_name = op
    if op in LANDMARK_ENTRIES:
        padded_landmarks = landmark_layout(valid, LANDMARK_ENTRIES[op])
        landmark_rows = landmarks = padded_landmarks[valid]
        ours = lambda h, q: lmk_ops.landmark_mean(h, landmark_rows, **packed_kw)  # noqa: E731
        theirs = lambda h, q: lmk_ops.landmark_mean(h, padded_landmarks)  # noqa: E731
    elif op in ATTENTION_ENTRIES:  # named by its heads, as the padded rows are
        heads = ATTENTION_ENTRIES[op](dim)
        row_name = f"attention_pool@{heads}h"
        query = torch.randn(heads, dim // heads, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        ours = lambda h, q: lmk_ops.attention_pool(h, None, q, **packed_kw)  # noqa: E731
        theirs = lambda h, q: lmk_ops.attention_pool(h, valid, q)  # noqa: E731
    else:
        fn = getattr(lmk_ops, op)
        ours = lambda h, q: fn(h, **packed_kw)  # noqa: E731
        theirs = lambda h, q: fn(h, valid)  # noqa: E731
    contenders = {name: (lambda h, q, f=f: f(h)) if f is not None else None
                  for name, f in packed_contenders(op, offsets, landmarks).items()}
    fns = {"ours": ours, "padded": theirs, **contenders}
    # Each function's input by name ("padded": the padded copy, the rest the packed one), moved to fresh memory
    # between rounds: on a virtual machine one tensor reads up to 1.7x slower than another of the same size by where
    # its pages land, and packed and padded are two tensors, so one placement each would time the placement.
    memory = {"packed": hidden, "padded": padded}
    tensor_of = {name: "padded" if name == "padded" else "packed" for name in fns}

    def move() -> None:
        for key in memory:
            memory[key] = memory[key].clone()

    with torch.no_grad():
        times = time_together({"floor": lambda: memory["packed"].sum(), **{
            name: (lambda f=f, name=name: f(memory[tensor_of[name]], query)) if f is not None else None
            for name, f in fns.items()}}, device, between_rounds=move, warm_up=())
    floor = times["floor"]
    batch = f"{len(lengths)} texts, {tokens}x{dim}"
    rows = [PackedRow(row_name, dtype_name, batch, "forward", times["ours"], times["padded"], times["segment_reduce"],
                      times["index_add"], times["index_add_fp32"], floor)]
    grad = torch.randn(len(lengths), dim, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    query_leaf = None if query is None else query.clone().requires_grad_()

    def differentiate(f, name):
        h = memory[tensor_of[name]].detach().requires_grad_()
        return torch.autograd.grad(f(h, query_leaf), [t for t in (h, query_leaf) if t is not None], grad)

    lmk_ops_own = {"ours", "padded"}  # warmed up first (their gradients fault memory in for all) and timed in turns
    times = time_together({name: (lambda f=f, name=name: differentiate(f, name)) if f is not None else None
                           for name, f in fns.items()}, device, between_rounds=move, warm_up=lmk_ops_own,
                          in_turns=lmk_ops_own)
    rows.append(PackedRow(row_name, dtype_name, batch, "forward+backward", times["ours"], times["padded"],
                          times["segment_reduce"], times["index_add"], times["index_add_fp32"], floor))
    return rows


PACKED_HEADER = (f"{'packed op':<18} {'dtype':<9} {'batch':<22} {'mode':<16} {'lmk_ops':>9} {'padded':>9} "
                 f"{'seg_red':>9} {'idx_add':>9} {'idx_f32':>9} {'x floor':>8} {'vs best':>8} {'vs padded':>9}")


def format_packed_row(r: PackedRow) -> str:
    return (f"{r.op:<18} {r.dtype:<9} {r.batch:<22} {r.mode:<16} {r.lmk_ops_ms:8.3f}m {r.padded_ms:8.3f}m "
            f"{_cell(r.segment_reduce_ms, '8.3f', 9, 'm')} {_cell(r.index_add_ms, '8.3f', 9, 'm')} "
            f"{_cell(r.index_add_fp32_ms, '8.3f', 9, 'm')} {_cell(r.x_floor, '7.2f', 8, 'x')} "
            f"{_cell(r.vs_best, '7.2f', 8, 'x')} {r.vs_padded:8.2f}x")


def parse_packed(text: str) -> list:
    """Comma-separated BxLO-HIxD batches, e.g. 120x16-2048x768,32x16-128x768 (or "none": no packed rows)."""
    return [] if text == "none" else [_packed_batch(spec) for spec in text.split(",")]


def _packed_batch(text: str):
    parts = text.lower().split("x")
    span = parts[1].split("-") if len(parts) == 3 else []
    if (len(span) != 2 or not all(p.isdigit() for p in [parts[0], *span, parts[2]]) or int(span[0]) > int(span[1])
            or min(int(parts[0]), int(span[1]), int(parts[2])) < 1):  # texts may be empty, not all of them
        raise argparse.ArgumentTypeError(f"expected a packed batch like 120x16-2048x768 (B, the longest text and D "
                                         f">= 1; several separated by commas; or none), got {text!r}")
    return int(parts[0]), (int(span[0]), int(span[1])), int(parts[2])


HEADER = (f"{'op':<18} {'dtype':<9} {'shape':<13} {'mode':<16} {'lmk_ops':>9} {'eager':>9} {'compiled':>9} "
          f"{'vs eager':>9} {'vs comp.':>9} {'GB/s':>7} {'x floor':>8} {'vs mean_pool':>12}")


def _cell(value, spec: str, width: int, unit: str = "") -> str:
    return f"{value:{spec}}{unit}" if value is not None else " " * width


def format_row(r: Row) -> str:
    return (f"{r.op:<18} {r.dtype:<9} {r.shape:<13} {r.mode:<16} {r.lmk_ops_ms:8.3f}m {r.eager_ms:8.3f}m "
            f"{_cell(r.compiled_ms, '8.3f', 9, 'm')} {r.vs_eager:8.1f}x {_cell(r.vs_compiled, '8.2f', 9, 'x')} "
            f"{_cell(r.read_gb_per_s, '7.1f', 7)} {_cell(r.x_floor, '7.2f', 8, 'x')} "
            f"{_cell(r.vs_mean_pool, '11.1f', 12, 'x')}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def huge_pages(environ: Mapping[str, str] = os.environ) -> str:
    """How torch's CPU tensors get their pages: the kernel's transparent-huge-page mode, and torch's own switch,
    THP_MEM_ALLOC_ENABLE=1, which asks for 2 MiB pages on its large tensors. A CPU backward writes a fresh gradient
    as large as hidden, and the page faults of its 4 KiB pages can take most of its time (README, "For CPU training
    with large batches")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = next((w[1:-1] for w in f.read().split() if w.startswith("[")), "unknown")
    except OSError:
        mode = "unknown"
    value = environ.get("THP_MEM_ALLOC_ENABLE")
    switch = "unset" if value is None else "=1" if value == "1" else f"={value!r} (off: torch takes only 1)"
    return f"THP {mode}, THP_MEM_ALLOC_ENABLE {switch}"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected shapes like 32x512x768[,8x4096x1024], sizes >= 1, got "
                                             f"{item!r}")
        batch, length, dim = (int(p) for p in parts)
        shapes.append((batch, length, dim))
    return shapes


def parse_list(choices):
    def parse(text: str) -> list[str]:
        items = text.split(",")
        unknown = [i for i in items if i not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return items

    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmk_ops.bench", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", type=parse_list(DTYPES), default=["float32", "bfloat16"],
                        help="comma-separated: float16,bfloat16,float32,float64 (default float32,bfloat16)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"comma-separated BxLxD (default {DEFAULT_SHAPES})")
    parser.add_argument("--ops", type=parse_list(REPORT_OPS), default=list(REPORT_OPS),
                        help=f"comma-separated, from {','.join(REPORT_OPS)} (default: all)")
    parser.add_argument("--padding", type=float, default=0.0,
                        help="share of each sequence that is padding, masked out (default 0: every token valid)")
    parser.add_argument("--packed", type=parse_packed, default=parse_packed(DEFAULT_PACKED),
                        help=f"the packed batches of the packed rows, comma-separated BxLO-HIxD (default "
                             f"{DEFAULT_PACKED}; none: no packed rows)")
    parser.add_argument("--json", metavar="PATH", help="also write the results and the machine's details here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to torch")
    if not 0.0 <= args.padding < 1.0:
        parser.error(f"--padding: expected a share in [0, 1), got {args.padding}")
    if args.json:  # found out now, not after minutes of timing
        folder = os.path.dirname(os.path.abspath(args.json))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            parser.error(f"--json: cannot create the folder {folder}: {e.strerror}")
        try:  # a file written and removed there: os.access says yes to root wherever writes would fail
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            parser.error(f"--json: cannot write in {folder}: {e.strerror}")
        if os.path.isdir(args.json):
            parser.error(f"--json: expected a file path, got the folder {args.json}")

    own_cache = capability_compile_cache()
    if own_cache:
        print(f"ATEN_CPU_CAPABILITY is set: the contenders compile into {own_cache} (torch's compile cache does not "
              "tell capabilities apart)", file=sys.stderr)
    info = lmk_ops.build_info()
    machine = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    pages = huge_pages() if args.device == "cpu" else None
    print(f"lmk_ops {info['version']} | torch {torch.__version__} | {args.device}: {machine} | "
          f"{torch.get_num_threads()} threads | CPU kernels {info['cpu_capability']}, prefetch "
          f"{info['cpu_prefetch']} | padding {args.padding:.0%}"
          + (f" | {pages}" if pages else ""))
    print("times are medians in ms; 'x floor' = lmk_ops forward time / hidden.sum() time on the same tensor; "
          "'vs mean_pool' = lmk_ops.mean_pool forward time / landmark_mean forward time on the same tensor\n")
    print(HEADER, flush=True)
    rows: list[Row] = []
    # insert_landmarks works on token ids: one case per shape, whatever the dtypes.
    cases = [(op, dt, shape) for op in args.ops for dt in (args.dtype if op != "insert_landmarks" else ["int64"])
             for shape in args.shapes]
    packed_rows: list[PackedRow] = []

    def write_json(complete: bool) -> None:
        """The report so far, to args.json (through a new file moved over it): rewritten after every case, so that
        a run cut short (a time limit on a GPU machine) still leaves the cases it finished, marked incomplete."""
        if not args.json:
            return
        report = {
            "command": " ".join(["python", "-m", "lmk_ops.bench", *(argv if argv is not None else sys.argv[1:])]),
            "complete": complete, "device": args.device, "machine": machine, "platform": platform.platform(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "build_info": info,
            "padding": args.padding, "huge_pages": pages,
            "rows": [asdict(r) | {"vs_eager": r.vs_eager, "vs_compiled": r.vs_compiled, "x_floor": r.x_floor,
                                  "vs_mean_pool": r.vs_mean_pool} for r in rows],
            "packed_rows": [asdict(r) | {"x_floor": r.x_floor, "vs_best": r.vs_best, "vs_padded": r.vs_padded}
                            for r in packed_rows],
        }
        with open(f"{args.json}.partial", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{args.json}.partial", args.json)

    started = time.perf_counter()
    precompile(cases, args.device, args.padding)
    for i, (op, dt, shape) in enumerate(cases, 1):
        print(f"  [{i}/{len(cases)}] {op} {dt} {shape} ...", end="\r", file=sys.stderr, flush=True)
        for row in bench_case(op, dt, shape, args.device, args.padding):
            rows.append(row)
            print(format_row(row), flush=True)
        write_json(complete=False)
        torch._dynamo.reset()  # keep compiled graphs of finished cases from piling up
    shared_inputs.cache_clear()
    packed_cases = [(op, dt, spec) for spec in args.packed for op in PACKED_OPS if op in args.ops for dt in args.dtype]
    if packed_cases:
        print("\npacked batches (cu_seqlens): 'padded' = lmk_ops on the same texts padded; seg_red, idx_add, idx_f32 ="
              " torch.segment_reduce, index_add in hidden's dtype, index_add in float32 (lmk_ops.reference); 'vs "
              "best' = fastest of those / lmk_ops\n")
        print(PACKED_HEADER, flush=True)
    for i, (op, dt, spec) in enumerate(packed_cases, 1):
        print(f"  [packed {i}/{len(packed_cases)}] {op} {dt} ...", end="\r", file=sys.stderr, flush=True)
        for packed_row in bench_packed(op, dt, spec, args.device):
            packed_rows.append(packed_row)
            print(format_packed_row(packed_row), flush=True)
        write_json(complete=False)
    packed_inputs.cache_clear()
    print(f"\n{len(cases) + len(packed_cases)} cases in {time.perf_counter() - started:.0f} s")
    write_json(complete=True)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
