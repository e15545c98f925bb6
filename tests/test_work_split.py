"""Inputs that stress how the kernels split their work, on every device: one very wide attention head (a lane holds
several packs on CUDA), thousands of texts (the query gradient's reduction over texts), positions that list nearly
every row and repeat them (the positions backward), masks whose rows are not 16-byte aligned and texts long enough
to be listed by several blocks, and upstream gradients that arrive as misaligned views (the row writers' pack
loads). The CPU runs the same cases as CUDA, against the plain-PyTorch reference in float64."""

from __future__ import annotations

import pytest
import torch

import lmk_ops
from devices import DEVICES
from lmk_ops import reference

# (rtol, atol) of a result in this dtype against the float64 reference on the same (rounded) inputs.
TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 1e-4), torch.float32: (1e-4, 1e-6),
              torch.float64: (1e-10, 1e-12)}


def _randn(shape, dtype, seed, layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed":  # features strided: the scalar path on CUDA
        b, l, d = shape
        return torch.randn(b, d, l, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), rtol=rtol, atol=atol)


def _attention_and_grads(hidden, mask, query, upstream, fn):
    h, q = hidden.detach().requires_grad_(), query.detach().requires_grad_()
    out = fn(h, mask, q)
    grad_h, grad_q = torch.autograd.grad(out, (h, q), upstream.to(out.dtype))
    return out, grad_h, grad_q


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,dim,layout", [
    (torch.float32, 4096, "contiguous"), (torch.bfloat16, 8192, "contiguous"), (torch.float64, 2048, "contiguous"),
    # Four packs per lane and two row lanes on CUDA, which hand their sums over in shared memory.
    (torch.bfloat16, 3072, "contiguous"),
    # Strided features: 1024 scalar packs; wider (a multiple of 8) is read from an aligned copy on CUDA.
    (torch.float32, 1024, "transposed"), (torch.bfloat16, 1512, "transposed")], ids=str)
