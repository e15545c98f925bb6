"""Plain-PyTorch versions of every op, with the same semantics: the oracle for the tests and the baseline for the
benchmarks. They are written as a user would write them in eager PyTorch, in the input's own dtype (call them on
an upcast input to get a float32 / float64 oracle). Each pooling reference takes a packed batch too (keyword-only
``cu_seqlens`` / ``max_seqlen``, hidden ``[T, D]``, masks ``[T]``, positions ``[B, K]`` counted from each text's
start), through its padded form: what a user without lmk_ops would write."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import values_known

__all__ = [
    "attention_pool", "attention_pool_backward_jvp", "attention_pool_jvp", "first_token_pool", "index_add_mean",
    "insert_landmarks", "last_token_pool", "landmark_gather", "landmark_mean", "max_pool", "mean_pool", "padded_view",
    "scatter_max", "segment_max", "segment_mean",
]


def _valid(hidden: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return mask != 0


def _maybe_normalize(out: Tensor, normalize: bool) -> Tensor:
    # F.normalize's eps (1e-12) is 0 in float16, where a zero row would become 0/0 = NaN: keep eps representable.
    return F.normalize(out, dim=-1, eps=max(1e-12, torch.finfo(out.dtype).tiny)) if normalize else out


def _unpacked(hidden: Tensor, mask: Tensor | None, cu_seqlens: Tensor | None, max_seqlen: int | None):
    """(hidden, mask) as the padded references take them: a packed batch's padded form [B, W, D] and its valid
    tokens [B, W] (padded_view's), else the arguments as they came."""
    if cu_seqlens is None:
        return hidden, mask
    padded, valid, _, _ = padded_view(hidden, mask, cu_seqlens, max_seqlen)
    return padded, valid


def mean_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False,
              cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> Tensor:
    hidden, mask = _unpacked(hidden, mask, cu_seqlens, max_seqlen)
    valid = _valid(hidden, mask)
    summed = (hidden * valid.unsqueeze(-1).to(hidden.dtype)).sum(dim=1)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1).to(hidden.dtype)
    return _maybe_normalize(summed / count, normalize)


def _no_tokens(hidden: Tensor) -> Tensor:
    """The pooled zeros of a batch of texts of length 0 (argmax and amax refuse an empty dimension): the sum over
    no rows, so that they stay in hidden's graph, as lmk_ops' results do (a backward through them gives hidden its
    empty gradient instead of failing)."""
    return hidden.sum(dim=1)


def max_pool(hidden: Tensor, mask: Tensor | None = None, *, normalize: bool = False, return_indices: bool = False,
             cu_seqlens: Tensor | None = None, max_seqlen: int | None = None):
    hidden, mask = _unpacked(hidden, mask, cu_seqlens, max_seqlen)  # positions count from each text's start
    if hidden.shape[1] == 0:
        empty = _no_tokens(hidden)
        return (empty, torch.full(empty.shape, -1, dtype=torch.int32, device=hidden.device)) if return_indices \
            else empty
    valid = _valid(hidden, mask).unsqueeze(-1)
    filled = hidden.masked_fill(~valid, float("-inf"))
    best = filled.amax(dim=1, keepdim=True)
    # The first valid position holding the maximum (a NaN counts as the maximum), 0 where none is valid. (Not
    # argmax of hit as int8, which finds the first hit too: torch.compile of that on CUDA, torch 2.11, gathered out
    # of range in the backward, a device-side assert.)
    hit = ((filled == best) | (filled.isnan() & best.isnan())) & valid
    positions = torch.arange(hidden.shape[1], device=hidden.device).view(1, -1, 1)
    index = torch.where(hit, positions, hidden.shape[1]).amin(dim=1).clamp_max(hidden.shape[1] - 1)
    values = hidden.gather(1, index.unsqueeze(1)).squeeze(1)
    any_valid = valid.any(dim=1)
    values = _maybe_normalize(torch.where(any_valid, values, torch.zeros_like(values)), normalize)
    if return_indices:
        return values, torch.where(any_valid, index, -1).to(torch.int32)
    return values


