"""Hypothesis strategies for pooling inputs: shapes, masks and memory layouts that users actually pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MASK_KINDS = ("none", "random", "all_true", "empty_rows", "right_pad", "left_pad")
MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.uint8)
LAYOUTS = ("contiguous", "transposed", "sliced")


@dataclass
class PoolCase:
    hidden: torch.Tensor
    mask: torch.Tensor | None
    grad: torch.Tensor  # upstream gradient for the pooled [B, D] output

    def __repr__(self) -> str:
        h = self.hidden
        mask = "None" if self.mask is None else f"{self.mask.dtype} valid={self.mask.sum(1).tolist()}"
        return f"PoolCase(shape={list(h.shape)}, dtype={h.dtype}, strides={h.stride()}, mask={mask})"


def make_hidden(shape, dtype, layout, gen) -> torch.Tensor:
    b, l, d = shape
    if layout == "transposed":  # stored as [B, D, L]: features are not contiguous
        return torch.randn(b, d, l, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
    if layout == "sliced":  # every other feature of a wider tensor
        return torch.randn(b, l, 2 * d, generator=gen, dtype=torch.float64).to(dtype)[:, :, ::2]
    return torch.randn(b, l, d, generator=gen, dtype=torch.float64).to(dtype)


def make_mask(kind, mask_dtype, batch, seq_len, gen) -> torch.Tensor | None:
    if kind == "none":
        return None
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=gen)
    positions = torch.arange(seq_len)
    if kind == "random":
        mask = torch.rand(batch, seq_len, generator=gen) < 0.6
    elif kind == "all_true":
        mask = torch.ones(batch, seq_len, dtype=torch.bool)
    elif kind == "empty_rows":  # some texts have no valid token at all
        mask = torch.rand(batch, seq_len, generator=gen) < 0.5
        mask[torch.rand(batch, generator=gen) < 0.5] = False
    elif kind == "right_pad":
        mask = positions < lengths[:, None]
    else:  # left_pad
        mask = positions >= (seq_len - lengths)[:, None]
    return mask.to(mask_dtype)


def draw_hidden(draw, dtypes, max_seq, max_dim, dim=None):
    """hidden [B, L, D] of a drawn shape (D drawn unless given), dtype and layout, and the generator for the rest
    of the case."""
    batch = draw(st.integers(1, 8))
    seq_len = draw(st.integers(1, max_seq))
    dim = dim if dim is not None else draw(st.integers(1, max_dim))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return make_hidden((batch, seq_len, dim), dtype, draw(st.sampled_from(LAYOUTS)), gen), gen


@st.composite
def pool_cases(draw, dtypes=DTYPES, max_seq=300, max_dim=300) -> PoolCase:
    hidden, gen = draw_hidden(draw, dtypes, max_seq, max_dim)
    (batch, seq_len, dim), dtype = hidden.shape, hidden.dtype
    mask = make_mask(draw(st.sampled_from(MASK_KINDS)), draw(st.sampled_from(MASK_DTYPES)), batch, seq_len, gen)
    grad = torch.randn(batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    return PoolCase(hidden, mask, grad)


LANDMARK_FORMS = ("mask", "positions")


@dataclass
class LandmarkCase:
    hidden: torch.Tensor
    landmarks: torch.Tensor  # bool [B, L] or int64 positions [B, K] padded with -1
    grad: torch.Tensor  # upstream gradient for the pooled [B, D] output

    def __repr__(self) -> str:
        h, lm = self.hidden, self.landmarks
        return (f"LandmarkCase(shape={list(h.shape)}, dtype={h.dtype}, strides={h.stride()}, "
                f"landmarks={lm.dtype} {lm.tolist() if lm.dtype == torch.long else lm.sum(1).tolist()})")


def make_positions(batch, seq_len, gen) -> torch.Tensor:
    """int64 [B, K] positions: random rows (repeats allowed), -1 anywhere, some rows all -1."""
    width = int(torch.randint(0, 12, (), generator=gen))
    positions = torch.randint(0, seq_len, (batch, width), generator=gen)
    positions[torch.rand(batch, width, generator=gen) < 0.3] = -1
    positions[torch.rand(batch, generator=gen) < 0.2] = -1
    if width == seq_len >= 3 and batch > 0 and ((positions == 0) | (positions == 1)).all():
        positions[0, 0] = -1  # else it is refused as a 0/1 mask in the wrong dtype (prepare_positions)
    return positions


def make_landmark_mask(batch, seq_len, gen) -> torch.Tensor:
    """bool [B, L]: a landmark every `interval` tokens of a right-padded text, the way insert_landmarks lays them."""
    interval = int(torch.randint(1, 40, (), generator=gen))
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=gen)
    positions = torch.arange(seq_len)
    every_interval = ((positions + 1) % (interval + 1) == 0) & (positions < lengths[:, None])
    return every_interval | (positions == lengths[:, None] - 1)


@st.composite
def landmark_cases(draw, dtypes=DTYPES, max_seq=300, max_dim=300) -> LandmarkCase:
    hidden, gen = draw_hidden(draw, dtypes, max_seq, max_dim)
    (batch, seq_len, dim), dtype = hidden.shape, hidden.dtype
    if draw(st.sampled_from(LANDMARK_FORMS)) == "mask":
        landmarks = make_landmark_mask(batch, seq_len, gen)
    else:
        landmarks = make_positions(batch, seq_len, gen)
    grad = torch.randn(batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    return LandmarkCase(hidden, landmarks, grad)


HEAD_COUNTS = (1, 2, 4, 8, 12)


@dataclass
class AttentionCase:
    hidden: torch.Tensor
    mask: torch.Tensor | None
    query: torch.Tensor  # [D] or [H, D // H]
    scale: float | None
    return_weights: bool
    grad: torch.Tensor  # upstream gradient for the pooled [B, D] output
    grad_weights: torch.Tensor  # upstream gradient for the weights (used with return_weights)

    def __repr__(self) -> str:
        h = self.hidden
        mask = "None" if self.mask is None else f"{self.mask.dtype} valid={self.mask.sum(1).tolist()}"
        return (f"AttentionCase(shape={list(h.shape)}, dtype={h.dtype}, strides={h.stride()}, mask={mask}, "
                f"query={list(self.query.shape)} {self.query.dtype} |q|max={self.query.abs().max().item():.3g}, "
                f"scale={self.scale}, return_weights={self.return_weights})")


@st.composite
def attention_cases(draw, dtypes=DTYPES, max_seq=200, max_head_dim=40) -> AttentionCase:
    heads = draw(st.sampled_from(HEAD_COUNTS))
    head_dim = draw(st.integers(1, max_head_dim))
    hidden, gen = draw_hidden(draw, dtypes, max_seq, None, dim=heads * head_dim)
    (batch, seq_len, dim), dtype = hidden.shape, hidden.dtype
    mask = make_mask(draw(st.sampled_from(MASK_KINDS)), draw(st.sampled_from(MASK_DTYPES)), batch, seq_len, gen)
    shape = (dim,) if heads == 1 and draw(st.booleans()) else (heads, head_dim)
    # 0 gives uniform weights; larger queries give peaked ones.
    spread = draw(st.sampled_from((0.0, 0.3, 1.0, 3.0)))
    query = (torch.randn(shape, generator=gen, dtype=torch.float64) * spread).to(
        draw(st.sampled_from((dtype, torch.float32))))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    grad = torch.randn(batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    grad_weights = torch.randn(batch, heads, seq_len, generator=gen, dtype=torch.float64).to(wide)
    if len(shape) == 1:
        grad_weights = grad_weights.squeeze(1)
    return AttentionCase(hidden, mask, query, scale, draw(st.booleans()), grad, grad_weights)
