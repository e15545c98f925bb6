"""Bad inputs raise errors that name the op and say what was expected and what came, eagerly on CPU and through the
fake kernels (the path torch.compile and meta tensors take)."""

import pytest
import torch

import lmk_ops
from parity import OPS

POOLS = {op: ours for op, (ours, _) in OPS.items()}
# attention_pool with a query that fits hidden, so that the hidden and mask checks are the ones that fire.
POOLS["attention_pool"] = lambda hidden, mask: lmk_ops.attention_pool(
    hidden, mask, torch.zeros(hidden.shape[-1], device=hidden.device))

# (description, hidden, mask, message pattern after "lmk_ops.<op>: ")
BAD_INPUTS = [
    ("2-D hidden", lambda: torch.randn(4, 8), None,
     r"expected hidden of shape \[B, L, D\] \(3-D\), got a 2-D tensor of shape \[4, 8\]"),
    ("4-D hidden", lambda: torch.randn(2, 3, 4, 5), None, r"expected hidden of shape \[B, L, D\] \(3-D\), got a 4-D"),
    ("integer hidden", lambda: torch.ones(2, 3, 4, dtype=torch.long), None,
     r"expected hidden of dtype float16, bfloat16, float32 or float64, got Long"),
    ("mask batch mismatch", lambda: torch.randn(2, 3, 4), torch.ones(3, 3, dtype=torch.bool),
     r"expected mask of shape \[B, L\] = \[2, 3\], got \[3, 3\]"),
    ("mask length mismatch", lambda: torch.randn(2, 3, 4), torch.ones(2, 5, dtype=torch.bool),
     r"expected mask of shape \[B, L\] = \[2, 3\], got \[2, 5\]"),
    ("3-D mask", lambda: torch.randn(2, 3, 4), torch.ones(2, 3, 1, dtype=torch.bool),
     r"expected mask of shape \[B, L\] = \[2, 3\], got \[2, 3, 1\]"),
    ("float mask", lambda: torch.randn(2, 3, 4), torch.ones(2, 3),
     r"expected mask of dtype bool or an integer dtype holding 0/1, got Float"),
]


@pytest.mark.parametrize("op", POOLS)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs(op, case, device):
    _, make_hidden, mask, pattern = case
    hidden = make_hidden().to(device)
    mask = None if mask is None else mask.to(device)
    with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: {pattern}"):
        POOLS[op](hidden, mask)


@pytest.mark.parametrize("op", POOLS)
def test_mask_values_other_than_0_1(op):
    mask = torch.tensor([[1, 1, 0], [1, 2, 0]])
    with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: expected mask values 0 or 1, got 2 at \[1, 1\]"):
        POOLS[op](torch.randn(2, 3, 4), mask)
    with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: expected mask values 0 or 1, got -1 at \[0, 2\]"):
        POOLS[op](torch.randn(2, 3, 4), torch.tensor([[1, 1, -1], [1, 0, 0]]))


@pytest.mark.parametrize("op", POOLS)
def test_tensors_on_different_devices(op):
    with pytest.raises(RuntimeError,
                       match=rf"^lmk_ops\.{op}: expected mask on the same device as hidden \(cpu\), got meta"):
        POOLS[op](torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("op", POOLS)
def test_bad_inputs_under_compile(op):
    compiled = torch.compile(POOLS[op], fullgraph=True)
    with pytest.raises(Exception, match=rf"lmk_ops\.{op}: expected mask of shape \[B, L\] = \[2, 3\], got \[2, 4\]"):
        compiled(torch.randn(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))


def test_backward_ops_check_their_inputs():
    ops = torch.ops.lmk_ops
    for device in ("cpu", "meta"):
        grad = torch.randn(2, 4, device=device)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.mean_pool_backward: expected grad_out of shape \[B, D\] "
                                               r"\(2-D\), got shape \[2, 4, 1\]"):
            ops.mean_pool_backward(grad[..., None], None, 3)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.mean_pool_backward: expected mask of shape \[B, L\] = "
                                               r"\[2, 3\], got \[2, 5\]"):
            ops.mean_pool_backward(grad, torch.ones(2, 5, dtype=torch.bool, device=device), 3)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.max_pool_backward: expected argmax of dtype int32 and shape "
                                               r"\[2, 4\] \(as max_pool returns\), got Long of shape \[2, 4\]"):
            ops.max_pool_backward(grad, torch.zeros(2, 4, dtype=torch.long, device=device), 3)


