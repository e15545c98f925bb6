"""How the Python layer calls the registered ops."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

# Per op (its OpOverloadPacket): the torch.autograd.Function of eager calls and the one torch.func's transforms and
# forward mode take, both with the op's own setup_context and backward, and the schema's defaults for the arguments
# a call leaves out (register_autograd below).
_functions: dict = {}


def register_autograd(name: str, backward, setup_context, jvp) -> None:
    """Registers the autograd of op lmk_ops::name, as one setup_context, one backward and one forward-mode rule
    (jvp), on three routes: with the dispatcher (torch.library.register_autograd, backward only; dynamo and direct
    torch.ops calls take it), as the torch.autograd.Function through which call() differentiates the op in eager
    mode, and as the one it takes inside torch.func's transforms and forward-mode AD. The dispatcher's route runs
    them through a Python wrapper that redispatches the op and fills its defaults: about 25 µs more per small
    forward+backward (a 4x16x384 mean pooling: 84 against 60 µs)."""
    torch.library.register_autograd(f"lmk_ops::{name}", backward, setup_context=setup_context)
    op = getattr(torch.ops.lmk_ops, name)
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
    # torch.func's transforms need a Function with a separate setup_context (and, under torch.vmap, a vmap rule:
    # generated, from the ops' own rules); forward mode, its jvp.
    transformable = type(op.__name__.replace("lmk_ops.", ""), (torch.autograd.Function,), {
        "forward": staticmethod(op), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp), "generate_vmap_rule": True})
    _functions[op] = (function, transformable, defaults)


def call(op, *args):
    """op(*args): through its autograd Function when something requires grad (register_autograd), else past autograd
    altogether (the op's autograd kernel is a Python function whose tens of microseconds per call are most of a small
    pooling's time: inference on a short query, first-token pooling). The backward functions call the backward ops
    through here too, so a double backward (create_graph) is recorded the same way. While compiling (dynamo traces the
    plain call) or under torch.jit.trace (which would record the Function as a Python op that it can neither check
    nor save), the op is called as it is; inside torch.func transforms or a forward-mode dual level, through the
    Function that they can take (with a jvp, and a setup_context apart from forward: torch.library.
    register_autograd's, which a plain call would reach, has neither, and the transforms refuse it)."""
    if torch.compiler.is_compiling() or torch._C._is_tracing():
        if _forward_ad._current_level >= 0:
            # The dispatcher's route has no forward-mode rule: traced, the op's tangents would come out zero. Raised
            # while dynamo traces (torch.compile over torch.func.jvp), this makes it run the frame eagerly, through
            # the ops' rules; with fullgraph=True the compile fails with this message.
            raise RuntimeError(f"{op}: forward-mode AD (torch.func.jvp, jacfwd, hessian) runs eagerly, not inside "
                               "torch.compile(fullgraph=True) or torch.jit.trace")
        return op(*args)
    if torch._C._functorch.peek_interpreter_stack() is not None or _forward_ad._current_level >= 0:
        _, transformable, defaults = _functions[op]
        return transformable.apply(*args, *defaults[len(args):])
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        function, _, defaults = _functions[op]
        return function.apply(*args, *defaults[len(args):])
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
