"""Landmark insertion for token batches (the LMK layout of arXiv 2601.21525).

A text tokenized as ``[CLS] t1 ... tn [SEP]`` becomes ``[CLS] z1 [LMK] z2 [LMK] ... zk [LMK]``: a landmark after every
chunk of ``interval`` content tokens, the last (shorter) chunk included. The leading special tokens stay in front and
are not chunked; the trailing ones (``[SEP]``) are dropped, since the final landmark closes the text, or kept after
it with ``keep_trailing=True``. Either way they are never marked as landmarks, even when the landmark id is the SEP id:
the returned ``landmark_mask`` says which tokens are landmarks, so nothing downstream has to match ids.

One host op does the work (``csrc/ops/insert_landmarks.cpp``): a loop over each row's tokens lays it out, a second
writes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import is_flag, is_int

__all__ = ["LandmarkBatch", "PackedLandmarkBatch", "insert_landmarks", "sample_intervals"]

PAPER_TRAINING_INTERVALS = (32, 64, 128, 256)


class _Fields(Mapping):
    """A batch read as the mapping of its fields, as a Hugging Face ``BatchEncoding`` is read: ``batch["key"]``,
    ``"key" in batch``, ``batch.keys()`` / ``items()``, ``**batch``. Subclasses name their fields in ``_KEYS``."""

    _KEYS: tuple = ()

    def __getitem__(self, key: str):
        if key not in self._KEYS:  # a KeyError, as a mapping's (not the AttributeError getattr would give)
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


@dataclass
class LandmarkBatch(_Fields):
    """A token batch with landmarks: ``[B, L']`` tensors on the input's device."""

    _KEYS = ("input_ids", "attention_mask", "landmark_mask")

    input_ids: Tensor  # int64, pad_id where attention_mask is 0
    attention_mask: Tensor  # int64 0/1, as Hugging Face models take it
    landmark_mask: Tensor  # bool, True at landmark tokens only

    def to(self, device, non_blocking: bool = False) -> LandmarkBatch:
        """The batch on another device (the tensors keep their dtypes)."""
        return _moved(self, device, non_blocking)

    def model_inputs(self) -> dict[str, Tensor]:
        """The keyword arguments for a Hugging Face model: ``input_ids`` and ``attention_mask``."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def packed(self) -> PackedLandmarkBatch:
        """The same texts packed (padding removed, either side), for a varlen model."""
        valid = self.attention_mask != 0
        lengths = valid.sum(1)
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
        offsets[1:] = lengths.cumsum(0)
        starts = torch.repeat_interleave(offsets[:-1].long(), lengths)
        positions = torch.arange(int(offsets[-1]), device=lengths.device) - starts
        return PackedLandmarkBatch(self.input_ids[valid].unsqueeze(0), positions.unsqueeze(0), offsets,
                                   int(lengths.max()) if lengths.numel() else 0, self.landmark_mask[valid])


@dataclass
class PackedLandmarkBatch(_Fields):
    """Texts with landmarks packed without padding, as flash-attention's varlen kernels and transformers'
    ``DataCollatorWithFlattening`` lay them out: ``[1, T]`` ids and positions, offsets ``cu_seqlens``."""

    _KEYS = ("input_ids", "position_ids", "cu_seqlens", "max_seqlen", "landmark_mask")

    input_ids: Tensor  # int64 [1, T]
    position_ids: Tensor  # int64 [1, T], restarting at 0 in each text
    cu_seqlens: Tensor  # int32 [B + 1]
    max_seqlen: int  # the longest text's length
    landmark_mask: Tensor  # bool [T], True at landmark tokens only

    def to(self, device, non_blocking: bool = False) -> PackedLandmarkBatch:
        """The batch on another device (the tensors keep their dtypes; max_seqlen stays a host int)."""
        return _moved(self, device, non_blocking)

    def model_inputs(self) -> dict:
        """The keyword arguments for a Hugging Face model running flash-attention varlen: ``input_ids``,
        ``position_ids`` and the ``cu_seq_lens_q/k``, ``max_length_q/k`` it reads the text boundaries from."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


def _moved(batch, device, non_blocking: bool):
    """A copy of a LandmarkBatch or PackedLandmarkBatch with its tensors on device."""
    if isinstance(device, torch.dtype):
        raise TypeError(f"lmk_ops.{type(batch).__name__}.to: expected a device, got the dtype {device} (the ids and "
                        "masks keep their dtypes)")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise TypeError(f"lmk_ops.{type(batch).__name__}.to: expected a device (a torch.device, or a string such as "
                        f"'cuda:0'), got {device!r} ({error})") from None
    return type(batch)(**{k: v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v
                          for k, v in batch.items()})


def sample_intervals(batch: int, choices: Sequence[int] = PAPER_TRAINING_INTERVALS, *,
                     generator: torch.Generator | None = None) -> Tensor:
    """Training mode: one interval per row, drawn uniformly from ``choices`` (the paper's {32, 64, 128, 256}).

    Pass a seeded ``torch.Generator`` for reproducible runs. Returns int64 ``[batch]`` on the CPU.
    """
    values = list(choices)
    if not values or not all(is_int(v) and v >= 1 for v in values):
        raise ValueError(f"lmk_ops.sample_intervals: expected a non-empty list of integer intervals in [1, 2**63), got "
                         f"{values}")
    if not is_int(batch) or batch < 0:
        raise ValueError(f"lmk_ops.sample_intervals: expected batch as an int in [0, 2**63), got {batch!r}")
    options = torch.tensor([int(v) for v in values], dtype=torch.long)
    return options[torch.randint(len(options), (batch,), generator=generator)]


def _fail(message: str) -> None:
    raise ValueError(f"lmk_ops.insert_landmarks: {message}")


def max_length_problem(max_length) -> str | None:
    """What is wrong with a max_length (None: nothing), for insert_landmarks and hf.tokenize_with_landmarks."""
    if max_length is not None and (not is_int(max_length) or max_length < 1):
        return f"expected max_length as an int in [1, 2**63) or None, got {max_length!r}"
    return None


def _check_flags(name: str, flags, input_ids: Tensor) -> None:
    """A [B, L] bool or integer tensor beside input_ids (attention_mask, sentence_ends); the op checks that an
    integer one holds 0/1 as it reads it."""
    if not isinstance(flags, Tensor) or flags.is_floating_point() or flags.is_complex():
        _fail(f"expected {name} as a bool or integer 0/1 tensor, got {getattr(flags, 'dtype', type(flags).__name__)}")
    if flags.shape != input_ids.shape:
        _fail(f"expected {name} of shape {list(input_ids.shape)} (as input_ids), got {list(flags.shape)}")


def _check_inputs(input_ids, attention_mask, interval, sentence_ends, num_leading, num_trailing, max_length,
                  padding_side, landmark_id, pad_id, keep_trailing):
    if not isinstance(input_ids, Tensor):
        _fail(f"expected input_ids as an integer tensor [B, L], got {type(input_ids).__name__}")
    if (input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex()
            or input_ids.dtype == torch.bool):
        _fail(f"expected input_ids as an integer tensor [B, L], got {input_ids.dtype} of shape {list(input_ids.shape)}")
    if input_ids.is_meta:  # the new rows' width depends on the values
        _fail("expected input_ids with values (on the CPU or a GPU), got a meta tensor")
    if attention_mask is not None:
        _check_flags("attention_mask", attention_mask, input_ids)
    for name, value in (("landmark_id", landmark_id), ("pad_id", pad_id)):
        if not is_int(value) or value < 0:  # a token id indexes the vocabulary
            _fail(f"expected {name} as a token id (an int in [0, 2**63)), got {value!r}")
        info = torch.iinfo(input_ids.dtype)
        if not info.min <= int(value) <= info.max:
            _fail(f"expected {name} representable in input_ids' dtype {input_ids.dtype} ([{info.min}, {info.max}]), "
                  f"got {int(value)}{'' if input_ids.dtype == torch.int64 else '; pass input_ids as int64'}")
    if sentence_ends is not None:
        _check_flags("sentence_ends", sentence_ends, input_ids)
    if isinstance(interval, Tensor):
        if interval.is_floating_point() or interval.is_complex() or interval.dtype == torch.bool:
            _fail(f"expected per-row intervals as an integer tensor, got {interval.dtype}")
        if interval.shape != (input_ids.shape[0],):  # the op checks the values (>= 1) as it reads them
            _fail(f"expected per-row intervals as a [B] = [{input_ids.shape[0]}] tensor, got shape "
                  f"{list(interval.shape)}")
    elif not is_int(interval) or interval < 1:
        _fail(f"expected interval as an int in [1, 2**63), or a [B] integer tensor per row, got {interval!r}")
    for name, value in (("num_leading", num_leading), ("num_trailing", num_trailing)):
        if not is_int(value) or value < 0:
            _fail(f"expected {name} as an int in [0, 2**63), got {value!r}")
    if not is_flag(keep_trailing):
        _fail(f"expected keep_trailing as a bool, got {keep_trailing!r}")
    if padding_side not in (None, "left", "right"):
        _fail(f"expected padding_side 'left', 'right' or None (as the input), got {padding_side!r}")
    problem = max_length_problem(max_length)
    if problem is not None:
        _fail(problem)


def insert_landmarks(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    landmark_id: int,
    interval: int | Tensor = 32,
    sentence_ends: Tensor | None = None,
    max_length: int | None = None,
    num_leading: int = 1,
    num_trailing: int = 1,
    keep_trailing: bool = False,
    pad_id: int = 0,
    padding_side: str | None = None,
) -> LandmarkBatch:
    """Puts a landmark token after every chunk of each text, on a left- or right-padded batch.

    Args:
        input_ids: ``[B, L]`` integer token ids as a tokenizer returns them (with its special tokens).
        attention_mask: ``[B, L]`` 0/1 (or bool); ``None`` means no padding. Padding may be on either side.
        landmark_id: the token id of the landmark (a new ``[LMK]`` token, or a reused special such as SEP).
        interval: content tokens per chunk: an int, or a ``[B]`` tensor of per-row intervals (training mode, see
            :func:`sample_intervals`).
        sentence_ends: instead of fixed chunks, a ``[B, L]`` bool tensor marking the last token of each sentence:
            a landmark goes after each marked content token (and after the last content token, always).
        max_length: truncate to this many tokens after inserting; if no landmark survives, the last kept
            position becomes one (its id replaced by ``landmark_id``).
        num_leading: special tokens at the start of each text (``[CLS]``), kept in front and not chunked.
        num_trailing: special tokens at the end of each text (``[SEP]``): dropped, or kept after the final
            landmark with ``keep_trailing`` (never marked as landmarks; truncation keeps them at the end).
        pad_id: id written at padding positions.
        padding_side: of the output; ``None`` keeps the input's (left if a row is padded at the front).

    Returns:
        :class:`LandmarkBatch` with ``input_ids``, ``attention_mask`` (int64) and ``landmark_mask`` (bool), as long
        as the longest new row. An empty text (no content tokens) becomes ``[CLS][LMK]``.

    Raises:
        ValueError: starting ``lmk_ops.insert_landmarks:`` for inputs of the wrong shape or values, or a
        ``max_length`` too short to hold the kept special tokens and one landmark.
    """
    _check_inputs(input_ids, attention_mask, interval, sentence_ends, num_leading, num_trailing, max_length,
                  padding_side, landmark_id, pad_id, keep_trailing)
    # One host op writes the new rows (csrc/ops/insert_landmarks.cpp): token ids are small, and the rows' width
    # depends on their values, so device tensors come over and the result goes back.
    device = input_ids.device
    per_row = interval.to("cpu", torch.long) if isinstance(interval, Tensor) else None
    try:
        ids, mask, landmarks = torch.ops.lmk_ops.insert_landmarks(
            input_ids.cpu(), None if attention_mask is None else attention_mask.cpu(),
            None if sentence_ends is None else sentence_ends.cpu(), per_row,
            1 if per_row is not None else int(interval), int(landmark_id), int(pad_id), int(num_leading),
            int(num_trailing), bool(keep_trailing), None if max_length is None else int(max_length), padding_side)
    except RuntimeError as error:  # the checks of values: a flag not 0/1, an interval < 1, max_length too short
        if str(error).startswith("lmk_ops.insert_landmarks:"):
            raise ValueError(str(error)) from None
        raise
    return LandmarkBatch(ids.to(device), mask.to(device), landmarks.to(device))
