"""Autograd for every op: backward calls the op's *_backward operator, and each backward is itself differentiable
(double backward), so gradcheck, gradgradcheck and higher-order uses work.

The pooling ops fuse an optional L2 normalisation. Their backward first maps the gradient of the normalised output
(and of the norm output) to the gradient of the pooled vector before normalising: [B, D] arithmetic in the
accumulation type, written with ATen ops so that it is differentiable too. The single pass that writes the
[B, L, D] gradient is the backward operator.
"""

from __future__ import annotations

import torch

ops = torch.ops.lmk_ops

_EPS = 1e-12  # as torch.nn.functional.normalize


def _pooled_grad(ctx, grad, grad_norm):
    """Gradient w.r.t. the pooled vector m, given those w.r.t. out = m / max(|m|, eps) and norm = |m|."""
    if not ctx.normalize:
        return grad
    out, norm = ctx.saved_tensors[-2:]
    y, g, n = out.to(norm.dtype), grad.to(norm.dtype), norm.unsqueeze(1)
    above = n > _EPS
    # Above eps, out = m / |m|: project out the component along y. At or below it the divisor is the constant eps.
    through_out = torch.where(above, (g - y * (y * g).sum(1, keepdim=True)) / n.clamp_min(_EPS), g / _EPS)
    if grad_norm is not None:
        # d|m|/dm = m / |m| = y * max(|m|, eps) / |m|, taken as 0 at m = 0.
        unit = torch.where(above, y, y * _EPS / n.clamp_min(torch.finfo(n.dtype).tiny))
        through_out = through_out + grad_norm.unsqueeze(1) * unit
    return through_out.to(grad.dtype)


def _save_normalized(ctx, normalize, out, norm, *tensors):
    ctx.normalize = normalize
    ctx.save_for_backward(*tensors, *((out, norm) if normalize else ()))


# mean_pool: d hidden[b, l] = grad[b] * mask[b, l] / count[b]. Saves only the mask (no activations).
def _mean_pool_setup(ctx, inputs, output):
    hidden, mask, normalize = inputs
    ctx.seq_len = hidden.shape[1]
    _save_normalized(ctx, normalize, *output, mask)


def _mean_pool_backward(ctx, grad, grad_norm):
    mask = ctx.saved_tensors[0]
    return ops.mean_pool_backward(_pooled_grad(ctx, grad, grad_norm), mask, ctx.seq_len), None, None


# mean_pool_backward is linear in grad_out, and its adjoint is mean pooling itself.
def _mean_pool_backward_setup(ctx, inputs, output):
    _, mask, _ = inputs
    ctx.save_for_backward(mask)


def _mean_pool_backward_backward(ctx, grad_grad_hidden):
    (mask,) = ctx.saved_tensors
    return ops.mean_pool(grad_grad_hidden, mask)[0], None, None


# max_pool: the gradient goes to the saved argmax position (int32, -1 for an empty row).
def _max_pool_setup(ctx, inputs, output):
    hidden, _, normalize = inputs
    out, argmax, norm = output
    ctx.seq_len = hidden.shape[1]
    ctx.mark_non_differentiable(argmax)
    _save_normalized(ctx, normalize, out, norm, argmax)


def _max_pool_backward(ctx, grad, _grad_argmax, grad_norm):
    argmax = ctx.saved_tensors[0]
    return ops.max_pool_backward(_pooled_grad(ctx, grad, grad_norm), argmax, ctx.seq_len), None, None


# max_pool_backward scatters grad_out to the argmax rows; its adjoint gathers from them.
def _max_pool_backward_setup(ctx, inputs, output):
    _, argmax, _ = inputs
    ctx.save_for_backward(argmax)


def _max_pool_backward_backward(ctx, grad_grad_hidden):
    (argmax,) = ctx.saved_tensors
    index = argmax.clamp_min(0).long().unsqueeze(1)
    gathered = grad_grad_hidden.gather(1, index).squeeze(1).masked_fill(argmax < 0, 0)
    return gathered, None, None


# landmark_mean: the mean over the landmark rows; as mean_pool, with the landmarks in place of the mask.
def _landmark_mean_setup(ctx, inputs, output):
    hidden, landmarks, normalize = inputs
    ctx.seq_len = hidden.shape[1]
    _save_normalized(ctx, normalize, *output, landmarks)


def _landmark_mean_backward(ctx, grad, grad_norm):
    landmarks = ctx.saved_tensors[0]
    return ops.landmark_mean_backward(_pooled_grad(ctx, grad, grad_norm), landmarks, ctx.seq_len), None, None


def _landmark_mean_backward_setup(ctx, inputs, output):
    _, landmarks, _ = inputs
    ctx.save_for_backward(landmarks)


def _landmark_mean_backward_backward(ctx, grad_grad_hidden):
    (landmarks,) = ctx.saved_tensors
    return ops.landmark_mean(grad_grad_hidden, landmarks)[0], None, None


# landmark_gather copies rows out; its backward adds them back (summing repeated positions); each is the
# other's adjoint.
def _landmark_gather_setup(ctx, inputs, output):
    hidden, positions = inputs
    ctx.seq_len = hidden.shape[1]
    ctx.save_for_backward(positions)


def _landmark_gather_backward(ctx, grad):
    (positions,) = ctx.saved_tensors
    return ops.landmark_gather_backward(grad, positions, ctx.seq_len), None


def _landmark_gather_backward_setup(ctx, inputs, output):
    _, positions, _ = inputs
    ctx.save_for_backward(positions)


def _landmark_gather_backward_backward(ctx, grad_grad_hidden):
    (positions,) = ctx.saved_tensors
    return ops.landmark_gather(grad_grad_hidden, positions), None, None


for _name, _backward, _setup in [
    ("mean_pool", _mean_pool_backward, _mean_pool_setup),
    ("mean_pool_backward", _mean_pool_backward_backward, _mean_pool_backward_setup),
    ("max_pool", _max_pool_backward, _max_pool_setup),
    ("max_pool_backward", _max_pool_backward_backward, _max_pool_backward_setup),
    ("landmark_mean", _landmark_mean_backward, _landmark_mean_setup),
    ("landmark_mean_backward", _landmark_mean_backward_backward, _landmark_mean_backward_setup),
    ("landmark_gather", _landmark_gather_backward, _landmark_gather_setup),
    ("landmark_gather_backward", _landmark_gather_backward_backward, _landmark_gather_backward_setup),
]:
    torch.library.register_autograd(f"lmk_ops::{_name}", _backward, setup_context=_setup)
