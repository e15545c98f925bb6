"""Autograd for every op: backward calls the op's *_backward operator, and each backward is itself differentiable
(double backward), so gradcheck, gradgradcheck and higher-order uses work. Each op also has a forward-mode rule
(jvp: the linear ops run themselves on the tangent), which torch.func.jvp, jacfwd, hessian and
torch.autograd.forward_ad take.

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
    through_out = _through_normalize(m, grad).to(m.dtype)
    return through_out + grad_pooled if grad_pooled is not None else through_out


def _through_normalize(m, t):
    """What out = m / max(|m|, eps) does to a vector t ([B, D], the gradient w.r.t. out or the tangent of m), in
    float64: above eps (y = out) t - y <y, t> over |m|, the one expression serving the backward and the forward-mode
    rule since the Jacobian is symmetric; at or below it t / eps. Each row is scaled first by a power of two near its
    largest magnitude (exact), so that no square overflows or underflows: a float32 m past 1.8e19 (its squares past
    float32's range) had |m| = inf and a zero gradient, which the forward gets right (csrc/ops/pooling.cpp)."""
    if m.shape[1] == 0:  # no features (amax refuses an empty dimension)
        return t.double()
    wide = m.double()
    largest = wide.abs().amax(1, keepdim=True)
    usable = (largest > 0) & largest.isfinite()
    scale = torch.where(usable, torch.exp2(torch.floor(torch.log2(torch.where(usable, largest, 1.0)))), 1.0)
    scaled = wide / scale
    scaled_norm = torch.linalg.vector_norm(scaled, dim=1, keepdim=True)
    norm = scaled_norm * scale  # only compared with eps, and divided by: inf if past float64's range
    y, t = scaled / scaled_norm.clamp_min(torch.finfo(torch.float64).tiny), t.double()
    return torch.where(norm > _EPS, (t - y * (y * t).sum(1, keepdim=True)) / norm.clamp_min(_EPS), t / _EPS)


def _save(ctx, *tensors):
    """Saves tensors for the backward and for the forward-mode rule (jvp) alike: each reads ctx.saved_tensors."""
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)


def _save_normalized(ctx, normalize, pooled, *tensors):
    ctx.normalize = normalize
    _save(ctx, *tensors, *((pooled,) if normalize else ()))


def _empty_tangent(like, dtype):
    """The tangent of an op's empty placeholder output ([0] in the accumulation type of dtype)."""
    return like.new_zeros(0, dtype=accumulation_dtype(dtype))


def _normalized_tangents(ctx, pooled_tangent, dtype):
    """The tangents of (out, pooled) given that of the pooled vector m (in the accumulation type): out moves as
    _through_normalize says, pooled (saved with normalize, else empty) by the tangent itself."""
    if not ctx.normalize:
        return pooled_tangent.to(dtype), _empty_tangent(pooled_tangent, dtype)
    m = ctx.saved_tensors[-1]
    return _through_normalize(m, pooled_tangent).to(dtype), pooled_tangent.to(m.dtype)


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


# The forward-mode rules get one tangent per input; hidden (a backward op's grad_out) is the one input of these ops
# that can carry one (the attention rules take hidden's and the query's), so it is never None.
def _mean_jvp(op):
    """The forward-mode rule of a mean (mean_pool, landmark_mean): the op itself on the tangent. With normalize, its
    second output is the tangent's mean unrounded, as the normalisation's rule needs it."""
    def jvp(ctx, tangent, *_):
        rows, cu_seqlens = ctx.saved_tensors[:2]
        means = call(op, tangent, rows, ctx.normalize, cu_seqlens)
        return _normalized_tangents(ctx, means[1] if ctx.normalize else means[0], tangent.dtype)
    return jvp


# mean_pool_backward is linear in grad_out, and its adjoint is mean pooling itself.
# (With a dtype, the adjoint's result is cast back to grad_out's dtype by autograd.)
def _mean_pool_backward_setup(ctx, inputs, output):
    _, mask, ctx.seq_len, ctx.dtype, cu_seqlens = inputs
    _save(ctx, mask, cu_seqlens)


def _mean_pool_backward_backward(ctx, grad_grad_hidden):
    mask, cu_seqlens = ctx.saved_tensors
    return call(ops.mean_pool, grad_grad_hidden, mask, False, cu_seqlens)[0], None, None, None, None


