"""Hostile inputs: long sums, odd tensors, unsupported differentiation modes, and the defects a hostile review found,
each pinned by a test. Runs in CI (CPU); the CUDA cases of the ops' own suites cover the device."""

from __future__ import annotations

import contextlib
import decimal
import math
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lmk_ops
import lmk_ops.hf
from lmk_ops import reference

from devices import DEVICES


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of got against exact, in units of got's last place."""
    spacing = torch.from_numpy(np.spacing(got.abs().float().numpy())).double()
    return ((got.double() - exact.double()).abs() / spacing).max().item()


# --- accuracy of long sums -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, 3.3])
def test_mean_of_a_million_equal_rows_is_within_a_few_ulp(value):
    hidden = torch.full((1, 10**6, 8), value)
    assert _ulps(lmk_ops.mean_pool(hidden), hidden.double().mean(1)) <= 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, 3.3])
def test_float64_means_of_a_million_equal_rows_do_not_drift_with_the_number_of_chunks(device, value):
    # The chunks' shares were added up in float64 itself, which drifted with their number: 44-234 ulp here on the
    # CPU. Added in the x87 extended type (CPU) or compensated (CUDA), what is left is each chunk's own rounding
    # (torch.mean: 2-6 ulp on these columns): on the CPU, where a chunk's runs of 32 rows add up four-row groups
    # pairwise, 1-2 ulp (runs of 8: 2-8); CUDA's bound is the one it was written for, not yet run.
    hidden = torch.full((1, 10**6, 4), value, dtype=torch.float64, device=device)
    results = {"mean_pool": lmk_ops.mean_pool(hidden),
               "landmark_mean": lmk_ops.landmark_mean(hidden, torch.ones(1, 10**6, dtype=torch.bool, device=device)),
               "attention_pool": lmk_ops.attention_pool(hidden, None, torch.zeros(4, dtype=torch.float64,
                                                                                device=device))}
    for name, got in results.items():
        assert ((got.cpu() - value).abs() / math.ulp(value)).max().item() <= (2 if device == "cpu" else 8), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dim", [8, 1024])  # on CUDA a head of 1024 float32 features takes a chunk's rows in one lane
