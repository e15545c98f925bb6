"""landmark_mean, landmark_gather and the fused normalisation against lmk_ops.reference, plus the outcomes their
contracts define: repeated and padded positions, texts without landmarks, reading only landmark rows."""

from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import example, given

import lmk_ops
from devices import DEVICES, on
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