def _mean_pool_backward_jvp(ctx, tangent, *_):
    mask, cu_seqlens = ctx.saved_tensors
    return call(ops.mean_pool_backward, tangent, mask, ctx.seq_len, ctx.dtype, cu_seqlens)


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


def _at_argmax(values, argmax, cu_seqlens):
    """values [B, L, D] (packed [T, D]) at each text's argmax [B, D], zero for an empty text."""
    rows = values.shape[-2]
    if rows == 0:
        return values.new_zeros(argmax.shape)
    index = argmax.clamp_min(0).long()
    if cu_seqlens is not None:  # rows of the packed [T, D], from each text's start (an empty last text's is T)
        gathered = values.gather(0, (index + cu_seqlens[:-1].long().unsqueeze(1)).clamp_max(rows - 1))
    else:
        gathered = values.gather(1, index.unsqueeze(1)).squeeze(1)
    return gathered.masked_fill(argmax < 0, 0)


def _max_pool_jvp(ctx, tangent, *_):
    argmax, cu_seqlens = ctx.saved_tensors[:2]
    out, pooled = _normalized_tangents(ctx, _at_argmax(tangent, argmax, cu_seqlens), tangent.dtype)
    return out, None, pooled


# max_pool_backward scatters grad_out to the argmax rows; its adjoint gathers from them.
def _max_pool_backward_setup(ctx, inputs, output):
    _, argmax, ctx.seq_len, cu_seqlens = inputs
    _save(ctx, argmax, cu_seqlens)


def _max_pool_backward_backward(ctx, grad_grad_hidden):
    argmax, cu_seqlens = ctx.saved_tensors
    return _at_argmax(grad_grad_hidden, argmax, cu_seqlens), None, None, None


def _max_pool_backward_jvp(ctx, tangent, *_):
    argmax, cu_seqlens = ctx.saved_tensors
    return call(ops.max_pool_backward, tangent, argmax, ctx.seq_len, cu_seqlens)


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
    _, landmarks, ctx.seq_len, ctx.dtype, cu_seqlens = inputs
    _save(ctx, landmarks, cu_seqlens)


def _landmark_mean_backward_backward(ctx, grad_grad_hidden):
    landmarks, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_mean, grad_grad_hidden, landmarks, False, cu_seqlens)[0], None, None, None, None


def _landmark_mean_backward_jvp(ctx, tangent, *_):
    landmarks, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_mean_backward, tangent, landmarks, ctx.seq_len, ctx.dtype, cu_seqlens)


# landmark_gather copies rows out; its backward adds them back (summing repeated positions); each is the
# other's adjoint.
def _landmark_gather_setup(ctx, inputs, output):
    hidden, positions, cu_seqlens = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    _save(ctx, positions, cu_seqlens)


def _landmark_gather_backward(ctx, grad):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather_backward, grad, positions, ctx.seq_len, cu_seqlens), None, None


def _landmark_gather_jvp(ctx, tangent, *_):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather, tangent, positions, cu_seqlens)


def _landmark_gather_backward_setup(ctx, inputs, output):
    _, positions, ctx.seq_len, cu_seqlens = inputs
    _save(ctx, positions, cu_seqlens)


def _landmark_gather_backward_backward(ctx, grad_grad_hidden):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather, grad_grad_hidden, positions, cu_seqlens), None, None, None


def _landmark_gather_backward_jvp(ctx, tangent, *_):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather_backward, tangent, positions, ctx.seq_len, cu_seqlens)


# token_pool copies one row per text out: its backward is the gather's, at the positions it returns.
def _token_pool_setup(ctx, inputs, output):
    hidden, _, _, cu_seqlens, _ = inputs
    ctx.seq_len = _seq_len(hidden, cu_seqlens)
    ctx.mark_non_differentiable(output[1])
    _save(ctx, output[1], cu_seqlens)


def _token_pool_backward(ctx, grad, _grad_positions):
    positions, cu_seqlens = ctx.saved_tensors
    grad_hidden = call(ops.landmark_gather_backward, grad.unsqueeze(1), positions, ctx.seq_len, cu_seqlens)
    return grad_hidden, None, None, None, None


def _token_pool_jvp(ctx, tangent, *_):
    positions, cu_seqlens = ctx.saved_tensors
    return call(ops.landmark_gather, tangent, positions, cu_seqlens).squeeze(1), None


