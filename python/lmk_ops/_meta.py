"""Fake (meta) kernels: output shapes and dtypes for torch.compile and FakeTensor, for every op."""

from __future__ import annotations

import torch

from ._checks import accumulation_dtype, check_float_tensor, check_grad, check_grad_dtype, check_hidden
from ._checks import check_landmarks, check_mask, check_pooled_grad, check_positions, check_query, check_scale
from ._checks import dtype_name, fail


def _unnormalized(hidden, normalize: bool):
    """The second output: [B, D] in the accumulation type with normalize, else empty."""
    shape = (hidden.shape[0], hidden.shape[2]) if normalize else (0,)
    return hidden.new_empty(shape, dtype=accumulation_dtype(hidden.dtype))


def _pooled(hidden):
    return hidden.new_empty((hidden.shape[0], hidden.shape[2]))


def _unpooled(grad_out, seq_len, dtype=None):
    return grad_out.new_empty((grad_out.shape[0], seq_len, grad_out.shape[-1]), dtype=dtype or grad_out.dtype)


@torch.library.register_fake("lmk_ops::mean_pool")
def _mean_pool_fake(hidden, mask=None, normalize=False):
    check_hidden("mean_pool", hidden)
    check_mask("mean_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::mean_pool_backward")
def _mean_pool_backward_fake(grad_out, mask, seq_len, dtype=None):
    check_pooled_grad("mean_pool_backward", grad_out)
    check_grad_dtype("mean_pool_backward", dtype)
    check_mask("mean_pool_backward", mask, grad_out.shape[0], seq_len, grad_out)
    return _unpooled(grad_out, seq_len, dtype)


@torch.library.register_fake("lmk_ops::max_pool")
def _max_pool_fake(hidden, mask=None, normalize=False):
    check_hidden("max_pool", hidden)
    check_mask("max_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _pooled(hidden).to(torch.int32), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::max_pool_backward")
def _max_pool_backward_fake(grad_out, argmax, seq_len):
    check_pooled_grad("max_pool_backward", grad_out)
    if argmax.dtype != torch.int32 or argmax.shape != grad_out.shape:
        fail("max_pool_backward", f"expected argmax of dtype int32 and shape {list(grad_out.shape)} "
             f"(as max_pool returns), got {dtype_name(argmax.dtype)} of shape {list(argmax.shape)}")
    return _unpooled(grad_out, seq_len)


@torch.library.register_fake("lmk_ops::landmark_mean")
def _landmark_mean_fake(hidden, landmarks, normalize=False):
    check_hidden("landmark_mean", hidden)
    check_landmarks("landmark_mean", landmarks, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::landmark_mean_backward")
def _landmark_mean_backward_fake(grad_out, landmarks, seq_len, dtype=None):
    check_pooled_grad("landmark_mean_backward", grad_out)
    check_grad_dtype("landmark_mean_backward", dtype)
    check_landmarks("landmark_mean_backward", landmarks, grad_out.shape[0], seq_len, grad_out)
    return _unpooled(grad_out, seq_len, dtype)


@torch.library.register_fake("lmk_ops::landmark_gather")
def _landmark_gather_fake(hidden, positions):
    check_hidden("landmark_gather", hidden)
    check_positions("landmark_gather", positions, hidden.shape[0], hidden)
    return hidden.new_empty((hidden.shape[0], positions.shape[1], hidden.shape[2]))


@torch.library.register_fake("lmk_ops::landmark_gather_backward")
def _landmark_gather_backward_fake(grad_out, positions, seq_len):
    check_grad("landmark_gather_backward", grad_out, 3, "[B, K, D]")
    check_positions("landmark_gather_backward", positions, grad_out.shape[0], grad_out)
    if positions.shape[1] != grad_out.shape[1]:
        fail("landmark_gather_backward", f"expected grad_out of shape [B, K, D] with K = {positions.shape[1]} "
             f"(as positions), got [{', '.join(str(s) for s in grad_out.shape)}]")
    return _unpooled(grad_out, seq_len)


@torch.library.register_fake("lmk_ops::valid_mask")
def _valid_mask_fake(mask, op):
    if mask.dim() != 2:
        fail(op, f"expected mask of shape [B, L], got [{', '.join(str(s) for s in mask.shape)}]")
    check_mask(op, mask, mask.shape[0], mask.shape[1], mask)
    return mask.new_empty(mask.shape, dtype=torch.bool)


@torch.library.register_fake("lmk_ops::attention_pool")
def _attention_pool_fake(hidden, mask, query, scale=None, return_weights=False):
    check_hidden("attention_pool", hidden)
    heads, _ = check_query("attention_pool", query, hidden)
    check_scale("attention_pool", scale)
    check_mask("attention_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    batch, seq_len = hidden.shape[0], hidden.shape[1]
    weights = hidden.new_empty((batch, heads, seq_len) if return_weights else (0,),
                               dtype=accumulation_dtype(hidden.dtype))
    return _pooled(hidden), hidden.new_empty((batch, heads, 2), dtype=torch.float64), weights


@torch.library.register_fake("lmk_ops::attention_pool_backward")
def _attention_pool_backward_fake(grad_out, grad_weights, hidden, mask, query, out, stats, scale=None):
    op = "attention_pool_backward"
    check_hidden(op, hidden)
    heads, _ = check_query(op, query, hidden)
    check_scale(op, scale)
    batch, seq_len, dim = hidden.shape
    check_float_tensor(op, "grad_out", grad_out, (batch, dim), hidden)
    check_float_tensor(op, "out", out, (batch, dim), hidden)
    check_float_tensor(op, "stats", stats, (batch, heads, 2), hidden)
    if grad_weights is not None:
        check_float_tensor(op, "grad_weights", grad_weights, (batch, heads, seq_len), hidden)
    check_mask(op, mask, batch, seq_len, hidden)
    return hidden.new_empty(hidden.shape), query.new_empty(query.shape)
