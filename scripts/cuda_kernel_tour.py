"""Launches every CUDA kernel of lmk_ops once or a few times on small inputs, forward and backward: the run that
compute-sanitizer (memcheck, racecheck, synccheck, initcheck) watches in scripts/gpu_check.sh. Small on purpose (a
sanitizer slows kernels 10-100x), but it covers each path: one chunk and several (L > 128), row listing by several
blocks (L > 4096) with unaligned mask rows, 16-byte packs and the strided path, small, wide and very wide attention
heads, attention's second passes (forward and backward) over rows near float32's maximum, the value checks, packed
batches, and the four dtypes."""

from __future__ import annotations

import torch

import lmk_ops

torch.manual_seed(0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def run(fn, hidden, *extra):
    """fn's outputs and their gradients w.r.t. hidden and the tensors of extra that require one."""
    h = hidden.detach().requires_grad_()
    outputs = fn(h, *extra)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o.is_floating_point()]
    leaves = [h] + [t for t in extra if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.grad(outputs, leaves, [torch.randn_like(o) for o in outputs])


def tour(dtype, batch, seq_len, dim, layout="contiguous"):
    hidden = torch.randn(batch, dim, seq_len, device="cuda", dtype=dtype).transpose(1, 2) if layout == "strided" \
        else torch.randn(batch, seq_len, dim, device="cuda", dtype=dtype)
    mask = torch.rand(batch, seq_len, device="cuda") < 0.7
    mask[0] = False  # a text with nothing to pool
    positions = torch.randint(-1, seq_len, (batch, 2 * seq_len // 3 + 1), device="cuda")
    for m in (None, mask, mask.int()):
        run(lambda h: lmk_ops.mean_pool(h, m, normalize=True), hidden)
        run(lambda h: lmk_ops.max_pool(h, m), hidden)
        run(lambda h: lmk_ops.first_token_pool(h, m), hidden)
        run(lambda h: lmk_ops.last_token_pool(h, m), hidden)
    for landmarks in (mask, positions):
        run(lambda h: lmk_ops.landmark_mean(h, landmarks), hidden)
    run(lambda h: lmk_ops.landmark_gather(h, positions), hidden)
    run(lambda h: lmk_ops.landmark_gather(h, mask), hidden)  # the mask's positions: a counting pass, then them
    for heads in {1, 4, dim // 8} if dim % 8 == 0 else {1}:
        query = (torch.randn(heads, dim // heads, device="cuda") * 0.1).requires_grad_()
        run(lambda h, q: lmk_ops.attention_pool(h, mask, q, return_weights=True), hidden, query)
        run(lambda h, q: lmk_ops.attention_pool(h, None, q), hidden, query)


def packed_tour(dtype, lengths, dim):
    """The packed layout's paths: texts as runs of rows (empty ones too), their backward kernels by text of row."""
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    hidden = torch.randn(sum(lengths), dim, device="cuda", dtype=dtype)
    mask = torch.rand(sum(lengths), device="cuda") < 0.7
    kw = {"cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)}
    for m in (None, mask):
        run(lambda h: lmk_ops.mean_pool(h, m, **kw), hidden)
        run(lambda h: lmk_ops.max_pool(h, m, **kw), hidden)
        run(lambda h: lmk_ops.first_token_pool(h, m, **kw), hidden)
        run(lambda h: lmk_ops.last_token_pool(h, m, **kw), hidden)
    run(lambda h: lmk_ops.landmark_mean(h, mask, **kw), hidden)
    run(lambda h: lmk_ops.landmark_gather(h, mask, **kw), hidden)
    query = (torch.randn(4, dim // 4, device="cuda") * 0.1).requires_grad_()
    run(lambda h, q: lmk_ops.attention_pool(h, mask, q, **kw), hidden, query)


for dtype in DTYPES:
    packed_tour(dtype, [0, 5, 300, 1, 0, 40], 64)
    tour(dtype, 3, 300, 64)
    tour(dtype, 2, 70, 33, layout="strided")
tour(torch.bfloat16, 2, 4200, 24)  # listing by several blocks, mask rows not 16-byte aligned
tour(torch.float32, 2, 140, 2048)  # one head of 512 packs: several packs a lane
tour(torch.float32, 2, 140, 1200, layout="strided")  # one head of 1200 strided features
# Rows near float32's maximum: attention's second, shrunk passes over a chunk, forward and backward (one chunk and
# several).
for seq_len in (100, 300):
    big = torch.full((2, seq_len, 64), 3e38, device="cuda", dtype=torch.bfloat16)
    big[1, ::2] *= -1
    run(lambda h: lmk_ops.attention_pool(h, None, torch.full((4, 16), 1e-38, device="cuda")), big)
# Integer masks checked by one block in two rounds of loads, and past one block's check (rows.cu: kOneBlockCheck)
# by a grid.
for texts in (8, 70):
    run(lambda h: lmk_ops.mean_pool(h, torch.ones(texts, 1000, dtype=torch.long, device="cuda")),
        torch.randn(texts, 1000, 8, device="cuda"))
# Packed offsets past one block's conversion (rows.cu: packed_offsets over a grid): 70000 texts of two rows, their
# offsets int64 and then strided int32, and positions checked against their texts' lengths.
pairs = torch.randn(140000, 8, device="cuda")
offsets = torch.arange(0, 140001, 2, device="cuda")
run(lambda h: lmk_ops.landmark_mean(h, torch.ones(70000, 1, dtype=torch.long, device="cuda"), cu_seqlens=offsets),
    pairs)
run(lambda h: lmk_ops.mean_pool(h, cu_seqlens=torch.arange(140001, device="cuda", dtype=torch.int32)[::2]), pairs)
torch.cuda.synchronize()
print("cuda_kernel_tour: every kernel launched")