def test_attention_with_a_zero_query_over_equal_rows_is_within_a_few_ulp(device, heads, dim):
    # Every weight is equal: the mean again, through attention's weighted sums. The CPU adds a group of rows
    # pairwise and CUDA compensates its sums; one fused multiply-add per row into a run's sum was 8 ulp off on
    # these columns on the CPU (5-8 at 1000 rows), and on CUDA a lane's 128 rows lose up to 30 ulp.
    values = torch.tensor([0.894774317741394, 0.23325754702091217, 1.6202945709228516, 7.754859924316406])
    hidden = values.repeat(dim // 4).view(1, 1, dim).expand(1, 1000, dim).contiguous().to(device)
    got = lmk_ops.attention_pool(hidden, None, torch.zeros(heads, dim // heads, device=device).squeeze(0))
    assert _ulps(got.cpu(), hidden.cpu().double().mean(1)) <= 4


@pytest.mark.parametrize("seq_len", [1000, 100_000, 1_000_000])
def test_long_means_stay_within_a_few_ulp_of_a_float64_oracle(seq_len):
    gen = torch.Generator().manual_seed(seq_len)
    hidden = torch.randn(1, seq_len, 16, generator=gen) + 1  # a mean away from zero
    mask = torch.rand(1, seq_len, generator=gen) < 0.5
    masked = (hidden.double() * mask[..., None]).sum(1) / mask.sum()
    assert _ulps(lmk_ops.mean_pool(hidden), hidden.double().mean(1)) <= 4
    assert _ulps(lmk_ops.mean_pool(hidden, mask), masked) <= 4
    assert _ulps(lmk_ops.landmark_mean(hidden, mask), masked) <= 4
    assert _ulps(lmk_ops.landmark_mean(hidden, lmk_ops.landmark_positions(mask)), masked) <= 4
    normalized = torch.nn.functional.normalize(hidden.double().mean(1), dim=-1)
    assert _ulps(lmk_ops.mean_pool(hidden, normalize=True), normalized) <= 4


def test_attention_over_a_long_text_stays_accurate():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 200_000, 32, generator=gen) + 1
    query = torch.randn(32, generator=gen) * 0.01
    got = lmk_ops.attention_pool(hidden, None, query)
    assert _ulps(got, reference.attention_pool(hidden.double(), None, query.double())) <= 4


@pytest.mark.parametrize("value", [-65504.0, 60000.0, 65504.0])
def test_float16_means_of_large_values_do_not_overflow(value):
    hidden = torch.full((1, 20000, 3), value, dtype=torch.float16)
    assert torch.equal(lmk_ops.mean_pool(hidden), torch.full((1, 3), value, dtype=torch.float16))
    assert torch.equal(lmk_ops.landmark_mean(hidden, torch.ones(1, 20000, dtype=torch.bool)),
                       torch.full((1, 3), value, dtype=torch.float16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [-0.99, 0.5, 0.99])
def test_means_of_values_near_the_dtype_maximum_do_not_overflow(device, dtype, value):
    # bfloat16 shares float32's range, so float32 sums of its largest values overflow though their mean is finite;
    # float64 sums of values near float64's maximum do. Attention pooling with a zero query is the same mean.
    top = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    big = torch.tensor(value * top, dtype=torch.float64).to(dtype).item()
    hidden = torch.full((2, 1500, 4), big, dtype=dtype)  # three chunks of rows, and a column of mixed signs
    hidden[1, :, 0] *= torch.tensor([1.0, -1.0]).repeat(750).to(dtype)
    expected = (hidden.double() / 4096).mean(1) * 4096  # exact scaling: float64's own mean overflows here
    hidden = hidden.to(device)
    got = lmk_ops.mean_pool(hidden).cpu()
    assert got.isfinite().all()
    if dtype == torch.float64:  # the rows are summed in float64 itself: a few ulps
        assert torch.allclose(got, expected, rtol=1e-13, atol=0)
    else:
        assert torch.equal(got, expected.to(dtype))
    attended = lmk_ops.attention_pool(hidden, None, torch.zeros(4, device=device)).cpu()
    assert attended.isfinite().all()
    assert torch.allclose(attended.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    mask = torch.ones(2, 1500, dtype=torch.bool, device=device)
    assert torch.equal(lmk_ops.landmark_mean(hidden, mask).cpu(), got)
    cu_seqlens = torch.tensor([0, 1500, 3000], device=device)
    assert torch.equal(lmk_ops.mean_pool(hidden.flatten(0, 1), cu_seqlens=cu_seqlens).cpu(), got)
    unit = torch.nn.functional.normalize(expected / top, dim=-1)  # the same direction; squares that do not overflow
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(lmk_ops.mean_pool(hidden, normalize=True).cpu().double(), unit, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_means_near_the_maximum_keep_each_feature_in_place(device):
    # Contiguous bfloat16 rows are summed in pair order (SumReducer::slot on the CPU), and a chunk whose float32 sums
    # overflow is summed again in float64: each feature must come back in its own place. Every feature has its own
    # value; the mixed-sign ones sit inside pair blocks (1, 17) and past the last whole one (35).
    top = torch.finfo(torch.float32).max
    hidden = (torch.linspace(0.5, 0.99, 40, dtype=torch.float64) * top).to(torch.bfloat16).expand(2, 1500, 40).clone()
    for feature in (1, 17, 35):
        hidden[1, :, feature] *= torch.tensor([1.0, -1.0]).repeat(750).to(torch.bfloat16)
    expected = (hidden.double() / 4096).mean(1) * 4096  # exact scaling, as in the test above
    assert torch.equal(lmk_ops.mean_pool(hidden.to(device)).cpu(), expected.to(torch.bfloat16))


def _rows_near_the_float32_maximum(dtype, heads, length):
    """Two texts of rows at 0.9 * float32's maximum (the second with five features of alternating sign and 54
    random ones), a float32 query of ~1e-38 (scores of order one), and the generator, for more draws."""
    gen = torch.Generator().manual_seed(heads)
    big = torch.tensor(0.9 * torch.finfo(torch.float32).max).to(dtype).item()
    hidden = torch.full((2, length, 64), big, dtype=dtype)
    hidden[1, ::2, :5] *= -1
    hidden[1, :, 10:] = torch.randn(length, 54, generator=gen).to(dtype)
    query = (torch.randn(64, generator=gen) * 1e-38).reshape(heads, -1).squeeze(0)
    return hidden, query, gen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("length", [100, 1500])  # one chunk (finished in place), several (merged)
def test_attention_over_values_near_the_float32_maximum_does_not_overflow(device, dtype, heads, length):
    hidden, query, _ = _rows_near_the_float32_maximum(dtype, heads, length)
    query = query.to(dtype)
    out, weights = lmk_ops.attention_pool(hidden.to(device), None, query.to(device), return_weights=True)
    exact, exact_weights = reference.attention_pool(hidden.double(), None, query.double(), return_weights=True)
    assert out.isfinite().all()
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.cpu().double(), exact, rtol=rtol, atol=1e-2)
    assert torch.allclose(weights.cpu().double(), exact_weights, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [1, 4, 16])
def test_attention_scores_whose_dot_product_overflows_before_the_scale(device, dtype, heads):
    # States of ~4e37 and a unit query: <x, q> passes float32's maximum, scale * <x, q> does not. The softmax is then
    # one-hot on each text's top row, and the gradients are finite.
    gen = torch.Generator().manual_seed(heads)
    hidden = (torch.randn(2, 300, 64 * heads, generator=gen) * 4e37).to(dtype)  # heads of 64 features
    query = torch.randn(heads, 64, generator=gen).squeeze(0)
    grad = torch.randn(2, 64 * heads, generator=gen).to(dtype)
    h, q = hidden.to(device).requires_grad_(), query.to(device).requires_grad_()
    out, weights = lmk_ops.attention_pool(h, None, q, return_weights=True)
    grad_h, grad_q = torch.autograd.grad(out, (h, q), grad.to(device))
    h64, q64 = hidden.double().requires_grad_(), query.double().requires_grad_()
    exact, exact_weights = reference.attention_pool(h64, None, q64, return_weights=True)
    exact_h, exact_q = torch.autograd.grad(exact, (h64, q64), grad.double())
    dots = torch.einsum("blhd,hd->bhl", hidden.double().unflatten(-1, (heads, 64)), query.double().reshape(heads, 64))
    assert (dots.abs() > torch.finfo(torch.float32).max).any()  # the case: a dot product overflows float32
    assert torch.equal(out.cpu(), exact.to(dtype))
    assert torch.equal(weights.cpu(), exact_weights.to(weights.dtype))
    assert grad_h.isfinite().all() and grad_q.isfinite().all()
    assert torch.allclose(grad_h.cpu().double(), exact_h, rtol=1e-2, atol=1e-6)
    assert torch.allclose(grad_q.cpu().double(), exact_q, rtol=1e-2, atol=1e-6)


def _centred_attention_grads(hidden, query, grad, shrink=1.0):
    """The gradients of attention_pool (default scale, no mask) w.r.t. hidden and query, in float64, written
    relative to each text's first row c: p_l (e_l - S) with e_l = <g, x_l - c> and S = sum_l p_l e_l, which no
    choice of c changes. The autograd of the float64 reference forms <g, x_l> and cancels it against its mean,
    which loses everything when |x| is near float32's maximum (its query gradient is off by 1e31 where the exact
    value is 3e6); relative to the output m, m's rounding leaves 1e22 where rows are equal. Also the query
    gradient's terms summed in magnitude, the scale of its rounding errors. x - c is taken as x * shrink - c * shrink
    (a power of two: exact), the factors taken out after, for rows near float64's maximum."""
    x, q, g = hidden.double(), query.double().reshape(-1, query.shape[-1]), grad.double()
    heads, head_dim = q.shape
    x = x.unflatten(-1, (heads, head_dim))                                # [B, L, H, d]
    g = g.unflatten(-1, (heads, head_dim))                                # [B, H, d]
    scale = head_dim ** -0.5
    p = torch.softmax(scale * torch.einsum("blhd,hd->bhl", x, q), dim=-1)
    y = x * shrink - x[:, :1] * shrink
    e = torch.einsum("bhd,blhd->bhl", g, y)
    total = (p * e).sum(-1, keepdim=True)
    coef = p * (e - total)                                                # [B, H, L], times shrink
    grad_h = torch.einsum("bhl,bhd->blhd", p, g) + scale * torch.einsum("bhl,hd->blhd", coef / shrink, q)
    grad_q = scale * torch.einsum("bhl,blhd->hd", coef, y) / shrink / shrink
    terms = scale * torch.einsum("bhl,blhd->hd", p * (e.abs() + total.abs()), y.abs()) / shrink / shrink
    return grad_h.flatten(-2), grad_q.reshape(query.shape), terms.reshape(query.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("length", [100, 1500])
def test_attention_gradient_over_values_near_the_float32_maximum(device, dtype, heads, length):
    # Rows of +-0.9 * max: x - m reaches 1.8 * max, past float32's range, though the gradient of hidden is tiny.
    # The query's gradient grows with |x|^2: past float32's range in some features (inf, as the exact value
    # rounds), small in others.
    hidden, query, gen = _rows_near_the_float32_maximum(dtype, heads, length)
    grad = (torch.randn(2, 64, generator=gen) * 1e-30).to(dtype)
    h, q = hidden.to(device).requires_grad_(), query.to(device).requires_grad_()
    grad_h, grad_q = torch.autograd.grad(lmk_ops.attention_pool(h, None, q), (h, q), grad.to(device))
    exact_h, exact_q, terms_q = _centred_attention_grads(hidden, query, grad)
    assert grad_h.isfinite().all()
    tol = (1e-2 if dtype == torch.bfloat16 else 1e-5) * exact_h.abs().max().item()
    assert torch.allclose(grad_h.cpu().double(), exact_h, rtol=0, atol=tol)
    assert torch.equal(grad_q.isinf().cpu(), exact_q.float().isinf())
    finite = exact_q.float().isfinite()
    assert finite.any()
    assert ((grad_q.cpu().double() - exact_q)[finite].abs() <= 1e-5 * terms_q[finite]).all()


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("length", [100, 1500])
def test_attention_gradient_over_values_near_the_float64_maximum(heads, length):
    # Float64 rows of +-0.9 * its maximum: x - m passes float64's range, so the CPU sums such a chunk again in the
    # x87 extended type; the gradient of hidden is finite, the query's inf where its exact value is. The CUDA kernels
    # still overflow here (as PyTorch's float64 autograd does): CPU only.
    gen = torch.Generator().manual_seed(heads)
    hidden = torch.full((2, length, 64), 0.9 * torch.finfo(torch.float64).max, dtype=torch.float64)
    hidden[1, ::2, :5] *= -1
    hidden[:, :, 10:] = torch.randn(2, length, 54, generator=gen, dtype=torch.float64)
    query = (torch.randn(64, generator=gen, dtype=torch.float64) * 1e-308).reshape(heads, -1).squeeze(0)
    grad = torch.randn(2, 64, generator=gen, dtype=torch.float64) * 1e-300
    h, q = hidden.clone().requires_grad_(), query.clone().requires_grad_()
    grad_h, grad_q = torch.autograd.grad(lmk_ops.attention_pool(h, None, q), (h, q), grad)
    exact_h, exact_q, terms_q = _centred_attention_grads(hidden, query, grad, shrink=2.0 ** -8)
    assert grad_h.isfinite().all()
    assert torch.allclose(grad_h, exact_h, rtol=0, atol=1e-12 * exact_h.abs().max().item())
    assert torch.equal(grad_q.isinf(), exact_q.isinf())
    # Features 10.. differ from row to row. Features 0-9 of the first text and 5-9 of the second are equal in every
    # row: there the exact value is 0, and the kernel's, worked relative to the output m, is m's rounding (1 ulp of
    # 1.6e308) times the error sums times 1 - sum(p), about 1e269: float64 rounding at the scale of |x|^2.
    finite = exact_q.isfinite() & (torch.arange(64).reshape(query.shape) >= 10)
    assert finite.any()
    assert ((grad_q - exact_q)[finite].abs() <= 1e-12 * terms_q[finite]).all()


def test_float64_normalize_is_within_an_ulp_of_the_exact_unit_vector():
    # A float64 sum of D float64 squares drifts with D: these rows' unit vectors were up to 5.7 ulp off the exact
    # ones (F.normalize: 1.2). The max is exact, so what is left is normalize's own error: the host loop's (sums in
    # the x87 extended type) 0.5, or in a CPU-twin build the device-generic path's (torch's float64 sum, as CUDA's)
    # 1.1.
    limit = 1.25 if lmk_ops.build_info()["cpu_twin"] else 0.75
    decimal.getcontext().prec = 60
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 5, 768, generator=gen, dtype=torch.float64) + 3
    got = lmk_ops.max_pool(hidden, normalize=True)
    for pooled, row in zip(hidden.amax(1).tolist(), got.tolist()):
        exact = [decimal.Decimal(x) for x in pooled]
        norm = sum(x * x for x in exact).sqrt()
        errors = [abs(decimal.Decimal(g) - x / norm) / decimal.Decimal(math.ulp(g)) for g, x in zip(row, exact)]
        assert max(errors) <= limit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 0), (0, 3, 4), (2, 0, 4), (0, 0, 0)])
def test_normalize_of_empty_batches_and_rows_without_features(device, shape):
    # D = 0 with normalize=True killed the process (SIGFPE: the CPU pass split its work by D), and its backward
    # failed in amax over the empty feature dimension.
    import torch.autograd.forward_ad as forward_ad
    batch, seq_len, dim = shape
    mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    cu_seqlens = torch.arange(batch + 1, device=device) * seq_len
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        hidden = torch.randn(shape, dtype=dtype).to(device)
        packed = hidden.reshape(batch * seq_len, dim)
        for fn, x in ((lambda h: lmk_ops.mean_pool(h, mask, normalize=True), hidden),
                      (lambda h: lmk_ops.max_pool(h, mask, normalize=True), hidden),
                      (lambda h: lmk_ops.landmark_mean(h, mask, normalize=True), hidden),
                      (lambda h: lmk_ops.mean_pool(h, cu_seqlens=cu_seqlens, normalize=True), packed)):
            h = x.detach().requires_grad_()
            out = fn(h)
            assert out.shape == (batch, dim) and out.dtype == dtype and not out.any()
            (grad,) = torch.autograd.grad(out, h, torch.ones_like(out))
            assert grad.shape == h.shape and not grad.any()
            with forward_ad.dual_level():
                tangent = forward_ad.unpack_dual(fn(forward_ad.make_dual(x, torch.ones_like(x)))).tangent
            assert tangent.shape == (batch, dim) and not tangent.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalize_of_a_pooled_row_with_a_nan_is_all_nan_as_in_f_normalize(device, dtype):
    # The host loop (and the device-generic path's float64 rows) divided such a row by eps (its norm is NaN, which
    # failed "norm > eps"): finite features came out as 1e12 times themselves, where F.normalize gives NaN throughout.
    hidden = torch.ones(2, 3, 4, device=device, dtype=dtype)
    hidden[0, 1, 2] = math.nan
    for op in (lmk_ops.mean_pool, lmk_ops.max_pool):
        out = op(hidden, normalize=True).cpu()
        assert out[0].isnan().all(), op.__name__
        assert torch.equal(out[1], torch.full((4,), 0.5, dtype=dtype)), op.__name__


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_normalize_gives_unit_vectors_where_the_norm_leaves_the_dtype_range(device, dtype, scale):
    # The norm of a vector whose entries are near the maximum overflows in the dtype itself (and the squares of
    # float32 values beyond 1.8e19 overflow in float32); tiny entries' squares underflow. Either way the direction
    # is well defined, and F.normalize's eps (1e-12) is far below the norm only for the large vectors.
    big = torch.finfo(dtype).max / 4 if scale > 1 else 1e-30
    hidden = torch.full((1, 3, 8), big, dtype=dtype)
    hidden[0, :, 0] = -big
    exact = torch.nn.functional.normalize(hidden.double().mean(1) / big, dim=-1)
    if scale < 1:  # below eps: divided by eps, as F.normalize
        exact = hidden.double().mean(1) / 1e-12
    hidden = hidden.to(device)
    for out in (lmk_ops.max_pool(hidden, normalize=True), lmk_ops.mean_pool(hidden, normalize=True)):
        out = out.cpu()
        assert out.isfinite().all()
        assert torch.allclose(out.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e30), (torch.bfloat16, 1e20), (torch.float64, 1e200)])