def test_backward_ops_trust_the_values_their_forward_checked_and_stay_inside_their_tensors():
    # Validated once, in the forward (a backward op never synchronises with a GPU to re-check); a value no forward
    # would produce only selects no row, it never reads or writes outside a tensor.
    ops = torch.ops.lmk_ops
    grad = torch.randn(2, 4)
    argmax = torch.tensor([[0, 7, 1, -5], [0, 0, 0, 0]], dtype=torch.int32)
    want = torch.zeros(2, 3, 4)
    want[0, 0, 0], want[0, 1, 2], want[1, 0] = grad[0, 0], grad[0, 2], grad[1]
    assert torch.equal(ops.max_pool_backward(grad, argmax, 3), want)
    positions = torch.tensor([[0, 9], [-4, 2]])
    want = torch.zeros(2, 3, 4)
    want[0, 0], want[1, 2] = grad[0] / 2, grad[1] / 1
    assert torch.equal(ops.landmark_mean_backward(grad, positions, 3), want)
    rows = torch.randn(2, 2, 4)
    want = torch.zeros(2, 3, 4)
    want[0, 0], want[1, 2] = rows[0, 0], rows[1, 1]
    assert torch.equal(ops.landmark_gather_backward(rows, positions, 3), want)


LANDMARK_OPS = {
    "landmark_mean": lmk_ops.landmark_mean,
    "landmark_gather": lambda hidden, landmarks, **packed: lmk_ops.landmark_gather(hidden, landmarks, **packed)[0],
}
# (description, landmarks for hidden [2, 3, 4], message pattern after "lmk_ops.<op>: ")
BAD_LANDMARKS = [
    ("int32 positions", torch.zeros(2, 1, dtype=torch.int32),
     r"expected landmarks as a bool mask \[B, L\] or int64 positions \[B, K\] padded with -1, got Int"),
    ("float landmarks", torch.zeros(2, 3),
     r"expected landmarks as a bool mask \[B, L\] or int64 positions \[B, K\] padded with -1, got Float"),
    ("positions batch mismatch", torch.zeros(3, 2, dtype=torch.long),
     r"expected landmark positions of shape \[B, K\] = \[2, K\], got \[3, 2\]"),
    ("1-D positions", torch.zeros(2, dtype=torch.long),
     r"expected landmark positions of shape \[B, K\] = \[2, K\], got \[2\]"),
    ("mask length mismatch", torch.ones(2, 5, dtype=torch.bool),
     r"expected a landmark mask of shape \[B, L\] = \[2, 3\], got \[2, 5\]"),
]


@pytest.mark.parametrize("op", LANDMARK_OPS)
@pytest.mark.parametrize("case", BAD_LANDMARKS, ids=[c[0] for c in BAD_LANDMARKS])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_landmarks(op, case, device):
    _, landmarks, pattern = case
    with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: {pattern}"):
        LANDMARK_OPS[op](torch.randn(2, 3, 4, device=device), landmarks.to(device))


@pytest.mark.parametrize("op", LANDMARK_OPS)
@pytest.mark.parametrize("bad,row,entry", [(3, 1, 1), (-2, 0, 0), (100, 1, 0)])
def test_positions_out_of_range_name_the_row_and_position(op, bad, row, entry):
    positions = torch.tensor([[0, 2], [1, -1]])
    positions[row, entry] = bad
    pattern = (rf"^lmk_ops\.{op}: expected landmark positions in \[0, L\) = \[0, 3\) or -1 for none, got {bad} "
               rf"in row {row} \(landmarks\[{row}, {entry}\]\)")
    with pytest.raises(RuntimeError, match=pattern):
        LANDMARK_OPS[op](torch.randn(2, 3, 4), positions)


@pytest.mark.parametrize("op", LANDMARK_OPS)
def test_landmarks_on_another_device(op):
    for landmarks in (torch.zeros(2, 1, dtype=torch.long, device="meta"),
                      torch.ones(2, 3, dtype=torch.bool, device="meta")):
        if op == "landmark_gather" and landmarks.dtype == torch.bool:
            continue  # turned into positions on its own device first
        with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: expected landmarks on the same device as hidden "
                                               rf"\(cpu\), got meta"):
            LANDMARK_OPS[op](torch.randn(2, 3, 4), landmarks)


def test_packed_landmarks_of_another_dtype_name_both_forms():
    """An int8 or int32 landmark mask is neither form: landmark_gather named only the positions' dtype."""
    hidden, offsets = torch.randn(5, 4), torch.tensor([0, 2, 5])
    for op, fn in LANDMARK_OPS.items():
        for dtype, name in ((torch.int8, "Char"), (torch.int32, "Int")):
            with pytest.raises(RuntimeError, match=rf"^lmk_ops\.{op}: expected packed landmarks as a bool mask "
                                                   rf"\[T\] or int64 positions \[B, K\] padded with -1, got {name}"):
                fn(hidden, torch.ones(5, dtype=dtype), cu_seqlens=offsets)


def test_landmark_backward_ops_check_their_inputs():
    ops = torch.ops.lmk_ops
    positions = torch.tensor([[0, 2], [1, -1]])
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_gather_backward: expected grad_out of shape "
                                               r"\[B, K, D\] with K = 2 \(as positions\), got \[2, 3, 4\]"):
            ops.landmark_gather_backward(torch.randn(2, 3, 4, device=device), positions.to(device), 3)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.landmark_mean_backward: expected dtype float16, bfloat16, "
                                               r"float32 or float64, got Long"):
            ops.landmark_mean_backward(torch.randn(2, 4, device=device), positions.to(device), 3, torch.long)


