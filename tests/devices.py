"""The devices the suite runs on: the CPU always, CUDA when torch sees a GPU (the CUDA cases are skipped, and
reported as skipped, elsewhere)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def on(device, value):
    """value moved to device: a tensor, None, or a dataclass of them (a Hypothesis case)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return dataclasses.replace(value, **{
        f.name: on(device, getattr(value, f.name)) for f in dataclasses.fields(value)
        if isinstance(getattr(value, f.name), torch.Tensor)})
