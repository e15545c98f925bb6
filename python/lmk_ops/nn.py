"""nn.Module wrappers: a pooling head that takes a model's output and its batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import torch
from torch import Tensor

from . import ops
from ._checks import check_call, check_scale_type, is_flag, is_integer, values_known
from ._dispatch import call

__all__ = ["AttentionPooling", "Pooling"]


def hidden_states(output: Any) -> Tensor:
    """The token states [B, L, D] of a model's output: a tensor, a Hugging Face ModelOutput (last_hidden_state),
    a sentence-transformers features dict (token_embeddings), or a tuple whose first item is the states."""
    if isinstance(output, Tensor):
        return output
    for key in ("last_hidden_state", "token_embeddings"):
        value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if value is not None:
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(f"lmk_ops.nn.Pooling: expected token states [B, L, D] or a model output holding them "
                    f"(last_hidden_state / token_embeddings), got {type(output).__name__}")


def _field(batch: Any, key: str) -> Tensor | None:
    if batch is None:
        return None
    return batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)


_BATCH_FIELDS = ("attention_mask", "landmark_mask", "cu_seq_lens_q", "cu_seqlens", "position_ids", "seq_idx",
                 "prompt_length")


def _batch_and_mask(who: str, output: Any, batch: Any, attention_mask: Tensor | None) -> tuple[Any, Tensor | None]:
    """(the batch that holds the masks and offsets, the attention mask given by the caller).

    The batch is ``batch``, or where none is given and the output is a mapping (sentence-transformers' features
    dict, which carries ``attention_mask`` and ``cu_seq_lens_q`` beside ``token_embeddings``), the output itself. A
    tensor given as the batch is the attention mask (``pooling(hidden, mask)``, which was silently ignored); a batch
    that is neither a mapping nor an object with a batch's fields is refused rather than ignored."""
    if isinstance(batch, Tensor):
        if attention_mask is not None:
            raise ValueError(f"lmk_ops.nn.{who}: expected the attention mask once, got a tensor as the batch and "
                             f"attention_mask=")
        batch, attention_mask = None, batch
    if batch is not None and not isinstance(batch, Mapping) and not any(hasattr(batch, f) for f in _BATCH_FIELDS):
        raise TypeError(f"lmk_ops.nn.{who}: expected batch as a mapping (a dict, a BatchEncoding, "
                        f"sentence-transformers' features), an object with a batch's fields "
                        f"({', '.join(_BATCH_FIELDS[:3])}, ...), or the attention mask as a tensor, got "
                        f"{type(batch).__name__}")
    return (output if batch is None and isinstance(output, Mapping) else batch), attention_mask


def _masks(batch: Any, attention_mask: Tensor | None) -> Tensor | None:
    return attention_mask if attention_mask is not None else _field(batch, "attention_mask")


