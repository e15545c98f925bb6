"""landmark_mean, landmark_gather and the fused normalisation against lmk_ops.reference, plus the outcomes their
contracts define: repeated and padded positions, texts without landmarks, reading only landmark rows."""

from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import example, given

import lmk_ops
from devices import DEVICES, expect_bad_value, on
from lmk_ops import reference
from parity import check_pair, forward_and_grad
from strategies import LandmarkCase, landmark_cases, pool_cases


def _unchanged(*tensors):
    before = [t.clone() for t in tensors]
    return lambda: all(torch.equal(t, b) for t, b in zip(tensors, before))


# Found by Hypothesis: in float16 rows 0 and 4 cancel exactly (0.36328125 twice, -0.7265625), so the normalised mean
# is a zero vector, whose gradient is 1/eps = 1e12 per unit: past float16's range, inf is its rounding.
_CANCELLING = LandmarkCase(
    hidden=torch.tensor([0.3633, -1.8066, -0.1276, 1.3027, -0.7266, 0.5581, 0.5488, -1.1777],
                        dtype=torch.float16).view(1, 8, 1),
    landmarks=torch.tensor([[0, 4, 0]]), grad=torch.tensor([[0.6279]], dtype=torch.float16))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@given(case=landmark_cases())
@example(case=_CANCELLING)
def test_landmark_mean_matches_reference(normalize, case, device):
    case = on(device, case)
    unchanged = _unchanged(case.hidden, case.landmarks, case.grad)
    check_pair("landmark_mean", partial(lmk_ops.landmark_mean, normalize=normalize),
               partial(reference.landmark_mean, normalize=normalize), case.hidden, case.landmarks, case.grad)
    assert unchanged(), "an input tensor was modified"


@pytest.mark.parametrize("device", DEVICES)
@given(case=landmark_cases())
def test_landmark_gather_matches_reference(case, device):
    case = on(device, case)
    vectors, valid = lmk_ops.landmark_gather(case.hidden, case.landmarks)
    ref_vectors, ref_valid = reference.landmark_gather(case.hidden, case.landmarks)
    assert torch.equal(valid, ref_valid) and torch.equal(vectors, ref_vectors)  # a copy: exact
    grad = torch.randn(vectors.shape, dtype=torch.float64).to(vectors)
    check_pair("landmark_gather", lambda h, lm: lmk_ops.landmark_gather(h, lm)[0],
               lambda h, lm: reference.landmark_gather(h, lm)[0], case.hidden, case.landmarks, grad)


@pytest.mark.parametrize("op", ["mean_pool", "max_pool"])
@pytest.mark.parametrize("device", DEVICES)
@given(case=pool_cases())
def test_normalized_pooling_matches_reference(op, case, device):
    case = on(device, case)
    ours, ref = getattr(lmk_ops, op), getattr(reference, op)
    check_pair(f"{op}(normalize=True)", partial(ours, normalize=True), partial(ref, normalize=True),
               case.hidden, case.mask, case.grad)


def test_landmark_mask_is_mean_pool_over_it_bit_for_bit():
    hidden = torch.randn(4, 100, 96, dtype=torch.bfloat16)
    landmarks = torch.rand(4, 100) < 0.1
    assert torch.equal(lmk_ops.landmark_mean(hidden, landmarks), lmk_ops.mean_pool(hidden, landmarks))
    positions = lmk_ops.landmark_positions(landmarks)
    assert torch.equal(lmk_ops.landmark_mean(hidden, positions), lmk_ops.mean_pool(hidden, landmarks))


def test_only_landmark_rows_are_read():
    # NaN everywhere but the landmark rows: a kernel that touched any other row would return NaN.
    hidden = torch.full((2, 50, 40), float("nan"))
    positions = torch.tensor([[3, 20, 49], [0, -1, -1]])
    hidden[0, [3, 20, 49]] = torch.randn(3, 40)
    hidden[1, 0] = torch.randn(40)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[0, [3, 20, 49]] = mask[1, 0] = True
    for landmarks in (positions, mask):
        out = lmk_ops.landmark_mean(hidden, landmarks)
        assert not out.isnan().any()
        torch.testing.assert_close(out[0], hidden[0, [3, 20, 49]].mean(0))
        torch.testing.assert_close(out[1], hidden[1, 0])


