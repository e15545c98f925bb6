"""Packed (cu_seqlens) batches: every op gives a text the same bits packed, padded (either side) or alone, forward
and gradient; the offsets are checked; the packed ops pass opcheck, gradcheck and torch.compile."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lmk_ops
from devices import DEVICES, expect_bad_value
from strategies import DTYPES

ops = torch.ops.lmk_ops


def _attention(heads):
    def pool(hidden, mask, **packed):
        count = heads if hidden.shape[-1] % heads == 0 else 1
        query = torch.linspace(-1.0, 1.0, hidden.shape[-1], dtype=torch.float64).reshape(count, -1)
        return lmk_ops.attention_pool(hidden, mask, query.to(hidden.device), **packed)
    return pool


# Every public function as f(hidden, token mask or None, **packed), with whether it takes a token mask.
FUNCTIONS = {
    "mean_pool": lmk_ops.mean_pool,
    "mean_pool+normalize": partial(lmk_ops.mean_pool, normalize=True),
    "max_pool": lmk_ops.max_pool,
    "first_token_pool": lmk_ops.first_token_pool,
    "last_token_pool": lmk_ops.last_token_pool,
    "landmark_mean": lambda h, m, **p: lmk_ops.landmark_mean(h, m if m is not None else _all(h, p), **p),
    "landmark_mean+normalize": lambda h, m, **p: lmk_ops.landmark_mean(h, m if m is not None else _all(h, p),
                                                                       normalize=True, **p),
    "landmark_gather": lambda h, m, **p: lmk_ops.landmark_gather(h, m if m is not None else _all(h, p),
                                                                 num_landmarks=_longest(h, p), **p)[0],
    "attention_pool@1h": _attention(1),
    "attention_pool@2h": _attention(2),
}


def _longest(hidden, packed):
    """The longest text's length: padded L, or from a packed batch's offsets."""
    if packed.get("cu_seqlens") is None:
        return hidden.shape[1]
    offsets = packed["cu_seqlens"]
    return int((offsets[1:] - offsets[:-1]).max())


def _all(hidden, packed):
    """A landmark mask selecting every token (landmark ops need one)."""
    shape = hidden.shape[:2] if packed.get("cu_seqlens") is None else hidden.shape[:1]
    return torch.ones(shape, dtype=torch.bool, device=hidden.device)


def _layouts(lengths, dim, dtype, strided, selected, device):
    """The same texts packed [T, D] (offsets int64; when asked, a strided view that starts past its storage's
    first element), right-padded and left-padded [B, W, D], and their masks ([T], [B, W]); selected: per token,
    whether it is valid (None: every token)."""
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + dim)
    total, width, batch = sum(lengths), max(lengths, default=0), len(lengths)
    wide = torch.randn(total, 2 * dim if strided else dim, generator=gen, dtype=torch.float64).to(dtype).to(device)
    packed = wide[:, 1::2] if strided else wide
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)
    pads = {}
    for side in ("right", "left"):
        hidden = torch.randn(batch, width, dim, generator=gen, dtype=torch.float64).to(dtype).to(device)
        mask = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for b, n in enumerate(lengths):
            start = int(offsets[b])
            slots = slice(0, n) if side == "right" else slice(width - n, width)
            hidden[b, slots] = packed[start:start + n]
            mask[b, slots] = True if selected is None else selected[start:start + n].to(device)
        pads[side] = (hidden, mask)
    token_mask = None if selected is None else selected.to(device)
    return packed, offsets, token_mask, pads


def _rows_of(padded_grad, lengths, side):
    """The text rows of a padded [B, W, D] gradient, packed into [T, D]."""
    width = padded_grad.shape[1]
    parts = [padded_grad[b, :n] if side == "right" else padded_grad[b, width - n:] for b, n in enumerate(lengths)]
    return torch.cat(parts) if parts else padded_grad.new_zeros(0, padded_grad.shape[-1])


def _run(fn, hidden, mask, upstream_seed, **packed):
    h = hidden.detach().requires_grad_()
    out = fn(h, mask, **packed)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    (g,) = torch.autograd.grad(out, h, grad.to(out.dtype).to(out.device))
    return out.detach(), g


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6), dim=st.sampled_from([1, 8, 24, 33]),
       dtype=st.sampled_from(DTYPES), offsets32=st.booleans(), strided=st.booleans(), masked=st.booleans(),
       name=st.sampled_from(sorted(FUNCTIONS)), data=st.data())
def test_a_text_pools_to_the_same_bits_packed_padded_and_alone(device, lengths, dim, dtype, offsets32, strided,
                                                               masked, name, data):
    total = sum(lengths)
    selected = torch.tensor(data.draw(st.lists(st.booleans(), min_size=total, max_size=total)), dtype=torch.bool) \
        if masked else None
    fn = FUNCTIONS[name]
    packed, offsets, token_mask, pads = _layouts(lengths, dim, dtype, strided, selected, device)
    if offsets32:
        offsets = offsets.int()
    out, grad = _run(fn, packed, token_mask, 7, cu_seqlens=offsets)
    # The same hint as the longest text, or none (read from the offsets): the same bits.
    out_hinted, _ = _run(fn, packed, token_mask, 7, cu_seqlens=offsets, max_seqlen=max(lengths) + 1)
    assert torch.equal(out, out_hinted), name
    for side, (hidden, mask) in pads.items():
        padded_out, padded_grad = _run(fn, hidden, mask, 7)
        assert torch.equal(out, padded_out), f"{name}: packed and {side}-padded outputs differ"
        assert torch.equal(grad, _rows_of(padded_grad, lengths, side)), f"{name}: {side}-padded gradient differs"
    # Alone: the first non-empty text as a batch of one.
    b = next((i for i, n in enumerate(lengths) if n), None)
    if b is not None:
        start, n = int(offsets[b]), lengths[b]
        alone = packed[start:start + n]
        alone_mask = None if token_mask is None else token_mask[start:start + n]
        one = torch.tensor([0, n], dtype=offsets.dtype, device=device)
        alone_out, _ = _run(fn, alone, alone_mask, 7, cu_seqlens=one)
        mine = out[b]
        if name == "landmark_gather":  # K is the batch's longest text there: the rest are zero rows
            assert not mine[alone_out.shape[1]:].any()
            mine = mine[:alone_out.shape[1]]
        assert torch.equal(alone_out[0], mine), f"{name}: text {b} alone differs from its batch"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_packed_attention_weights_and_their_gradients_are_the_padded_ones(device, heads, masked):
    """return_weights packed: weights [H, T] (a [D] query: [T]) hold each text's padded weights at its rows, and
    gradients through the weights as well as the output have the padded bits (hidden's and the query's)."""
    lengths, dim = [5, 0, 300, 1, 640], 32  # texts of several chunks, an empty one
    gen = torch.Generator().manual_seed(11)
    selected = torch.rand(sum(lengths), generator=gen) < 0.8 if masked else None
    packed, offsets, token_mask, pads = _layouts(lengths, dim, torch.float32, False, selected, device)
    query = torch.randn(heads, dim // heads, generator=gen).squeeze(0).to(device)

    def run(hidden, mask, weights_to_rows, **packed_args):
        h, q = hidden.detach().requires_grad_(), query.clone().requires_grad_()
        out, weights = lmk_ops.attention_pool(h, mask, q, return_weights=True, **packed_args)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device)
        rows = weights_to_rows(weights)
        upstream_weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(6)).to(device)
        grad_h, grad_q = torch.autograd.grad((out * upstream).sum() + (rows * upstream_weights).sum(), (h, q))
        return out, rows, grad_h, grad_q

    as_heads = (lambda w: w.unsqueeze(0)) if heads == 1 else (lambda w: w)
    out, weights, grad_h, grad_q = run(packed, token_mask, as_heads, cu_seqlens=offsets)
    assert weights.shape == (heads, sum(lengths))
    for side, (hidden, mask) in pads.items():
        def padded_rows(w):  # [B, (H,) W] as [H, T]: each text's weights at its packed rows
            w = w.unsqueeze(1) if heads == 1 else w
            return _rows_of(w.permute(0, 2, 1), lengths, side).t()
        padded = run(hidden, mask, padded_rows)
        for name, mine, theirs in zip(["output", "weights", "hidden gradient"], (out, weights, grad_h),
                                      (padded[0], padded[1], _rows_of(padded[2], lengths, side))):
            assert torch.equal(mine, theirs), f"{side}-padded: packed {name} differs"
        assert torch.equal(grad_q, padded[3]), f"{side}-padded: packed query gradient differs"


@pytest.mark.parametrize("device", DEVICES)
def test_packed_landmark_positions_count_from_each_text_and_repeat(device):
    hidden = torch.randn(9, 6, dtype=torch.float64, device=device, requires_grad=True)
    offsets = torch.tensor([0, 4, 4, 9], device=device)
    positions = torch.tensor([[1, 3, 1], [-1, -1, -1], [0, -1, 4]], device=device)
    out = lmk_ops.landmark_mean(hidden, positions, cu_seqlens=offsets)
    expected = torch.stack([(hidden[1] + hidden[3] + hidden[1]) / 3, torch.zeros(6, dtype=torch.float64,
                           device=device), (hidden[4] + hidden[8]) / 2])
    torch.testing.assert_close(out, expected)
    vectors, valid = lmk_ops.landmark_gather(hidden, positions, cu_seqlens=offsets)
    assert torch.equal(vectors[0, 2], hidden[1].detach()) and torch.equal(vectors[2, 2], hidden[8].detach())
    assert valid.tolist() == [[True, True, True], [False, False, False], [True, False, True]]
    torch.autograd.gradcheck(lambda h: lmk_ops.landmark_mean(h, positions, cu_seqlens=offsets), (hidden,))
    torch.autograd.gradcheck(lambda h: lmk_ops.landmark_gather(h, positions, cu_seqlens=offsets)[0], (hidden,))
    _, argmax = lmk_ops.max_pool(hidden, cu_seqlens=offsets, return_indices=True)
    assert argmax.dtype == torch.int32 and int(argmax[1].max()) == -1 and int(argmax[2].max()) < 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("lengths", [(3, 0, 4), (3, 4, 0), (0,)], ids=["empty middle", "empty last", "no rows"])
def test_packed_gradcheck_and_gradgradcheck(device, name, lengths):
    # Reverse, forward, and forward over reverse. (The double backward of max pooling once read row T for an empty
    # last text, whose start is T: an IndexError.)
    fn = FUNCTIONS[name]
    hidden = torch.randn(sum(lengths), 4, dtype=torch.float64, device=device, requires_grad=True)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 1][:sum(lengths)], dtype=torch.bool, device=device)
    torch.autograd.gradcheck(lambda h: fn(h, mask, cu_seqlens=offsets), (hidden,), check_forward_ad=True)
    torch.autograd.gradgradcheck(lambda h: fn(h, mask, cu_seqlens=offsets), (hidden,), check_fwd_over_rev=True)


# Regular expressions (a line's end: the message ends the error, or a line of the device's output), and whether the
# value is checked by a kernel (on CUDA, on the device).
BAD_OFFSETS = [
    (torch.tensor([1, 3, 7]), r"expected cu_seqlens\[0\] = 0, got 1(\n|$)", True),
    (torch.tensor([0, 3, 6]), r"expected cu_seqlens\[-1\] = T = 7 \(hidden's rows\), got 6(\n|$)", True),
    (torch.tensor([0, 5, 3, 7]), r"expected non-decreasing cu_seqlens .*, got -2 at \[1\](\n|$)", True),
    (torch.tensor([0, 3, 7]).float(), r"expected cu_seqlens of dtype int32 or int64, got Float", False),
    (torch.tensor([[0, 3, 7]]), r"expected cu_seqlens of shape \[B \+ 1\]", False),
    (torch.tensor([], dtype=torch.long), r"expected cu_seqlens of shape \[B \+ 1\]", False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offsets,message,on_device", BAD_OFFSETS)
@pytest.mark.parametrize("name", ["mean_pool", "max_pool", "landmark_mean", "first_token_pool", "last_token_pool"])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_bad_offsets_name_the_op(offsets, message, on_device, name, index, device, request):
    # int32 too: token pooling reads contiguous offsets as they are given (PackedReads::kGivenOffsets), checked alike.
    hidden = torch.randn(7, 4, device=device)
    offsets = offsets.to(device, index if offsets.dtype == torch.int64 else offsets.dtype)
    call = {"landmark_mean": lambda: lmk_ops.landmark_mean(hidden, torch.ones(7, dtype=torch.bool, device=device),
                                                           cu_seqlens=offsets)}.get(
        name, lambda: getattr(lmk_ops, name)(hidden, cu_seqlens=offsets))
    if on_device:  # a bad value, which the kernels check
        expect_bad_value(device, f"lmk_ops.{name}: " + message, call, request)
    else:  # a bad dtype or shape, which the host checks
        with pytest.raises(RuntimeError, match=f"lmk_ops.{name}: " + message):
            call()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mean_pool", "max_pool", "landmark_mean", "landmark_gather", "first_token_pool",
                                  "last_token_pool", "attention_pool"])
def test_a_max_seqlen_shorter_than_a_text_is_refused_by_every_op(name, device, request):
    hidden, offsets = torch.randn(7, 4, device=device), torch.tensor([0, 3, 7], device=device)
    landmarks = torch.tensor([1, 0, 1, 0, 0, 0, 1], dtype=torch.bool, device=device)
    call = {
        "landmark_mean": lambda: lmk_ops.landmark_mean(hidden, landmarks, cu_seqlens=offsets, max_seqlen=3),
        "landmark_gather": lambda: lmk_ops.landmark_gather(hidden, landmarks, cu_seqlens=offsets, max_seqlen=3),
        "attention_pool": lambda: lmk_ops.attention_pool(hidden, None, torch.randn(4, device=device),
                                                         cu_seqlens=offsets, max_seqlen=3),
    }.get(name, lambda: getattr(lmk_ops, name)(hidden, cu_seqlens=offsets, max_seqlen=3))
    assert lmk_ops.landmark_gather(hidden, landmarks, cu_seqlens=offsets, max_seqlen=4)[0].shape == (2, 2, 4)
    expect_bad_value(device, rf"lmk_ops.{name}: expected every text at most max_seqlen = 3 ", call, request)


def test_landmark_gather_refuses_a_short_max_seqlen_under_compile():
    hidden, offsets, positions = torch.randn(7, 4), torch.tensor([0, 3, 7]), torch.tensor([[0, 2], [1, -1]])
    torch._dynamo.reset()
    gather = torch.compile(lambda h, p, c, w: lmk_ops.landmark_gather(h, p, cu_seqlens=c, max_seqlen=w),
                           fullgraph=True)
    expected = lmk_ops.landmark_gather(hidden, positions, cu_seqlens=offsets)
    assert all(torch.equal(a, b) for a, b in zip(gather(hidden, positions, offsets, 4), expected))
    with pytest.raises(RuntimeError, match=r"lmk_ops.landmark_gather: expected every text at most max_seqlen = 3 "):
        gather(hidden, positions, offsets, 3)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("how", ["eager", "meta", "compiled"])
def test_max_seqlen_without_cu_seqlens_is_refused(name, how):
    """max_seqlen is a packed batch's hint: on a padded call it used to be ignored, hiding a forgotten cu_seqlens."""
    hidden = torch.randn(2, 5, 4, device="meta" if how == "meta" else "cpu")
    call = partial(lambda h, **packed: FUNCTIONS[name](h, None, **packed), max_seqlen=5)
    if how == "compiled":
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True)
    op = name.split("+")[0].split("@")[0]
    with pytest.raises(Exception, match=rf"lmk_ops\.{op}: expected max_seqlen only with cu_seqlens \(a packed "
                                        rf"batch\), got max_seqlen = 5 for a padded hidden of shape \[2, 5, 4\]"):
        call(hidden)


