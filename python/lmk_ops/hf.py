"""Landmark tokenization for any Hugging Face tokenizer (``transformers``): texts in, a batch with a landmark mask
out. Tokenizes without truncation, inserts the landmarks, then truncates (as the LMK paper prescribes)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from typing import Literal, Optional, Union, overload

import torch

from ._checks import is_flag, is_integer
from .landmarks import (PAPER_TRAINING_INTERVALS, LandmarkBatch, PackedLandmarkBatch, insert_landmarks,
                        max_length_problem, sample_intervals)

__all__ = ["PAPER_TRAINING_INTERVALS", "add_landmark_token", "cut_before_insertion", "insert_for_tokenizer",
           "landmark_token_id", "simple_sentence_ends", "special_token_layout", "tokenize_with_landmarks"]

def special_token_layout(tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after a single text: (1, 1) for BERT's [CLS] ... [SEP],
    (1, 0) for a BOS-only tokenizer, (0, 1) for T5's ... </s>. Found by encoding a probe with and without them."""
    probe = "landmark probe"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    full = tokenizer.encode(probe)
    for leading in range(len(full) - len(plain) + 1):
        if full[leading:leading + len(plain)] == plain:
            return leading, len(full) - leading - len(plain)
    raise ValueError(f"lmk_ops.hf: cannot find where {type(tokenizer).__name__} puts its special tokens")


def add_landmark_token(tokenizer, token: str = "[LMK]") -> int:
    """Adds ``token`` to the tokenizer as a special token (if it is not there yet) and returns its id.

    A new token needs a row in the model's embedding table: call ``model.resize_token_embeddings(len(tokenizer))``
    before running the model (a warning says so), and fine-tune, since the new row starts untrained.
    """
    if not isinstance(token, str) or not token:
        raise ValueError(f"lmk_ops.hf.add_landmark_token: expected the token as a non-empty string, got {token!r}")
    if token not in tokenizer.get_vocab():
        tokenizer.add_tokens([token], special_tokens=True)
        warnings.warn(f"lmk_ops: added the landmark token {token!r} to the tokenizer as id "
                      f"{tokenizer.convert_tokens_to_ids(token)}; resize the model's embeddings before running it: "
                      f"model.resize_token_embeddings(len(tokenizer)) (the new row is untrained: fine-tune, or reuse "
                      f"an existing token such as the SEP token instead)", stacklevel=2)
    return tokenizer.convert_tokens_to_ids(token)


def landmark_token_id(tokenizer, landmark_token: str | None = None) -> int:
    """The id of ``landmark_token`` (which must be in the vocabulary), or when None the tokenizer's SEP token,
    falling back to EOS (the paper's default: reuse an existing special token)."""
    if landmark_token is None:
        found = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        if found is None:
            raise ValueError("lmk_ops.hf: the tokenizer has neither a SEP nor an EOS token; name a landmark_token "
                             "(add one with lmk_ops.hf.add_landmark_token)")
        return found
    if not isinstance(landmark_token, str):
        raise ValueError(f"lmk_ops.hf: expected landmark_token as a token string (or None: the SEP or EOS token), got "
                         f"{landmark_token!r}")
    if landmark_token not in tokenizer.get_vocab():
        raise ValueError(f"lmk_ops.hf: expected the landmark token {landmark_token!r} in the tokenizer's vocabulary; "
                         "add it with lmk_ops.hf.add_landmark_token(tokenizer, token)")
    return tokenizer.convert_tokens_to_ids(landmark_token)


def insert_for_tokenizer(tokenizer, input_ids, attention_mask, *, landmark_id: int,
                         layout: tuple[int, int] | None = None, **options) -> LandmarkBatch:
    """:func:`lmk_ops.insert_landmarks` on a batch this tokenizer made: its special-token layout (``layout``, when
    already known, else :func:`special_token_layout`), pad id and padding side. ``options``: interval, max_length,
    sentence_ends."""
    leading, trailing = layout if layout is not None else special_token_layout(tokenizer)
    return insert_landmarks(
        input_ids, attention_mask, landmark_id=landmark_id, num_leading=leading, num_trailing=trailing,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        padding_side=getattr(tokenizer, "padding_side", "right"), **options)


def cut_before_insertion(max_length: int | None, layout: tuple[int, int]) -> int | None:
    """How many tokens (special ones included) a tokenizer may cut a text to before landmarks go in, without changing
    what truncating to max_length after inserting them keeps: one content token more than can be kept, which with
    its landmark lies past that truncation (None: no cut). Tokenizing untruncated instead, one long document padded
    the batch to its length: 4000 short texts beside a 65000-word one made [4001, 65002] tensors for 512 tokens kept,
    and ran the machine out of memory."""
    return None if max_length is None else max_length + 1 + sum(layout)