def test_normalize_gradients_hold_where_the_pooled_norm_leaves_the_dtype_range(device, dtype, scale):
    # The backward and the forward-mode rule took |m| in m's own type: past 1.8e19 in float32 (1.3e154 in float64)
    # the squares overflowed, |m| was inf and the gradient silently zero, where the forward gives unit vectors. The
    # exact gradient is that of the same vectors shrunk by the scale (normalize ignores it), shrunk once more.
    gen = torch.Generator().manual_seed(0)
    hidden = ((torch.randn(2, 3, 8, generator=gen, dtype=torch.float64) + 2) * scale).to(dtype)
    grad = torch.randn(2, 8, generator=gen, dtype=torch.float64)
    tangent = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    for op, pool in ((lmk_ops.mean_pool, lambda x: x.mean(1)), (lmk_ops.max_pool, lambda x: x.amax(1))):
        shrunk = (hidden.double() / scale).requires_grad_()
        exact = torch.nn.functional.normalize(pool(shrunk), dim=-1)
        exact_grad, = torch.autograd.grad(exact, shrunk, grad)
        exact_tangent = torch.func.jvp(lambda x: torch.nn.functional.normalize(pool(x), dim=-1), (shrunk.detach(),),
                                       (tangent,))[1]
        x = hidden.to(device).requires_grad_()
        got_grad, = torch.autograd.grad(op(x, normalize=True), x, grad.to(device, dtype))
        got_tangent = torch.func.jvp(lambda h: op(h, normalize=True), (hidden.to(device),),
                                     (tangent.to(device, dtype),))[1]
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(got_grad.double().cpu() * scale, exact_grad, rtol=tolerance, atol=tolerance), op
        assert torch.allclose(got_tangent.double().cpu() * scale, exact_tangent, rtol=tolerance, atol=tolerance), op


def test_a_failed_allocation_says_what_torch_said_and_what_lmk_ops_was_doing():
    # 640 TB: beyond any address space, so it fails even where memory is overcommitted.
    with pytest.raises(RuntimeError) as failure:
        torch.ops.lmk_ops.mean_pool_backward(torch.randn(2, 8), None, 10**13, torch.float32, None)
    message = str(failure.value)
    assert "allocating a tensor of shape [2, 10000000000000, 8]" in message
    if tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 13):  # older torch keeps its message to itself
        assert "you tried to allocate 640000000000000 bytes" in message


def test_a_failed_torch_call_inside_an_op_names_the_op_and_says_what_torch_said():
    # Positions expanded to 10^13 a text: the op's contiguous copy (a torch::stable call, not lmk_ops' own allocation)
    # asks torch for 160 TB. The stable ABI's own error names neither the op nor the reason (csrc/ops/op_entry.h).
    positions = torch.zeros(1, 1, dtype=torch.int64).expand(2, 10**13)
    with pytest.raises(RuntimeError, match=r"^lmk_ops::landmark_mean: a call into torch failed: ") as failure:
        lmk_ops.landmark_mean(torch.randn(2, 5, 4), positions)
    message = str(failure.value)
    if tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 13):
        assert "you tried to allocate 160000000000000 bytes" in message
    else:
        assert "torch logged why above" in message


@pytest.mark.exhausts_memory
def test_a_host_buffer_too_large_to_allocate_is_an_lmk_ops_error_not_a_bare_memory_error():
    # One text of 10^14 rows (a stride-0 view): its chunks' partial sums would take petabytes, beyond any address
    # space, so the kernels' own buffer fails to allocate (std::bad_alloc, a bare MemoryError in Python).
    with pytest.raises(RuntimeError, match=r"^lmk_ops::mean_pool: out of host memory for its working buffers"):
        lmk_ops.mean_pool(torch.zeros(1, 1, 1).expand(1, 10**14, 1000))


def test_a_long_text_gives_the_same_bits_alone_padded_packed_and_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(9)
    text = torch.randn(1, 5000, 96, generator=gen)
    batch = torch.randn(3, 6100, 96, generator=gen)
    batch[1, 1100:] = text[0]
    mask = torch.zeros(3, 6100, dtype=torch.bool)
    mask[1, 1100:] = True
    mask[0] = True
    # Packed between a long and a short text (every row selected: the kernels take each text's run of rows).
    packed = torch.cat([batch[0], text[0], batch[2, :300]])
    offsets = torch.tensor([0, 6100, 11100, 11400], dtype=torch.int32)
    query = torch.randn(4, 24, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, threads):
            torch.set_num_threads(n)
            results.append([
                [lmk_ops.mean_pool(text)[0], lmk_ops.mean_pool(batch, mask)[1],
                 lmk_ops.mean_pool(packed, cu_seqlens=offsets)[1]],
                [lmk_ops.max_pool(text)[0], lmk_ops.max_pool(batch, mask)[1],
                 lmk_ops.max_pool(packed, cu_seqlens=offsets)[1]],
                [lmk_ops.attention_pool(text, None, query)[0], lmk_ops.attention_pool(batch, mask, query)[1],
                 lmk_ops.attention_pool(packed, None, query, cu_seqlens=offsets)[1]]])
    finally:
        torch.set_num_threads(threads)
    for run in results:
        for op, first in zip(run, results[0]):
            assert all(torch.equal(op[0], other) for other in op[1:])
            assert torch.equal(op[0], first[0])


# --- differentiation modes ----------------------------------------------------------------------------------------

def _h():
    return torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


FUNCTIONS = {
    "mean_pool": lambda h: lmk_ops.mean_pool(h),
    "max_pool": lambda h: lmk_ops.max_pool(h),
    "landmark_mean": lambda h: lmk_ops.landmark_mean(h, torch.tensor([[0, 2], [1, -1]])),
    "landmark_gather": lambda h: lmk_ops.landmark_gather(h, torch.tensor([[0, 2], [1, -1]]))[0],
    "first_token_pool": lambda h: lmk_ops.first_token_pool(h),
    "attention_pool": lambda h: lmk_ops.attention_pool(h, None, torch.ones(4, dtype=torch.float64)),
}


@pytest.mark.parametrize("op", FUNCTIONS)
def test_forward_mode_gives_the_jacobians_tangents(op):
    """Forward mode (the ops' jvp rules) gives J t, as the reverse-mode Jacobian says, through torch.func.jvp,
    jacfwd, hessian (forward over reverse) and torch.autograd.forward_ad (it used to give zero tangents silently)."""
    import torch.autograd.forward_ad as forward_ad

    fn, h = FUNCTIONS[op], _h()
    tangent = torch.linspace(-1, 1, h.numel(), dtype=torch.float64).reshape(h.shape)
    jacobian = torch.autograd.functional.jacobian(fn, h)
    want = (jacobian.flatten(-3) @ tangent.flatten()).reshape(fn(h).shape)
    torch.testing.assert_close(torch.func.jvp(fn, (h,), (tangent,))[1], want)
    with forward_ad.dual_level():
        torch.testing.assert_close(forward_ad.unpack_dual(fn(forward_ad.make_dual(h, tangent))).tangent, want)
    torch.testing.assert_close(torch.func.jacfwd(fn)(h), jacobian)
    torch.testing.assert_close(torch.func.hessian(lambda x: fn(x).square().sum())(h),
                               torch.autograd.functional.hessian(lambda x: fn(x).square().sum(), h))


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "last", "lmk", "mean_sqrt_len_tokens", "weightedmean",
                                  "attention"])