def test_repeated_and_padded_positions():
    hidden = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[-1, 2, 4, 2, -1]])  # 2 is listed twice, -1 anywhere is skipped
    out = lmk_ops.landmark_mean(hidden, positions)
    torch.testing.assert_close(out[0], (2 * hidden[0, 2] + hidden[0, 4]) / 3)
    out.sum().backward()
    expected = torch.zeros(1, 6, 8, dtype=torch.float64)
    expected[0, 2], expected[0, 4] = 2 / 3, 1 / 3
    torch.testing.assert_close(hidden.grad, expected)
    hidden.grad = None
    vectors, valid = lmk_ops.landmark_gather(hidden, positions)
    assert valid.tolist() == [[False, True, True, True, False]]
    assert torch.equal(vectors[0, 0], torch.zeros(8, dtype=torch.float64)) and torch.equal(vectors[0, 3], hidden[0, 2])
    vectors.sum().backward()
    expected[0, 2], expected[0, 4] = 2, 1  # a repeated position gets both gradients
    torch.testing.assert_close(hidden.grad, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", [False, True])
def test_text_without_landmarks_gives_zeros_and_zero_grad(dtype, normalize):
    hidden = torch.randn(2, 5, 7).to(dtype)
    for landmarks in (torch.tensor([[1, -1], [-1, -1]]), torch.tensor([[0, 1, 0, 0, 0], [0] * 5]).bool(),
                      torch.empty(2, 0, dtype=torch.long)):
        fn = partial(lmk_ops.landmark_mean, normalize=normalize)
        out, grad = forward_and_grad(fn, hidden, landmarks, torch.ones(2, 7, dtype=dtype))
        assert torch.equal(out[1], torch.zeros(7, dtype=dtype)) and torch.equal(grad[1], torch.zeros(5, 7, dtype=dtype))
        assert not out.isnan().any() and not grad.isnan().any()


def test_normalize_returns_unit_vectors_and_keeps_zero_rows():
    hidden = torch.randn(3, 9, 64, dtype=torch.bfloat16) * 100
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[2] = False
    for fn in (lmk_ops.mean_pool, lmk_ops.max_pool, lmk_ops.landmark_mean):
        out = fn(hidden, mask, normalize=True)
        norms = out[:2].float().norm(dim=1)
        torch.testing.assert_close(norms, torch.ones(2), atol=1e-2, rtol=0)
        assert torch.equal(out[2], torch.zeros(64, dtype=torch.bfloat16))


def test_landmarks_alone_or_in_a_batch_give_the_same_bits():
    text = torch.randn(1, 40, 700, dtype=torch.bfloat16)
    positions = torch.tensor([[5, 11, 39]])
    alone = lmk_ops.landmark_mean(text, positions)
    batch = torch.randn(4, 64, 700, dtype=torch.bfloat16)
    batch[1, 10:50] = text[0]
    listed = torch.full((4, 5), -1)
    listed[1, 1:4] = positions[0] + 10
    assert torch.equal(lmk_ops.landmark_mean(batch, listed)[1], alone[0])


def test_landmark_positions():
    mask = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]).bool()
    assert lmk_ops.landmark_positions(mask).tolist() == [[1, 3, 4], [-1, -1, -1], [0, -1, -1]]
    assert lmk_ops.landmark_positions(mask, 4).tolist() == [[1, 3, 4, -1], [-1] * 4, [0, -1, -1, -1]]
    # K as a NumPy integer (a config value, an array's max) counts as an int, as max_seqlen does; a float does not.
    assert lmk_ops.landmark_positions(mask, np.int64(4)).tolist() == [[1, 3, 4, -1], [-1] * 4, [0, -1, -1, -1]]
    assert lmk_ops.landmark_gather(torch.randn(3, 5, 2), mask, num_landmarks=np.int32(3))[0].shape == (3, 3, 2)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_positions: expected num_landmarks as an int in "
                                           r"\[0, 2\*\*63\) \(or None\), got 4\.0"):
        lmk_ops.landmark_positions(mask, 4.0)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_positions: expected at most num_landmarks = 2 "
                                           r"landmarks per row, got 3 in row 0"):
        lmk_ops.landmark_positions(mask, 2)
    # Called from landmark_gather, the same checks name landmark_gather.
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_gather: expected at most num_landmarks = 2 "):
        lmk_ops.landmark_gather(torch.randn(3, 5, 2), mask, num_landmarks=2)
    with pytest.raises(RuntimeError,
                       match=r"^lmk_ops\.landmark_gather: expected num_landmarks as an int in \[0, 2\*\*63\)"):
        lmk_ops.landmark_gather(torch.randn(3, 5, 2), mask, num_landmarks=-1)
    # Positions [B, K] set K: a num_landmarks beside them must agree (it was ignored).
    positions = lmk_ops.landmark_positions(mask)
    assert lmk_ops.landmark_gather(torch.randn(3, 5, 2), positions, num_landmarks=3)[0].shape == (3, 3, 2)
    for wrong in (5, 2, "3", 3.0):
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_gather: expected num_landmarks = K = 3 \(the "
                                               r"width of the positions \[B, K\]\) or None, got"):
            lmk_ops.landmark_gather(torch.randn(3, 5, 2), positions, num_landmarks=wrong)
    assert lmk_ops.landmark_positions(torch.zeros(0, 4, dtype=torch.bool)).shape == (0, 0)