def simple_sentence_ends(text: str) -> list[int]:
    """Character offsets just after each sentence: after '.', '!' or '?' followed by whitespace, and at the end."""
    ends = [m.end() for m in re.finditer(r"[.!?]+(?=\s)", text)]
    return ends + [len(text)] if text.strip() and (not ends or ends[-1] < len(text.rstrip())) else ends


def _sentence_end_flags(offsets: torch.Tensor, attention_mask: torch.Tensor, ends: Sequence[Sequence[int]]):
    """bool [B, L]: the last token starting before each sentence's end offset (special tokens have (0, 0)). One
    search per text over its content tokens' starts, which tokenizers give in order (a tensor op per sentence took
    most of the time of tokenizing documents of hundreds of sentences); starts out of order are searched end by end."""
    flags = torch.zeros(attention_mask.shape, dtype=torch.bool)
    content = (offsets[..., 1] > offsets[..., 0]) & attention_mask.bool()
    for b, text_ends in enumerate(ends):
        if not len(text_ends):
            continue
        positions = content[b].nonzero().squeeze(1)
        starts = offsets[b, positions, 0]
        end_offsets = torch.as_tensor(text_ends, dtype=starts.dtype)
        if bool((starts[1:] >= starts[:-1]).all()):
            last = torch.searchsorted(starts, end_offsets, side="left") - 1  # the tokens starting before each end
        else:
            last = torch.stack([(starts < end).nonzero().max() if bool((starts < end).any()) else starts.new_tensor(-1)
                                for end in end_offsets])
        flags[b, positions[last[last >= 0]]] = True
    return flags


def _sentence_ends_of_texts(texts: list[str], sentence_ends, one_text: bool) -> list[list[int]]:
    """Each text's sentence ends as character offsets in [0, len(text)], checked: from a callable, a list per text,
    or for a single string given alone, one flat list of offsets."""
    def fail(message: str):
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: {message}")

    def offsets(value, what: str) -> list:
        array = isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "tolist")
        if isinstance(value, (str, bytes)) or not (array or isinstance(value, Sequence)):
            fail(f"expected {what} as a list of character offsets, got {type(value).__name__}")
        return value.tolist() if array else list(value)

    if callable(sentence_ends):
        per_text = [offsets(sentence_ends(t), f"sentence_ends({t[:20]!r}...)") for t in texts]
    else:
        per_text = offsets(sentence_ends, "sentence_ends (a list per text, or a callable)")
        if one_text and all(is_integer(e) for e in per_text):
            per_text = [per_text]  # one string's offsets, as one string is one text
        if len(per_text) != len(texts):
            fail(f"expected sentence_ends for each of the {len(texts)} texts, got {len(per_text)}")
        per_text = [offsets(ends, f"sentence_ends of text {b}") for b, ends in enumerate(per_text)]
    for b, (text, text_ends) in enumerate(zip(texts, per_text)):
        bad = [e for e in text_ends if not is_integer(e) or not 0 <= e <= len(text)]
        if bad:
            fail(f"expected sentence_ends of text {b} as character offsets in [0, len(text)] = [0, {len(text)}], "
                 f"got {bad[0]!r}")
    return per_text


# Each text's sentence ends (character offsets), or a function that finds them in a text.
SentenceEnds = Optional[Union[Sequence[Sequence[int]], Callable[[str], Sequence[int]]]]


# What tokenize_with_landmarks returns, for type checkers: a padded batch, or with packed=True a packed one.
@overload
def tokenize_with_landmarks(
        tokenizer, texts: str | Sequence[str], *, landmark_token: str | None = None, interval: int = 32,
        training_intervals: Sequence[int] | None = None, generator: torch.Generator | None = None,
        sentence_ends: SentenceEnds = None, max_length: int | None = None,
        packed: Literal[False] = False) -> LandmarkBatch: ...
@overload
def tokenize_with_landmarks(
        tokenizer, texts: str | Sequence[str], *, landmark_token: str | None = None, interval: int = 32,
        training_intervals: Sequence[int] | None = None, generator: torch.Generator | None = None,
        sentence_ends: SentenceEnds = None, max_length: int | None = None,
        packed: Literal[True]) -> PackedLandmarkBatch: ...
