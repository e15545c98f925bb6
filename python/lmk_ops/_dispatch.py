"""How the Python layer calls the registered ops."""

from __future__ import annotations

import torch
from torch import Tensor


def call(op, *args):
    """op(*args), past its autograd kernel when there is nothing to differentiate. That kernel is a Python function
    (torch.library's), and its tens of microseconds per call are most of a small pooling's time (inference on a
    short query, first-token pooling), and of a small backward: the backward functions call the backward ops through
    here too, which need their own autograd kernel only while a double backward is recorded (create_graph). Never
    while compiling (dynamo traces the plain call) or inside torch.func transforms, whose layers need every dispatch
    key."""
    if ((torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args))
            or torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