def test_torch_func_through_the_pooling_modules(mode):
    # The modules' own arithmetic around the ops (weightedmean's weights, mean_sqrt_len_tokens' scale) included.
    pooling = lmk_ops.nn.Pooling(mode, **({"dim": 4, "heads": 2} if mode == "attention" else {})).double()
    if mode == "attention":
        torch.nn.init.normal_(pooling.attention.query, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = {"attention_mask": mask, "landmark_mask": torch.tensor([[0, 1, 1], [1, 0, 0]]).bool()}

    def fn(h):
        return pooling(h, batch)

    jacobian = torch.autograd.functional.jacobian(fn, _h())
    assert torch.equal(torch.func.jacrev(fn)(_h()), jacobian)
    torch.testing.assert_close(torch.func.jacfwd(fn)(_h()), jacobian)


def test_forward_mode_inside_torch_compile_runs_eagerly_or_fails_clearly():
    # Traced by dynamo, the ops have no forward-mode rule (PyTorch's custom-op route has none) and their tangents
    # would come out zero: call() makes dynamo run such a frame eagerly, and fullgraph=True fail with a message.
    torch._dynamo.reset()
    fn, h = FUNCTIONS["attention_pool"], _h()
    tangent = torch.ones_like(h)
    eager = torch.func.jvp(fn, (h,), (tangent,))[1]
    assert eager.abs().sum() > 0
    assert torch.equal(torch.compile(lambda x, t: torch.func.jvp(fn, (x,), (t,))[1])(h, tangent), eager)
    with pytest.raises(Exception, match=r"lmk_ops\.attention_pool: forward-mode AD .* runs eagerly, not inside "
                                        r"torch\.compile\(fullgraph=True\)"):
        torch.compile(lambda x, t: torch.func.jvp(fn, (x,), (t,))[1], fullgraph=True)(h, tangent)


def test_torch_func_grad_inside_torch_compile_gives_eagers_gradient():
    # Dynamo traces the ops into the graph, so their autograd is the dispatcher's kernel: torch.library.
    # register_autograd's used to be refused there (PyTorch's "must override the setup_context staticmethod").
    torch._dynamo.reset()
    fn, h = FUNCTIONS["attention_pool"], _h()
    grad = torch.func.grad(lambda x: (fn(x) ** 2).sum())
    assert torch.equal(torch.compile(grad, fullgraph=True)(h), grad(h))


_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
_POSITIONS = torch.tensor([[0, 2], [1, -1]])
# Each forward op called through torch.ops directly, beside its public function: (direct, public).
_DIRECT = {
    "mean_pool": (lambda h: torch.ops.lmk_ops.mean_pool(h, _MASK, True)[0],
                  lambda h: lmk_ops.mean_pool(h, _MASK, normalize=True)),
    "max_pool": (lambda h: torch.ops.lmk_ops.max_pool(h, _MASK)[0], lambda h: lmk_ops.max_pool(h, _MASK)),
    "landmark_mean": (lambda h: torch.ops.lmk_ops.landmark_mean(h, _POSITIONS)[0],
                      lambda h: lmk_ops.landmark_mean(h, _POSITIONS)),
    "landmark_gather": (lambda h: torch.ops.lmk_ops.landmark_gather(h, _POSITIONS),
                        lambda h: lmk_ops.landmark_gather(h, _POSITIONS)[0]),
    "token_pool": (lambda h: torch.ops.lmk_ops.token_pool(h, _MASK, True)[0],
                   lambda h: lmk_ops.last_token_pool(h, _MASK)),
    "attention_pool": (lambda h: torch.ops.lmk_ops.attention_pool(h, _MASK, torch.ones(4, dtype=h.dtype))[0],
                       lambda h: lmk_ops.attention_pool(h, _MASK, torch.ones(4, dtype=h.dtype))),
}


@pytest.mark.parametrize("name", _DIRECT)
def test_direct_op_calls_carry_forward_mode_tangents(name):
    # torch.ops.lmk_ops.* reach the dispatcher's autograd kernel, whose Function has the ops' forward-mode rules:
    # torch.library.register_autograd's had none, and a dual tensor's tangent came out as None, silently.
    import torch.autograd.forward_ad as forward_ad
    direct, public = _DIRECT[name]
    h, tangent = _h(), torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = torch.func.jvp(public, (h,), (tangent,))[1]
    assert expected.abs().sum() > 0
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with forward_ad.dual_level(), grad_mode():
            assert torch.equal(forward_ad.unpack_dual(direct(forward_ad.make_dual(h, tangent))).tangent, expected)
    # Under torch.func the rules run where the dispatcher's kernel sits under the transform (attention's, which once
    # nested torch.func transforms there, were refused).
    assert torch.equal(torch.func.jvp(direct, (h,), (tangent,))[1], expected)
    torch.testing.assert_close(torch.func.jacfwd(direct)(h), torch.func.jacfwd(public)(h))
    if name == "attention_pool":  # forward over reverse: the backward op's forward-mode rule, called at that level
        def summed(f):
            return lambda x: f(x).sum()
        torch.testing.assert_close(torch.func.hessian(summed(direct))(h), torch.func.hessian(summed(public))(h))


@pytest.mark.parametrize("name", _DIRECT)
def test_torch_func_reverse_mode_of_direct_op_calls_gives_the_public_functions_bits(name):
    # register_autograd's kernel made torch.func.grad, jacrev and vmap over grad of a direct call fail with
    # PyTorch's "must override the setup_context staticmethod".
    direct, public = _DIRECT[name]
    h, up = _h(), torch.randn(public(_h()).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    def grad(f):
        return torch.func.grad(lambda x: (f(x) * up).sum())

    for transform, x in ((grad, h), (torch.func.jacrev, h), (lambda f: torch.func.vmap(grad(f)), torch.stack([h, -h]))):
        assert torch.equal(transform(direct)(x), transform(public)(x))


@pytest.mark.parametrize("op", FUNCTIONS)
def test_vmap_and_reverse_mode_work(op):
    stacked = torch.stack([_h(), 2 * _h()])
    assert torch.allclose(torch.vmap(FUNCTIONS[op])(stacked)[1], FUNCTIONS[op](2 * _h()))
    h = _h().requires_grad_()
    assert torch.autograd.gradcheck(FUNCTIONS[op], (h,))


_VMAP_QUERY = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4)
# f(hidden [B, L, D], mask [B, L]) for each forward op, padded, with outputs of the same shape for every mask.
_VMAPPED = {
    "mean_pool": lambda h, m: lmk_ops.mean_pool(h, m),
    "mean_pool+normalize": lambda h, m: lmk_ops.mean_pool(h, m, normalize=True),
    "max_pool": lambda h, m: lmk_ops.max_pool(h, m),
    "landmark_mean": lambda h, m: lmk_ops.landmark_mean(h, m),
    "landmark_gather": lambda h, m: lmk_ops.landmark_gather(h, m, num_landmarks=h.shape[1])[0],
    "first_token_pool": lambda h, m: lmk_ops.first_token_pool(h, m),
    "last_token_pool": lambda h, m: lmk_ops.last_token_pool(h, m.long()),
    "attention_pool": lambda h, m: lmk_ops.attention_pool(h, m, _VMAP_QUERY),
    "attention_pool weights": lambda h, m: lmk_ops.attention_pool(h, m, _VMAP_QUERY, return_weights=True)[1],
}


@pytest.mark.parametrize("name", _VMAPPED)
def test_vmap_gives_each_slice_its_own_bits_in_one_call(name):
    """torch.vmap over padded batches folds the vmapped dimension into the texts (_vmap.py): the same bits as each
    slice alone, for any vmapped dimension and either input unvmapped, gradients included, and without PyTorch's
    per-slice fallback (which warns the user to file an issue with PyTorch)."""
    fn = _VMAPPED[name]
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 6, 8, dtype=torch.float64, generator=gen)
    mask = torch.rand(3, 4, 6, generator=gen) > 0.3
    mask[:, :, 0] |= name == "landmark_gather"  # (the gather's validity mask aside, every row has a landmark)
    cases = [((0, 0), (hidden, mask), lambda j: (hidden[j], mask[j])),
             ((2, 1), (hidden.movedim(0, 2), mask.movedim(0, 1)), lambda j: (hidden[j], mask[j])),
             ((0, None), (hidden, mask[0]), lambda j: (hidden[j], mask[0])),
             ((None, 0), (hidden[0], mask), lambda j: (hidden[0], mask[j]))]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule")
        for in_dims, args, slice_args in cases:
            got = torch.vmap(fn, in_dims=in_dims)(*args)
            assert torch.equal(got, torch.stack([fn(*slice_args(j)) for j in range(3)])), in_dims
        h = hidden.clone().requires_grad_()
        upstream = torch.randn(got.shape, dtype=torch.float64, generator=gen)
        (grad,) = torch.autograd.grad(torch.vmap(fn)(h, mask), h, upstream)
    slices = [hidden[j].clone().requires_grad_() for j in range(3)]
    want = torch.autograd.grad(torch.stack([fn(s, mask[j]) for j, s in enumerate(slices)]), slices, upstream)
    assert torch.equal(grad, torch.stack(want))


def test_vmap_over_packed_batches_and_queries_runs_slice_by_slice():
    gen = torch.Generator().manual_seed(6)
    stack, offsets = torch.randn(3, 9, 8, generator=gen), torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    got = torch.vmap(lambda h: lmk_ops.mean_pool(h, cu_seqlens=offsets))(stack)
    assert torch.equal(got, torch.stack([lmk_ops.mean_pool(stack[j], cu_seqlens=offsets) for j in range(3)]))
    queries = torch.randn(3, 8, generator=gen)
    got = torch.vmap(lambda q: lmk_ops.attention_pool(stack, None, q))(queries)
    assert torch.equal(got, torch.stack([lmk_ops.attention_pool(stack, None, q) for q in queries]))
    with pytest.raises(RuntimeError, match=r"lmk_ops.landmark_positions: expected num_landmarks .*torch.vmap"):
        torch.vmap(lambda m: lmk_ops.landmark_positions(m))(torch.ones(3, 2, 4, dtype=torch.bool))


