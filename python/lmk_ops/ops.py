"""The public pooling functions. Each calls operators registered with the PyTorch dispatcher
(``torch.ops.lmk_ops.*``), so it works eagerly, under autograd and under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from ._checks import call_problem, check_call, check_flag, check_hidden, check_landmarks, check_mask
from ._checks import check_offsets, check_packed, check_packed_mask, check_scale_type, fail, is_integer, values_known
from ._dispatch import call as _call

__all__ = [
    "attention_pool", "first_token_pool", "landmark_gather", "landmark_mean", "landmark_positions", "last_token_pool",
    "max_pool", "mean_pool",
]

_PACKED_DOC = """cu_seqlens: for a packed (variable-length) batch: int32 or int64 ``[B + 1]`` offsets on hidden's
            device (first 0, last T, non-decreasing; texts may be empty), as flash-attention's varlen kernels and
            transformers' ``DataCollatorWithFlattening`` give them. hidden is then ``[T, D]`` (any strides), a mask
            ``[T]``, and each text pools to the same bits as padded or alone.
        max_seqlen: with cu_seqlens, the longest text's length if known (a host int), as varlen kernels take it:
            checked to be at least every text's length. The ops need no device sync without it."""


_NORMALIZE_DOC = """normalize: L2-normalise each output vector inside the op (forward and backward), as
            ``torch.nn.functional.normalize(out, dim=-1)`` would, but from the float32 result before it is rounded to
            hidden's dtype. A zero vector stays zero."""


def mean_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False,
              cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> Tensor:
    """Mask-aware mean of the token states of each text.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        mask: ``[B, L]`` bool, or integer holding 0/1 (a Hugging Face ``attention_mask``), on hidden's device;
            ``None`` means every token is valid.
        {normalize}
        {packed}

    Returns:
        ``[B, D]`` in hidden's dtype: the mean of the valid rows, accumulated in float32 (float64 for float64).
        A text with no valid token gives zeros, and its gradient is zero. Padding on either side is fine.

    Raises:
        RuntimeError: starting ``lmk_ops.mean_pool:`` for hidden that is not 3-D floating point, a mask of
        another shape, device or dtype (float), or mask values other than 0/1.
    """
    normalize = check_flag("mean_pool", "normalize", normalize)
    return _checked_call("mean_pool", torch.ops.lmk_ops.mean_pool, (hidden, mask, normalize, cu_seqlens, max_seqlen),
                         mask=mask, cu_seqlens=cu_seqlens)[0]


# What max_pool returns, for type checkers: the values alone, or with return_indices=True also the positions.
@overload
def max_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False,
             return_indices: Literal[False] = False, cu_seqlens: Tensor | None = None,
             max_seqlen: int | None = None) -> Tensor: ...
@overload
def max_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False, return_indices: Literal[True],
             cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> tuple[Tensor, Tensor]: ...
@overload
def max_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False, return_indices: bool,
             cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> Tensor | tuple[Tensor, Tensor]: ...
