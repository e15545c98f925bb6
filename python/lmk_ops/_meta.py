"""Fake (meta) kernels: output shapes and dtypes for torch.compile and FakeTensor, for every op."""

from __future__ import annotations

import torch

from ._checks import accumulation_dtype, check_float_tensor, check_grad, check_grad_dtype, check_hidden
from ._checks import check_landmarks, check_mask, check_pooled_grad, check_positions, check_query, check_scale
from ._checks import check_offsets, check_packed, check_packed_mask, dtype_name, fail


def _unnormalized(hidden, normalize: bool, batch=None):
    """The second output: [B, D] in the accumulation type with normalize, else empty."""
    shape = (hidden.shape[0] if batch is None else batch, hidden.shape[-1]) if normalize else (0,)
    return hidden.new_empty(shape, dtype=accumulation_dtype(hidden.dtype))


def _pooled(hidden, batch=None):
    return hidden.new_empty((hidden.shape[0] if batch is None else batch, hidden.shape[-1]))


def _unpooled(grad_out, seq_len, dtype=None, cu_seqlens=None):
    """The gradient of hidden: [B, L, D], or [T, D] for a packed batch (seq_len = T)."""
    width = grad_out.shape[-1]
    shape = (seq_len, width) if cu_seqlens is not None else (grad_out.shape[0], seq_len, width)
    return grad_out.new_empty(shape, dtype=dtype or grad_out.dtype)


def _check_packed_grad(op, grad_out, cu_seqlens):
    if cu_seqlens is None:
        return
    check_offsets(op, cu_seqlens, grad_out)
    if grad_out.shape[0] != cu_seqlens.shape[0] - 1:
        fail(op, f"expected grad_out with B = {cu_seqlens.shape[0] - 1} texts (as cu_seqlens), got shape "
                 f"[{', '.join(str(s) for s in grad_out.shape)}]")


@torch.library.register_fake("lmk_ops::mean_pool")
def _mean_pool_fake(hidden, mask=None, normalize=False, cu_seqlens=None, max_seqlen=None):
    if cu_seqlens is not None:
        batch = check_packed("mean_pool", hidden, cu_seqlens, max_seqlen)
        check_packed_mask("mean_pool", mask, hidden.shape[0], hidden)
        return _pooled(hidden, batch), _unnormalized(hidden, normalize, batch)
    check_hidden("mean_pool", hidden, max_seqlen)
    check_mask("mean_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::mean_pool_backward")
def _mean_pool_backward_fake(grad_out, mask, seq_len, dtype=None, cu_seqlens=None):
    check_pooled_grad("mean_pool_backward", grad_out)
    check_grad_dtype("mean_pool_backward", dtype)
    _check_packed_grad("mean_pool_backward", grad_out, cu_seqlens)
    if cu_seqlens is not None:
        check_packed_mask("mean_pool_backward", mask, seq_len, grad_out)
    else:
        check_mask("mean_pool_backward", mask, grad_out.shape[0], seq_len, grad_out)
    return _unpooled(grad_out, seq_len, dtype, cu_seqlens)


@torch.library.register_fake("lmk_ops::max_pool")
def _max_pool_fake(hidden, mask=None, normalize=False, cu_seqlens=None, max_seqlen=None):
    if cu_seqlens is not None:
        batch = check_packed("max_pool", hidden, cu_seqlens, max_seqlen)
        check_packed_mask("max_pool", mask, hidden.shape[0], hidden)
        pooled = _pooled(hidden, batch)
        return pooled, pooled.to(torch.int32), _unnormalized(hidden, normalize, batch)
    check_hidden("max_pool", hidden, max_seqlen)
    check_mask("max_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _pooled(hidden).to(torch.int32), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::max_pool_backward")
def _max_pool_backward_fake(grad_out, argmax, seq_len, cu_seqlens=None):
    check_pooled_grad("max_pool_backward", grad_out)
    _check_packed_grad("max_pool_backward", grad_out, cu_seqlens)
    if argmax.dtype != torch.int32 or argmax.shape != grad_out.shape:
        fail("max_pool_backward", f"expected argmax of dtype int32 and shape {list(grad_out.shape)} "
             f"(as max_pool returns), got {dtype_name(argmax.dtype)} of shape {list(argmax.shape)}")
    return _unpooled(grad_out, seq_len, cu_seqlens=cu_seqlens)