def test_a_bad_value_under_vmap_is_named_in_its_own_slice():
    # The folded call would name row 5 (slice 2, row 1): the error names the row of the mask the function saw.
    marks = torch.zeros(3, 2, 5, dtype=torch.bool)
    marks[2, 1, :3] = True
    with pytest.raises(RuntimeError, match=r"lmk_ops.landmark_positions: expected at most num_landmarks = 2 landmarks "
                                           r"per row, got 3 in row 1 \(in torch.vmap's slice 2\)$"):
        torch.vmap(lambda m: lmk_ops.landmark_positions(m, 2))(marks)
    mask = torch.ones(3, 2, 4, dtype=torch.long)
    mask[1, 0, 3] = 2
    with pytest.raises(RuntimeError, match=r"lmk_ops.mean_pool: expected .*got 2 at \[0, 3\] \(in torch.vmap's "
                                           r"slice 1\)$"):
        torch.vmap(lmk_ops.mean_pool)(torch.randn(3, 2, 4, 8), mask)


# --- modules and helpers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["cls", "last", "attention"])
def test_pooling_normalize_in_float16_gives_zeros_for_a_text_with_no_token(mode):
    hidden = torch.randn(2, 4, 8).half()
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    pooling = lmk_ops.nn.Pooling(mode, normalize=True, **({"dim": 8} if mode == "attention" else {}))
    out = pooling(hidden, {"attention_mask": mask})
    assert out.dtype == torch.float16 and not out.isnan().any()
    assert torch.equal(out[1], torch.zeros(8, dtype=torch.float16))
    assert abs(out[0].float().norm().item() - 1) < 1e-3


def test_landmark_gather_checks_a_bool_mask_against_hidden():
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_gather: expected a landmark mask of shape \[B, L\] = "
                                           r"\[2, 5\], got \[2, 3\]"):
        lmk_ops.landmark_gather(torch.randn(2, 5, 8), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_gather: expected landmarks on the same device"):
        lmk_ops.landmark_gather(torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool, device="meta"))


def test_num_landmarks_makes_positions_and_gather_traceable():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    hidden = torch.randn(2, 5, 8)
    compiled = torch.compile(lambda h, m: lmk_ops.landmark_gather(h, m, num_landmarks=4), fullgraph=True)
    want = lmk_ops.landmark_gather(hidden, mask, num_landmarks=4)
    got = compiled(hidden, mask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    positions = torch.compile(lambda m: lmk_ops.landmark_positions(m, 3), fullgraph=True)(mask)
    assert torch.equal(positions, torch.tensor([[1, 2, 4], [0, -1, -1]]))
    meta = lmk_ops.landmark_positions(mask.to("meta"), 3)
    assert meta.shape == (2, 3) and meta.device.type == "meta"
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_positions: expected num_landmarks where"):
        lmk_ops.landmark_positions(mask.to("meta"))
    with pytest.raises(RuntimeError,
                       match=r"^lmk_ops\.landmark_positions: expected num_landmarks as an int in \[0, 2\*\*63\)"):
        lmk_ops.landmark_positions(mask, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_without_num_landmarks_positions_and_gather_trace_whole_with_an_unbacked_width(dynamic, device):
    """K depends on the mask's values: an unbacked size in the graph, so fullgraph compiles it, padded and packed,
    forward and gradient, and the graph serves masks of other widths."""
    torch._dynamo.reset()  # no compiled code of an earlier test's call may serve this one

    def gather(h, m, offsets=None):
        vectors, valid = lmk_ops.landmark_gather(h, m, cu_seqlens=offsets)
        return vectors * 2, valid

    compiled = torch.compile(gather, fullgraph=True, dynamic=dynamic)
    hidden = torch.randn(2, 5, 8, device=device, requires_grad=True)
    for mask in ([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], [[1] * 5] * 2, [[0] * 5] * 2, [[0, 0, 0, 0, 1], [1, 1, 0, 0, 0]]):
        mask = torch.tensor(mask, dtype=torch.bool, device=device)
        for offsets in (None, torch.tensor([0, 3, 3, 10], dtype=torch.int32, device=device)):
            h, m = (hidden, mask) if offsets is None else (hidden.view(10, 8), mask.view(10))
            got, want = compiled(h, m, offsets), gather(h, m, offsets)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(torch.autograd.grad(got[0].sum(), hidden)[0],
                               torch.autograd.grad(want[0].sum(), hidden)[0])
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool, device=device)
    positions = torch.compile(lambda m: lmk_ops.landmark_positions(m), fullgraph=True, dynamic=dynamic)(mask)
    assert torch.equal(positions.cpu(), torch.tensor([[1, 2, 4], [0, -1, -1]]))
    with pytest.raises(Exception, match=r"lmk_ops\.landmark_positions: expected a bool landmark mask of shape "
                                        r"\[B, L\], got torch\.int64"):
        torch.compile(lambda m: lmk_ops.landmark_positions(m), fullgraph=True)(mask.long())


def test_without_num_landmarks_gather_exports_and_its_width_op_passes_opcheck():
    class Gather(torch.nn.Module):
        def forward(self, h, m):
            return lmk_ops.landmark_gather(h, m)[0]

    hidden, mask = torch.randn(2, 5, 8), torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    exported = torch.export.export(Gather(), (hidden, mask)).module()
    assert torch.equal(exported(hidden, mask), lmk_ops.landmark_gather(hidden, mask)[0])
    op = torch.ops.lmk_ops.fitted_landmark_positions.default
    torch.library.opcheck(op, (mask, None, "landmark_positions"))
    torch.library.opcheck(op, (mask.view(10), torch.tensor([0, 4, 4, 10]), "landmark_gather"))


@pytest.mark.parametrize("call", [lambda m: lmk_ops.landmark_positions(m, 10**12),
                                  lambda m: lmk_ops.landmark_gather(torch.randn(2, 5, 4), m, num_landmarks=2**62),
                                  lambda m: lmk_ops.landmark_positions(m[0], 10**15, cu_seqlens=torch.tensor([0, 5]))])
def test_a_num_landmarks_too_large_to_allocate_is_an_lmk_ops_error(call):
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_(positions|gather): expected num_landmarks whose int64 "
                                           r"positions \[[12], K\] fit in memory, got num_landmarks = [0-9]+ \("):
        call(mask)


@pytest.mark.parametrize("fn", [lmk_ops.first_token_pool, lmk_ops.last_token_pool,
                                lambda h, m: lmk_ops.landmark_gather(h, m.bool(), num_landmarks=2)[0]])
def test_token_pools_and_gather_work_on_meta_and_fake_tensors(fn):
    hidden, mask = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    assert fn(hidden.to("meta"), mask.to("meta")).shape[0] == 2
    with FakeTensorMode() as mode:
        out = fn(mode.from_tensor(hidden), mode.from_tensor(mask))
    assert out.shape[0] == 2


@pytest.mark.parametrize("fn", [lmk_ops.first_token_pool, lmk_ops.last_token_pool])
def test_compiled_token_pools_reject_mask_values_other_than_0_and_1(fn):
    hidden, mask = torch.randn(2, 5, 8), torch.tensor([[1, 2, 1, 0, 0], [0, 1, 1, 1, 1]])
    for run in (fn, torch.compile(fn, fullgraph=True)):
        with pytest.raises(Exception, match=r"lmk_ops\.\w+_token_pool: expected mask values 0 or 1, got 2 at \[0, 1\]"):
            run(hidden, mask)
        # Packed, the [T] mask's own index.
        with pytest.raises(Exception, match=r"lmk_ops\.\w+_token_pool: expected mask values 0 or 1, got 2 at \[1\]"):
            run(hidden.view(10, 8), mask.view(10), cu_seqlens=torch.tensor([0, 5, 10]), max_seqlen=5)


def test_valid_mask_op_passes_opcheck():
    for mask in (torch.tensor([[1, 0, 1], [0, 0, 1]]), torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.uint8),
                 torch.tensor([1, 0, 1, 1])):
        torch.library.opcheck(torch.ops.lmk_ops.valid_mask.default, (mask, "first_token_pool"))


def test_attention_scale_must_be_a_number_finite_in_float32():
    hidden, query = torch.randn(2, 3, 4), torch.randn(4)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool: expected scale as a Python number, got a "
                                           r"tensor"):
        lmk_ops.attention_pool(hidden, None, query, scale=torch.tensor(0.5, requires_grad=True))
    for scale in (1e39, -1e39, math.inf):
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool: expected a scale finite in float32"):
            lmk_ops.attention_pool(hidden, None, query, scale=scale)
        with pytest.raises(Exception, match=r"lmk_ops\.attention_pool: expected a scale finite in float32"):
            torch.compile(lambda h: lmk_ops.attention_pool(h, None, query, scale=scale), fullgraph=True)(hidden)


