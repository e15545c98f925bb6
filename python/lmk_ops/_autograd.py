"""Autograd for every op: backward calls the op's *_backward operator, and each backward is itself differentiable
(double backward), so gradcheck, gradgradcheck and higher-order uses work."""

from __future__ import annotations

import torch

ops = torch.ops.lmk_ops


# mean_pool: d hidden[b, l] = grad[b] * mask[b, l] / count[b]. Saves only the mask (no activations).
def _mean_pool_setup(ctx, inputs, output):
    hidden, mask = inputs
    ctx.seq_len = hidden.shape[1]
    ctx.save_for_backward(mask)


def _mean_pool_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return ops.mean_pool_backward(grad, mask, ctx.seq_len), None


# mean_pool_backward is linear in grad_out, and its adjoint is mean pooling itself.
def _mean_pool_backward_setup(ctx, inputs, output):
    _, mask, _ = inputs
    ctx.save_for_backward(mask)


def _mean_pool_backward_backward(ctx, grad_grad_hidden):
    (mask,) = ctx.saved_tensors
    return ops.mean_pool(grad_grad_hidden, mask), None, None


# max_pool: the gradient goes to the saved argmax position (int32, -1 for an empty row).
def _max_pool_setup(ctx, inputs, output):
    hidden, _ = inputs
    _, argmax = output
    ctx.seq_len = hidden.shape[1]
    ctx.save_for_backward(argmax)


def _max_pool_backward(ctx, grad, _grad_argmax):
    (argmax,) = ctx.saved_tensors
    return ops.max_pool_backward(grad, argmax, ctx.seq_len), None


# max_pool_backward scatters grad_out to the argmax rows; its adjoint gathers from them.
def _max_pool_backward_setup(ctx, inputs, output):
    _, argmax, _ = inputs
    ctx.save_for_backward(argmax)


def _max_pool_backward_backward(ctx, grad_grad_hidden):
    (argmax,) = ctx.saved_tensors
    index = argmax.clamp_min(0).long().unsqueeze(1)
    gathered = grad_grad_hidden.gather(1, index).squeeze(1).masked_fill(argmax < 0, 0)
    return gathered, None, None


torch.library.register_autograd("lmk_ops::mean_pool", _mean_pool_backward, setup_context=_mean_pool_setup)
torch.library.register_autograd(
    "lmk_ops::mean_pool_backward", _mean_pool_backward_backward, setup_context=_mean_pool_backward_setup
)
torch.library.register_autograd("lmk_ops::max_pool", _max_pool_backward, setup_context=_max_pool_setup)
torch.library.register_autograd(
    "lmk_ops::max_pool_backward", _max_pool_backward_backward, setup_context=_max_pool_backward_setup
)
