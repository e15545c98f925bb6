"""The CUDA kernels against the CPU kernels, their determinism, and the CUDA-only contracts (streams, devices).
Skipped without a GPU. The Hypothesis parity, opcheck, gradcheck and compile tests run on CUDA as well (their
`device` parameter); this file adds what only a GPU run can say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import lmk_ops
from devices import HAS_CUDA
from parity import assert_same_bits_alone_and_padded

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Tolerances of CPU against CUDA: both accumulate in float32 (float64), in different orders, and round once.
TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (2e-5, 2e-5),
              torch.float64: (1e-12, 1e-12)}


def _landmarks(mask):
    return lmk_ops.landmark_positions(mask.bool() & (torch.arange(mask.shape[1], device=mask.device) % 32 == 31))


def _query(dim, heads, dtype, device):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(heads, dim // heads, generator=gen, dtype=torch.float64).to(device, dtype)


# Each op as f(hidden, mask) -> tuple of differentiable outputs (attention: heads chosen from D).
FUNCTIONS = {
    "mean_pool": lambda h, m: (lmk_ops.mean_pool(h, m),),
    "mean_pool+normalize": lambda h, m: (lmk_ops.mean_pool(h, m, normalize=True),),
    "max_pool": lambda h, m: (lmk_ops.max_pool(h, m),),
    "landmark_mean/mask": lambda h, m: (lmk_ops.landmark_mean(h, m.bool() & (torch.arange(
        h.shape[1], device=h.device) % 7 == 6)),),
    "landmark_mean/positions": lambda h, m: (lmk_ops.landmark_mean(h, _landmarks(m)),),
    "landmark_gather": lambda h, m: (lmk_ops.landmark_gather(h, _landmarks(m))[0],),
    "attention_pool@1h": lambda h, m: lmk_ops.attention_pool(
        h, m, _query(h.shape[2], 1, torch.float32, h.device), return_weights=True),
    "attention_pool@4h": lambda h, m: lmk_ops.attention_pool(
        h, m, _query(h.shape[2], 4, h.dtype, h.device), return_weights=True),
}

# (B, L, D, layout): one chunk and many chunks (L > 128), 16-byte packs and the scalar path (odd D, strided
# features), a wide head (D = 1024: 128 lanes of bf16, whole warps per head) and several small ones, texts listed by
# several blocks (L > 4096) with mask rows that are not 16-byte aligned (L % 16 != 0), and a batch whose chunks are
# numbered in runs of several texts a thread (B > 256, texts of 0-3 chunks).
SHAPES = [(3, 50, 64, "contiguous"), (2, 1000, 96, "contiguous"), (1, 4100, 40, "contiguous"),
          (4, 300, 33, "contiguous"), (3, 200, 48, "transposed"), (2, 333, 1024, "contiguous"),
          (5, 130, 40, "offset"), (3, 4500, 24, "contiguous"), (700, 300, 16, "contiguous")]


def _hidden(shape, layout, dtype):
    b, l, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    if layout == "transposed":
        return torch.randn(b, d, l, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
    if layout == "offset":  # contiguous rows, but the data starts one element past a 16-byte boundary
        return torch.randn(b * l * d + 1, generator=gen, dtype=torch.float64).to(dtype)[1:].view(b, l, d)
    return torch.randn(b, l, d, generator=gen, dtype=torch.float64).to(dtype)


def _mask(b, l):
    gen = torch.Generator().manual_seed(b * l)
    lengths = torch.randint(0, l + 1, (b,), generator=gen)
    lengths[0] = l
    mask = torch.arange(l) < lengths[:, None]
    mask[-1] = torch.rand(l, generator=gen) < 0.5  # a ragged row
    return mask.long()


def _outputs_and_grads(fn, hidden, mask):
    h = hidden.detach().requires_grad_()
    outputs = fn(h, mask)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outputs]
    (grad,) = torch.autograd.grad(outputs, h, upstream)
    return [o.detach() for o in outputs] + [grad]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_cuda_agrees_with_cpu(name, dtype, shape):
    *size, layout = shape
    hidden, mask = _hidden(size, layout, dtype), _mask(*size[:2])
    if name.startswith("attention_pool@4h") and size[2] % 4:
        pytest.skip("4 heads need D divisible by 4")
    cpu = _outputs_and_grads(FUNCTIONS[name], hidden, mask)
    gpu = _outputs_and_grads(FUNCTIONS[name], hidden.cuda(), mask.cuda())
    rtol, atol = TOLERANCES[dtype]
    for got, want in zip(gpu, cpu):
        assert got.device.type == "cuda" and got.dtype == want.dtype
        if name.startswith("max_pool"):
            assert torch.equal(got.cpu(), want), "max is exact: CUDA and CPU must agree bit for bit"
        else:
            # Attention outputs in low precision depend on the rounding of scores: a wider band.
            scale = 8 if name.startswith("attention") and dtype in (torch.float16, torch.bfloat16) else 1
            torch.testing.assert_close(got.cpu(), want, rtol=rtol * scale, atol=atol * scale)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_two_runs_give_identical_bits(name):
    hidden = _hidden((4, 3000, 256), "contiguous", torch.bfloat16).cuda()
    mask = _mask(4, 3000).cuda()
    first = _outputs_and_grads(FUNCTIONS[name], hidden, mask)
    second = _outputs_and_grads(FUNCTIONS[name], hidden, mask)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["mean_pool", "max_pool", "attention_pool@1h", "attention_pool@4h"])
@pytest.mark.parametrize("dim", [64, 1000])
def test_a_text_gives_the_same_bits_alone_or_padded_in_a_batch(name, dim):
    def on_cuda(hidden, mask):
        return FUNCTIONS[name](hidden.cuda(), None if mask is None else mask.cuda())[0].cpu()

    assert_same_bits_alone_and_padded(on_cuda, dim)


def test_long_text_alone_or_in_a_batch_across_many_chunks():
    text = torch.randn(1, 5000, 256, dtype=torch.bfloat16, device="cuda")
    batch = torch.randn(3, 6000, 256, dtype=torch.bfloat16, device="cuda")
    batch[1, 1000:] = text[0]
    mask = torch.zeros(3, 6000, dtype=torch.bool, device="cuda")
    mask[1, 1000:] = True
    mask[0] = True
    query = torch.randn(256, device="cuda")
    assert torch.equal(lmk_ops.mean_pool(batch, mask)[1], lmk_ops.mean_pool(text)[0])
    assert torch.equal(lmk_ops.attention_pool(batch, mask, query)[1], lmk_ops.attention_pool(text, None, query)[0])


def test_runs_on_the_current_stream_and_device_guard():
    hidden = torch.randn(8, 700, 512, device="cuda")
    mask = torch.rand(8, 700, device="cuda") < 0.8
    want = lmk_ops.mean_pool(hidden, mask)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = lmk_ops.mean_pool(hidden, mask)
        got_attention = lmk_ops.attention_pool(hidden, mask, torch.ones(512, device="cuda"))
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_attention, lmk_ops.attention_pool(hidden, mask, torch.ones(512, device="cuda")),
                               rtol=0, atol=0)


def test_inputs_on_the_cpu_are_a_clear_error():
    hidden = torch.randn(2, 5, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"lmk_ops\.mean_pool: expected mask on the same device as hidden"):
        lmk_ops.mean_pool(hidden, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"lmk_ops\.attention_pool: expected query on the same device"):
        lmk_ops.attention_pool(hidden, None, torch.ones(8))
    with pytest.raises(RuntimeError, match=r"lmk_ops\.landmark_mean: expected landmarks on the same device"):
        lmk_ops.landmark_mean(hidden, torch.tensor([[0, -1], [1, 2]]))


def _run_in_a_fresh_process(code):
    """Runs code in a new Python (a device-side assertion leaves its process's CUDA context unusable)."""
    return subprocess.run([sys.executable, "-c", "import torch, lmk_ops\n" + code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(__file__))


@pytest.mark.parametrize("code,message", [
    ("lmk_ops.landmark_mean(torch.randn(2, 5, 8, device='cuda'), torch.tensor([[0, -1], [1, 7]], device='cuda'))",
     "lmk_ops.landmark_mean: expected landmark positions in [0, L) = [0, 5) or -1 for none, got 7 in row 1 "
     "(landmarks[1, 1])"),
    ("lmk_ops.landmark_gather(torch.randn(2, 5, 8, device='cuda'), torch.tensor([[0, -3], [1, 2]], device='cuda'))",
     "lmk_ops.landmark_gather: expected landmark positions in [0, L) = [0, 5) or -1 for none, got -3 in row 0 "
     "(landmarks[0, 1])"),
    ("lmk_ops.mean_pool(torch.randn(2, 5, 8, device='cuda'), torch.tensor([[1, 1, 0, 0, 0], [1, 2, 1, 0, 0]], "
     "device='cuda'))", "lmk_ops.mean_pool: expected mask values 0 or 1, got 2 at [1, 1]"),
    ("lmk_ops.max_pool(torch.randn(7, 8, device='cuda'), torch.tensor([1, 1, 2, 1, 1, 1, 1], device='cuda'), "
     "cu_seqlens=torch.tensor([0, 3, 7], device='cuda'))",
     "lmk_ops.max_pool: expected mask values 0 or 1, got 2 at [2]"),
    # One block's check in two rounds of loads (rows.cu: check_in_one_block): of three bad values, the first named.
    ("m = torch.ones(8, 1000, dtype=torch.long, device='cuda'); m[5, 2] = 2; m[3, 500] = -1; m[7, 999] = 5\n"
     "lmk_ops.mean_pool(torch.randn(8, 1000, 8, device='cuda'), m)",
     "lmk_ops.mean_pool: expected mask values 0 or 1, got -1 at [3, 500]"),
    # Past one block's check (rows.cu: kOneBlockCheck): searched by a grid, reported by a second kernel.
    ("m = torch.ones(70, 1000, dtype=torch.long, device='cuda'); m[69, 998] = 3; m[69, 999] = -1\n"
     "lmk_ops.mean_pool(torch.randn(70, 1000, 8, device='cuda'), m)",
     "lmk_ops.mean_pool: expected mask values 0 or 1, got 3 at [69, 998]"),
], ids=["landmark_mean", "landmark_gather", "mean_pool", "packed max_pool", "mean_pool, three bad values",
        "mean_pool, a large mask"])
def test_bad_values_stop_the_stream_with_the_op_message_and_no_host_sync(code, message):
    # The value checks run on the device (no synchronisation, so the ops can be captured in CUDA graphs): the
    # message is printed by the device and the host sees a device-side assertion at its next synchronisation.
    done = _run_in_a_fresh_process(code + "\ntorch.cuda.synchronize()\nprint('no error')")
    assert done.returncode != 0 and "no error" not in done.stdout, done.stdout + done.stderr
    assert message in done.stdout + done.stderr
    assert "device-side assert" in done.stderr


def test_a_head_too_wide_for_cuda_is_a_clear_error():
    hidden = torch.randn(1, 3, 8192, device="cuda")
    with pytest.raises(RuntimeError, match=r"lmk_ops\.attention_pool: on CUDA a head is at most 4096 features wide "
                                           r"in Float \(1024 when its width is not a multiple of 4\), got 8192"):
        lmk_ops.attention_pool(hidden, None, torch.ones(8192, device="cuda"))


# Each op as f(hidden, query) -> output, with a bool mask or positions: the inputs that need no host sync.
def _graph_functions(mask, positions):
    return {
        "mean_pool": lambda h, q: lmk_ops.mean_pool(h, mask),
        "mean_pool+normalize": lambda h, q: lmk_ops.mean_pool(h, mask, normalize=True),
        "max_pool": lambda h, q: lmk_ops.max_pool(h, mask),
        "landmark_mean/mask": lambda h, q: lmk_ops.landmark_mean(h, mask),
        "landmark_mean/positions": lambda h, q: lmk_ops.landmark_mean(h, positions, normalize=True),
        "landmark_gather": lambda h, q: lmk_ops.landmark_gather(h, positions)[0],
        "first_token_pool": lambda h, q: lmk_ops.first_token_pool(h, mask),
        "last_token_pool": lambda h, q: lmk_ops.last_token_pool(h, mask),
        "attention_pool@1h": lambda h, q: lmk_ops.attention_pool(h, mask, q.flatten()),
        "attention_pool@4h+weights": lambda h, q: torch.cat(
            [t.flatten() for t in lmk_ops.attention_pool(h, mask, q, return_weights=True)]),
    }


GRAPH_CASES = list(_graph_functions(None, None))


def _graph_inputs():
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(4, 300, 256, generator=gen).cuda()
    mask = (torch.rand(4, 300, generator=gen) < 0.7).cuda()
    positions = torch.randint(-1, 300, (4, 40), generator=gen).cuda()
    query = (torch.randn(4, 64, generator=gen) * 0.1).cuda()
    return hidden, mask, positions, query


def _step(fn, hidden, query, upstream):
    h, q = hidden.detach().requires_grad_(), query.detach().requires_grad_()
    out = fn(h, q)
    grads = torch.autograd.grad(out, (h, q), upstream, allow_unused=True)
    return (out,) + tuple(g for g in grads if g is not None)


@pytest.mark.parametrize("name", GRAPH_CASES)
def test_forward_and_backward_run_without_a_host_sync(name):
    hidden, mask, positions, query = _graph_inputs()
    fn = _graph_functions(mask, positions)[name]
    upstream = torch.randn_like(fn(hidden, query))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(fn, hidden, query, upstream)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", GRAPH_CASES)
def test_forward_and_backward_can_be_captured_in_a_cuda_graph_and_replayed(name):
    static_hidden, mask, positions, query = _graph_inputs()
    fn = _graph_functions(mask, positions)[name]
    upstream = torch.randn_like(fn(static_hidden, query))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            _step(fn, static_hidden, query, upstream)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(fn, static_hidden, query, upstream)
    for seed in (1, 2):
        static_hidden.copy_(torch.randn(static_hidden.shape, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        eager = _step(fn, static_hidden, query, upstream)
        for got, want in zip(captured, eager):
            assert torch.equal(got, want), f"{name}: a replay differs from the eager run"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_two_gpus_are_a_clear_error_and_the_second_gpu_works():
    hidden = torch.randn(2, 5, 8, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"expected mask on the same device as hidden \(cuda:1\), got cuda:0"):
        lmk_ops.mean_pool(hidden, torch.ones(2, 5, dtype=torch.bool, device="cuda:0"))
    torch.testing.assert_close(lmk_ops.mean_pool(hidden).cpu(), lmk_ops.mean_pool(hidden.cpu()))


def test_empty_and_degenerate_shapes():
    for shape in [(0, 5, 8), (2, 0, 8), (2, 5, 0)]:
        hidden = torch.randn(shape, device="cuda", requires_grad=True)
        for fn in (lmk_ops.mean_pool, lmk_ops.max_pool):
            out = fn(hidden)
            assert out.shape == (shape[0], shape[2]) and not out.isnan().any()
            out.sum().backward()
    hidden = torch.randn(2, 5, 8, device="cuda", requires_grad=True)
    no_positions = torch.empty(2, 0, dtype=torch.long, device="cuda")
    vectors, valid = lmk_ops.landmark_gather(hidden, no_positions)
    assert vectors.shape == (2, 0, 8) and valid.shape == (2, 0)
    # No landmark listed at all: zeros and a zero gradient, not the mean of every row.
    out = lmk_ops.landmark_mean(hidden, no_positions)
    assert torch.equal(out, torch.zeros(2, 8, device="cuda"))
    (grad,) = torch.autograd.grad(out.sum(), hidden)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_build_info_reports_cuda():
    assert lmk_ops.build_info()["cuda"] is True


def test_aligned_rows_take_the_vector_kernels():
    """Contiguous float32 rows of whole 16-byte packs are read and written four features a thread: every row kernel
    of mean, max, gather and their backwards is the VEC = 4 instance (they all once took the scalar path, unseen by
    any result: only the kernel's name, from the profiler, tells)."""
    from torch.profiler import ProfilerActivity, profile

    hidden = torch.randn(4, 300, 64, device="cuda", requires_grad=True)
    mask = torch.rand(4, 300, device="cuda") < 0.9
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for out in (lmk_ops.mean_pool(hidden, mask), lmk_ops.max_pool(hidden, mask),
                    lmk_ops.landmark_gather(hidden, _landmarks(mask))[0]):
            out.sum().backward()
        torch.cuda.synchronize()
    # "void lmk_ops::cuda::(anonymous namespace)::pool_chunks<false, float, float, 4>(float const*, ...)"
    names = {m.group(1) for e in prof.key_averages() if (m := re.search(r"::(\w+<[^()]*>)\(", e.key))}
    row_kernels = ["pool_chunks", "mean_backward_kernel", "max_backward_kernel", "gather_kernel", "scatter_kernel"]
    launched = {n for n in names if n.split("<")[0] in row_kernels}
    assert {n.split("<")[0] for n in launched} == set(row_kernels), names
    assert all(n.endswith(", 4>") for n in launched), launched