def test_empty_sequences():
    batch = lmk_ops.insert_landmarks(torch.zeros(2, 0, dtype=torch.long), landmark_id=9)
    assert batch.input_ids.shape == (2, 0) and batch.landmark_mask.shape == (2, 0)
    ref_ids, _, ref_landmarks = reference.insert_landmarks(torch.zeros(2, 0, dtype=torch.long), landmark_id=9)
    assert torch.equal(ref_ids, batch.input_ids) and torch.equal(ref_landmarks, batch.landmark_mask)
    out = reference.landmark_mean(torch.randn(2, 0, 4), torch.full((2, 3), -1))
    assert torch.equal(out, torch.zeros(2, 4))
    assert torch.equal(lmk_ops.landmark_mean(torch.randn(2, 0, 4), torch.full((2, 3), -1)), out)
    # Every pooling op and its reference on texts of length 0: zeros (max: positions -1).
    hidden, zeros = torch.randn(2, 0, 4), torch.zeros(2, 4)
    for op in ("mean_pool", "max_pool", "first_token_pool", "last_token_pool"):
        for mask in (None, torch.zeros(2, 0, dtype=torch.bool)):
            assert torch.equal(getattr(lmk_ops, op)(hidden, mask), zeros), op
            assert torch.equal(getattr(reference, op)(hidden, mask), zeros), op
    minus_one = torch.full((2, 4), -1, dtype=torch.int32)
    assert torch.equal(reference.max_pool(hidden, return_indices=True)[1], minus_one)
    assert torch.equal(lmk_ops.max_pool(hidden, return_indices=True)[1], minus_one)
    # Differentiable like any other result, in lmk_ops and in the reference alike: the gradient is hidden's empty one.
    offsets = torch.zeros(3, dtype=torch.int32)
    calls = {op: lambda m, h, op=op, **kw: getattr(m, op)(h, **kw) for op in
             ("mean_pool", "max_pool", "first_token_pool", "last_token_pool")}
    calls["landmark_mean"] = lambda m, h, **kw: m.landmark_mean(h, torch.full((2, 3), -1), **kw)
    calls["landmark_gather"] = lambda m, h, **kw: m.landmark_gather(h, torch.full((2, 3), -1), **kw)[0]
    calls["attention_pool"] = lambda m, h, **kw: m.attention_pool(h, None, torch.randn(4), **kw)
    for name, call in calls.items():
        for module in (lmk_ops, reference):
            for leaf, packed in ((torch.randn(2, 0, 4, requires_grad=True), {}),
                                 (torch.randn(0, 4, requires_grad=True), {"cu_seqlens": offsets})):
                out = call(module, leaf, **packed)
                (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
                assert grad.shape == leaf.shape and torch.equal(out, torch.zeros_like(out)), (name, module, packed)


def test_insert_landmarks_takes_integer_intervals_only():
    ids = torch.tensor([[101, 5, 6, 7, 102]])
    with pytest.raises(ValueError, match=r"^lmk_ops\.insert_landmarks: expected per-row intervals as an integer "
                                         r"tensor, got torch\.float32"):
        lmk_ops.insert_landmarks(ids, landmark_id=9, interval=torch.tensor([1.5]))
    with pytest.raises(ValueError, match=r"^lmk_ops\.insert_landmarks: expected interval as an int in \[1, 2\*\*63\)"):
        lmk_ops.insert_landmarks(ids, landmark_id=9, interval=2.5)
    with pytest.raises(ValueError, match=r"^lmk_ops\.sample_intervals: expected a non-empty list of integer "
                                         r"intervals in \[1, 2\*\*63\), got \[1\.5, 2\.7\]"):
        lmk_ops.sample_intervals(2, (1.5, 2.7))


def test_an_all_padding_row_stays_empty_and_pools_to_zeros():
    ids = torch.tensor([[101, 5, 6, 102], [0, 0, 0, 0]])
    batch = lmk_ops.insert_landmarks(ids, (ids != 0).long(), landmark_id=102, interval=1)
    assert batch.attention_mask[1].sum() == 0 and not batch.landmark_mask[1].any()
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1] and batch.landmark_mask[0].sum() == 2
    hidden = torch.randn(2, batch.input_ids.shape[1], 8)
    assert torch.equal(lmk_ops.landmark_mean(hidden, batch.landmark_mask)[1], torch.zeros(8))
    # With truncation too: the padding row gets no landmark from "the last kept position becomes one".
    cut = lmk_ops.insert_landmarks(ids, (ids != 0).long(), landmark_id=102, interval=8, max_length=2)
    assert not cut.landmark_mask[1].any() and cut.attention_mask[1].sum() == 0


# (call, expected message after "lmk_ops.<name>: ")
UNCLEAR = [
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=-1),
     r"insert_landmarks: expected landmark_id as a token id \(an int in \[0, 2\*\*63\)\), got -1"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, pad_id=-100),
     r"insert_landmarks: expected pad_id as a token id \(an int in \[0, 2\*\*63\)\), got -100"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, max_length=4.0),
     r"insert_landmarks: expected max_length as an int in \[1, 2\*\*63\) or None, got 4\.0"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, num_leading=1.0),
     r"insert_landmarks: expected num_leading as an int in \[0, 2\*\*63\), got 1\.0"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]], dtype=torch.uint8), landmark_id=30522),
     r"insert_landmarks: expected landmark_id representable in input_ids' dtype torch\.uint8 \(\[0, 255\]\), got "
     r"30522"),
    (lambda: lmk_ops.mean_pool(None), r"mean_pool: expected hidden to be a tensor \[B, L, D\], got None"),
    (lambda: lmk_ops.max_pool(torch.randn(2, 3, 4).to_sparse()),
     r"max_pool: expected hidden as a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    (lambda: lmk_ops.mean_pool(torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])),
     r"mean_pool: expected hidden as a dense \[B, L, D\] tensor, got a nested tensor"),
    (lambda: lmk_ops.mean_pool(torch.quantize_per_tensor(torch.randn(2, 3, 4), 0.1, 0, torch.qint8)),
     r"mean_pool: expected hidden of dtype float16, bfloat16, float32 or float64, got a quantized tensor"),
    (lambda: lmk_ops.landmark_positions(torch.ones(2, 3, dtype=torch.bool), -1),
     r"landmark_positions: expected num_landmarks as an int in \[0, 2\*\*63\) \(or None\), got -1"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9).to(torch.float16),
     r"LandmarkBatch\.to: expected a device, got the dtype torch\.float16"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9).packed().to("nonsense"),
     r"PackedLandmarkBatch\.to: expected a device \(a torch\.device, or a string such as 'cuda:0'\), got 'nonsense'"),
    # Tensor arguments other than hidden, and the scale, are checked before the dispatcher's own message.
    (lambda: lmk_ops.mean_pool(torch.randn(2, 3, 4), [[1, 1, 0], [1, 0, 0]]),
     r"mean_pool: expected mask to be a tensor or None, got list"),
    (lambda: lmk_ops.max_pool(torch.randn(5, 4), cu_seqlens=[0, 2, 5]),
     r"max_pool: expected cu_seqlens to be a tensor or None, got list"),
    (lambda: lmk_ops.mean_pool(torch.randn(5, 4), cu_seqlens=torch.tensor([0, 2, 5]), max_seqlen=3.0),
     r"mean_pool: expected max_seqlen as an int in \[0, 2\*\*63\) \(or None\), got 3\.0"),
    (lambda: lmk_ops.landmark_gather(torch.randn(5, 4), torch.tensor([[0], [1]]), cu_seqlens=torch.tensor([0, 2, 5]),
                                     max_seqlen=torch.tensor(3)),
     r"landmark_gather: expected max_seqlen as an int in \[0, 2\*\*63\) \(or None\), got tensor\(3\)"),
    (lambda: lmk_ops.attention_pool(torch.randn(2, 3, 4), None, None),
     r"attention_pool: expected query to be a tensor, got None"),
    (lambda: lmk_ops.attention_pool(torch.randn(2, 3, 4), None, torch.randn(4), scale="0.5"),
     r"attention_pool: expected scale as a real number or None, got str"),
    (lambda: lmk_ops.landmark_mean(torch.randn(2, 3, 4), None),
     r"landmark_mean: expected landmarks to be a tensor, got None"),
    (lambda: lmk_ops.landmark_gather(torch.randn(2, 3, 4), [[0, 2], [1, -1]]),
     r"landmark_gather: expected landmarks to be a tensor, got list"),
    (lambda: lmk_ops.first_token_pool(torch.randn(2, 3, 4), (1, 1, 0)),
     r"first_token_pool: expected mask to be a tensor or None, got tuple"),
    (lambda: lmk_ops.insert_landmarks([[101, 5, 102]], landmark_id=9),
     r"insert_landmarks: expected input_ids as an integer tensor \[B, L\], got list"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[101, 5, 102]], device="meta"), landmark_id=9),
     r"insert_landmarks: expected input_ids with values \(on the CPU or a GPU\), got a meta tensor"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[101, 5, 6, 102]]), landmark_id=9,
                                      sentence_ends=torch.tensor([[0, 3, 0, 0]])),
     r"insert_landmarks: expected sentence_ends values 0 or 1"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[101, 5, 6, 102]]), landmark_id=9,
                                      sentence_ends=torch.tensor([[0.0, 1.0, 0.0, 0.0]])),
     r"insert_landmarks: expected sentence_ends as a bool or integer 0/1 tensor, got torch\.float32"),
    (lambda: lmk_ops.nn.AttentionPooling(384.0, heads=6),
     r"nn\.AttentionPooling: expected ints heads >= 1 dividing dim >= 1, got dim=384\.0, heads=6"),
    (lambda: lmk_ops.nn.AttentionPooling(384, heads=6, scale=torch.tensor(0.1)),
     r"nn\.AttentionPooling: expected scale as a Python number, got a tensor"),
    # Yes/no arguments: a string or None was the dispatcher's message, or taken for its truth value.
    (lambda: lmk_ops.mean_pool(torch.randn(2, 3, 4), normalize="yes"),
     r"mean_pool: expected normalize as a bool, got 'yes'"),
    (lambda: lmk_ops.max_pool(torch.randn(2, 3, 4), return_indices=None),
     r"max_pool: expected return_indices as a bool, got None"),
    (lambda: lmk_ops.landmark_mean(torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), normalize=2),
     r"landmark_mean: expected normalize as a bool, got 2"),
    (lambda: lmk_ops.attention_pool(torch.randn(2, 3, 4), None, torch.randn(4), return_weights="no"),
     r"attention_pool: expected return_weights as a bool, got 'no'"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[101, 5, 102]]), landmark_id=9, keep_trailing="no"),
     r"insert_landmarks: expected keep_trailing as a bool, got 'no'"),
    # nn.Pooling('weightedmean') is plain PyTorch: it computed with an integer hidden, a float mask or a mask value
    # of 2, and failed inside torch.bmm on a wrong shape.
    (lambda: lmk_ops.nn.Pooling("weightedmean")(torch.ones(2, 3, 4, dtype=torch.long)),
     r"nn\.Pooling\('weightedmean'\): expected hidden of dtype float16, bfloat16, float32 or float64, got Long"),
    (lambda: lmk_ops.nn.Pooling("weightedmean")(torch.randn(3, 4), attention_mask=torch.ones(3, dtype=torch.bool)),
     r"nn\.Pooling\('weightedmean'\): expected hidden of shape \[B, L, D\] \(3-D\), got a 2-D tensor"),
    (lambda: lmk_ops.nn.Pooling("weightedmean")(torch.randn(2, 3, 4), attention_mask=torch.ones(2, 3)),
     r"nn\.Pooling\('weightedmean'\): expected mask of dtype bool or an integer dtype holding 0/1, got Float"),
    (lambda: lmk_ops.nn.Pooling("weightedmean")(torch.randn(2, 3, 4), attention_mask=torch.tensor([[1, 2, 0]] * 2)),
     r"nn\.Pooling\('weightedmean'\): expected mask values 0 or 1, got 2 at \[0, 1\]"),
    (lambda: lmk_ops.nn.Pooling("weightedmean")(torch.randn(2, 3, 4),
                                                attention_mask=torch.ones(2, 4, dtype=torch.bool)),
     r"nn\.Pooling\('weightedmean'\): expected mask of shape \[B, L\] = \[2, 3\], got \[2, 4\]"),
    # normalize="no" normalised the modes nn.Pooling normalises itself (cls, last, attention, weightedmean, ...);
    # heads were taken and ignored outside attention.
    (lambda: lmk_ops.nn.Pooling("cls", normalize="no"), r"nn\.Pooling: expected normalize as a bool, got 'no'"),
    (lambda: lmk_ops.nn.Pooling("mean", heads=4),
     r"nn\.Pooling: expected dim \(the token states' width\) and heads for mode='attention' and for no other mode"),
    # "no" was taken for True (packed); the flag is checked before the tokenizer is used.
    (lambda: lmk_ops.hf.tokenize_with_landmarks(None, "a text", packed="no"),
     r"hf\.tokenize_with_landmarks: expected packed as a bool, got 'no'"),
    # Integers past int64 went on to the dispatcher or to tensor constructors and came back as their messages
    # ("Expected a value of type 'Optional[int]'", "value cannot be converted to type int64_t", "Overflow when
    # unpacking long long").
    (lambda: lmk_ops.mean_pool(torch.randn(5, 4), cu_seqlens=torch.tensor([0, 2, 5]), max_seqlen=2**63),
     r"mean_pool: expected max_seqlen as an int in \[0, 2\*\*63\) \(or None\), got 9223372036854775808"),
    (lambda: lmk_ops.attention_pool(torch.randn(5, 4), None, torch.randn(4), cu_seqlens=torch.tensor([0, 2, 5]),
                                    max_seqlen=2**64),
     r"attention_pool: expected max_seqlen as an int in \[0, 2\*\*63\) \(or None\), got 18446744073709551616"),
    (lambda: lmk_ops.landmark_positions(torch.ones(2, 3, dtype=torch.bool), 2**63),
     r"landmark_positions: expected num_landmarks as an int in \[0, 2\*\*63\) \(or None\), got 9223372036854775808"),
    (lambda: lmk_ops.landmark_gather(torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), num_landmarks=2**64),
     r"landmark_gather: expected num_landmarks as an int in \[0, 2\*\*63\) \(or None\), got 18446744073709551616"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, interval=2**63),
     r"insert_landmarks: expected interval as an int in \[1, 2\*\*63\), or a \[B\] integer tensor per row, got "
     r"9223372036854775808"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, num_trailing=2**63),
     r"insert_landmarks: expected num_trailing as an int in \[0, 2\*\*63\), got 9223372036854775808"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=9, max_length=2**64),
     r"insert_landmarks: expected max_length as an int in \[1, 2\*\*63\) or None, got 18446744073709551616"),
    (lambda: lmk_ops.insert_landmarks(torch.tensor([[1, 2, 3]]), landmark_id=2**63),
     r"insert_landmarks: expected landmark_id as a token id \(an int in \[0, 2\*\*63\)\), got 9223372036854775808"),
    (lambda: lmk_ops.landmark_positions(torch.ones(10, dtype=torch.bool),
                                        cu_seqlens=torch.tensor([0, 10], device="meta")),
     r"landmark_positions: expected cu_seqlens on the same device as the landmark mask \(cpu\), got meta"),
    (lambda: lmk_ops.landmark_positions(torch.ones(10, dtype=torch.bool), cu_seqlens=[0, 10]),
     r"landmark_positions: expected cu_seqlens to be a tensor or None, got list"),
    (lambda: lmk_ops.hf.landmark_token_id(None, 102),
     r"hf: expected landmark_token as a token string \(or None: the SEP or EOS token\), got 102"),
    (lambda: lmk_ops.hf.add_landmark_token(None, 5),
     r"hf\.add_landmark_token: expected the token as a non-empty string, got 5"),
    (lambda: lmk_ops.sample_intervals(2**63),
     r"sample_intervals: expected batch as an int in \[0, 2\*\*63\), got 9223372036854775808"),
]
if torch.backends.mkldnn.is_available():
    UNCLEAR.append((lambda: lmk_ops.mean_pool(torch.randn(2, 3, 4).to_mkldnn()),
                    r"mean_pool: expected hidden as a dense \(strided\) tensor, got layout torch\._mkldnn"))