@overload
def tokenize_with_landmarks(
        tokenizer, texts: str | Sequence[str], *, landmark_token: str | None = None, interval: int = 32,
        training_intervals: Sequence[int] | None = None, generator: torch.Generator | None = None,
        sentence_ends: SentenceEnds = None, max_length: int | None = None,
        packed: bool) -> LandmarkBatch | PackedLandmarkBatch: ...
def tokenize_with_landmarks(
    tokenizer,
    texts: str | Sequence[str],
    *,
    landmark_token: str | None = None,
    interval: int = 32,
    training_intervals: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    sentence_ends: SentenceEnds = None,
    max_length: int | None = None,
    packed: bool = False,
) -> LandmarkBatch | PackedLandmarkBatch:
    """Tokenizes ``texts`` and lays them out for LMK pooling.

    Args:
        tokenizer: any Hugging Face tokenizer (a fast one for ``sentence_ends``).
        landmark_token: the landmark token (see :func:`landmark_token_id`; None reuses SEP, else EOS).
        interval: content tokens per chunk (the paper uses 32 at inference).
        training_intervals: training mode: each text's interval drawn from these (the paper: (32, 64, 128, 256))
            with ``generator`` (seed it for reproducible runs); ``lmk_ops.hf.PAPER_TRAINING_INTERVALS`` holds them.
        sentence_ends: sentence placement instead of fixed chunks: per text, the character offsets where its
            sentences end, or a callable giving them for a text (e.g. :func:`simple_sentence_ends`).
        max_length: tokens per text after insertion; default the tokenizer's ``model_max_length``.
        packed: return the texts packed for a varlen model (:class:`lmk_ops.PackedLandmarkBatch`: ``input_ids`` and
            ``position_ids`` ``[1, T]``, ``cu_seqlens``, ``max_seqlen``, the ``[T]`` ``landmark_mask``).

    Returns:
        :class:`lmk_ops.LandmarkBatch` (``input_ids``, ``attention_mask``, ``landmark_mask``), padded on the
        tokenizer's padding side. Pass ``batch.model_inputs()`` to the model and ``batch`` to
        :class:`lmk_ops.nn.Pooling`.
    """
    # One string is one text (list("abc") would be three).
    try:
        if isinstance(texts, (bytes, bytearray)):  # iterable, but as ints
            raise TypeError
        one_text = isinstance(texts, str)
        texts = [texts] if isinstance(texts, str) else list(texts)
    except TypeError:  # not iterable: an int, None
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: expected a string or a non-empty list of strings, got "
                         f"{type(texts).__name__}") from None
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: expected a string or a non-empty list of strings, got "
                         f"{texts if not texts else [type(t).__name__ for t in texts]}")
    if not is_flag(packed):  # "no" would be taken for True
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: expected packed as a bool, got {packed!r}")
    problem = max_length_problem(max_length)  # before the tokenizer sees it
    if problem is not None:
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: {problem}")
    if max_length is not None:
        max_length = int(max_length)  # a NumPy or 0-d tensor integer too, as insert_landmarks takes it
    if max_length is None and getattr(tokenizer, "model_max_length", None) and tokenizer.model_max_length < 10**6:
        max_length = tokenizer.model_max_length
    want_offsets = sentence_ends is not None
    layout = special_token_layout(tokenizer)
    cut = cut_before_insertion(max_length, layout)
    encoded = tokenizer(texts, padding=True, truncation=cut is not None, max_length=cut, return_tensors="pt",
                        verbose=False, return_offsets_mapping=want_offsets)
    try:
        every: int | torch.Tensor = interval
        if training_intervals is not None:
            every = sample_intervals(len(texts), training_intervals, generator=generator)
        flags = _sentence_end_flags(encoded["offset_mapping"], encoded["attention_mask"],
                                    _sentence_ends_of_texts(texts, sentence_ends, one_text)) if want_offsets else None
        batch = insert_for_tokenizer(tokenizer, encoded["input_ids"], encoded["attention_mask"],
                                     landmark_id=landmark_token_id(tokenizer, landmark_token), layout=layout,
                                     interval=every, sentence_ends=flags, max_length=max_length)
    except ValueError as error:  # an argument passed on (interval, training_intervals, max_length): named as the
        # user passed it, to this function
        inner = re.match(r"lmk_ops\.(insert_landmarks|sample_intervals): ", str(error))
        if inner is None:
            raise
        raise ValueError(f"lmk_ops.hf.tokenize_with_landmarks: {str(error)[inner.end():]}") from None
    return batch.packed() if packed else batch