# attention_pool: the backward recomputes the probabilities from hidden, query and the saved softmax statistics
# ([B, H, 2]: max score and sum of exp(score - max)), works relative to the output [B, D] for accuracy, and returns
# the gradients of hidden and of query (the weights' gradient joins in when they were returned). It keeps a copy of
# the output ([B, D], small beside hidden): saved as returned, an in-place change to it before backward()
# (emb /= norm) was refused, where the other ops and the eager form allow it.
def _attention_pool_setup(ctx, inputs, output):
    hidden, mask, query, scale, return_weights, cu_seqlens, max_seqlen = inputs
    out, stats, weights = output
    ctx.scale, ctx.return_weights, ctx.max_seqlen, ctx.weights_shape = scale, return_weights, max_seqlen, weights.shape
    ctx.mark_non_differentiable(stats)
    _save(ctx, hidden, mask, query, out.detach().clone(), stats, cu_seqlens)


def _attention_pool_backward(ctx, grad, _grad_stats, grad_weights):
    hidden, mask, query, out, stats, cu_seqlens = ctx.saved_tensors
    grad_weights = grad_weights if ctx.return_weights else None
    grad_hidden, grad_query = call(ops.attention_pool_backward, grad, grad_weights, hidden, mask, query, out, stats,
                                   ctx.scale, cu_seqlens, ctx.max_seqlen)
    return grad_hidden, None, grad_query, None, None, None, None


# The derivatives of attention pooling beyond its fused backward run in plain PyTorch in the accumulation type,
# correct rather than fused: forward mode (of the op and of its backward: Hessian-vector products) in closed form
# (reference.attention_pool_jvp, attention_pool_backward_jvp), the double backward (gradient penalties) through the
# reference, by torch.func inside its transforms and by torch.autograd.grad otherwise (_vjp).
def _reference_attention(ctx, mask, cu_seqlens):
    """(hidden, query) -> (out, weights) by the reference, for the op's mask, offsets and scale."""
    def forward(h, q):
        return reference.attention_pool(h, mask, q, scale=ctx.scale, return_weights=True, cu_seqlens=cu_seqlens,
                                        max_seqlen=ctx.max_seqlen)
    return forward


def _widened(tensors, like, hidden):
    """tensors in hidden's accumulation type, zeros of like's shapes for those missing (None: no tangent)."""
    wide = accumulation_dtype(hidden.dtype)
    return tuple(torch.zeros_like(x, dtype=wide) if t is None else t.to(wide) for t, x in zip(tensors, like))


def _attention_pool_jvp(ctx, hidden_tangent, _, query_tangent, *__):
    # In closed form, by plain operators (as the backward's, below): no torch.func transform nested inside the rule,
    # which a direct call's rule, run at a transform's level, could not do.
    hidden, mask, query, _, _, cu_seqlens = ctx.saved_tensors
    primals = (hidden, query)
    (h, q), (dh, dq) = _widened(primals, primals, hidden), _widened((hidden_tangent, query_tangent), primals, hidden)
    out, weights = reference.attention_pool_jvp(h, mask, q, dh, dq, scale=ctx.scale, cu_seqlens=cu_seqlens,
                                                max_seqlen=ctx.max_seqlen)
    weights = weights.reshape(ctx.weights_shape) if ctx.return_weights else _empty_tangent(weights, hidden.dtype)
    return out.to(hidden.dtype), None, weights


def _attention_pool_backward_setup(ctx, inputs, output):
    grad, grad_weights, hidden, mask, query, _, _, scale, cu_seqlens, max_seqlen = inputs
    ctx.scale, ctx.has_grad_weights, ctx.max_seqlen = scale, grad_weights is not None, max_seqlen
    _save(ctx, grad, grad_weights, hidden, mask, query, cu_seqlens)