@pytest.mark.parametrize("call,message", UNCLEAR, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(UNCLEAR)])
def test_clear_errors_for_inputs_that_used_to_fail_unclearly(call, message):
    """The pooling functions check these only once the op has failed (a small call is a third faster for it), so
    the error must also stand alone: not chained to the dispatcher's unclear one."""
    with pytest.raises((RuntimeError, ValueError, TypeError), match=rf"^lmk_ops\.{message}") as raised:
        call()
    assert raised.value.__context__ is None or raised.value.__suppress_context__


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16])
def test_masks_of_every_integer_dtype(dtype):
    hidden = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]]).to(dtype)
    want = reference.mean_pool(hidden, mask.long())
    torch.testing.assert_close(lmk_ops.mean_pool(hidden, mask), want)
    torch.testing.assert_close(lmk_ops.first_token_pool(hidden, mask), hidden[[0, 1], [0, 1]])
    bad = mask.clone()
    bad[1, 2] = 2
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.mean_pool: expected mask values 0 or 1, got 2 at \[1, 2\]"):
        lmk_ops.mean_pool(hidden, bad)


def test_landmark_batch_moves_between_devices():
    batch = lmk_ops.insert_landmarks(torch.tensor([[101, 5, 6, 102]]), landmark_id=102, interval=1)
    moved = batch.to("meta")
    assert all(getattr(moved, k).device.type == "meta" and getattr(moved, k).dtype == getattr(batch, k).dtype
               for k in batch.keys())


# --- strides, aliasing, padding values, threads, size -------------------------------------------------------------

def test_padding_full_of_nan_and_inf_does_not_leak():
    hidden = torch.randn(2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    poisoned = hidden.clone()
    poisoned[0, 3:] = float("nan")
    poisoned[1, :2] = float("inf")
    query = torch.randn(8)
    for fn in (lambda h: lmk_ops.mean_pool(h, mask), lambda h: lmk_ops.max_pool(h, mask),
               lambda h: lmk_ops.landmark_mean(h, mask), lambda h: lmk_ops.attention_pool(h, mask, query),
               lambda h: lmk_ops.first_token_pool(h, mask), lambda h: lmk_ops.last_token_pool(h, mask)):
        assert torch.equal(fn(poisoned), fn(hidden))
        h = poisoned.clone().requires_grad_()
        (grad,) = torch.autograd.grad(fn(h).sum(), h)
        assert grad.isfinite().all() and not grad[~mask].any()


def test_strided_and_aliased_inputs_are_read_right_and_left_untouched():
    base = torch.randn(3, 20, 16)
    hidden = base[:, ::2, 1::2]  # strides in every dimension
    mask = (base[:, ::2, 0] > -0.5)  # a view of the same storage as hidden
    snapshot = (base.clone(), mask.clone())
    dense = hidden.contiguous()
    for ours, ref in ((lmk_ops.mean_pool, reference.mean_pool), (lmk_ops.max_pool, reference.max_pool)):
        torch.testing.assert_close(ours(hidden, mask), ref(dense, mask))
    h = hidden.clone().requires_grad_()
    lmk_ops.attention_pool(h, mask, torch.ones(8)).sum().backward()
    assert torch.equal(base, snapshot[0]) and torch.equal(mask, snapshot[1])


_OUTPUT_CASES = {
    "mean_pool": lambda h, m: lmk_ops.mean_pool(h, m),
    "mean_pool normalize": lambda h, m: lmk_ops.mean_pool(h, m, normalize=True),
    "max_pool": lambda h, m: lmk_ops.max_pool(h, m),
    "landmark_mean": lambda h, m: lmk_ops.landmark_mean(h, m),
    "landmark_gather": lambda h, m: lmk_ops.landmark_gather(h, m)[0],
    "first_token_pool": lambda h, m: lmk_ops.first_token_pool(h, m),
    "last_token_pool": lambda h, m: lmk_ops.last_token_pool(h, m),
    "first_token_pool packed": lambda h, m: lmk_ops.first_token_pool(
        h.flatten(0, 1), m.flatten(), cu_seqlens=torch.tensor([0, 5, 10])),
    "attention weights": lambda h, m: lmk_ops.attention_pool(h, m, torch.ones(4, 2), return_weights=True)[1],
    "attention_pool": lambda h, m: lmk_ops.attention_pool(h, m, torch.linspace(-1, 1, 8)),
    "attention_pool packed, 4 heads": lambda h, m: lmk_ops.attention_pool(
        h.flatten(0, 1), m.flatten(), torch.linspace(-1, 1, 8).reshape(4, 2), cu_seqlens=torch.tensor([0, 5, 10])),
}


@pytest.mark.parametrize("case", _OUTPUT_CASES)
def test_outputs_can_be_changed_in_place_under_autograd(case):
    """emb /= emb.norm(...) on a pooled embedding: each op's output is a tensor of its own (a view made inside an op
    cannot be changed in place under autograd; first/last_token_pool's was one), not saved for the backward as
    returned (attention_pool's was), and the gradient is what the same change out of place gives."""
    fn = _OUTPUT_CASES[case]
    base = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)

    def grad(in_place: bool):
        h = base.clone().requires_grad_()
        out = fn(h * 1, mask)
        out = out.mul_(2) if in_place else out * 2
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return h.grad

    torch.testing.assert_close(grad(True), grad(False), rtol=0, atol=0)