def first_token_pool(hidden: Tensor, mask: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
                     max_seqlen: int | None = None) -> Tensor:
    """The first valid token's state (zeros for a text with none), as sentence-transformers' cls pooling finds it."""
    hidden, mask = _unpacked(hidden, mask, cu_seqlens, max_seqlen)
    if hidden.shape[1] == 0:
        return _no_tokens(hidden)
    valid = _valid(hidden, mask)
    index = valid.to(torch.int).argmax(dim=1)
    picked = hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.shape[2])).squeeze(1)
    return picked * valid.any(dim=1, keepdim=True).to(hidden.dtype)


def last_token_pool(hidden: Tensor, mask: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
                    max_seqlen: int | None = None) -> Tensor:
    hidden, mask = _unpacked(hidden, mask, cu_seqlens, max_seqlen)
    if hidden.shape[1] == 0:
        return _no_tokens(hidden)
    valid = _valid(hidden, mask)
    index = hidden.shape[1] - 1 - valid.flip(1).to(torch.int).argmax(dim=1)
    picked = hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.shape[2])).squeeze(1)
    return picked * valid.any(dim=1, keepdim=True).to(hidden.dtype)


def _positions(landmarks: Tensor) -> Tensor:
    """int64 positions [B, K] padded with -1 from either landmark form (a bool mask: a loop over rows)."""
    if landmarks.dtype != torch.bool:
        return landmarks
    rows = [row.nonzero().flatten() for row in landmarks]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((landmarks.shape[0], width), -1, dtype=torch.long, device=landmarks.device)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out


def _unpacked_landmarks(hidden: Tensor, landmarks: Tensor, cu_seqlens: Tensor | None, max_seqlen: int | None):
    """(hidden, landmarks) in padded form: a packed [T] mask becomes [B, W]; positions [B, K] already count from
    each text's start, as a padded row's columns do."""
    if landmarks.dtype == torch.bool:
        return _unpacked(hidden, landmarks, cu_seqlens, max_seqlen)
    return _unpacked(hidden, None, cu_seqlens, max_seqlen)[0], landmarks


def landmark_gather(hidden: Tensor, landmarks: Tensor, *, cu_seqlens: Tensor | None = None,
                    max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
    hidden, landmarks = _unpacked_landmarks(hidden, landmarks, cu_seqlens, max_seqlen)
    positions = _positions(landmarks)
    valid = positions >= 0
    if hidden.shape[1] == 0:  # nothing to gather from: every entry is -1
        return _no_tokens(hidden).unsqueeze(1).repeat(1, positions.shape[1], 1), valid
    index = positions.clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[2])
    gathered = hidden.gather(1, index) * valid.unsqueeze(-1).to(hidden.dtype)
    return gathered, valid


def landmark_mean(hidden: Tensor, landmarks: Tensor, *, normalize: bool = False, cu_seqlens: Tensor | None = None,
                  max_seqlen: int | None = None) -> Tensor:
    hidden, landmarks = _unpacked_landmarks(hidden, landmarks, cu_seqlens, max_seqlen)
    if landmarks.dtype == torch.bool:
        return mean_pool(hidden, landmarks, normalize=normalize)
    gathered, valid = landmark_gather(hidden, landmarks)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1).to(hidden.dtype)
    return _maybe_normalize(gathered.sum(dim=1) / count, normalize)


def attention_pool(hidden: Tensor, mask: Tensor | None, query: Tensor, *, scale: float | None = None,
                   return_weights: bool = False, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None):
    if cu_seqlens is not None:  # through the padded layout; the weights come back as [T] / [H, T]
        padded, valid, text, slot = padded_view(hidden, mask, cu_seqlens, max_seqlen)
        result = attention_pool(padded, valid, query, scale=scale, return_weights=return_weights)
        if not return_weights:
            return result
        out, weights = result
        weights = weights[text, slot] if query.dim() == 1 else weights[text, :, slot].T
        return out, weights
    states, _, _, _, weights = _attention_weights(hidden, mask, query, scale)
    out = torch.einsum("bhl,blhd->bhd", weights.to(hidden.dtype), states).reshape(hidden.shape[0], hidden.shape[2])
    if not return_weights:
        return out
    return out, weights.squeeze(1) if query.dim() == 1 else weights