def test_landmark_mean_under_compile_reports_the_error():
    compiled = torch.compile(lmk_ops.landmark_mean, fullgraph=True)
    with pytest.raises(Exception, match=r"lmk_ops\.landmark_mean: expected a landmark mask of shape \[B, L\] = "
                                        r"\[2, 3\], got \[2, 4\]"):
        compiled(torch.randn(2, 3, 4), torch.ones(2, 4, dtype=torch.bool))


# (description, hidden [2, 3, 12], query, keywords, message pattern after "lmk_ops.attention_pool: ")
BAD_QUERIES = [
    ("query too short", lambda: torch.randn(11), {}, r"expected query of shape \[D\] = \[12\] \(one head\) or "
     r"\[H, D / H\] with H \* \(D / H\) = 12 \(H heads\), got \[11\]"),
    ("heads not dividing D", lambda: torch.randn(5, 2), {}, r"expected query of shape .* got \[5, 2\]"),
    ("3-D query", lambda: torch.randn(2, 3, 2), {}, r"expected query of shape .* got \[2, 3, 2\]"),
    ("no heads", lambda: torch.randn(0, 5), {}, r"expected query of shape .* got \[0, 5\]"),
    ("integer query", lambda: torch.ones(12, dtype=torch.long), {}, r"expected query of dtype float16, bfloat16, "
     r"float32 or float64, got Long"),
    ("infinite scale", lambda: torch.randn(12), {"scale": float("inf")},
     r"expected a scale finite in float32, got inf"),
    ("NaN scale", lambda: torch.randn(12), {"scale": float("nan")}, r"expected a scale finite in float32, got nan"),
]


@pytest.mark.parametrize("case", BAD_QUERIES, ids=[c[0] for c in BAD_QUERIES])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_attention_queries(case, device):
    _, make_query, options, pattern = case
    with pytest.raises(RuntimeError, match=rf"^lmk_ops\.attention_pool: {pattern}"):
        lmk_ops.attention_pool(torch.randn(2, 3, 12, device=device), None, make_query().to(device), **options)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_attention_needs_features_and_a_query_on_the_same_device(device):
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool: expected hidden with D > 0 features "
                                           r"\(attention scores need them\), got shape \[2, 3, 0\]"):
        lmk_ops.attention_pool(torch.randn(2, 3, 0, device=device), None, torch.randn(0, device=device))
    # A packed batch's message shows hidden as given, [T, D], not the kernels' view of it.
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool: expected hidden with D > 0 features "
                                           r"\(attention scores need them\), got shape \[5, 0\]"):
        lmk_ops.attention_pool(torch.randn(5, 0, device=device), None, torch.randn(0, device=device),
                               cu_seqlens=torch.tensor([0, 2, 5], device=device))
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool: expected query on the same device as hidden "
                                           r"\(cpu\), got meta"):
        lmk_ops.attention_pool(torch.randn(2, 3, 4), None, torch.randn(4, device="meta"))


def test_attention_errors_under_compile():
    compiled = torch.compile(lmk_ops.attention_pool, fullgraph=True)
    with pytest.raises(Exception, match=r"lmk_ops\.attention_pool: expected query of shape .* got \[5\]"):
        compiled(torch.randn(2, 3, 4), None, torch.randn(5))


def test_attention_backward_op_checks_its_inputs():
    op = torch.ops.lmk_ops.attention_pool_backward
    hidden, query = torch.randn(2, 3, 4), torch.randn(2, 2)
    out, stats, _ = torch.ops.lmk_ops.attention_pool(hidden, None, query)
    grad = torch.randn(2, 4)
    for device in ("cpu", "meta"):
        args = [t.to(device) for t in (grad, hidden, query, out, stats)]
        g, h, q, o, st = args
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool_backward: expected grad_out of a floating "
                                               r"dtype and shape \[2, 4\], got Float of shape \[2, 5\]"):
            op(torch.randn(2, 5, device=device), None, h, None, q, o, st)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool_backward: expected stats of a floating "
                                               r"dtype and shape \[2, 2, 2\], got Double of shape \[2, 2\]"):
            op(g, None, h, None, q, o, st[..., 0])
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool_backward: expected grad_weights of a "
                                               r"floating dtype and shape \[2, 2, 3\], got Float of shape \[2, 3\]"):
            op(g, torch.randn(2, 3, device=device), h, None, q, o, st)
        with pytest.raises(RuntimeError, match=r"^lmk_ops\.attention_pool_backward: expected out of a floating "
                                               r"dtype and shape \[2, 4\], got Long"):
            op(g, None, h, None, q, o.long(), st)
