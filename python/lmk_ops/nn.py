"""nn.Module wrappers: a pooling head that takes a model's output and its batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import ops

__all__ = ["Pooling"]


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


class Pooling(torch.nn.Module):
    """Pools token states into one vector per text with the lmk_ops kernels.

    Modes: ``"mean"``, ``"max"`` (over valid tokens), ``"cls"`` / ``"first"`` (first valid token), ``"last"`` (last
    valid token), ``"lmk"`` (mean of the landmark tokens, from the batch's ``landmark_mask``). First and last are
    found from the attention mask, so either padding side works. ``normalize=True`` L2-normalises inside the op.

    ``forward(output, batch)``: ``output`` is a model's output (or the token states), ``batch`` what the model was
    called with, holding ``attention_mask`` (and ``landmark_mask`` for "lmk"): a dict, a ``BatchEncoding`` or a
    :class:`lmk_ops.LandmarkBatch`. The masks can also be passed as keywords.
    """

    MODES = ("mean", "max", "cls", "first", "last", "lmk")

    def __init__(self, mode: str = "mean", *, normalize: bool = False):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"lmk_ops.nn.Pooling: expected mode in {self.MODES}, got {mode!r}")
        self.mode = mode
        self.normalize = normalize

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, normalize={self.normalize}"

    def forward(self, output: Any, batch: Any = None, *, attention_mask: Tensor | None = None,
                landmark_mask: Tensor | None = None) -> Tensor:
        hidden = hidden_states(output)
        mask = attention_mask if attention_mask is not None else _field(batch, "attention_mask")
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
        pooled = (ops.last_token_pool if self.mode == "last" else ops.first_token_pool)(hidden, mask)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled
