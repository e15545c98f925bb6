"""How the Python layer calls the registered ops, and the autograd the dispatcher runs for them."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import _C
from torch._functorch.utils import enable_single_level_autograd_function

# Per op (its OpOverloadPacket): the torch.autograd.Function of eager calls, the one torch.func's transforms take
# through call(), and the schema's defaults for the arguments a call leaves out (register_autograd below).
_functions: dict = {}

# What call() asks on every call, bound once (a small pooling's whole call is ~8 µs; each lookup of torch._C's
# attributes costs tens of nanoseconds, Python's any() over the arguments 0.4 µs more than this one).
_is_compiling, _is_tracing, _peek_interpreter_stack = (torch.compiler.is_compiling, _C._is_tracing,
                                                       _C._functorch.peek_interpreter_stack)
_is_grad_enabled, _any_requires_grad = _C.is_grad_enabled, _C._any_requires_grad

# The ops' autograd kernels (register_autograd), kept alive with the library that holds them.
_LIBRARY = torch.library.Library("lmk_ops", "IMPL")


_kernel_state = threading.local()


def at_transform_level() -> bool:
    """Whether this thread runs an op's autograd kernel at a torch.func transform's level (register_autograd): a
    forward-mode rule runs there, inside the transform's handling of the op, where no transform can be nested."""
    return getattr(_kernel_state, "at_transform_level", False)


@contextlib.contextmanager
def _transform_level(interpreter):
    """Marks the thread as at_transform_level() while a kernel runs with a transform's interpreter on the stack."""
    before = at_transform_level()
    _kernel_state.at_transform_level = interpreter is not None
    try:
        yield
    finally:
        _kernel_state.at_transform_level = before


def register_autograd(name: str, backward, setup_context, jvp) -> None:
    """Registers the autograd of op lmk_ops::name, as one setup_context, one backward and one forward-mode rule
    (jvp), on three routes: as the dispatcher's autograd kernel of the op, which every call that reaches the op's
    autograd takes (torch.ops.lmk_ops.* called directly, torch.compile), and as two torch.autograd.Functions that
    call() takes: one for eager calls (a shorter route, below), one inside torch.func's transforms and forward mode.

    The kernel is not torch.library.register_autograd's: that one has no forward-mode rule (the tangent of a dual
    tensor was dropped, silently) and a Function that torch.func's transforms refuse (no separate setup_context).
    Here a Function with all three runs at the autograd key, which a transform reaches with its level's tensors, as
    a single-level Function (as PyTorch's own C++ autograd kernels run there). A rule must not nest a transform of
    its own there (PyTorch's internal assert: attention's forward-mode rules are in closed form for that), and the
    ops a rule calls go through the dispatcher (at_transform_level() says when)."""
    op = getattr(torch.ops.lmk_ops, name)
    schema = op.default._schema
    assert not any(a.kwarg_only for a in schema.arguments), f"{name}: the kernel passes every argument by position"
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)
    title = name.replace("_", " ").title().replace(" ", "")

    # The dispatcher's route: the keyset the kernel was called with comes last (it says where to redispatch).
    def dispatched_forward(*args):
        with _C._AutoDispatchBelowAutograd():
            return op.default.redispatch(args[-1] & _C._after_autograd_keyset, *args[:-1])

    def dispatched_backward(ctx, *grads):
        grad_inputs = backward(ctx, *grads)
        return (*grad_inputs, None) if isinstance(grad_inputs, tuple) else (grad_inputs, None)

    dispatched = type(f"{title}Dispatched", (torch.autograd.Function,), {
        "forward": staticmethod(dispatched_forward),
        "setup_context": staticmethod(lambda ctx, inputs, output: setup_context(ctx, inputs[:-1], output)),
        "backward": staticmethod(dispatched_backward),
        "jvp": staticmethod(lambda ctx, *tangents: jvp(ctx, *tangents[:-1]))})

    def autograd_kernel(keyset, *args):
        args = (*args, *defaults[len(args):])  # the dispatcher drops trailing arguments equal to their defaults
        if (_is_grad_enabled() and _any_requires_grad(*args)) or (
                _forward_ad._current_level >= 0 and _C._is_fwd_grad_enabled()):
            with enable_single_level_autograd_function(), _transform_level(_peek_interpreter_stack()):
                return super(torch.autograd.Function, dispatched).apply(*args, keyset)
        return dispatched_forward(*args, keyset)

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)

    # The eager route: forward(ctx, ...) calls setup_context itself, as a Function that defines setup_context binds
    # every call's arguments to forward's signature with inspect (25 µs a call).
    def forward(ctx, *args):
        with _C._AutoDispatchBelowAutograd():
            output = op(*args)
        setup_context(ctx, args, output)
        return output

    function = type(title, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})
    # torch.func's transforms take a Function with a separate setup_context (and, under torch.vmap, a vmap rule:
    # generated, from the ops' own rules) at their own level, where a rule may nest transforms; forward mode, its jvp.
    transformable = type(title, (torch.autograd.Function,), {
        "forward": staticmethod(op), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp), "generate_vmap_rule": True})
    _functions[op] = (function, transformable, defaults)


def call(op, *args):
    """op(*args): through its autograd Function when something requires grad (register_autograd), else past autograd
    altogether (the op's autograd kernel is a Python function whose tens of microseconds per call are most of a small
    pooling's time: inference on a short query, first-token pooling). The backward functions call the backward ops
    through here too, so a double backward (create_graph) is recorded the same way. While compiling (dynamo traces
    the plain call, which reaches the op's autograd kernel) or under torch.jit.trace (which would record the Function
    as a Python op that it can neither check nor save), the op is called as it is; inside torch.func's transforms or
    a forward-mode dual level, through the Function that they take at their own level."""
    if _is_compiling() or _is_tracing():
        if _forward_ad._current_level >= 0:
            # Raised while dynamo traces (torch.compile over torch.func.jvp), this makes it run the frame eagerly,
            # through the transformable Function; with fullgraph=True the compile fails with this message.
            raise RuntimeError(f"{op}: forward-mode AD (torch.func.jvp, jacfwd, hessian) runs eagerly, not inside "
                               "torch.compile(fullgraph=True) or torch.jit.trace")
        return op(*args)
    if _peek_interpreter_stack() is not None or _forward_ad._current_level >= 0:
        if at_transform_level():  # a forward-mode rule in an op's autograd kernel: the dispatcher has the transform
            return op(*args)
        _, transformable, defaults = _functions[op]
        return transformable.apply(*args, *defaults[len(args):])
    if _is_grad_enabled() and _any_requires_grad(*args):
        function, _, defaults = _functions[op]
        return function.apply(*args, *defaults[len(args):])
    with _C._AutoDispatchBelowAutograd():
        return op(*args)
