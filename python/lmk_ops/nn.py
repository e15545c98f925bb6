"""nn.Module wrappers: a pooling head that takes a model's output and its batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import ops

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


def _masks(batch: Any, attention_mask: Tensor | None) -> Tensor | None:
    return attention_mask if attention_mask is not None else _field(batch, "attention_mask")


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
        if heads < 1 or dim < 1 or dim % heads:
            raise ValueError(f"lmk_ops.nn.AttentionPooling: expected heads >= 1 dividing dim >= 1, got dim={dim}, "
                             f"heads={heads}")
        self.dim, self.heads, self.scale = dim, heads, scale
        self.query = torch.nn.Parameter(torch.empty(heads, dim // heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.query)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}" + (f", scale={self.scale}" if self.scale is not None else "")

    def forward(self, output: Any, batch: Any = None, *, attention_mask: Tensor | None = None,
                return_weights: bool = False):
        return ops.attention_pool(hidden_states(output), _masks(batch, attention_mask), self.query, scale=self.scale,
                                  return_weights=return_weights)


class Pooling(torch.nn.Module):
    """Pools token states into one vector per text with the lmk_ops kernels.

    Modes: ``"mean"``, ``"max"`` (over valid tokens), ``"cls"`` / ``"first"`` (first valid token), ``"last"`` (last
    valid token), ``"lmk"`` (mean of the landmark tokens, from the batch's ``landmark_mask``), ``"attention"``
    (learned attention pooling: an :class:`AttentionPooling` of ``dim`` and ``heads``, which only this mode takes).
    First and last are found from the attention mask, so either padding side works. ``normalize=True``
    L2-normalises the result (inside the op for mean, max and lmk).

    ``forward(output, batch)``: ``output`` is a model's output (or the token states), ``batch`` what the model was
    called with, holding ``attention_mask`` (and ``landmark_mask`` for "lmk"): a dict, a ``BatchEncoding`` or a
    :class:`lmk_ops.LandmarkBatch`. The masks can also be passed as keywords.
    """

    MODES = ("mean", "max", "cls", "first", "last", "lmk", "attention")

    def __init__(self, mode: str = "mean", *, normalize: bool = False, dim: int | None = None, heads: int = 1):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"lmk_ops.nn.Pooling: expected mode in {self.MODES}, got {mode!r}")
        if (mode == "attention") != (dim is not None):
            raise ValueError("lmk_ops.nn.Pooling: expected dim (the token states' width) for mode='attention' and "
                             f"for no other mode, got mode={mode!r}, dim={dim}")
        self.mode = mode
        self.normalize = normalize
        self.attention = AttentionPooling(dim, heads) if mode == "attention" else None

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, normalize={self.normalize}"

    def forward(self, output: Any, batch: Any = None, *, attention_mask: Tensor | None = None,
                landmark_mask: Tensor | None = None) -> Tensor:
        hidden = hidden_states(output)
        mask = _masks(batch, attention_mask)
        if self.mode == "lmk":
            landmarks = landmark_mask if landmark_mask is not None else _field(batch, "landmark_mask")
            if landmarks is None:
                raise ValueError("lmk_ops.nn.Pooling(mode='lmk'): expected a landmark_mask in the batch or as a "
                                 "keyword (lmk_ops.insert_landmarks or lmk_ops.hf.tokenize_with_landmarks make one)")
            # A mask, whatever its dtype after collation (an integer mask would otherwise read as positions).
            return ops.landmark_mean(hidden, landmarks != 0, normalize=self.normalize)
        if self.mode == "mean":
            return ops.mean_pool(hidden, mask, normalize=self.normalize)
        if self.mode == "max":
            return ops.max_pool(hidden, mask, normalize=self.normalize)
        if self.mode == "attention":
            pooled = self.attention(hidden, attention_mask=mask)
        else:
            pooled = (ops.last_token_pool if self.mode == "last" else ops.first_token_pool)(hidden, mask)
        if not self.normalize:
            return pooled
        # In float32 (float64 for float64) and rounded once, as the fused ops do: in float16, F.normalize's eps
        # underflows to 0 and turns a text with no valid token (a zero vector) into NaN.
        wide = pooled.to(torch.promote_types(pooled.dtype, torch.float32))
        return torch.nn.functional.normalize(wide, dim=-1).to(pooled.dtype)