def test_many_python_threads_get_the_same_bits():
    hidden = torch.randn(4, 3000, 64)
    mask = torch.rand(4, 3000) < 0.7
    want = lmk_ops.mean_pool(hidden, mask), lmk_ops.max_pool(hidden, mask)
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append((lmk_ops.mean_pool(hidden, mask), lmk_ops.max_pool(hidden, mask)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert all(torch.equal(m, want[0]) and torch.equal(x, want[1]) for m, x in results)


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@pytest.mark.skipif(_memory_gib() < 16, reason="needs 16 GiB of memory")
def test_more_than_2_to_the_31_elements():
    seq_len = 2**31 // 1024 + 7
    hidden = torch.empty(1, seq_len, 1024, dtype=torch.bfloat16)
    hidden.fill_(1.0)
    hidden[0, -1] = 3.0  # past element 2^31: read with 64-bit offsets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mean = lmk_ops.mean_pool(hidden)
        values, where = lmk_ops.max_pool(hidden, return_indices=True)
    expected = (seq_len - 1 + 3.0) / seq_len
    assert torch.equal(mean, torch.full((1, 1024), expected).to(torch.bfloat16))
    assert torch.equal(values, torch.full((1, 1024), 3.0, dtype=torch.bfloat16))
    assert (where == seq_len - 1).all()
    # Packed, the last text's five rows start past element 2^31; attention with a zero query is the mean.
    rows = hidden.view(seq_len, 1024)
    offsets = torch.tensor([0, seq_len - 5, seq_len])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tail_mean = lmk_ops.mean_pool(rows, cu_seqlens=offsets)[1]
        assert torch.equal(tail_mean, torch.full((1024,), 7 / 5).to(torch.bfloat16))
        assert (lmk_ops.max_pool(rows, cu_seqlens=offsets, return_indices=True)[1][1] == 4).all()
        assert (lmk_ops.last_token_pool(rows, cu_seqlens=offsets)[1] == 3).all()
        query = torch.zeros(16, 64, dtype=torch.bfloat16)
        assert torch.equal(lmk_ops.attention_pool(rows, None, query, cu_seqlens=offsets)[1], tail_mean)
        # The max's gradient is written past element 2^31 too.
        h = hidden.requires_grad_()
        (grad,) = torch.autograd.grad(lmk_ops.max_pool(h).sum(), h)
    assert (grad[0, -1] == 1).all() and not grad[0, :-1].any()


_SKEWED_BATCH = """
lengths = [1] * 4000 + [65536]  # many short texts and one long one (CPU chunks of 512 rows, CUDA of 128)
hidden = torch.randn(sum(lengths), 256, generator=torch.Generator().manual_seed(0)).to(device)
offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
query = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
valid = torch.ones(len(hidden), dtype=torch.bool, device=device)
valid[4000:4100] = False  # a prompt, excluded
landmarks = torch.zeros(len(hidden), dtype=torch.bool, device=device)
landmarks[:4000] = True
landmarks[4031::32] = True
long_text, long_valid, long_landmarks = hidden[4000:][None], valid[4000:][None], landmarks[4000:][None]

def pool_all(measure):
    h = hidden.detach().requires_grad_()
    with measure():
        mean, top = lmk_ops.mean_pool(h, cu_seqlens=offsets), lmk_ops.max_pool(h, cu_seqlens=offsets)
        masked = lmk_ops.mean_pool(h, valid, cu_seqlens=offsets)
        landmark = lmk_ops.landmark_mean(h, landmarks, cu_seqlens=offsets)
        attended = lmk_ops.attention_pool(h, valid, query, cu_seqlens=offsets)
        (grad,) = torch.autograd.grad(attended.sum(), h)
        weighted = lmk_ops.nn.Pooling("weightedmean")(h, cu_seqlens=offsets)
    # The short texts pool to their one row, the long one as it does alone.
    assert torch.equal(weighted[4000], lmk_ops.nn.Pooling("weightedmean")(long_text)[0])
    for pooled in (mean, top, masked, landmark, attended, weighted):
        assert torch.equal(pooled[:4000], hidden[:4000])
    assert torch.equal(mean[4000], lmk_ops.mean_pool(long_text)[0])
    assert torch.equal(top[4000], lmk_ops.max_pool(long_text)[0])
    assert torch.equal(masked[4000], lmk_ops.mean_pool(long_text, long_valid)[0])
    assert torch.equal(landmark[4000], lmk_ops.landmark_mean(long_text, long_landmarks)[0])
    assert torch.equal(attended[4000], lmk_ops.attention_pool(long_text, long_valid, query)[0])
    assert grad.isfinite().all()
"""


@pytest.mark.parametrize("device", DEVICES)
def test_a_packed_batch_of_short_texts_and_a_long_one_pools_in_memory_of_its_size(device):
    """The chunks' partial results and the lists of selected rows take room for what there is. Laid out per text
    for the longest text, 4000 one-token texts beside one of 65536 tokens (D 256, 70 MB) took 1 GB for the mean and
    2 GB for attention's backward on CPU, and listing a mask's rows 2 GB more (on CUDA, whose chunks are shorter,
    4 GB and more); nn.Pooling('weightedmean') copied the batch into the padded layout (4001 x 65536 x 256). The
    bound here is the input's size three times over (the gradient is one)."""
    input_bytes = (4000 + 65536) * 256 * 4
    if device == "cuda":
        scope = {"torch": torch, "lmk_ops": lmk_ops, "device": device}
        exec(_SKEWED_BATCH, scope)  # noqa: S102 - the same body as the CPU process below

        @contextlib.contextmanager
        def peak_on_cuda():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            yield
            torch.cuda.synchronize()
            assert torch.cuda.max_memory_allocated() - start < 3 * input_bytes

        scope["pool_all"](peak_on_cuda)
        return
    if not sys.platform.startswith("linux"):
        pytest.skip("peak memory read from getrusage (Linux)")
    # The CPU's peak resident memory, in a process of its own, so that nothing before in this one counts.
    script = ("import contextlib, resource, torch, lmk_ops\ndevice = 'cpu'\n" + _SKEWED_BATCH + f"""
@contextlib.contextmanager
def peak_resident():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    assert grown < 3 * {input_bytes}, grown

pool_all(peak_resident)
""")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("offsets", [[0, 4, 12], [0, 6, 4], [0, 4, 9], [0, -3, 10]])
@pytest.mark.parametrize("name", ["mean_pool_backward", "max_pool_backward", "landmark_mean_backward",
                                  "landmark_gather_backward", "attention_pool_backward"])
def test_backward_ops_called_with_offsets_that_do_not_cover_the_rows_raise(name, offsets):
    """A direct call of a backward op may pass offsets whose texts do not cover the T rows. A negative text length
    once corrupted the heap (torch's repeat_interleave given output_size writes out of bounds for a negative
    repeat), and CUDA's backward kernels, which take each text's rows from the offsets, trusted them; now every
    packed backward op checks them as the forwards do (on CUDA on the device, without synchronising)."""
    tokens, dim = 10, 8
    hidden, query, grad = torch.randn(tokens, dim), torch.randn(dim), torch.randn(2, dim)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, stats, _ = torch.ops.lmk_ops.attention_pool(hidden, None, query, None, False, good, None)
    bad = torch.tensor(offsets, dtype=torch.int32)
    calls = {
        "mean_pool_backward": lambda: torch.ops.lmk_ops.mean_pool_backward(grad, None, tokens, None, bad),
        "max_pool_backward": lambda: torch.ops.lmk_ops.max_pool_backward(
            grad, torch.zeros(2, dim, dtype=torch.int32), tokens, bad),
        "landmark_mean_backward": lambda: torch.ops.lmk_ops.landmark_mean_backward(
            grad, torch.tensor([[1, 3], [0, 2]]), tokens, None, bad),
        "landmark_gather_backward": lambda: torch.ops.lmk_ops.landmark_gather_backward(
            grad.view(2, 1, dim), torch.tensor([[1], [0]]), tokens, bad),
        "attention_pool_backward": lambda: torch.ops.lmk_ops.attention_pool_backward(
            grad, None, hidden, None, query, out, stats, None, bad, None),
    }
    # T is the backward op's seq_len argument, or hidden's rows where it takes hidden (attention).
    rows = "hidden's rows" if name == "attention_pool_backward" else "seq_len"
    message = rf"^lmk_ops\.{name}: expected (cu_seqlens\[-1\] = T = 10 \({rows}\)|non-decreasing cu_seqlens)"
    with pytest.raises(RuntimeError, match=message):
        calls[name]()