def test_bad_packed_inputs_name_the_op():
    hidden, offsets = torch.randn(7, 4), torch.tensor([0, 3, 7])
    with pytest.raises(RuntimeError, match=r"lmk_ops.mean_pool: expected every text at most max_seqlen = 3 .*, got 4 "
                                           r"at \[1\]$"):
        lmk_ops.mean_pool(hidden, cu_seqlens=offsets, max_seqlen=3)
    with pytest.raises(RuntimeError, match=r"lmk_ops.mean_pool: expected a packed mask of shape \[T\] = \[7\]"):
        lmk_ops.mean_pool(hidden, torch.ones(2, 7, dtype=torch.bool), cu_seqlens=offsets)
    # A bad mask value is reported at its index in the [T] mask.
    bad_mask = torch.tensor([1, 1, 2, 1, 1, 1, 1])
    for name, call in [("max_pool", lambda: lmk_ops.max_pool(hidden, bad_mask, cu_seqlens=offsets)),
                       ("mean_pool", lambda: lmk_ops.mean_pool(hidden, bad_mask, cu_seqlens=offsets)),
                       ("first_token_pool", lambda: lmk_ops.first_token_pool(hidden, bad_mask, cu_seqlens=offsets)),
                       ("attention_pool", lambda: lmk_ops.attention_pool(hidden, bad_mask, torch.randn(4),
                                                                         cu_seqlens=offsets))]:
        with pytest.raises(RuntimeError, match=rf"^lmk_ops.{name}: expected mask values 0 or 1, got 2 at \[2\]$"):
            call()
    with pytest.raises(RuntimeError, match=r"lmk_ops.mean_pool: expected packed hidden of shape \[T, D\]"):
        lmk_ops.mean_pool(hidden[None], cu_seqlens=offsets)
    with pytest.raises(RuntimeError, match=r"lmk_ops.landmark_mean: expected landmark positions in \[0, length of "
                                           r"their text\).*got 3 in row 0"):
        lmk_ops.landmark_mean(hidden, torch.tensor([[0, 3], [0, -1]]), cu_seqlens=offsets)
    with pytest.raises(RuntimeError, match=r"lmk_ops.landmark_gather: expected landmark positions"):
        lmk_ops.landmark_gather(hidden, torch.tensor([[0, -2], [0, -1]]), cu_seqlens=offsets)
    with pytest.raises(RuntimeError, match=r"lmk_ops.first_token_pool: expected cu_seqlens\[-1\] = T = 7"):
        lmk_ops.first_token_pool(hidden, cu_seqlens=torch.tensor([0, 3, 8]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offsets_as_a_strided_view(device, dtype):
    hidden = torch.randn(9, 5, device=device)
    offsets = torch.tensor([0, 4, 4, 9], dtype=dtype, device=device)
    strided = torch.stack([offsets, offsets + 100], 1)[:, 0]
    assert not strided.is_contiguous()
    for fn in (lmk_ops.mean_pool, lmk_ops.max_pool, lmk_ops.first_token_pool, lmk_ops.last_token_pool):
        assert torch.equal(fn(hidden, cu_seqlens=strided), fn(hidden, cu_seqlens=offsets))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_packed_hidden_that_starts_inside_its_storage(device, name):
    """A packed [T, D] that is a later slice of a bigger tensor (stacked batches, hidden[k]): its rows are read from
    its own start. The view of the packed rows the kernels take doubled the storage offset: hidden[1] of a stack
    pooled hidden[2]'s rows, and hidden[2] read past the storage's end."""
    fn = FUNCTIONS[name]
    stack = torch.randn(3, 9, 8, dtype=torch.float64, device=device)
    offsets = torch.tensor([0, 4, 4, 9], device=device)
    for k in range(3):
        out, grad = _run(fn, stack[k], None, 3, cu_seqlens=offsets)
        want_out, want_grad = _run(fn, stack[k].clone(), None, 3, cu_seqlens=offsets)
        assert torch.equal(out, want_out) and torch.equal(grad, want_grad), (name, k)
    tail = stack.flatten(0, 1)[5:14]  # rows 5..13 of the flattened stack: offset 5 * 8, rows straddling two slices
    assert torch.equal(fn(tail, None, cu_seqlens=offsets), fn(tail.clone(), None, cu_seqlens=offsets))


def test_packed_inputs_are_not_modified():
    hidden, offsets = torch.randn(7, 4), torch.tensor([0, 3, 7], dtype=torch.int32)
    mask = torch.ones(7, dtype=torch.long)
    before = (hidden.clone(), offsets.clone(), mask.clone())
    for fn in (lmk_ops.mean_pool, lmk_ops.max_pool, lmk_ops.first_token_pool, lmk_ops.last_token_pool):
        fn(hidden, mask, cu_seqlens=offsets)
    assert all(torch.equal(a, b) for a, b in zip(before, (hidden, offsets, mask)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_packed_ops(device):
    hidden = torch.randn(9, 5, device=device, requires_grad=True)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device=device)
    mask = torch.tensor([1, 0, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool, device=device)
    positions = torch.tensor([[1, 3], [-1, -1], [0, 4]], device=device)
    for normalize in (False, True):
        torch.library.opcheck(ops.mean_pool.default, (hidden, mask, normalize, offsets, 5))
        torch.library.opcheck(ops.max_pool.default, (hidden, None, normalize, offsets))
        torch.library.opcheck(ops.landmark_mean.default, (hidden, mask, normalize, offsets))
        torch.library.opcheck(ops.landmark_mean.default, (hidden, positions, normalize, offsets, 5))
    torch.library.opcheck(ops.landmark_gather.default, (hidden, positions, offsets))
    query = torch.randn(5, device=device, requires_grad=True)
    for weights in (False, True):
        torch.library.opcheck(ops.attention_pool.default, (hidden, mask, query, None, weights, offsets, 5))
    out, stats, _ = ops.attention_pool(hidden.detach(), mask, query.detach(), None, False, offsets)
    grad_out = torch.randn(3, 5, device=device, requires_grad=True)
    grad_weights = torch.randn(1, 9, device=device)
    torch.library.opcheck(ops.attention_pool_backward.default,
                          (grad_out, grad_weights, hidden, mask, query, out, stats, None, offsets, 5))
    for last in (False, True):
        torch.library.opcheck(ops.token_pool.default, (hidden, mask, last, offsets, 5))
        torch.library.opcheck(ops.token_pool.default, (hidden.view(3, 3, 5), mask.view(3, 3), last))
        torch.library.opcheck(ops.token_pool.default, (hidden.view(3, 3, 5), None, last))
    grad = torch.randn(3, 5, device=device, requires_grad=True)
    torch.library.opcheck(ops.mean_pool_backward.default, (grad, mask, 9, None, offsets))
    torch.library.opcheck(ops.landmark_mean_backward.default, (grad, positions, 9, torch.float64, offsets))
    argmax = ops.max_pool(hidden.detach(), None, False, offsets)[1]
    torch.library.opcheck(ops.max_pool_backward.default, (grad, argmax, 9, offsets))
    torch.library.opcheck(ops.landmark_gather_backward.default,
                          (torch.randn(3, 2, 5, device=device, requires_grad=True), positions, 9, offsets))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_packed(device):
    def model(hidden, offsets, mask):
        return (lmk_ops.mean_pool(hidden, mask, cu_seqlens=offsets, max_seqlen=6)
                + lmk_ops.max_pool(hidden, cu_seqlens=offsets, max_seqlen=6)
                + lmk_ops.first_token_pool(hidden, mask, cu_seqlens=offsets)
                + lmk_ops.landmark_gather(hidden, mask, cu_seqlens=offsets, num_landmarks=6)[0].sum(1))

    hidden = torch.randn(11, 8, device=device)
    offsets = torch.tensor([0, 5, 5, 11], device=device)
    mask = torch.rand(11, device=device) < 0.7
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(hidden, offsets, mask), model(hidden, offsets, mask))


@pytest.mark.parametrize("mode", ["mean_sqrt_len_tokens", "weightedmean"])
def test_sentence_transformers_modes_padded_either_side_and_packed(mode):
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 0, 6]
    packed = torch.randn(sum(lengths), 4, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 3, 3, 9])
    expected = []
    for start, n in zip(offsets.tolist(), lengths):
        rows = packed[start:start + n]
        if mode == "weightedmean":
            weights = torch.arange(1, n + 1, dtype=torch.float64).unsqueeze(1)
            expected.append((rows * weights).sum(0) / weights.sum().clamp_min(1e-9))
        else:
            expected.append(rows.sum(0) / max(n, 1) ** 0.5)
    expected = torch.stack(expected)
    pooling = lmk_ops.nn.Pooling(mode)
    out = pooling(packed, cu_seqlens=offsets)
    torch.testing.assert_close(out, expected)
    for side in ("right", "left"):
        hidden = packed.new_zeros(3, 6, 4)
        mask = torch.zeros(3, 6, dtype=torch.long)
        for b, (start, n) in enumerate(zip(offsets.tolist(), lengths)):
            slots = slice(0, n) if side == "right" else slice(6 - n, 6)
            hidden[b, slots], mask[b, slots] = packed[start:start + n], 1
        torch.testing.assert_close(pooling(hidden, {"attention_mask": mask}), expected)
    (grad,) = torch.autograd.grad(out.sum(), packed)
    (expected_grad,) = torch.autograd.grad(expected.sum(), packed)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "last", "lmk", "attention", "mean_sqrt_len_tokens",
                                  "weightedmean"])
