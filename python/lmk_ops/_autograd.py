"""Autograd for every op: backward calls the op's *_backward operator, and each backward is itself differentiable
(double backward), so gradcheck, gradgradcheck and higher-order uses work.

The pooling ops fuse an optional L2 normalisation. Their backward first maps the gradient of the normalised output
(and of the unnormalised second output) to the gradient of the pooled vector before normalising: [B, D]
arithmetic in the accumulation type, written with ATen ops so that it is differentiable too. The single pass that
writes the [B, L, D] gradient is the backward operator.
"""

from __future__ import annotations

import torch

from . import reference
from ._checks import accumulation_dtype
from ._dispatch import call, register_autograd

ops = torch.ops.lmk_ops

_EPS = 1e-12  # as torch.nn.functional.normalize


def _pooled_grad(ctx, grad, grad_pooled):
    """Gradient w.r.t. the pooled vector m, given those w.r.t. out = m / max(|m|, eps) and w.r.t. the op's second
    output (m itself, unrounded, saved with normalize). With normalize it stays in the accumulation type."""
    if not ctx.normalize:
        return grad
    m = ctx.saved_tensors[-1]
    n = torch.linalg.vector_norm(m, dim=1, keepdim=True)
    y, g = m / n.clamp_min(_EPS), grad.to(m.dtype)
    # Above eps, out = m / |m|: project out the component along out. At or below it the divisor is the constant eps.
    through_out = torch.where(n > _EPS, (g - y * (y * g).sum(1, keepdim=True)) / n.clamp_min(_EPS), g / _EPS)
    return through_out + grad_pooled if grad_pooled is not None else through_out


def _save_normalized(ctx, normalize, pooled, *tensors):
    ctx.normalize = normalize
    ctx.save_for_backward(*tensors, *((pooled,) if normalize else ()))


# mean_pool: d hidden[b, l] = grad[b] * mask[b, l] / count[b]. Saves only the mask (no activations).
def _seq_len(hidden, cu_seqlens):
    """The row count a backward op restores: L for a padded batch, T for a packed one."""
    return hidden.shape[0] if cu_seqlens is not None else hidden.shape[1]


def _mean_pool_setup(ctx, inputs, output):
    hidden, mask, normalize, cu_seqlens, _ = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    _save_normalized(ctx, normalize, output[1], mask, cu_seqlens)


def _mean_pool_backward(ctx, grad, grad_pooled):
    mask, cu_seqlens = ctx.saved_tensors[:2]
    pooled_grad = _pooled_grad(ctx, grad, grad_pooled)
    return call(ops.mean_pool_backward, pooled_grad, mask, ctx.seq_len, grad.dtype, cu_seqlens), None, None, None, None


# mean_pool_backward is linear in grad_out, and its adjoint is mean pooling itself.
# (With a dtype, the adjoint's result is cast back to grad_out's dtype by autograd.)
def _mean_pool_backward_setup(ctx, inputs, output):
    _, mask, _, _, cu_seqlens = inputs
    ctx.save_for_backward(mask, cu_seqlens)


def _mean_pool_backward_backward(ctx, grad_grad_hidden):
    mask, cu_seqlens = ctx.saved_tensors
    return call(ops.mean_pool, grad_grad_hidden, mask, False, cu_seqlens)[0], None, None, None, None


# max_pool: the gradient goes to the saved argmax position (int32, -1 for an empty row).
def _max_pool_setup(ctx, inputs, output):
    hidden, _, normalize, cu_seqlens, _ = inputs
    _, argmax, pooled = output
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    ctx.mark_non_differentiable(argmax)
    _save_normalized(ctx, normalize, pooled, argmax, cu_seqlens)


def _max_pool_backward(ctx, grad, _grad_argmax, grad_pooled):
    argmax, cu_seqlens = ctx.saved_tensors[:2]
    pooled_grad = _pooled_grad(ctx, grad, grad_pooled).to(grad.dtype)  # moved as is: rounding first is exact
    return call(ops.max_pool_backward, pooled_grad, argmax, ctx.seq_len, cu_seqlens), None, None, None, None