def _vjp(f, primals, cotangents, *, leaves=False):
    """The vector-Jacobian product of f (a tuple of tensors) at primals: by torch.func.vjp inside torch.func's
    transforms (which refuse requires_grad_()), else by torch.autograd.grad (torch 2.10's AOT tracing with dynamic
    shapes, as opcheck runs it, hit an internal assert in index_select's backward under torch.func.vjp), on detached
    copies of the primals as leaves, or with leaves=True on the primals themselves (the leaves of an enclosing _vjp,
    which differentiates the result)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return torch.func.vjp(f, *primals)[1](cotangents)
    with torch.enable_grad():
        inputs = primals if leaves else [p.detach().requires_grad_() for p in primals]
        return torch.autograd.grad(f(*inputs), inputs, cotangents, create_graph=leaves, allow_unused=True,
                                   materialize_grads=True)


def _reference_attention_backward(ctx, mask, cu_seqlens):
    """(grad, hidden, query[, grad_weights]) -> (grad_hidden, grad_query) by the reference: attention_pool_backward
    as a function of the inputs that out and stats derive from."""
    forward = _reference_attention(ctx, mask, cu_seqlens)

    def backward(g, h, q, weights_grad=None):
        def outputs(h, q):  # out, and the weights in the op's shape where their gradient is given
            out, weights = forward(h, q)
            return (out,) if weights_grad is None else (out, weights.reshape(weights_grad.shape))
        return _vjp(outputs, (h, q), (g,) if weights_grad is None else (g, weights_grad), leaves=True)
    return backward


def _attention_pool_backward_jvp(ctx, grad_tangent, grad_weights_tangent, hidden_tangent, _, query_tangent, *__):
    grad, grad_weights, hidden, mask, query, cu_seqlens = ctx.saved_tensors
    like = (grad, hidden, query, *((grad_weights,) if ctx.has_grad_weights else ()))
    tangents = (grad_tangent, hidden_tangent, query_tangent, grad_weights_tangent)[:len(like)]
    (g, h, q, *gw), (dg, dh, dq, *dgw) = _widened(like, like, hidden), _widened(tangents, like, hidden)
    d_hidden, d_query = reference.attention_pool_backward_jvp(
        g, gw[0] if gw else None, h, mask, q, dg, dgw[0] if dgw else None, dh, dq, scale=ctx.scale,
        cu_seqlens=cu_seqlens, max_seqlen=ctx.max_seqlen)
    return d_hidden.to(hidden.dtype), d_query.to(query.dtype)


def _attention_pool_backward_backward(ctx, grad_grad_hidden, grad_grad_query):
    grad, grad_weights, hidden, mask, query, cu_seqlens = ctx.saved_tensors
    like = (grad, hidden, query, *((grad_weights,) if ctx.has_grad_weights else ()))
    found = _vjp(_reference_attention_backward(ctx, mask, cu_seqlens), _widened(like, like, hidden),
                 _widened((grad_grad_hidden, grad_grad_query), (hidden, query), hidden))
    d_grad, d_hidden, d_query = (f.to(t.dtype) for f, t in zip(found[:3], (grad, hidden, query)))
    d_grad_weights = found[3].to(grad_weights.dtype) if ctx.has_grad_weights else None
    return d_grad, d_grad_weights, d_hidden, None, d_query, None, None, None, None, None


for _name, _backward, _setup, _jvp in [
    ("mean_pool", _mean_pool_backward, _mean_pool_setup, _mean_jvp(ops.mean_pool)),
    ("mean_pool_backward", _mean_pool_backward_backward, _mean_pool_backward_setup, _mean_pool_backward_jvp),
    ("max_pool", _max_pool_backward, _max_pool_setup, _max_pool_jvp),
    ("max_pool_backward", _max_pool_backward_backward, _max_pool_backward_setup, _max_pool_backward_jvp),
    ("landmark_mean", _landmark_mean_backward, _landmark_mean_setup, _mean_jvp(ops.landmark_mean)),
    ("landmark_mean_backward", _landmark_mean_backward_backward, _landmark_mean_backward_setup,
     _landmark_mean_backward_jvp),
    ("landmark_gather", _landmark_gather_backward, _landmark_gather_setup, _landmark_gather_jvp),
    ("landmark_gather_backward", _landmark_gather_backward_backward, _landmark_gather_backward_setup,
     _landmark_gather_backward_jvp),
    ("token_pool", _token_pool_backward, _token_pool_setup, _token_pool_jvp),
    ("attention_pool", _attention_pool_backward, _attention_pool_setup, _attention_pool_jvp),
    ("attention_pool_backward", _attention_pool_backward_backward, _attention_pool_backward_setup,
     _attention_pool_backward_jvp),
]:
    register_autograd(_name, _backward, _setup, _jvp)