def test_a_features_dict_alone_is_its_own_batch(mode):
    """sentence-transformers calls its modules with the features dict only: its attention mask (padded) or
    cu_seq_lens_q (flattened) must count as they do when the dict is also passed as the batch."""
    gen = torch.Generator().manual_seed(6)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    hidden = torch.randn(2, 5, 8, generator=gen)
    landmarks = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 0, 0, 1]]) * mask
    padded = {"token_embeddings": hidden, "attention_mask": mask, "landmark_mask": landmarks}
    valid = mask.bool()
    flat = {"token_embeddings": hidden[valid].unsqueeze(0), "cu_seq_lens_q": torch.tensor([0, 3, 7], dtype=torch.int32),
            "max_length_q": 4, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1]]), "landmark_mask": landmarks[valid]}
    pooling = lmk_ops.nn.Pooling(mode, **({"dim": 8, "heads": 2} if mode == "attention" else {}))
    if mode == "attention":
        torch.nn.init.normal_(pooling.attention.query, generator=gen)
    with torch.no_grad():
        expected = pooling(hidden, padded)
        if mode != "lmk":  # (lmk needs the batch's landmark mask)
            assert not torch.equal(expected, pooling(hidden))  # the mask matters here
        assert torch.equal(pooling(padded), expected)
        assert torch.equal(pooling(flat), pooling(flat["token_embeddings"], flat))
        assert torch.equal(pooling(flat), expected)