def packed_layout(hidden: Tensor, batch: Any, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
                  attention_mask: Tensor | None = None):
    """(hidden, {"cu_seqlens": ..., "max_seqlen": ...}) for a packed batch, else (hidden, {}).

    A batch is packed when cu_seqlens is given, or when the batch holds sentence-transformers' flattened features
    (``cu_seq_lens_q``, with ``max_length_q`` and ``seq_idx`` when present: the offsets define the texts),
    flash-attention's ``cu_seqlens``, or, with no attention mask anywhere, ``position_ids`` ``[1, T]`` that restart
    (transformers' ``DataCollatorWithFlattening`` by default; its flash-attention path likewise reads the position
    ids only without a mask, which a padded row's ids, e.g. ``cumsum - 1`` clamped at 0, would otherwise fool; one
    row of ids without a mask is read as flattened whatever its values: _offsets_from_position_ids).
    Flattened token states ``[1, T, D]`` become ``[T, D]``."""
    if cu_seqlens is None:
        cu_seqlens = _field(batch, "cu_seq_lens_q")
        if cu_seqlens is None:
            cu_seqlens = _field(batch, "cu_seqlens")
        if max_seqlen is None:
            hint = _field(batch, "max_length_q") if _field(batch, "max_length_q") is not None else _field(
                batch, "max_seqlen")
            max_seqlen = hint if isinstance(hint, int) else None
        if cu_seqlens is None and attention_mask is None and _field(batch, "attention_mask") is None:
            cu_seqlens = _offsets_from_position_ids(hidden, _field(batch, "position_ids"))
    if cu_seqlens is None:
        if _field(batch, "seq_idx") is not None:  # else the flattened texts would pool as one
            raise ValueError("lmk_ops.nn: expected cu_seq_lens_q (or cu_seqlens) beside seq_idx: the batch holds "
                             "flattened texts but not where each starts; pass cu_seqlens=")
        return hidden, {}
    if hidden.dim() == 3 and hidden.shape[0] == 1:
        hidden = hidden[0]
    return hidden, {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def _offsets_from_position_ids(hidden: Tensor, position_ids: Any) -> Tensor | None:
    """The offsets of the texts flattened into one row, read from its position ids as transformers' flash-attention
    path reads them (``prepare_fa_kwargs_from_position_ids``): a text starts wherever the ids return to their
    minimum (0, or RoBERTa's padding_idx + 1). None unless the ids ``[1, T]`` match hidden ``[1, T, D]`` (T > 0).
    Ids that do not start at their minimum are one padded row's (left padding) and one increasing run is one text:
    both give the offsets ``[0, T]``, so that whether the row is read as flattened depends on shapes only, never on
    the ids' values (the output's layout, e.g. attention's weights, is the same whatever texts the row holds), and
    the reading is tensor ops whose one data-dependent size, the number of texts, torch.compile keeps in the graph
    as an unbacked size (landmark_positions)."""
    if not (isinstance(position_ids, Tensor) and position_ids.dim() == 2 and hidden.dim() == 3
            and position_ids.shape[0] == 1 and position_ids.shape == hidden.shape[:2] and position_ids.shape[1] > 0
            and not position_ids.is_floating_point() and position_ids.device == hidden.device):
        return None
    ids = position_ids[0]
    if not torch.compiler.is_compiling() and not values_known(ids):
        raise ValueError("lmk_ops.nn: expected position_ids whose values can be read (not on meta or fake tensors "
                         "outside torch.compile, nor under torch.vmap): the flattened texts are found from them; "
                         "pass cu_seqlens")
    at_minimum = ids == ids.min()
    starts = torch.cat([at_minimum.new_ones(1), at_minimum[1:] & at_minimum[0]])  # row 0 always; others if it is one
    first_rows = ops.landmark_positions(starts.unsqueeze(0))[0]
    return torch.cat([first_rows, first_rows.new_full((1,), ids.shape[0])])


@overload
def _flat(mask: Tensor, packed: dict) -> Tensor: ...
@overload
def _flat(mask: Tensor | None, packed: dict) -> Tensor | None: ...
def _flat(mask: Tensor | None, packed: dict) -> Tensor | None:
    """A token mask as the layout needs it: [T] for a packed batch ([1, T] flattened features squeezed)."""
    if mask is None or not packed:
        return mask
    return mask.reshape(-1) if mask.dim() == 2 and mask.shape[0] == 1 else mask


def _landmark_mask(landmarks: Tensor, packed: dict) -> Tensor:
    """A batch's landmark mask as a bool mask, whatever its integer dtype after collation (landmark_mean would read
    an integer tensor as positions); values other than 0 and 1 are refused, as in attention masks."""
    if isinstance(landmarks, Tensor) and landmarks.dim() in (1, 2):  # other shapes: landmark_mean says what is wrong
        landmarks = ops.bool_mask("nn.Pooling('lmk') (its landmark_mask: 1 at each landmark token; landmark "
                                  "positions go to lmk_ops.landmark_mean)", landmarks)
    return _flat(landmarks, packed)


class AttentionPooling(torch.nn.Module):
    """Attention pooling with a learned query per head (:func:`lmk_ops.attention_pool`).

    Args:
        dim: the width D of the token states.
        heads: H, dividing D; head h scores and pools its own slice of D // H features.
        scale: the score scale, default ``1 / sqrt(D // H)``.

    The query (``[H, D // H]``, in ``self.query``) starts at zero, where every valid token gets the same weight: the
    module begins as mean pooling, a strong baseline, and learns from there (the query's gradient at zero is not
    zero). ``forward(output, batch=None, *, attention_mask=None, return_weights=False)`` takes what
    :class:`Pooling` takes; with ``return_weights`` it also returns the ``[B, H, L]`` probabilities.
    """

    def __init__(self, dim: int, heads: int = 1, *, scale: float | None = None, device=None, dtype=None):
        super().__init__()
        whole = all(is_integer(v) for v in (dim, heads))
        if not whole or heads < 1 or dim < 1 or dim % heads:
            raise ValueError(f"lmk_ops.nn.AttentionPooling: expected ints heads >= 1 dividing dim >= 1, got "
                             f"dim={dim!r}, heads={heads!r}")
        check_scale_type("nn.AttentionPooling", scale)
        self.dim, self.heads, self.scale = int(dim), int(heads), scale
        self.query = torch.nn.Parameter(torch.empty(self.heads, self.dim // self.heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.query)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}" + (f", scale={self.scale}" if self.scale is not None else "")

    def forward(self, output: Any, batch: Any = None, *, attention_mask: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None):
        batch, attention_mask = _batch_and_mask("AttentionPooling", output, batch, attention_mask)
        hidden, packed = packed_layout(hidden_states(output), batch, cu_seqlens, max_seqlen, attention_mask)
        mask = _flat(_masks(batch, attention_mask) if not packed or attention_mask is not None else None, packed)
        return ops.attention_pool(hidden, mask, self.query, scale=self.scale, return_weights=return_weights, **packed)


class Pooling(torch.nn.Module):
    """Pools token states into one vector per text with the lmk_ops kernels.

    Modes: ``"mean"``, ``"max"`` (over valid tokens), ``"cls"`` / ``"first"`` (first valid token), ``"last"`` (last
    valid token), ``"lmk"`` (mean of the landmark tokens, from the batch's ``landmark_mask``), ``"attention"``
    (learned attention pooling: an :class:`AttentionPooling` of ``dim`` and ``heads``, which only this mode takes),
    and sentence-transformers' ``"mean_sqrt_len_tokens"`` (the sum over valid tokens divided by the square root of
    their count) and ``"weightedmean"`` (token i of the valid tokens weighted i + 1). First and last are found from
    the attention mask, so either padding side works. ``normalize=True`` L2-normalises the result (inside the op for
    mean, max and lmk).

    ``forward(output, batch)``: ``output`` is a model's output (or the token states), ``batch`` what the model was
    called with, holding ``attention_mask`` (and ``landmark_mask`` for "lmk"): a dict, a ``BatchEncoding`` or a
    :class:`lmk_ops.LandmarkBatch`. A sentence-transformers features dict can come alone, ``forward(features)``: it
    is then the batch too. The masks can also be passed as keywords, and the attention mask as the batch itself
    (``pooling(hidden, attention_mask)``). Packed batches work too: pass
    ``cu_seqlens`` (and ``max_seqlen``), or a batch holding sentence-transformers' flattened features
    (``token_embeddings`` ``[1, T, D]`` with ``cu_seq_lens_q``) or transformers' (``position_ids`` ``[1, T]``
    restarting at each text, as ``DataCollatorWithFlattening`` gives them); there the attention mask is not used
    (every packed token is valid) unless passed as a keyword, and a landmark mask is ``[T]``.

    ``include_prompt=False`` leaves out each text's first ``prompt_length`` valid tokens (its prompt, after any left
    padding), as sentence-transformers' ``Pooling(include_prompt=False)`` does: ``prompt_length`` comes from the
    batch (sentence-transformers puts it in its features when ``encode(prompt=...)`` is used) or as a keyword, an
    int or an integer tensor of one value or of one per text; without it nothing is left out. Every mode honours
    it: "lmk" leaves out the prompt's landmarks, and "weightedmean" keeps the other tokens' weights (their ranks
    among all valid tokens), as sentence-transformers does. A text with nothing after its prompt pools to zeros.
    """

    MODES = ("mean", "max", "cls", "first", "last", "lmk", "attention", "mean_sqrt_len_tokens", "weightedmean")

    def __init__(self, mode: str = "mean", *, normalize: bool = False, dim: int | None = None, heads: int = 1,
                 include_prompt: bool = True):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"lmk_ops.nn.Pooling: expected mode in {self.MODES}, got {mode!r}")
        if (mode == "attention") != (dim is not None) or (mode != "attention" and heads != 1):
            raise ValueError("lmk_ops.nn.Pooling: expected dim (the token states' width) and heads for "
                             f"mode='attention' and for no other mode, got mode={mode!r}, dim={dim}, heads={heads}")
        if not is_flag(normalize):  # "no" would be taken for True by the modes normalised here
            raise ValueError(f"lmk_ops.nn.Pooling: expected normalize as a bool, got {normalize!r}")
        if not is_flag(include_prompt):
            raise ValueError(f"lmk_ops.nn.Pooling: expected include_prompt as a bool, got {include_prompt!r}")
        self.mode = mode
        self.normalize = bool(normalize)
        self.include_prompt = bool(include_prompt)
        self.attention = AttentionPooling(dim, heads) if mode == "attention" and dim is not None else None

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, normalize={self.normalize}" + (
            "" if self.include_prompt else ", include_prompt=False")

    def forward(self, output: Any, batch: Any = None, *, attention_mask: Tensor | None = None,
                landmark_mask: Tensor | None = None, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None, prompt_length: int | Tensor | None = None) -> Tensor:
        batch, attention_mask = _batch_and_mask("Pooling", output, batch, attention_mask)
        hidden, packed = packed_layout(hidden_states(output), batch, cu_seqlens, max_seqlen, attention_mask)
        # A flattened batch's attention mask (if any) describes the padded batch it came from, not the packed rows.
        mask = _flat(_masks(batch, attention_mask) if not packed or attention_mask is not None else None, packed)
        prompt = None
        if not self.include_prompt:
            prompt = prompt_length if prompt_length is not None else _field(batch, "prompt_length")
        elif prompt_length is not None:  # a batch's prompt_length is sentence-transformers', for any pooling
            raise ValueError("lmk_ops.nn.Pooling: expected no prompt_length keyword with include_prompt=True (the "
                             f"prompt is pooled), got prompt_length={prompt_length!r}")
        ranks = None
        if prompt is not None:  # the valid tokens past each text's prompt become the mask
            ranks = _valid_ranks(f"nn.Pooling({self.mode!r})", hidden, mask, packed)
            mask = _past_prompt(*ranks, prompt)
        if self.mode == "lmk":
            landmarks = landmark_mask if landmark_mask is not None else _field(batch, "landmark_mask")
            if landmarks is None:
                raise ValueError("lmk_ops.nn.Pooling(mode='lmk'): expected a landmark_mask in the batch or as a "
                                 "keyword (lmk_ops.insert_landmarks or lmk_ops.hf.tokenize_with_landmarks make one)")
            landmarks = _landmark_mask(landmarks, packed)
            if prompt is not None and mask is not None and isinstance(landmarks, Tensor) and (
                    landmarks.shape == mask.shape):
                landmarks = landmarks & mask
            return ops.landmark_mean(hidden, landmarks, normalize=self.normalize, **packed)
        if self.mode == "mean":
            return ops.mean_pool(hidden, mask, normalize=self.normalize, **packed)
        if self.mode == "max":
            return ops.max_pool(hidden, mask, normalize=self.normalize, **packed)
        if self.attention is not None:  # mode "attention"
            pooled = self.attention(hidden, attention_mask=mask, **packed)
        elif self.mode == "mean_sqrt_len_tokens":
            pooled = _mean_sqrt_len(hidden, mask, packed)
        elif self.mode == "weightedmean":
            pooled = _weighted_mean(hidden, mask, packed, ranks)
        else:
            pooled = (ops.last_token_pool if self.mode == "last" else ops.first_token_pool)(hidden, mask, **packed)
        if not self.normalize:
            return pooled
        # In float32 (float64 for float64) and rounded once, as the fused ops do: in float16, F.normalize's eps
        # underflows to 0 and turns a text with no valid token (a zero vector) into NaN.
        wide = pooled.to(torch.promote_types(pooled.dtype, torch.float32))
        return torch.nn.functional.normalize(wide, dim=-1).to(pooled.dtype)


def _valid_counts(hidden: Tensor, mask: Tensor | None, packed: dict) -> Tensor:
    """The number of valid tokens of each text, [B] int64."""
    if packed:
        starts, ends = _bounds(packed["cu_seqlens"].long())
        if mask is None:
            return ends - starts
        before = torch.cat([starts.new_zeros(1), (mask != 0).long().cumsum(0)])
        return before[ends] - before[starts]
    if mask is None:
        return torch.full((hidden.shape[0],), hidden.shape[1], dtype=torch.long, device=hidden.device)
    return (mask != 0).sum(1)


def _mean_sqrt_len(hidden: Tensor, mask: Tensor | None, packed: dict) -> Tensor:
    """sum / sqrt(count) = mean * sqrt(count), from the op's unrounded mean (its second output with normalize),
    rounded once."""
    mean = call(torch.ops.lmk_ops.mean_pool, hidden, mask, True, packed.get("cu_seqlens"), packed.get("max_seqlen"))[1]
    counts = _valid_counts(hidden, mask, packed).to(mean.dtype).unsqueeze(1)
    return (mean * counts.sqrt()).to(hidden.dtype)


def _bounds(offsets: Tensor) -> tuple[Tensor, Tensor]:
    """A packed batch's texts' first rows and ends, offsets[:-1] and offsets[1:], as narrow() views: torch 2.10's
    inductor fails to lower those slices where the texts' number is an unbacked size (texts read from position ids:
    KeyError 'unbacked_bindings'), and narrow's explicit lengths spare it the unknown bound."""
    texts = offsets.shape[0] - 1
    return offsets.narrow(0, 0, texts), offsets.narrow(0, 1, texts)


def _rows_of_texts(per_text: Tensor, offsets: Tensor, tokens: int) -> Tensor:
    """A packed batch's per-text values [B] repeated over each text's rows: [T]."""
    starts, ends = _bounds(offsets)
    return torch.repeat_interleave(per_text, ends - starts, output_size=tokens)


def _valid_ranks(op: str, hidden: Tensor, mask: Tensor | None,
                 packed: dict) -> tuple[Tensor, Tensor, Tensor | None]:
    """(valid, rank, offsets), checked as the ops check them (errors naming op): the valid tokens as a bool mask
    ([B, L], or [T] packed), each valid token's rank among its text's valid tokens, from 1 (0 at the others), int64,
    and a packed batch's checked offsets (int64 [B + 1]; None padded)."""
    if packed:
        offsets, valid = ops.packed_valid(op, hidden, mask, packed["cu_seqlens"], packed.get("max_seqlen"))
        before = torch.cat([offsets.new_zeros(1), valid.long().cumsum(0)])  # valid rows before each row, and all
        rank = before.narrow(0, 1, hidden.shape[0]) - _rows_of_texts(before[_bounds(offsets)[0]], offsets,
                                                                      hidden.shape[0])
    else:
        offsets, valid = None, ops.padded_valid(op, hidden, mask)
        rank = valid.long().cumsum(-1)
    return valid, rank * valid, offsets


@torch.library.custom_op("lmk_ops::nonnegative_prompt_lengths", mutates_args=())
def _nonnegative_prompt_lengths(lengths: Tensor) -> Tensor:
    """A copy of the prompt lengths (int64 [B]), refused where one is negative. An op rather than a Python branch on
    the values, which would break a torch.compile graph (the graph keeps the op, and the check, where it is used)."""
    if bool((lengths < 0).any()):
        raise ValueError(f"lmk_ops.nn.Pooling: expected prompt_length >= 0, got {lengths.tolist()}")
    return lengths.clone()


@_nonnegative_prompt_lengths.register_fake
def _(lengths: Tensor) -> Tensor:
    return torch.empty_like(lengths)


def _prompt_lengths(value: Any, batch: int, device: torch.device) -> Tensor:
    """prompt_length as int64 [B]: an int, or an integer tensor of one value or of B (sentence-transformers gives an
    int, or in training a tensor of one value or of one per text)."""
    if isinstance(value, Tensor) and not value.is_floating_point() and value.dtype != torch.bool and (
            value.numel() == 1 or value.shape == (batch,)):
        lengths = value.reshape(-1).to(device=device, dtype=torch.long).expand(batch)
        return _nonnegative_prompt_lengths(lengths.contiguous())
    if is_integer(value) and int(value) >= 0:
        return torch.full((batch,), int(value), dtype=torch.long, device=device)
    if is_integer(value):
        raise ValueError(f"lmk_ops.nn.Pooling: expected prompt_length >= 0, got {value!r}")
    got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
    raise ValueError(f"lmk_ops.nn.Pooling: expected prompt_length as an int >= 0 or an integer tensor of one "
                     f"value or of one per text ({batch}), got {got}")


def _past_prompt(valid: Tensor, rank: Tensor, offsets: Tensor | None, prompt: Any) -> Tensor:
    """The valid tokens after each text's first prompt_length valid tokens (bool, shaped as valid), from
    _valid_ranks' (valid, rank, offsets)."""
    if offsets is not None:
        lengths = _prompt_lengths(prompt, offsets.shape[0] - 1, valid.device)
        return valid & (rank > _rows_of_texts(lengths, offsets, valid.shape[0]))
    return valid & (rank > _prompt_lengths(prompt, valid.shape[0], valid.device).unsqueeze(1))


def _weighted_mean(hidden: Tensor, mask: Tensor | None, packed: dict,
                   ranks: tuple[Tensor, Tensor, Tensor | None] | None = None) -> Tensor:
    """sentence-transformers' weightedmean: valid token i (0-based, among the text's valid tokens) weighted i + 1,
    sum(w x) / sum(w) in float32 (float64 for float64). Plain PyTorch around the mean op: the mean of the weighted
    rows, sum(w x) / n, times n / sum(w) = 2 / (n + 1). So a text gives the same bits padded on either side, packed
    or alone, as the mean does, and a packed batch is not copied into the padded layout (4000 one-token texts beside
    one of 65536 tokens would take B x 65536 x D floats). With a prompt left out, mask holds the tokens past it and
    ranks is _valid_ranks' (valid, rank, offsets) of all valid tokens, whose weights the kept tokens keep: of n
    valid tokens the last k = n - p, weighted p + 1 .. n, sum to k (2n - k + 1) / 2."""
    op = "nn.Pooling('weightedmean')"
    check_call(op, hidden, mask=mask, **packed)
    wide = torch.promote_types(hidden.dtype, torch.float32)
    valid, rank, _ = ranks if ranks is not None else _valid_ranks(op, hidden, mask, packed)
    kept = valid if ranks is None or mask is None else mask  # with ranks, mask holds the tokens past the prompt
    weights = (rank * kept).to(wide).unsqueeze(-1)
    mean = ops.mean_pool(hidden.to(wide) * weights, kept, **packed)
    count = _valid_counts(hidden, valid, packed).to(wide).unsqueeze(1)
    count_kept = count if ranks is None else _valid_counts(hidden, kept, packed).to(wide).unsqueeze(1)
    return (mean * (2 / (2 * count - count_kept + 1))).to(hidden.dtype)