@torch.library.register_fake("lmk_ops::landmark_mean")
def _landmark_mean_fake(hidden, landmarks, normalize=False, cu_seqlens=None, max_seqlen=None):
    if cu_seqlens is not None:
        batch = check_packed("landmark_mean", hidden, cu_seqlens, max_seqlen)
        check_landmarks("landmark_mean", landmarks, batch, hidden.shape[0], hidden, packed=True)
        return _pooled(hidden, batch), _unnormalized(hidden, normalize, batch)
    check_hidden("landmark_mean", hidden, max_seqlen)
    check_landmarks("landmark_mean", landmarks, hidden.shape[0], hidden.shape[1], hidden)
    return _pooled(hidden), _unnormalized(hidden, normalize)


@torch.library.register_fake("lmk_ops::landmark_mean_backward")
def _landmark_mean_backward_fake(grad_out, landmarks, seq_len, dtype=None, cu_seqlens=None):
    op = "landmark_mean_backward"
    check_pooled_grad(op, grad_out)
    check_grad_dtype(op, dtype)
    _check_packed_grad(op, grad_out, cu_seqlens)
    if cu_seqlens is not None:
        check_landmarks(op, landmarks, grad_out.shape[0], seq_len, grad_out, packed=True)
    else:
        check_landmarks(op, landmarks, grad_out.shape[0], seq_len, grad_out)
    return _unpooled(grad_out, seq_len, dtype, cu_seqlens)


@torch.library.register_fake("lmk_ops::landmark_gather")
def _landmark_gather_fake(hidden, positions, cu_seqlens=None):
    if cu_seqlens is not None:
        batch = check_packed("landmark_gather", hidden, cu_seqlens)
    else:
        check_hidden("landmark_gather", hidden)
        batch = hidden.shape[0]
    check_positions("landmark_gather", positions, batch, hidden)
    return hidden.new_empty((batch, positions.shape[1], hidden.shape[-1]))


@torch.library.register_fake("lmk_ops::landmark_gather_backward")
def _landmark_gather_backward_fake(grad_out, positions, seq_len, cu_seqlens=None):
    check_grad("landmark_gather_backward", grad_out, 3, "[B, K, D]")
    _check_packed_grad("landmark_gather_backward", grad_out, cu_seqlens)
    check_positions("landmark_gather_backward", positions, grad_out.shape[0], grad_out)
    if positions.shape[1] != grad_out.shape[1]:
        fail("landmark_gather_backward", f"expected grad_out of shape [B, K, D] with K = {positions.shape[1]} "
             f"(as positions), got [{', '.join(str(s) for s in grad_out.shape)}]")
    return _unpooled(grad_out, seq_len, cu_seqlens=cu_seqlens)


@torch.library.register_fake("lmk_ops::valid_mask")
def _valid_mask_fake(mask, op):
    if mask.dim() not in (1, 2):
        fail(op, f"expected mask of shape [B, L] (or [T], packed), got [{', '.join(str(s) for s in mask.shape)}]")
    rows = mask if mask.dim() == 2 else mask.unsqueeze(0)
    check_mask(op, rows, rows.shape[0], rows.shape[1], rows)
    return mask.new_empty(mask.shape, dtype=torch.bool)


@torch.library.register_fake("lmk_ops::token_pool")
def _token_pool_fake(hidden, mask=None, last=False, cu_seqlens=None, max_seqlen=None):
    op = "last_token_pool" if last else "first_token_pool"
    if cu_seqlens is not None:
        batch = check_packed(op, hidden, cu_seqlens, max_seqlen)
        check_packed_mask(op, mask, hidden.shape[0], hidden)
    else:
        check_hidden(op, hidden, max_seqlen)
        batch = hidden.shape[0]
        check_mask(op, mask, batch, hidden.shape[1], hidden)
    return _pooled(hidden, batch), hidden.new_empty((batch, 1), dtype=torch.int64)


