"""Plain-PyTorch versions of every op, with the same semantics: the oracle for the tests and the baseline for the
benchmarks. They are written as a user would write them in eager PyTorch, in the input's own dtype (call them on
an upcast input to get a float32 / float64 oracle)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["max_pool", "mean_pool"]


def _valid(hidden: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return mask != 0


def mean_pool(hidden: Tensor, mask: Tensor | None = None) -> Tensor:
    valid = _valid(hidden, mask)
    summed = (hidden * valid.unsqueeze(-1).to(hidden.dtype)).sum(dim=1)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1).to(hidden.dtype)
    return summed / count


def max_pool(hidden: Tensor, mask: Tensor | None = None, *, return_indices: bool = False):
    valid = _valid(hidden, mask).unsqueeze(-1)
    filled = hidden.masked_fill(~valid, float("-inf"))
    best = filled.amax(dim=1, keepdim=True)
    # The first valid position holding the maximum (a NaN counts as the maximum); argmax returns the first hit.
    hit = ((filled == best) | (filled.isnan() & best.isnan())) & valid
    index = hit.to(torch.int8).argmax(dim=1)
    values = hidden.gather(1, index.unsqueeze(1)).squeeze(1)
    any_valid = valid.any(dim=1)
    values = torch.where(any_valid, values, torch.zeros_like(values))
    if return_indices:
        return values, torch.where(any_valid, index, -1).to(torch.int32)
    return values