# max_pool_backward scatters grad_out to the argmax rows; its adjoint gathers from them.
def _max_pool_backward_setup(ctx, inputs, output):
    _, argmax, _, cu_seqlens = inputs
    ctx.save_for_backward(argmax, cu_seqlens)


def _max_pool_backward_backward(ctx, grad_grad_hidden):
    argmax, cu_seqlens = ctx.saved_tensors
    index = argmax.clamp_min(0).long()
    if cu_seqlens is not None:  # rows of the packed [T, D], from each text's start
        gathered = grad_grad_hidden.gather(0, index + cu_seqlens[:-1].long().unsqueeze(1))
    else:
        gathered = grad_grad_hidden.gather(1, index.unsqueeze(1)).squeeze(1)
    return gathered.masked_fill(argmax < 0, 0), None, None, None


# landmark_mean: the mean over the landmark rows; as mean_pool, with the landmarks in place of the mask.
def _landmark_mean_setup(ctx, inputs, output):
    hidden, landmarks, normalize, cu_seqlens, _ = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    _save_normalized(ctx, normalize, output[1], landmarks, cu_seqlens)


def _landmark_mean_backward(ctx, grad, grad_pooled):
    landmarks, cu_seqlens = ctx.saved_tensors[:2]
    pooled_grad = _pooled_grad(ctx, grad, grad_pooled)
    grad_hidden = call(ops.landmark_mean_backward, pooled_grad, landmarks, ctx.seq_len, grad.dtype, cu_seqlens)
    return grad_hidden, None, None, None, None


def _landmark_mean_backward_setup(ctx, inputs, output):
    _, landmarks, _, _, cu_seqlens = inputs
    ctx.save_for_backward(landmarks, cu_seqlens)


def _landmark_mean_backward_backward(ctx, grad_grad_hidden):
    landmarks, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_mean, grad_grad_hidden, landmarks, False, cu_seqlens)[0], None, None, None, None


# landmark_gather copies rows out; its backward adds them back (summing repeated positions); each is the
# other's adjoint.
def _landmark_gather_setup(ctx, inputs, output):
    hidden, positions, cu_seqlens = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    ctx.save_for_backward(positions, cu_seqlens)


def _landmark_gather_backward(ctx, grad):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather_backward, grad, positions, ctx.seq_len, cu_seqlens), None, None


def _landmark_gather_backward_setup(ctx, inputs, output):
    _, positions, _, cu_seqlens = inputs
    ctx.save_for_backward(positions, cu_seqlens)


def _landmark_gather_backward_backward(ctx, grad_grad_hidden):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather, grad_grad_hidden, positions, cu_seqlens), None, None, None


# token_pool copies one row per text out: its backward is the gather's, at the positions it returns.
def _token_pool_setup(ctx, inputs, output):
    hidden, _, _, cu_seqlens, _ = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], cu_seqlens)


def _token_pool_backward(ctx, grad, _grad_positions):
    positions, cu_seqlens = ctx.saved_tensors
    grad_hidden = call(ops.landmark_gather_backward, grad.unsqueeze(1), positions, ctx.seq_len, cu_seqlens)
    return grad_hidden, None, None, None, None


# attention_pool: the backward recomputes the probabilities from hidden, query and the saved softmax statistics
# ([B, H, 2]: max score and sum of exp(score - max)), works relative to the output [B, D] for accuracy, and returns
# the gradients of hidden and of query (the weights' gradient joins in when they were returned). It keeps a copy of
# the output ([B, D], small beside hidden): saved as returned, an in-place change to it before backward()
# (emb /= norm) was refused, where the other ops and the eager form allow it.
def _attention_pool_setup(ctx, inputs, output):
    hidden, mask, query, scale, return_weights, cu_seqlens, max_seqlen = inputs
    out, stats, _ = output
    ctx.scale, ctx.return_weights, ctx.max_seqlen = scale, return_weights, max_seqlen
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(hidden, mask, query, out.detach().clone(), stats, cu_seqlens)


