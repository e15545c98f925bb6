"""Structural input checks for the fake (meta) kernels, worded exactly as the C++ checks in csrc/common/checks.cpp.

Under torch.compile the fake kernels see the inputs first, so a bad call must fail there with the same message it
gets eagerly. Checks that need tensor values (mask entries are 0/1, landmark positions in range) exist only in C++,
in the forward ops.
"""

from __future__ import annotations

import math
import numbers
from typing import NoReturn

import torch
from torch._subclasses.fake_tensor import FakeTensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# c10 prints ScalarType names ("Float", "Long", ...); the messages here match them.
_DTYPE_NAMES = {
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double",
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels accumulate a floating dtype in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def fail(op: str, message: str) -> NoReturn:
    raise RuntimeError(f"lmk_ops.{op}: {message}")


def _type_name(value) -> str:
    return "None" if value is None else type(value).__name__


def is_flag(value) -> bool:
    """Whether value is a yes/no argument: a bool, or a NumPy bool or an int 0/1 as Python treats them; anything
    else (a string, None) is refused rather than taken for its truth value."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    return isinstance(value, bool) or numpy_bool or (isinstance(value, numbers.Integral) and value in (0, 1))


def is_integer(value) -> bool:
    """A Python or NumPy integer that an int64 holds (as the ops and tensors take it), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and -2**63 <= int(value) < 2**63


def is_int(value) -> bool:
    """A Python or NumPy integer (or a 0-d integer tensor), not a bool or a float."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return is_integer(value)


def values_known(t: torch.Tensor) -> bool:
    """Whether t's values can be read here: not while tracing (torch.compile, FakeTensor), not inside torch.func
    transforms (torch.vmap, whose tensors refuse .item()) and not on meta."""
    return not (torch.compiler.is_compiling() or t.device.type == "meta" or isinstance(t, FakeTensor)
                or torch._C._functorch.peek_interpreter_stack() is not None)


def check_flag(op: str, name: str, value) -> bool:
    """A yes/no argument (normalize, return_weights, ...) as a bool (see is_flag)."""
    if not is_flag(value):
        fail(op, f"expected {name} as a bool, got {value!r}")
    return bool(value)


def call_problem(hidden, max_seqlen, others: dict) -> str | None:
    """What is wrong with a public function's arguments where the dispatcher would fail unclearly (a TypeError, or a
    missing-kernel error for a nested, quantized or sparse tensor): hidden that is not a dense strided tensor, other
    tensor arguments (by name; query and landmarks required, the rest optional) that are not tensors, a max_seqlen
    that is not an int >= 0. None when nothing is."""
    if not isinstance(hidden, torch.Tensor):
        return f"expected hidden to be a tensor [B, L, D], got {_type_name(hidden)}"
    if max_seqlen is not None and not isinstance(max_seqlen, torch.SymInt) and (
            not is_integer(max_seqlen) or max_seqlen < 0):
        return f"expected max_seqlen as an int in [0, 2**63) (or None), got {max_seqlen!r}"
    for name, value in others.items():
        required = name in ("query", "landmarks")
        if not isinstance(value, torch.Tensor) and (required or value is not None):
            return f"expected {name} to be a tensor{'' if required else ' or None'}, got {_type_name(value)}"
    if hidden.is_nested:
        return ("expected hidden as a dense [B, L, D] tensor, got a nested tensor (pad it with "
                "hidden.to_padded_tensor(0.0) and pass a mask)")
    if hidden.is_quantized:
        return (f"expected hidden of dtype float16, bfloat16, float32 or float64, got a quantized tensor "
                f"({dtype_name(hidden.dtype)}): dequantize it first")
    if hidden.layout != torch.strided:
        return f"expected hidden as a dense (strided) tensor, got layout {hidden.layout} (convert it with to_dense())"
    return None


def check_call(op: str, hidden, *, max_seqlen=None, **others) -> None:
    """Everything a public function checks before calling an op (call_problem)."""
    problem = call_problem(hidden, max_seqlen, others)
    if problem is not None:
        fail(op, problem)


def check_hidden(op: str, hidden: torch.Tensor, max_seqlen=None) -> None:
    if hidden.dim() != 3:
        fail(op, f"expected hidden of shape [B, L, D] (3-D), got a {hidden.dim()}-D tensor of shape {_shape(hidden)}")
    if hidden.dtype not in _FLOATS:
        fail(op, f"expected hidden of dtype float16, bfloat16, float32 or float64, got {dtype_name(hidden.dtype)}")
    if max_seqlen is not None:  # a packed batch's hint: taken silently, it would hide a call that forgot cu_seqlens
        fail(op, f"expected max_seqlen only with cu_seqlens (a packed batch), got max_seqlen = {max_seqlen} for a "
                 f"padded hidden of shape {_shape(hidden)}")


def check_pooled_grad(op: str, grad: torch.Tensor) -> None:
    check_grad(op, grad, 2, "[B, D]")


def check_mask(op: str, mask: torch.Tensor | None, batch, seq_len, like: torch.Tensor) -> None:
    if mask is None:
        return
    if mask.device != like.device:
        fail(op, f"expected mask on the same device as hidden ({like.device}), got {mask.device}")
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != seq_len:
        fail(op, f"expected mask of shape [B, L] = [{batch}, {seq_len}], got {_shape(mask)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        fail(op, f"expected mask of dtype bool or an integer dtype holding 0/1, got {dtype_name(mask.dtype)}")


def check_grad(op: str, grad: torch.Tensor, dims: int, shape: str) -> None:
    if grad.dim() != dims:
        fail(op, f"expected grad_out of shape {shape} ({dims}-D), got shape {_shape(grad)}")
    if grad.dtype not in _FLOATS:
        fail(op, f"expected grad_out of dtype float16, bfloat16, float32 or float64, got {dtype_name(grad.dtype)}")


def check_grad_dtype(op: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _FLOATS:
        fail(op, f"expected dtype float16, bfloat16, float32 or float64, got {dtype_name(dtype)}")


def check_positions(op: str, positions: torch.Tensor, batch, like: torch.Tensor) -> None:
    if positions.device != like.device:
        fail(op, f"expected landmarks on the same device as hidden ({like.device}), got {positions.device}")
    if positions.dtype != torch.int64:
        fail(op, f"expected landmark positions of dtype int64 (padded with -1), got {dtype_name(positions.dtype)}")
    if positions.dim() != 2 or positions.shape[0] != batch:
        fail(op, f"expected landmark positions of shape [B, K] = [{batch}, K], got {_shape(positions)}")


def check_landmarks(op: str, landmarks: torch.Tensor, batch, seq_len, like: torch.Tensor, packed: bool = False) -> None:
    """A landmark mask [B, L] ([T] for a packed batch of seq_len = T rows) or int64 positions [B, K]."""
    mask_shape = "[T]" if packed else "[B, L]"
    if landmarks.dtype not in (torch.bool, torch.int64):
        fail(op, f"expected {'packed ' if packed else ''}landmarks as a bool mask {mask_shape} or int64 positions "
             f"[B, K] padded with -1, got {dtype_name(landmarks.dtype)}")
    if landmarks.dtype == torch.int64:
        check_positions(op, landmarks, batch, like)
        return
    if landmarks.device != like.device:
        fail(op, f"expected landmarks on the same device as hidden ({like.device}), got {landmarks.device}")
    expected = (seq_len,) if packed else (batch, seq_len)
    if tuple(landmarks.shape) != expected:
        fail(op, f"expected a {'packed ' if packed else ''}landmark mask of shape {mask_shape} = "
                 f"[{', '.join(str(s) for s in expected)}], got {_shape(landmarks)}")


def check_query(op: str, query: torch.Tensor, hidden: torch.Tensor) -> tuple[int, int]:
    """query [D] or [H, D // H] for hidden [B, L, D] or packed [T, D] (checked); returns (H, D // H)."""
    dim = hidden.shape[-1]
    if dim == 0:
        fail(op, f"expected hidden with D > 0 features (attention scores need them), got shape {_shape(hidden)}")
    if query.device != hidden.device:
        fail(op, f"expected query on the same device as hidden ({hidden.device}), got {query.device}")
    if query.dtype not in _FLOATS:
        fail(op, f"expected query of dtype float16, bfloat16, float32 or float64, got {dtype_name(query.dtype)}")
    if query.dim() == 1 and query.shape[0] == dim:
        return 1, dim
    if query.dim() == 2 and query.shape[0] > 0 and query.shape[0] * query.shape[1] == dim:
        return query.shape[0], query.shape[1]
    fail(op, f"expected query of shape [D] = [{dim}] (one head) or [H, D / H] with H * (D / H) = {dim} (H heads), "
         f"got {_shape(query)}")


_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_scale_type(op: str, scale) -> None:
    """The scale's type, before the dispatcher sees it (its value is checked by the op: check_scale)."""
    if isinstance(scale, torch.Tensor):
        fail(op, "expected scale as a Python number, got a tensor (a scale is not learned: a learned one is the "
                 "query's norm, so fold it into the query)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat))):
        fail(op, f"expected scale as a real number or None, got {_type_name(scale)}")


def check_scale(op: str, scale: float | None) -> None:
    if scale is not None and not (math.isfinite(scale) and abs(scale) <= _FLOAT32_MAX):
        fail(op, f"expected a scale finite in float32, got {scale}")


def check_float_tensor(op: str, name: str, t: torch.Tensor, shape, like: torch.Tensor) -> None:
    if t.device != like.device:
        fail(op, f"expected {name} on the same device as hidden ({like.device}), got {t.device}")
    if t.dtype not in _FLOATS or list(t.shape) != list(shape):
        fail(op, f"expected {name} of a floating dtype and shape [{', '.join(str(s) for s in shape)}], got "
             f"{dtype_name(t.dtype)} of shape {_shape(t)}")


def check_packed(op: str, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen=None) -> int:
    """hidden [T, D] with cu_seqlens [B + 1] (int32/int64, hidden's device); returns B. Values are checked in C++."""
    if hidden.dim() != 2:
        fail(op, f"expected packed hidden of shape [T, D] (2-D, with cu_seqlens), got a {hidden.dim()}-D tensor of "
                 f"shape {_shape(hidden)}")
    if hidden.dtype not in _FLOATS:
        fail(op, f"expected hidden of dtype float16, bfloat16, float32 or float64, got {dtype_name(hidden.dtype)}")
    check_offsets(op, cu_seqlens, hidden)
    if max_seqlen is not None and not isinstance(max_seqlen, torch.SymInt) and max_seqlen < 0:
        fail(op, f"expected max_seqlen >= 0, got {max_seqlen}")
    return cu_seqlens.shape[0] - 1


def check_offsets(op: str, cu_seqlens: torch.Tensor, like: torch.Tensor, like_name: str = "hidden") -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        fail(op, f"expected cu_seqlens to be a tensor or None, got {_type_name(cu_seqlens)}")
    if cu_seqlens.device != like.device:
        fail(op, f"expected cu_seqlens on the same device as {like_name} ({like.device}), got {cu_seqlens.device}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail(op, f"expected cu_seqlens of dtype int32 or int64, got {dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        fail(op, f"expected cu_seqlens of shape [B + 1] (1-D, at least one entry), got {_shape(cu_seqlens)}")


def check_packed_mask(op: str, mask: torch.Tensor | None, tokens, like: torch.Tensor) -> None:
    if mask is None:
        return
    if mask.device != like.device:
        fail(op, f"expected mask on the same device as hidden ({like.device}), got {mask.device}")
    if mask.dim() != 1 or mask.shape[0] != tokens:
        fail(op, f"expected a packed mask of shape [T] = [{tokens}], got {_shape(mask)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        fail(op, f"expected mask of dtype bool or an integer dtype holding 0/1, got {dtype_name(mask.dtype)}")