def test_pooling_lmk_takes_an_integer_landmark_mask_of_0_and_1_only():
    hidden = torch.randn(2, 5, 8)
    landmarks = torch.tensor([[0, 1, 0, 0, 1], [1, 0, 0, 0, 0]])
    pooling = lmk_ops.nn.Pooling("lmk")
    expected = lmk_ops.landmark_mean(hidden, landmarks.bool())
    flat = {"token_embeddings": hidden.reshape(1, 10, 8), "cu_seq_lens_q": torch.tensor([0, 5, 10])}
    for dtype in (torch.bool, torch.uint8, torch.int32, torch.int64):
        assert torch.equal(pooling(hidden, {"landmark_mask": landmarks.to(dtype)}), expected)
        assert torch.equal(pooling({**flat, "landmark_mask": landmarks.reshape(1, 10).to(dtype)}), expected)
    landmarks[0, 1] = 2  # not a mask value: before, taken for a landmark
    with pytest.raises(RuntimeError, match=r"lmk_ops.nn.Pooling\('lmk'\) \(its landmark_mask: 1 at each landmark "
                                           r"token; landmark positions go to lmk_ops.landmark_mean\): expected mask "
                                           r"values 0 or 1, got 2"):
        pooling(hidden, {"landmark_mask": landmarks})
    with pytest.raises(RuntimeError, match=r"landmark_mean\): expected mask values 0 or 1, got 2"):
        pooling({**flat, "landmark_mask": landmarks.reshape(10)})


