"""Fake (meta) kernels: output shapes and dtypes for torch.compile and FakeTensor, for every op."""

from __future__ import annotations

import torch

from ._checks import check_hidden, check_mask, check_pooled_grad, dtype_name, fail


@torch.library.register_fake("lmk_ops::mean_pool")
def _mean_pool_fake(hidden, mask=None):
    check_hidden("mean_pool", hidden)
    check_mask("mean_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    return hidden.new_empty((hidden.shape[0], hidden.shape[2]))


@torch.library.register_fake("lmk_ops::mean_pool_backward")
def _mean_pool_backward_fake(grad_out, mask, seq_len):
    check_pooled_grad("mean_pool_backward", grad_out)
    check_mask("mean_pool_backward", mask, grad_out.shape[0], seq_len, grad_out)
    return grad_out.new_empty((grad_out.shape[0], seq_len, grad_out.shape[1]))


@torch.library.register_fake("lmk_ops::max_pool")
def _max_pool_fake(hidden, mask=None):
    check_hidden("max_pool", hidden)
    check_mask("max_pool", mask, hidden.shape[0], hidden.shape[1], hidden)
    shape = (hidden.shape[0], hidden.shape[2])
    return hidden.new_empty(shape), hidden.new_empty(shape, dtype=torch.int32)


@torch.library.register_fake("lmk_ops::max_pool_backward")
def _max_pool_backward_fake(grad_out, argmax, seq_len):
    check_pooled_grad("max_pool_backward", grad_out)
    if argmax.dtype != torch.int32 or argmax.shape != grad_out.shape:
        fail("max_pool_backward", f"expected argmax of dtype int32 and shape {list(grad_out.shape)} "
             f"(as max_pool returns), got {dtype_name(argmax.dtype)} of shape {list(argmax.shape)}")
    return grad_out.new_empty((grad_out.shape[0], seq_len, grad_out.shape[1]))