def _attention_pool_backward(ctx, grad, _grad_stats, grad_weights):
    hidden, mask, query, out, stats, cu_seqlens = ctx.saved_tensors
    grad_weights = grad_weights if ctx.return_weights else None
    grad_hidden, grad_query = call(ops.attention_pool_backward, grad, grad_weights, hidden, mask, query, out, stats,
                                   ctx.scale, cu_seqlens, ctx.max_seqlen)
    return grad_hidden, None, grad_query, None, None, None, None


# attention_pool_backward is not linear in its inputs, and its derivatives are needed only for double backward
# (gradient penalties, Hessian-vector products): they run through the plain-PyTorch reference, recomputed in the
# accumulation type. Correct rather than fused.
def _attention_pool_backward_setup(ctx, inputs, output):
    grad, grad_weights, hidden, mask, query, _, _, scale, cu_seqlens, max_seqlen = inputs
    ctx.scale, ctx.has_grad_weights, ctx.max_seqlen = scale, grad_weights is not None, max_seqlen
    ctx.save_for_backward(grad, grad_weights, hidden, mask, query, cu_seqlens)


def _attention_pool_backward_backward(ctx, grad_grad_hidden, grad_grad_query):
    grad, grad_weights, hidden, mask, query, cu_seqlens = ctx.saved_tensors
    wide = accumulation_dtype(hidden.dtype)
    leaves = [t.to(wide) for t in (grad, hidden, query)]
    if ctx.has_grad_weights:
        leaves.append(grad_weights.to(wide))

    def backward(g, h, q, weights_grad=None):  # attention_pool_backward, by the reference's autograd
        def forward(h, q):
            return reference.attention_pool(h, mask, q, scale=ctx.scale, return_weights=True, cu_seqlens=cu_seqlens,
                                            max_seqlen=ctx.max_seqlen)
        (_, weights), pullback = torch.func.vjp(forward, h, q)
        weights_grad = torch.zeros_like(weights) if weights_grad is None else weights_grad.reshape(weights.shape)
        return pullback((g, weights_grad))

    # torch.func.vjp rather than requires_grad_() and torch.autograd.grad, which torch.func's transforms refuse.
    _, pullback = torch.func.vjp(backward, *leaves)
    found = pullback((grad_grad_hidden.to(wide), grad_grad_query.to(wide)))
    d_grad, d_hidden, d_query = (f.to(t.dtype) for f, t in zip(found[:3], (grad, hidden, query)))
    d_grad_weights = found[3].to(grad_weights.dtype) if ctx.has_grad_weights else None
    return d_grad, d_grad_weights, d_hidden, None, d_query, None, None, None, None, None


for _name, _backward, _setup in [
    ("mean_pool", _mean_pool_backward, _mean_pool_setup),
    ("mean_pool_backward", _mean_pool_backward_backward, _mean_pool_backward_setup),
    ("max_pool", _max_pool_backward, _max_pool_setup),
    ("max_pool_backward", _max_pool_backward_backward, _max_pool_backward_setup),
    ("landmark_mean", _landmark_mean_backward, _landmark_mean_setup),
    ("landmark_mean_backward", _landmark_mean_backward_backward, _landmark_mean_backward_setup),
    ("landmark_gather", _landmark_gather_backward, _landmark_gather_setup),
    ("landmark_gather_backward", _landmark_gather_backward_backward, _landmark_gather_backward_setup),
    ("token_pool", _token_pool_backward, _token_pool_setup),
    ("attention_pool", _attention_pool_backward, _attention_pool_setup),
    ("attention_pool_backward", _attention_pool_backward_backward, _attention_pool_backward_setup),
]:
    register_autograd(_name, _backward, _setup)