REFERENCES = {
    "mean_pool": lambda h, m, **p: lmk_ops.reference.mean_pool(h, m, **p),
    "max_pool": lambda h, m, **p: lmk_ops.reference.max_pool(h, m, return_indices=True, **p),
    "first_token_pool": lambda h, m, **p: lmk_ops.reference.first_token_pool(h, m, **p),
    "last_token_pool": lambda h, m, **p: lmk_ops.reference.last_token_pool(h, m, **p),
    "landmark_mean": lambda h, m, **p: lmk_ops.reference.landmark_mean(h, m, normalize=True, **p),
    "landmark_mean@positions": lambda h, m, **p: lmk_ops.reference.landmark_mean(h, _positions_of(m, p), **p),
    "landmark_gather": lambda h, m, **p: lmk_ops.reference.landmark_gather(h, m, **p),
    "attention_pool": lambda h, m, **p: lmk_ops.reference.attention_pool(h, m, torch.ones(2, h.shape[-1] // 2,
                                                                                          dtype=h.dtype), **p),
}


def _positions_of(mask, packed):
    return lmk_ops.landmark_positions(mask, cu_seqlens=packed.get("cu_seqlens"))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_every_reference_takes_a_packed_batch_and_agrees_with_its_padded_form_and_the_op(name):
    """#13 asks for lmk_ops.reference versions of each op for packed batches (only attention_pool took one)."""
    lengths = [3, 0, 7, 1]
    selected = torch.tensor([1, 0, 1, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    packed, offsets, mask, pads = _layouts(lengths, 8, torch.float64, False, selected, "cpu")
    reference = REFERENCES[name]
    h = packed.detach().requires_grad_()
    got = reference(h, mask, cu_seqlens=offsets.int(), max_seqlen=7)
    hp = pads["right"][0].detach().requires_grad_()
    want = reference(hp, pads["right"][1])
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Differentiable in the packed rows, with the padded form's gradient at each text's rows.
    upstream = torch.randn(got[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (g,) = torch.autograd.grad(got[0], h, upstream)
    (gp,) = torch.autograd.grad(want[0], hp, upstream)
    assert torch.equal(g, _rows_of(gp, lengths, "right"))
    op = getattr(lmk_ops, name.split("@")[0])
    kwargs = {"cu_seqlens": offsets}
    args = (packed, _positions_of(mask, kwargs)) if name.endswith("@positions") else (packed, mask)
    if name == "attention_pool":
        args = (packed, mask, torch.ones(2, 4, dtype=torch.float64))
    extra = {"normalize": True} if name == "landmark_mean" else {"return_indices": True} if name == "max_pool" else {}
    ours = op(*args, **extra, **kwargs)
    ours = ours if isinstance(ours, tuple) else (ours,)
    for a, b in zip(ours, got):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"^lmk_ops\.reference: expected max_seqlen at least the longest text \(7\)"):
        reference(packed, mask, cu_seqlens=offsets, max_seqlen=6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("last", [False, True])
def test_token_pools_find_rows_behind_runs_of_padding_of_any_length(device, last):
    # CUDA scans a text's rows 32 at a time, from its start (its end for the last token): valid rows behind 0, 31,
    # 32, 33 and 70 invalid ones, a text with none and an empty text, padded and packed, against the reference.
    gen = torch.Generator().manual_seed(5)
    lengths, pads = [40, 75, 80, 90, 100, 6, 0], [0, 31, 32, 33, 70, 6, 0]
    valid = torch.cat([torch.arange(n) >= p if not last else torch.arange(n) < n - p for n, p in zip(lengths, pads)])
    valid[:9] = False  # the first text: 9 invalid rows before its first valid one, none after its last
    hidden = torch.randn(sum(lengths), 8, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    fn = lmk_ops.last_token_pool if last else lmk_ops.first_token_pool
    reference = lmk_ops.reference.last_token_pool if last else lmk_ops.reference.first_token_pool
    padded, padded_valid, _, _ = lmk_ops.reference.padded_view(hidden, valid, offsets)
    for args, kwargs in (((hidden, valid), {"cu_seqlens": offsets}), ((padded, padded_valid), {})):
        want_h = args[0].clone().requires_grad_()
        want = reference(want_h, args[1], **kwargs)
        (want_grad,) = torch.autograd.grad(want, want_h, torch.ones_like(want))
        got_h = args[0].to(device).requires_grad_()
        got = fn(got_h, args[1].to(device), **{k: v.to(device) for k, v in kwargs.items()})
        (got_grad,) = torch.autograd.grad(got, got_h, torch.ones_like(got))
        assert torch.equal(got.cpu(), want.detach()) and torch.equal(got_grad.cpu(), want_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["landmark_mean", "landmark_gather"])
@pytest.mark.parametrize("positions,named", [
    ([[0, 3], [1, -1]], r"got 3 in row 0 \(landmarks\[0, 1\]\)"),  # past text 0's 3 tokens (inside hidden's 7)
    ([[0, -1], [4, 2]], r"got 4 in row 1 \(landmarks\[1, 0\]\)"),  # past text 1's 4 tokens
    ([[0, -2], [1, 2]], r"got -2 in row 0 \(landmarks\[0, 1\]\)"),
])
def test_packed_positions_outside_their_text_are_refused(name, positions, named, device, request):
    hidden, offsets = torch.randn(7, 4, device=device), torch.tensor([0, 3, 7], device=device)
    landmarks = torch.tensor(positions, device=device)
    expect_bad_value(device, rf"lmk_ops.{name}: expected landmark positions in \[0, length of their text\) \(counted "
                             rf"from the text's start in cu_seqlens\) or -1 for none, {named}",
                     lambda: getattr(lmk_ops, name)(hidden, landmarks, cu_seqlens=offsets), request)


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_more_offsets_than_one_block_checks(device, request):
    # 70000 texts: on CUDA the offsets are converted and checked by a grid (rows.cu: packed_offsets), strided int32
    # here; the last text's bad offset is still the one named.
    hidden = torch.randn(140000, 8, dtype=torch.float64, device=device)
    offsets = torch.arange(140001, device=device, dtype=torch.int32)[::2]
    expected = hidden.view(70000, 2, 8).mean(1)
    assert torch.allclose(lmk_ops.mean_pool(hidden, cu_seqlens=offsets), expected, rtol=1e-15, atol=0)
    bad = offsets.clone()
    bad[-2] = bad[-1] + 1
    expect_bad_value(device, r"lmk_ops.mean_pool: expected non-decreasing cu_seqlens .*, got -1 at \[69999\](\n|$)",
                     lambda: lmk_ops.mean_pool(hidden, cu_seqlens=bad), request)
