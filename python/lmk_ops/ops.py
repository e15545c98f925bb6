"""The public pooling functions. Each calls one operator registered with the PyTorch dispatcher
(``torch.ops.lmk_ops.*``), so it works eagerly, under autograd and under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["max_pool", "mean_pool"]


def mean_pool(hidden: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mask-aware mean of the token states of each text.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        mask: ``[B, L]`` bool, or integer holding 0/1 (a Hugging Face ``attention_mask``), on hidden's device;
            ``None`` means every token is valid.

    Returns:
        ``[B, D]`` in hidden's dtype: the mean of the valid rows, accumulated in float32 (float64 for float64).
        A text with no valid token gives zeros, and its gradient is zero. Padding on either side is fine.

    Raises:
        RuntimeError: starting ``lmk_ops.mean_pool:`` for hidden that is not 3-D floating point, a mask of
        another shape, device or dtype (float), or mask values other than 0/1.
    """
    return torch.ops.lmk_ops.mean_pool(hidden, mask)


def max_pool(hidden: Tensor, mask: Tensor | None = None, *, return_indices: bool = False):
    """Mask-aware element-wise maximum over the token states of each text.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        mask: ``[B, L]`` bool or integer 0/1, ``None`` meaning every token is valid.
        return_indices: also return the position each maximum came from.

    Returns:
        ``[B, D]`` in hidden's dtype; with ``return_indices``, also an int32 ``[B, D]`` tensor of positions.
        Ties go to the first position, and the gradient of each output element flows to that one position. A NaN
        among the valid tokens wins (the first NaN), as in ``torch.max``. A text with no valid token gives zeros,
        position -1, and zero gradient.

    Raises:
        RuntimeError: starting ``lmk_ops.max_pool:``, as for :func:`mean_pool`.
    """
    values, argmax = torch.ops.lmk_ops.max_pool(hidden, mask)
    return (values, argmax) if return_indices else values