def max_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False, return_indices: bool = False,
             cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Mask-aware element-wise maximum over the token states of each text.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        mask: ``[B, L]`` bool or integer 0/1, ``None`` meaning every token is valid.
        {normalize}
        return_indices: also return the position each maximum came from: the column of hidden's row (padded,
            either side, as ``torch.max`` over dim 1 gives it), counted from the text's start (packed).
        {packed}

    Returns:
        ``[B, D]`` in hidden's dtype; with ``return_indices``, also an int32 ``[B, D]`` tensor of positions.
        Ties go to the first position, and the gradient of each output element flows to that one position. A NaN
        among the valid tokens wins (the first NaN), as in ``torch.max``. A text with no valid token gives zeros,
        position -1, and zero gradient.

    Raises:
        RuntimeError: starting ``lmk_ops.max_pool:``, as for :func:`mean_pool`.
    """
    normalize = check_flag("max_pool", "normalize", normalize)
    return_indices = check_flag("max_pool", "return_indices", return_indices)
    values, argmax, _ = _checked_call("max_pool", torch.ops.lmk_ops.max_pool,
                                      (hidden, mask, normalize, cu_seqlens, max_seqlen), mask=mask,
                                      cu_seqlens=cu_seqlens)
    return (values, argmax) if return_indices else values


def landmark_mean(hidden: Tensor, landmarks: Tensor, *, normalize: bool = False, cu_seqlens: Tensor | None = None,
                  max_seqlen: int | None = None) -> Tensor:
    """LMK pooling: the mean of the landmark tokens' states only (arXiv 2601.21525).

    Only the landmark rows are read, so the cost grows with the number of landmarks, not with L. The backward
    writes ``grad / count`` into the landmark rows and zeros elsewhere.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        landmarks: either a bool mask ``[B, L]`` (True at landmark tokens, as :func:`lmk_ops.insert_landmarks`
            returns), or int64 positions ``[B, K]`` padded with -1 (``-1`` entries may appear anywhere and are
            skipped). A position listed twice counts twice: the result is the mean of the listed rows, exactly
            the mean of what :func:`landmark_gather` returns for the valid entries. An integer mask is *not* taken
            for a mask: an int64 ``[B, L]`` (L >= 3) of 0s and 1s only, which as positions would list rows 0 and 1
            again and again, is refused as a bad value; pass ``mask.bool()``. Packed: a bool ``[T]`` mask, or
            positions ``[B, K]`` counted from each text's start.
        {normalize}
        {packed}

    Returns:
        ``[B, D]`` in hidden's dtype, accumulated in float32 (float64 for float64). A text without landmarks gives
        zeros and zero gradient.

    Raises:
        RuntimeError: starting ``lmk_ops.landmark_mean:`` for a bad hidden, landmarks of another dtype, shape or
        device, or a position outside ``[0, L)`` other than -1 (the message names the row and the entry; nothing
        outside hidden is ever read).
    """
    normalize = check_flag("landmark_mean", "normalize", normalize)
    return _checked_call("landmark_mean", torch.ops.lmk_ops.landmark_mean,
                         (hidden, landmarks, normalize, cu_seqlens, max_seqlen), landmarks=landmarks,
                         cu_seqlens=cu_seqlens)[0]


def _checked_call(name: str, op, args: tuple, **others):
    """op(*args) for the public function `name` (args: hidden first, max_seqlen last; others: the other tensor
    arguments by name), with check_call's checks: first while compiling (the fake kernels see the inputs first),
    otherwise once the op has failed, to turn the dispatcher's unclear error for a list, a nested or a sparse tensor
    into an lmk_ops one.
    Taken first, they cost a small call a third of its time (first_token_pool of one row: 17 -> 12 µs)."""
    hidden, max_seqlen = args[0], args[-1]
    # A max_seqlen that is not a plain int (a bool or a float would pass the dispatcher) is checked first too.
    if torch.compiler.is_compiling() or (max_seqlen is not None and type(max_seqlen) is not int):
        check_call(name, hidden, max_seqlen=max_seqlen, **others)
        return _call(op, *args)
    try:
        return _call(op, *args)
    except (TypeError, NotImplementedError, RuntimeError):
        problem = call_problem(hidden, max_seqlen, others)
        if problem is None:
            raise
    raise RuntimeError(f"lmk_ops.{name}: {problem}")


def landmark_positions(landmark_mask: Tensor, num_landmarks: int | None = None, *,
                       cu_seqlens: Tensor | None = None) -> Tensor:
    """The positions of the True entries of a bool ``[B, L]`` mask, in order, as int64 ``[B, K]`` padded with -1.

    ``K`` is ``num_landmarks`` when given (a row with more landmarks is an error, eagerly and inside a compiled
    graph; on CUDA a device-side assertion, as for the ops' other value checks), else the largest count in the
    batch. One op on every device: one pass over the mask with ``num_landmarks``, two without it (the first
    counts, and K is read back to the host).
    Both trace under ``torch.compile(fullgraph=True)``: without ``num_landmarks`` the width is an unbacked size in
    the graph (the op reads the counts back to the host to allocate the positions, as in eager). With
    ``num_landmarks`` given it also runs on meta and fake tensors, where the values cannot be counted.

    With ``cu_seqlens`` (a packed batch), the mask is ``[T]`` and positions count from each text's start.
    """
    return _positions("landmark_positions", landmark_mask, num_landmarks, cu_seqlens)


def _positions(op: str, landmark_mask: Tensor, num_landmarks: int | None, cu_seqlens: Tensor | None) -> Tensor:
    """landmark_positions, its errors naming op (the public function that was called)."""
    rank_dims = 1 if cu_seqlens is not None else 2
    if not isinstance(landmark_mask, Tensor) or landmark_mask.dtype != torch.bool or landmark_mask.dim() != rank_dims:
        fail(op, f"expected a bool landmark mask of shape {'[T]' if rank_dims == 1 else '[B, L]'}, got "
                 f"{getattr(landmark_mask, 'dtype', None)} of shape {list(getattr(landmark_mask, 'shape', []))}")
    if num_landmarks is not None and not isinstance(num_landmarks, torch.SymInt):
        if not is_integer(num_landmarks) or num_landmarks < 0:
            fail(op, f"expected num_landmarks as an int in [0, 2**63) (or None), got {num_landmarks!r}")
        num_landmarks = int(num_landmarks)  # a NumPy integer too
    if cu_seqlens is not None:
        check_offsets(op, cu_seqlens, landmark_mask, "the landmark mask")
    if num_landmarks is None:
        if torch.compiler.is_compiling():  # torch.compile, torch.export: K is an unbacked size in the graph
            return torch.ops.lmk_ops.fitted_landmark_positions(landmark_mask, cu_seqlens, op)
        if not values_known(landmark_mask):
            fail(op, "expected num_landmarks where the mask's values cannot be read (meta or fake tensors outside "
                     "torch.compile, torch.vmap): the output's width K depends on them")
        return _fitted_positions(landmark_mask, cu_seqlens, op)
    # One op on every device: a text with more than num_landmarks landmarks is refused there (on CUDA by a
    # device-side assertion, without synchronising), inside a compiled graph too.
    return torch.ops.lmk_ops.landmark_positions(landmark_mask, num_landmarks, cu_seqlens, op)[0]


def _fitted_positions(landmark_mask: Tensor, cu_seqlens: Tensor | None, op: str) -> Tensor:
    """The positions [B, K] with K the largest count: a counting pass, K read back to the host, the listing pass."""
    counts = torch.ops.lmk_ops.landmark_positions(landmark_mask, None, cu_seqlens, op)[1]
    num_landmarks = int(counts.max()) if counts.numel() else 0
    return torch.ops.lmk_ops.landmark_positions(landmark_mask, num_landmarks, cu_seqlens, op)[0]


@torch.library.custom_op("lmk_ops::fitted_landmark_positions", mutates_args=())
def _fitted_positions_op(landmark_mask: Tensor, cu_seqlens: Tensor | None, op: str) -> Tensor:
    """_fitted_positions as one op for torch.compile, whose fake gives the width as an unbacked size: the graph
    stays whole where K is not given (a Python read of the count would end it)."""
    return _fitted_positions(landmark_mask, cu_seqlens, op)


@_fitted_positions_op.register_fake
def _(landmark_mask: Tensor, cu_seqlens: Tensor | None, op: str) -> Tensor:
    counts = torch.ops.lmk_ops.landmark_positions(landmark_mask, None, cu_seqlens, op)[1]  # its checks, and B
    return counts.new_empty((counts.shape[0], torch.library.get_ctx().new_dynamic_size()))


def landmark_gather(hidden: Tensor, landmarks: Tensor, *, num_landmarks: int | None = None,
                    cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
    """One vector per landmark: chunk or sentence embeddings (as in BGE Landmark Embedding, arXiv 2402.11573).

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides (``[T, D]`` with cu_seqlens).
        landmarks: int64 positions ``[B, K]`` padded with -1, or a bool mask ``[B, L]`` (``[T]`` packed; turned
            into positions by :func:`landmark_positions`, with ``num_landmarks``). Packed positions count from
            each text's start. An int64 ``[B, L]`` 0/1 mask is refused, as in :func:`landmark_mean`.
        cu_seqlens: a packed batch's offsets, as for :func:`mean_pool`.
        max_seqlen: accepted for one call shape across the ops (K comes from the positions or num_landmarks); a
            text longer than it is an error, as in the other ops.

    Returns:
        ``(vectors, valid)``: ``[B, K, D]`` in hidden's dtype, with zero rows where there is no landmark, and the
        bool ``[B, K]`` validity mask. The gradient flows back to the landmark rows; a position listed twice gets
        the sum of both gradients.

    Raises:
        RuntimeError: starting ``lmk_ops.landmark_gather:``, as for :func:`landmark_mean`.
    """
    op = "landmark_gather"
    check_call(op, hidden, landmarks=landmarks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    mask_given = isinstance(landmarks, Tensor) and landmarks.dtype == torch.bool
    # Everything but int64 positions is checked here, so that landmarks of another dtype (an int8 or int32 mask) are
    # named as landmark_mean names them: a bool mask or int64 positions (the positions op alone would say only
    # "expected landmark positions of dtype int64").
    not_positions = isinstance(landmarks, Tensor) and landmarks.dtype != torch.int64
    if cu_seqlens is not None:
        batch = check_packed(op, hidden, cu_seqlens, max_seqlen)
        if max_seqlen is not None:  # the gather needs no width, but a wrong hint is refused as by every op (the
            # checked offsets are used, so that torch.compile keeps the check)
            cu_seqlens = torch.ops.lmk_ops.packed_offsets(cu_seqlens, hidden.shape[0], max_seqlen, op)
        if not_positions:
            check_landmarks(op, landmarks, batch, hidden.shape[0], hidden, packed=True)
    else:
        check_hidden(op, hidden, max_seqlen)
        if not_positions:
            check_landmarks(op, landmarks, hidden.shape[0], hidden.shape[1], hidden)
    if mask_given:
        landmarks = _positions(op, landmarks, num_landmarks, cu_seqlens)
    elif num_landmarks is not None and not isinstance(num_landmarks, torch.SymInt):
        # Positions [B, K] set K: a num_landmarks beside them must agree (it would be silently ignored).
        if not is_integer(num_landmarks) or num_landmarks != landmarks.shape[1]:
            fail(op, f"expected num_landmarks = K = {landmarks.shape[1]} (the width of the positions [B, K]) or "
                     f"None, got {num_landmarks!r}")
    return _call(torch.ops.lmk_ops.landmark_gather, hidden, landmarks, cu_seqlens), landmarks >= 0


for _fn in (mean_pool, max_pool, landmark_mean):
    if _fn.__doc__ is not None:  # None under python -OO, which strips docstrings
        _fn.__doc__ = _fn.__doc__.replace("{normalize}", _NORMALIZE_DOC).replace("{packed}", _PACKED_DOC)


def first_token_pool(hidden: Tensor, mask: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
                     max_seqlen: int | None = None) -> Tensor:
    """The state of each text's first valid token (CLS pooling), whatever the padding side. One op: finds the row
    and copies it.

    Args and errors as :func:`mean_pool` (packed batches too). Returns ``[B, D]``; a text with no valid token gives
    zeros. The gradient goes to that one token.
    """
    return _checked_call("first_token_pool", torch.ops.lmk_ops.token_pool,
                         (hidden, mask, False, cu_seqlens, max_seqlen), mask=mask, cu_seqlens=cu_seqlens)[0]


def last_token_pool(hidden: Tensor, mask: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
                    max_seqlen: int | None = None) -> Tensor:
    """The state of each text's last valid token (as decoder embedding models pool), whatever the padding side.

    Args and errors as :func:`mean_pool` (packed batches too). Returns ``[B, D]``; a text with no valid token gives
    zeros.
    """
    return _checked_call("last_token_pool", torch.ops.lmk_ops.token_pool,
                         (hidden, mask, True, cu_seqlens, max_seqlen), mask=mask, cu_seqlens=cu_seqlens)[0]


def bool_mask(op: str, mask: Tensor) -> Tensor:
    """A 0/1 mask [T] or [B, L] as a bool mask: an integer one's values checked by the valid_mask op (the same failure
    eager and compiled, errors naming op), a bool one as it is."""
    if mask.dtype == torch.bool:
        return mask
    return torch.ops.lmk_ops.valid_mask(mask, op)


def padded_valid(op: str, hidden: Tensor, mask: Tensor | None) -> Tensor:
    """A padded batch's hidden [B, L, D] and mask, checked as the ops check them (errors naming op): the valid tokens
    as a bool [B, L] mask."""
    check_hidden(op, hidden)
    check_mask(op, mask, hidden.shape[0], hidden.shape[1], hidden)
    if mask is None:
        return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return bool_mask(op, mask)


def packed_valid(op: str, hidden: Tensor, mask: Tensor | None, cu_seqlens: Tensor, max_seqlen: int | None):
    """A packed batch's hidden [T, D], mask and offsets, checked as the ops check them (errors naming op): the
    offsets as int64 [B + 1] and the valid tokens as a bool [T] mask."""
    check_packed(op, hidden, cu_seqlens, max_seqlen)
    check_packed_mask(op, mask, hidden.shape[0], hidden)
    offsets = torch.ops.lmk_ops.packed_offsets(cu_seqlens, hidden.shape[0], max_seqlen, op)
    if mask is None:
        return offsets, torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    return offsets, bool_mask(op, mask)


# What attention_pool returns, for type checkers: the pooled vectors, or with return_weights=True also the weights.
@overload
def attention_pool(hidden: Tensor, mask: Tensor | None, query: Tensor, *, scale: float | None = None,
                   return_weights: Literal[False] = False, cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None) -> Tensor: ...
@overload
def attention_pool(hidden: Tensor, mask: Tensor | None, query: Tensor, *, scale: float | None = None,
                   return_weights: Literal[True], cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None) -> tuple[Tensor, Tensor]: ...
@overload
def attention_pool(hidden: Tensor, mask: Tensor | None, query: Tensor, *, scale: float | None = None,
                   return_weights: bool, cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None) -> Tensor | tuple[Tensor, Tensor]: ...
def attention_pool(hidden: Tensor, mask: Tensor | None, query: Tensor, *, scale: float | None = None,
                   return_weights: bool = False, cu_seqlens: Tensor | None = None,
                   max_seqlen: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention pooling: a softmax over each text's valid tokens, scored against a learned query, weights the sum.

    One pass over hidden with an online softmax; the backward recomputes the probabilities from the saved softmax
    statistics (max score and sum per text and head) and gives the gradients of hidden and of query in one more
    pass.

    Args:
        hidden: ``[B, L, D]`` float16, bfloat16, float32 or float64, any strides.
        mask: ``[B, L]`` bool or integer 0/1, ``None`` meaning every token is valid.
        query: ``[D]`` (one head) or ``[H, D // H]`` (H heads: head h scores and pools its own slice
            ``[h * D // H, (h + 1) * D // H)`` of the features), any floating dtype (used in float32, float64 for
            float64 hidden); its gradient comes back in its own dtype.
        scale: multiplies the scores ``<hidden[b, l, slice_h], query[h]>``; default ``1 / sqrt(D // H)``.
        return_weights: also return the probabilities, differentiable.
        cu_seqlens, max_seqlen: a packed batch, as for :func:`mean_pool`; the weights are then ``[T]`` or
            ``[H, T]``.

    Returns:
        ``[B, D]`` in hidden's dtype: per head, the probability-weighted sum of its slice, with the softmax in
        float32 (float64 for float64). Extreme scores cannot overflow. A text with no valid token gives zeros and
        zero gradient. With ``return_weights``, also the probabilities in float32 (float64 for float64): ``[B, L]``
        for a ``[D]`` query, ``[B, H, L]`` for ``[H, D // H]``; zero at masked tokens and for a text with none.
        Double backward works, through the plain-PyTorch reference (correct, not fused).

    Raises:
        RuntimeError: starting ``lmk_ops.attention_pool:`` for a bad hidden or mask (as :func:`mean_pool`), hidden
        with ``D = 0``, a query of another shape, dtype or device, or a scale that is not finite.
    """
    return_weights = check_flag("attention_pool", "return_weights", return_weights)
    check_scale_type("attention_pool", scale)
    out, _, weights = _checked_call("attention_pool", torch.ops.lmk_ops.attention_pool,
                                    (hidden, mask, query, scale, return_weights, cu_seqlens, max_seqlen), mask=mask,
                                    query=query, cu_seqlens=cu_seqlens)
    if not return_weights:
        return out
    return out, weights.squeeze(-2 if cu_seqlens is None else 0) if query.dim() == 1 else weights
