"""How the Python layer calls the registered ops."""

from __future__ import annotations

import torch
from torch import Tensor

# Per op (its OpOverloadPacket): a torch.autograd.Function with the op's own setup_context and backward, and the
# schema's defaults for the arguments a call leaves out (register below).
_functions: dict = {}


def register(op, backward, setup_context) -> None:
    """Makes call() differentiate op in eager mode through a torch.autograd.Function with the setup_context and
    backward that _autograd.py also registers with the dispatcher (torch.library.register_autograd). The dispatcher's
    route runs those through a Python wrapper that redispatches the op and fills its defaults: about 40 µs more per
    forward+backward, most of a small batch's training step. Dynamo and torch.func still take that route."""
    defaults = tuple(a.default_value if a.has_default_value() else None for a in op.default._schema.arguments)

    # forward(ctx, ...) calls setup_context itself: a Function that defines setup_context binds every call's
    # arguments to forward's signature with inspect, 25 µs a call.
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*args)
        setup_context(ctx, args, output)
        return output

    function = type(op.__name__.replace("lmk_ops.", ""), (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})
    _functions[op] = (function, defaults)


def call(op, *args):
    """op(*args): through its autograd Function when something requires grad (register), else past autograd
    altogether (the op's autograd kernel is a Python function whose tens of microseconds per call are most of a small
    pooling's time: inference on a short query, first-token pooling). The backward functions call the backward ops
    through here too, so a double backward (create_graph) is recorded the same way. While compiling (dynamo traces the
    plain call) or inside torch.func transforms, whose layers need every dispatch key, the op is called as it is."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return op(*args)
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        function, defaults = _functions[op]
        return function.apply(*args, *defaults[len(args):])
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