def test_one_wide_attention_head(device, dtype, dim, layout):
    batch, seq_len = 2, 150  # more than one chunk of rows on CUDA
    hidden = _randn((batch, seq_len, dim), dtype, dim, layout).to(device)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    mask[1, 140:] = False
    query = (_randn((dim,), torch.float32, 1) * 0.05).to(device)
    upstream = _randn((batch, dim), dtype, 2).to(device)  # representable in dtype: the same for both
    got = _attention_and_grads(hidden, mask.to(device), query, upstream, lmk_ops.attention_pool)
    want = _attention_and_grads(hidden.cpu().double(), mask, query.cpu().double(), upstream.cpu(),
                                reference.attention_pool)
    for a, b in zip(got, want):
        _close(a, b, dtype if a.dtype == dtype else a.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
def test_query_gradient_over_thousands_of_texts(device, heads):
    batch, seq_len, dim = 4096, 6, 64
    hidden = _randn((batch, seq_len, dim), torch.float32, 5).to(device)
    mask = torch.rand(batch, seq_len, generator=torch.Generator().manual_seed(6)) < 0.8
    query = (_randn((heads, dim // heads), torch.float32, 7) * 0.3).to(device)
    upstream = _randn((batch, dim), torch.float64, 8).to(device)
    got = _attention_and_grads(hidden, mask.to(device), query, upstream, lmk_ops.attention_pool)
    again = _attention_and_grads(hidden, mask.to(device), query, upstream, lmk_ops.attention_pool)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "the reduction over texts must be deterministic"
    want = _attention_and_grads(hidden.cpu().double(), mask, query.cpu().double(), upstream.cpu(),
                                reference.attention_pool)
    for a, b in zip(got, want):
        _close(a, b, torch.float32)


def _positions_with_repeats(batch, seq_len, listed, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(-1, seq_len, (batch, listed), generator=gen)
    positions[0, :seq_len] = torch.arange(seq_len)  # every row listed, then more on top
    return positions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["landmark_mean", "landmark_gather"])
def test_positions_listing_nearly_every_row_and_repeating_them(device, dtype, op):
    batch, seq_len, dim = 3, 300, 40
    positions = _positions_with_repeats(batch, seq_len, 2 * seq_len, 9)
    hidden = _randn((batch, seq_len, dim), dtype, 10)

    def run(fn, h, p):
        h = h.detach().requires_grad_()
        out = fn(h, p)
        out = out[0] if isinstance(out, tuple) else out
        upstream = _randn(out.shape, dtype, 11)  # representable in dtype: the same for both
        (grad,) = torch.autograd.grad(out, h, upstream.to(out.device, out.dtype))
        return out, grad

    got = run(getattr(lmk_ops, op), hidden.to(device), positions.to(device))
    want = run(getattr(reference, op), hidden.double(), positions)
    for a, b in zip(got, want):
        _close(a, b, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 4097, 24), (1, 9000, 16), (5, 33, 8)], ids=str)
def test_masks_with_unaligned_rows_and_texts_listed_by_several_blocks(device, shape):
    batch, seq_len, dim = shape
    hidden = _randn(shape, torch.float32, seq_len)
    gen = torch.Generator().manual_seed(12)
    mask = torch.rand(batch, seq_len, generator=gen) < torch.rand(batch, 1, generator=gen)
    mask[0, -1] = True  # the last entry of a row that does not end on a 16-byte boundary
    for fn in ("mean_pool", "max_pool", "landmark_mean"):
        got = getattr(lmk_ops, fn)(hidden.to(device), mask.to(device))
        _close(got, getattr(reference, fn)(hidden.double(), mask), torch.float32)
    query = (_randn((dim,), torch.float32, 13) * 0.3).to(device)
    got = lmk_ops.attention_pool(hidden.to(device), mask.to(device), query)
    _close(got, reference.attention_pool(hidden.double(), mask, query.cpu().double()), torch.float32)


def _misaligned(t):
    """A contiguous copy of t whose data starts one element past its storage's start (not 16-byte aligned)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mean_pool", "max_pool", "attention_pool", "landmark_gather"])
def test_gradients_arriving_as_misaligned_views_give_the_same_bits(device, name):
    hidden = _randn((3, 70, 64), torch.float32, 14).to(device)
    mask = torch.ones(3, 70, dtype=torch.bool, device=device)
    mask[2, 50:] = False
    query = torch.ones(4, 16, device=device)
    positions = torch.tensor([[0, 5, 5, -1], [69, 1, 2, 3], [-1, -1, 7, 0]], device=device)
    fn = {"mean_pool": lambda h: lmk_ops.mean_pool(h, mask),
          "max_pool": lambda h: lmk_ops.max_pool(h, mask),
          "attention_pool": lambda h: lmk_ops.attention_pool(h, mask, query),
          "landmark_gather": lambda h: lmk_ops.landmark_gather(h, positions)[0]}[name]
    h = hidden.detach().requires_grad_()
    out = fn(h)
    upstream = _randn(out.shape, torch.float32, 15).to(device)
    (aligned,) = torch.autograd.grad(out, h, upstream, retain_graph=True)
    (misaligned,) = torch.autograd.grad(out, h, _misaligned(upstream))
    assert torch.equal(aligned, misaligned)


@pytest.mark.parametrize("op", ["mean_pool", "max_pool", "landmark_mean", "attention_pool"])
def test_packed_texts_of_mixed_lengths_on_any_number_of_threads(op):
    # The CPU splits a call's (text, chunk, feature block) tasks over the threads by rows, not by count: with texts
    # of very different lengths (empty ones too), few chunks (so several feature blocks a chunk) and odd thread
    # counts, every task must run once, and the result and the gradients must be the reference's and the same bits
    # on every count. (Attention's backward keeps a text of one chunk's sums apart from those of a text of several.)
    gen = torch.Generator().manual_seed(21)
    lengths = [0, 1, 700, 3, 0, 90, 1300, 17, 2, 0, 64, 5]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    hidden = torch.randn(offsets[-1].item(), 1000, generator=gen)
    landmarks = torch.rand(hidden.shape[0], generator=gen) < 0.3
    query = torch.randn(8, 125, generator=gen)
    upstream = torch.randn(len(lengths), 1000, generator=gen)
    pool = {"mean_pool": lambda lib, h, q: lib.mean_pool(h, cu_seqlens=offsets),
            "max_pool": lambda lib, h, q: lib.max_pool(h, cu_seqlens=offsets),
            "landmark_mean": lambda lib, h, q: lib.landmark_mean(h, landmarks, cu_seqlens=offsets),
            "attention_pool": lambda lib, h, q: lib.attention_pool(h, None, q, cu_seqlens=offsets)}[op]

    def run(lib, dtype):
        h, q = hidden.to(dtype).requires_grad_(), query.to(dtype).requires_grad_()
        out = pool(lib, h, q)
        leaves = [h, q] if op == "attention_pool" else [h]
        return [out.detach(), *torch.autograd.grad(out, leaves, upstream.to(dtype))]

    expected = run(reference, torch.float64)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5, 8):
            torch.set_num_threads(n)
            results.append(run(lmk_ops, torch.float32))
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(results[0], expected):
        _close(got, want, torch.float32)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