def _attention_weights(hidden: Tensor, mask: Tensor | None, query: Tensor, scale: float | None):
    """A padded batch's attention: (states [B, L, H, D / H], heads [H, D / H], valid [B, 1, L], the scale, weights
    [B, H, L])."""
    batch, seq_len, _ = hidden.shape
    heads = query if query.dim() == 2 else query.unsqueeze(0)
    head_dim = heads.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    states = hidden.reshape(batch, seq_len, heads.shape[0], head_dim)
    scores = torch.einsum("blhd,hd->bhl", states, heads.to(hidden.dtype)) * scale
    valid = _valid(hidden, mask).unsqueeze(1)
    # Softmax in float32 (float64 for float64) over the valid tokens; a text with none gets finite scores, then zero
    # weights.
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~valid, float("-inf"))
    scores = scores.masked_fill(~valid.any(-1, keepdim=True), 0.0)
    return states, heads, valid, scale, scores.softmax(-1) * valid


def attention_pool_jvp(hidden: Tensor, mask: Tensor | None, query: Tensor, hidden_tangent: Tensor,
                       query_tangent: Tensor, *, scale: float | None = None, cu_seqlens: Tensor | None = None,
                       max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
    """The tangents of attention_pool's (out, weights) at (hidden, query) along (hidden_tangent, query_tangent), in
    closed form: with p the weights and s the scores, dp = p * (ds - sum(p * ds)) and d out = sum(dp * h + p * dh).
    Inputs and tangents of one floating dtype (float32 or wider); masked rows count for nothing, even non-finite
    ones."""
    if cu_seqlens is not None:
        padded, valid, text, slot = padded_view(hidden, mask, cu_seqlens, max_seqlen)
        padded_tangent = padded_view(hidden_tangent, mask, cu_seqlens, max_seqlen)[0]
        out, weights = attention_pool_jvp(padded, valid, query, padded_tangent, query_tangent, scale=scale)
        return out, weights[text, slot] if query.dim() == 1 else weights[text, :, slot].T
    x, dx, _, _, _, p, dp = _attention_tangents(hidden, mask, query, hidden_tangent, query_tangent, scale)
    out = torch.einsum("bhl,blhd->bhd", dp, x) + torch.einsum("bhl,blhd->bhd", p, dx)
    return out.reshape(hidden.shape[0], hidden.shape[2]), dp.squeeze(1) if query.dim() == 1 else dp


def _attention_tangents(hidden: Tensor, mask: Tensor | None, query: Tensor, hidden_tangent: Tensor,
                        query_tangent: Tensor, scale: float | None):
    """A padded batch's attention and its tangent, the two forward-mode rules' common part: (rows x [B, L, H, D / H]
    and their tangent dx, both zero at masked rows even where those are not finite; heads q [H, D / H] and dq; the
    scale; weights p [B, H, L] and their tangent dp = p * (ds - sum(p * ds)))."""
    states, heads, valid, scale, p = _attention_weights(hidden, mask, query, scale)
    keep = valid.squeeze(1)[:, :, None, None]
    x = states.where(keep, 0.0)
    dx = hidden_tangent.reshape(x.shape).where(keep, 0.0)
    d_heads = query_tangent.reshape(heads.shape)
    ds = (torch.einsum("blhd,hd->bhl", dx, heads) + torch.einsum("blhd,hd->bhl", x, d_heads)) * scale
    dp = p * (ds - (p * ds).sum(-1, keepdim=True))
    return x, dx, heads, d_heads, scale, p, dp


def attention_pool_backward_jvp(grad: Tensor, grad_weights: Tensor | None, hidden: Tensor, mask: Tensor | None,
                                query: Tensor, grad_tangent: Tensor, grad_weights_tangent: Tensor | None,
                                hidden_tangent: Tensor, query_tangent: Tensor, *, scale: float | None = None,
                                cu_seqlens: Tensor | None = None,
                                max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
    """The tangents of attention_pool's gradients of (hidden, query) for the cotangents grad [B, D] and grad_weights
    (the op's layout: [B, H, L], or [H, T] packed; None: none), along tangents of all four (forward over reverse), in
    closed form. With p the weights, x the rows, s the scores and q the query, the gradients are p g + gs scale q and
    scale sum(gs x), where gs = p * (gp - sum(p * gp)) and gp = <g, x> + grad_weights. Dtypes as attention_pool_jvp."""
    if cu_seqlens is not None:
        padded, valid, text, slot = padded_view(hidden, mask, cu_seqlens, max_seqlen)

        def padded_weights(w: Tensor | None) -> Tensor | None:  # [H, T] -> [B, H, W], zero at padding
            if w is None:
                return None
            out = w.new_zeros(valid.shape[0], w.shape[0], valid.shape[1])
            out[text, :, slot] = w.T
            return out
        d_hidden, d_query = attention_pool_backward_jvp(
            grad, padded_weights(grad_weights), padded, valid, query, grad_tangent,
            padded_weights(grad_weights_tangent), padded_view(hidden_tangent, mask, cu_seqlens, max_seqlen)[0],
            query_tangent, scale=scale)
        return d_hidden[text, slot], d_query
    x, dx, heads, d_heads, scale, p, dp = _attention_tangents(hidden, mask, query, hidden_tangent, query_tangent,
                                                              scale)
    g, dg = grad.reshape(p.shape[0], *heads.shape), grad_tangent.reshape(p.shape[0], *heads.shape)
    gp = torch.einsum("bhd,blhd->bhl", g, x)
    dgp = torch.einsum("bhd,blhd->bhl", dg, x) + torch.einsum("bhd,blhd->bhl", g, dx)
    if grad_weights is not None:
        gp = gp + grad_weights.reshape(p.shape)
    if grad_weights_tangent is not None:
        dgp = dgp + grad_weights_tangent.reshape(p.shape)
    centred = gp - (p * gp).sum(-1, keepdim=True)
    gs = p * centred
    dgs = dp * centred + p * (dgp - (dp * gp + p * dgp).sum(-1, keepdim=True))
    d_hidden = (torch.einsum("bhl,bhd->blhd", dp, g) + torch.einsum("bhl,bhd->blhd", p, dg) +
                (torch.einsum("bhl,hd->blhd", dgs, heads) + torch.einsum("bhl,hd->blhd", gs, d_heads)) * scale)
    d_query = (torch.einsum("bhl,blhd->hd", dgs, x) + torch.einsum("bhl,blhd->hd", gs, dx)) * scale
    return d_hidden.reshape(hidden.shape), d_query.reshape(query.shape)


def insert_landmarks(input_ids: Tensor, attention_mask: Tensor | None = None, *, landmark_id: int, interval=32,
                     sentence_ends: Tensor | None = None, max_length: int | None = None, num_leading: int = 1,
                     num_trailing: int = 1, keep_trailing: bool = False, pad_id: int = 0,
                     padding_side: str | None = None):
    """lmk_ops.insert_landmarks row by row, in plain Python: returns (input_ids, attention_mask, landmark_mask)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if padding_side is None:
        padding_side = "left" if input_ids.shape[1] and bool((~valid[:, 0] & valid[:, -1]).any()) else "right"
    rows = []
    for b in range(input_ids.shape[0]):
        ids = input_ids[b][valid[b]].tolist()
        lead, rest = ids[:num_leading], ids[num_leading:]
        cut = len(rest) - min(num_trailing, len(rest))
        content, trail = rest[:cut], rest[cut:]
        every = int(interval[b]) if isinstance(interval, Tensor) else interval
        sentence = sentence_ends[b][valid[b]].tolist()[len(lead):] if sentence_ends is not None else None
        body, flags = list(lead), [False] * len(lead)
        for i, token in enumerate(content):
            body.append(token)
            flags.append(False)
            end = sentence[i] if sentence is not None else (i + 1) % every == 0
            if end or i == len(content) - 1:
                body.append(landmark_id)
                flags.append(True)
        if not content and ids:  # an empty text gets one landmark; a row of padding alone stays empty
            body.append(landmark_id)
            flags.append(True)
        tail = trail if keep_trailing else []
        if max_length is not None and len(body) + len(tail) > max_length:
            body, flags = body[: max_length - len(tail)], flags[: max_length - len(tail)]
            if body and not any(flags):
                body[-1], flags[-1] = landmark_id, True
        rows.append((body + tail, flags + [False] * len(tail)))
    width = max((len(ids) for ids, _ in rows), default=0)
    out_ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype)
    out_mask = torch.zeros((len(rows), width), dtype=torch.long)
    out_landmarks = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (ids, flags) in enumerate(rows):
        span = slice(width - len(ids), width) if padding_side == "left" else slice(0, len(ids))
        out_ids[b, span] = torch.tensor(ids, dtype=input_ids.dtype)
        out_mask[b, span] = 1
        out_landmarks[b, span] = torch.tensor(flags, dtype=torch.bool)
    return out_ids, out_mask, out_landmarks


# Packed (cu_seqlens) batches: the references unpack to the padded layout; and the ways people pool packed batches in
# plain PyTorch, which the benchmark report compares with.

def padded_view(hidden: Tensor, mask: Tensor | None, cu_seqlens: Tensor, width: int | None = None):
    """A packed batch ([T, D], a [T] mask or None, offsets [B + 1]) in padded form, differentiable in hidden:
    (padded [B, W, D] with zero padding rows, valid [B, W], each row's text [T] and slot [T]); W is width when
    given (at least the longest text: a max_seqlen hint), else the longest text."""
    offsets = cu_seqlens.long()
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    if width is None:
        width = int(lengths.max()) if lengths.numel() else 0
    # A hint that would cut texts, where the values can be read: a plain tensor (the double backward's trace passes
    # fake or functional ones here).
    elif type(lengths) is Tensor and values_known(lengths) and lengths.numel() and width < int(lengths.max()):
        raise ValueError(f"lmk_ops.reference: expected max_seqlen at least the longest text ({int(lengths.max())}), "
                         f"got {width}")
    column = torch.arange(width, device=hidden.device)
    inside = column < lengths.unsqueeze(1)
    rows = torch.where(inside, starts.unsqueeze(1) + column, hidden.shape[0])  # padding reads an appended zero row
    extended = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    padded = extended.index_select(0, rows.flatten()).view(*rows.shape, hidden.shape[1])
    valid = inside if mask is None else inside & torch.cat([mask != 0, mask.new_zeros(1, dtype=torch.bool)])[rows]
    text = torch.repeat_interleave(torch.arange(starts.shape[0], device=hidden.device), lengths,
                                   output_size=hidden.shape[0])
    return padded, valid, text, torch.arange(hidden.shape[0], device=hidden.device) - starts[text]


def segment_mean(hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    """torch.segment_reduce's mean, in hidden's dtype."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.segment_reduce(hidden, "mean", lengths=lengths, unsafe=True)


def segment_max(hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.segment_reduce(hidden, "max", lengths=lengths, unsafe=True)


def _segment_ids(cu_seqlens: Tensor, tokens: int) -> Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu_seqlens.device), lengths,
                                   output_size=tokens)


def index_add_mean(hidden: Tensor, cu_seqlens: Tensor, accumulate: torch.dtype | None = None,
                   rows: Tensor | None = None) -> Tensor:
    """The mean per text by index_add: in hidden's dtype (sentence-transformers' flattened mean in its older form)
    or in `accumulate` (vLLM's, float32); rows (bool [T]), when given, restricts it to those rows (landmarks)."""
    dtype = accumulate or hidden.dtype
    segments = _segment_ids(cu_seqlens, hidden.shape[0])
    if rows is not None:
        hidden, segments = hidden[rows], segments[rows]
    sums = hidden.new_zeros(cu_seqlens.shape[0] - 1, hidden.shape[-1], dtype=dtype).index_add_(
        0, segments, hidden.to(dtype))
    counts = torch.bincount(segments, minlength=sums.shape[0]).clamp_min(1).unsqueeze(1)
    return (sums / counts).to(hidden.dtype)


def scatter_max(hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The max per text by scatter_reduce (sentence-transformers' flattened max)."""
    segments = _segment_ids(cu_seqlens, hidden.shape[0]).unsqueeze(1).expand_as(hidden)
    out = hidden.new_full((cu_seqlens.shape[0] - 1, hidden.shape[-1]), float("-inf"))
    return out.scatter_reduce(0, segments, hidden, reduce="amax")