def _positions_by_loop(mask, lengths=None):
    """Each text's true entries in order, -1 padded to the widest: a row loop (padded [B, L], or packed [T] split
    by lengths)."""
    texts = list(mask) if lengths is None else list(torch.split(mask, lengths))
    found = [text.nonzero().flatten().tolist() for text in texts]
    width = max((len(f) for f in found), default=0)
    return torch.tensor([f + [-1] * (width - len(f)) for f in found], dtype=torch.long).view(len(found), width)


@pytest.mark.parametrize("device", DEVICES)
def test_landmark_positions_find_every_true_entry_in_order_padded_and_packed(device, request):
    # Texts longer than a warp's 32-row scan, with runs of landmarks crossing its rounds, empty texts and texts with
    # none: one op (find_rows) on every device, padded and packed, with K found (a count pass) or given.
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 31, 32, 33, 64, 100, 257, 0, 5]
    mask = torch.rand(sum(lengths), generator=gen) < 0.3
    mask[40:110] = True  # a run across several rounds of 32
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    want = _positions_by_loop(mask, lengths)
    got = lmk_ops.landmark_positions(mask.to(device), cu_seqlens=cu_seqlens.to(device))
    assert torch.equal(got.cpu(), want)
    wide = lmk_ops.landmark_positions(mask.to(device), want.shape[1] + 3, cu_seqlens=cu_seqlens.long().to(device))
    assert torch.equal(wide.cpu(), torch.cat([want, torch.full((len(lengths), 3), -1)], 1))
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for b, text in enumerate(torch.split(mask, lengths)):
        padded[b, max(lengths) - len(text):] = text  # left padding: positions count from the row's start
    shift = torch.tensor([max(lengths) - n for n in lengths]).unsqueeze(1)
    got = lmk_ops.landmark_positions(padded.to(device)).cpu()
    assert torch.equal(got, torch.where(want >= 0, want + shift, -1))
    h = torch.randn(len(lengths), max(lengths), 4, device=device)
    vectors, valid = lmk_ops.landmark_gather(h, padded.to(device))
    assert torch.equal(valid.cpu(), got >= 0) and torch.equal(vectors, lmk_ops.landmark_gather(h, got.to(device))[0])
    width = want.shape[1] + 2
    cases = [(padded, width, None), (padded, None, None), (mask, width, cu_seqlens), (mask, None, cu_seqlens.long())]
    for args in cases:
        torch.library.opcheck(torch.ops.lmk_ops.landmark_positions.default,
                              (args[0].to(device), args[1], on(device, args[2]), "landmark_positions"))


@pytest.mark.parametrize("device", DEVICES)
def test_landmark_positions_refuse_a_text_with_more_than_num_landmarks_on_every_device(device, request):
    mask = torch.zeros(3, 40, dtype=torch.bool, device=device)
    mask[2, 3:40:2] = True  # 19 landmarks, in the second round of a warp's scan too
    expect_bad_value(device, r"lmk_ops\.landmark_positions: expected at most num_landmarks = 18 landmarks per row, "
                             r"got 19 in row 2", lambda: lmk_ops.landmark_positions(mask, 18), request)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["landmark_mean", "landmark_gather"])
def test_an_int64_landmark_mask_of_zeros_and_ones_is_refused_not_read_as_positions(device, op, request):
    """int64 [B, L] of 0s and 1s (a mask built with .long(), a tokenizer's special_tokens_mask) would read as
    positions listing rows 0 and 1 again and again: refused as a bad value, on every device (CUDA: on the device,
    without a sync)."""
    hidden = torch.randn(2, 6, 4, device=device)
    mask = torch.tensor([[0, 0, 1, 0, 0, 1], [0, 1, 0, 0, 1, 0]], device=device)
    message = (rf"lmk_ops\.{op}: landmarks is an int64 \[B, L\] = \[2, 6\] tensor of 0s and 1s: a landmark mask in "
               r"the wrong dtype \(pass landmarks\.bool\(\)\), which read as positions would list rows 0 and 1 again "
               r"and again; expected positions' largest entry to be at least 2, or some entry -1, got 1")
    expect_bad_value(device, message, lambda: getattr(lmk_ops, op)(hidden, mask), request)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["landmark_mean", "landmark_gather"])
def test_positions_of_width_l_that_list_rows_0_and_1_are_still_taken_with_a_minus_one_or_a_larger_row(device, op):
    hidden = torch.randn(2, 6, 4, device=device)
    cases = [[[0, 1, -1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], [[0, 1, 2, 0, 1, 1], [1, 1, 1, 1, 1, 1]], [[0, 1], [1, 1]]]
    for positions in cases:
        positions = torch.tensor(positions, device=device)
        got, want = getattr(lmk_ops, op)(hidden, positions), getattr(reference, op)(hidden, positions)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b)