@torch.library.register_fake("lmk_ops::landmark_positions")
def _landmark_positions_fake(landmark_mask, num_landmarks, cu_seqlens, op):
    packed = cu_seqlens is not None
    if landmark_mask.dtype != torch.bool or landmark_mask.dim() != (1 if packed else 2):
        fail(op, f"expected a bool landmark mask of shape {'[T]' if packed else '[B, L]'}, got "
                 f"{dtype_name(landmark_mask.dtype)} of shape {list(landmark_mask.shape)}")
    if packed:
        check_offsets(op, cu_seqlens, landmark_mask, "the landmark mask")
    batch = cu_seqlens.shape[0] - 1 if packed else landmark_mask.shape[0]
    return (landmark_mask.new_empty((batch, num_landmarks or 0), dtype=torch.int64),
            landmark_mask.new_empty((batch,), dtype=torch.int64))


@torch.library.register_fake("lmk_ops::packed_offsets")
def _packed_offsets_fake(cu_seqlens, tokens, max_seqlen, op):
    check_offsets(op, cu_seqlens, cu_seqlens)
    return cu_seqlens.new_empty(cu_seqlens.shape, dtype=torch.int64)


@torch.library.register_fake("lmk_ops::insert_landmarks")
def _insert_landmarks_fake(input_ids, attention_mask, sentence_ends, intervals, interval, landmark_id, pad_id,
                           num_leading, num_trailing, keep_trailing, max_length, padding_side):
    # The new rows' width depends on the values.
    width = torch.library.get_ctx().new_dynamic_size()
    shape = (input_ids.shape[0], width)
    return (input_ids.new_empty(shape), input_ids.new_empty(shape, dtype=torch.int64),
            input_ids.new_empty(shape, dtype=torch.bool))


@torch.library.register_fake("lmk_ops::attention_pool")
def _attention_pool_fake(hidden, mask, query, scale=None, return_weights=False, cu_seqlens=None, max_seqlen=None):
    op = "attention_pool"
    if cu_seqlens is not None:
        batch = check_packed(op, hidden, cu_seqlens, max_seqlen)
        seq_len = hidden.shape[0]
        heads, _ = check_query(op, query, hidden)
        check_packed_mask(op, mask, seq_len, hidden)
        weights_shape = (heads, seq_len)
    else:
        check_hidden(op, hidden, max_seqlen)
        heads, _ = check_query(op, query, hidden)
        check_mask(op, mask, hidden.shape[0], hidden.shape[1], hidden)
        batch, seq_len = hidden.shape[0], hidden.shape[1]
        weights_shape = (batch, heads, seq_len)
    check_scale(op, scale)
    weights = hidden.new_empty(weights_shape if return_weights else (0,), dtype=accumulation_dtype(hidden.dtype))
    return _pooled(hidden, batch), hidden.new_empty((batch, heads, 2), dtype=torch.float64), weights


@torch.library.register_fake("lmk_ops::attention_pool_backward")
def _attention_pool_backward_fake(grad_out, grad_weights, hidden, mask, query, out, stats, scale=None,
                                  cu_seqlens=None, max_seqlen=None):
    op = "attention_pool_backward"
    if cu_seqlens is not None:
        batch = check_packed(op, hidden, cu_seqlens)
        seq_len, dim = hidden.shape
        check_packed_mask(op, mask, seq_len, hidden)
    else:
        check_hidden(op, hidden, max_seqlen)
        batch, seq_len, dim = hidden.shape
        check_mask(op, mask, batch, seq_len, hidden)
    heads, _ = check_query(op, query, hidden)
    check_scale(op, scale)
    check_float_tensor(op, "grad_out", grad_out, (batch, dim), hidden)
    check_float_tensor(op, "out", out, (batch, dim), hidden)
    check_float_tensor(op, "stats", stats, (batch, heads, 2), hidden)
    if grad_weights is not None:
        shape = (heads, seq_len) if cu_seqlens is not None else (batch, heads, seq_len)
        check_float_tensor(op, "grad_weights", grad_weights, shape, hidden)
    return hidden.new_empty(hidden.shape), query.new_empty(query.shape)
