"""attention_pool against lmk_ops.reference: output, weights and both gradients (hidden and query) over random
shapes, heads, masks, dtypes and layouts; the contracts its docstring names; the modules; a short training run."""

import pytest
import torch
from hypothesis import given

import lmk_ops
from devices import DEVICES, LOWER_CPU_CAPABILITIES, on, run_under_cpu_capability
from lmk_ops import reference
from lmk_ops.nn import AttentionPooling, Pooling
from parity import assert_matches, assert_same_bits_alone_and_padded
from strategies import AttentionCase, attention_cases


def _run(fn, hidden, mask, query, grad, grad_weights, scale=None, return_weights=False):
    """The outputs of fn and the gradients of (outputs . upstream) w.r.t. hidden and query."""
    h, q = hidden.detach().requires_grad_(), query.detach().requires_grad_()
    result = fn(h, mask, q, scale=scale, return_weights=return_weights)
    outputs = result if return_weights else (result,)
    upstream = (grad, grad_weights) if return_weights else (grad,)
    grad_h, grad_q = torch.autograd.grad(outputs, (h, q), upstream)
    return [o.detach() for o in outputs] + [grad_h, grad_q]


# float32 is held to the same rule as float16/bfloat16: against a float64 oracle, at most twice the error of the
# reference computed in float32, plus the error budget of rounding the scores. A peaked softmax turns each score's
# rounding (a few ulps of |score|) into output error; the float32 reference suffers the same, but its particular
# roundings can be luckier than ours (or the other way round), so twice its error alone would make a flaky test.
RULE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _score_rounding_budget(case, oracle_value: torch.Tensor) -> float:
    """4 float32 ulps of the largest score's bound |scale| * sum_d |x_d q_d|, times the output's magnitude."""
    batch, seq_len, dim = case.hidden.shape
    query = case.query.double().reshape(-1, case.query.shape[-1])
    heads = query.shape[0]
    scale = case.scale if case.scale is not None else (dim // heads) ** -0.5
    states = case.hidden.double().reshape(batch, seq_len, heads, dim // heads).abs()
    bound = abs(scale) * torch.einsum("blhd,hd->bhl", states, query.abs()).max().item()
    return 4 * torch.finfo(torch.float32).eps * bound * max(1.0, oracle_value.abs().max().item())


def _check_case(case):
    names = ["forward", *(["weights"] if case.return_weights else []), "grad hidden", "grad query"]
    options = {"scale": case.scale, "return_weights": case.return_weights}
    args = (case.hidden, case.mask, case.query, case.grad, case.grad_weights)
    ours = _run(lmk_ops.attention_pool, *args, **options)
    oracle = _run(reference.attention_pool, *(t.double() if t is not None and t.is_floating_point() else t
                                              for t in args), **options)
    same_dtype = _run(reference.attention_pool, *args, **options)
    for name, got, want, ref in zip(names, ours, oracle, same_dtype):
        slack = _score_rounding_budget(case, want) if got.dtype == torch.float32 else 0.0
        assert_matches(f"attention_pool {name}", got, want, ref, RULE_DTYPES, slack)


@pytest.mark.parametrize("device", DEVICES)
@given(case=attention_cases())
def test_matches_reference(case, device):
    case = on(device, case)
    inputs = [t for t in (case.hidden, case.mask, case.query) if t is not None]
    before = [t.clone() for t in inputs]
    _check_case(case)
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "an input tensor was modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_statistics_of_every_text_written_by_the_kernels(device, packed):
    """The op's statistics {max score, sum of exp(score - max)}: {-inf, -inf} for a text with no valid row, written by
    the kernels (nothing fills them first), and the softmax's own for the others, on texts of one chunk and of
    several (300 rows), with two heads across two feature blocks."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 0, 300, 1, 0]
    hidden = torch.randn(sum(lengths), 64, generator=gen, dtype=torch.float64).to(device)
    query = torch.randn(2, 32, generator=gen, dtype=torch.float64).to(device)
    offsets = torch.tensor([0, 5, 5, 305, 306, 306], device=device)
    if packed:
        _, stats, _ = torch.ops.lmk_ops.attention_pool(hidden, None, query, None, False, offsets, None)
    else:
        padded, valid, _, _ = reference.padded_view(hidden, None, offsets)
        _, stats, _ = torch.ops.lmk_ops.attention_pool(padded, valid, query, None, False, None, None)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(stats[b].cpu(), torch.full((2, 2), -torch.inf, dtype=torch.float64)), stats[b]
            continue
        rows = hidden[offsets[b]:offsets[b + 1]].reshape(n, 2, 32)
        scores = torch.einsum("lhd,hd->hl", rows, query) * 32 ** -0.5
        best = scores.max(dim=1).values
        torch.testing.assert_close(stats[b, :, 0], best, rtol=1e-12, atol=0)
        torch.testing.assert_close(stats[b, :, 1], (scores - best[:, None]).exp().sum(dim=1), rtol=1e-12, atol=0)


# Heads of 96, 48 and 16 features are read in pair order in bfloat16 with AVX2 (bf16_pairs.h: 6, 3 and 1 blocks of
# 16), those of 24, 12 and 8 features not.
@pytest.mark.parametrize("heads", [1, 2, 4, 6, 8, 12])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_head_count_in_every_dtype(heads, dtype):
    gen = torch.Generator().manual_seed(heads)
    hidden = torch.randn(4, 67, 96, generator=gen).to(dtype)
    mask = torch.rand(4, 67, generator=gen) < 0.7
    query = torch.randn(heads, 96 // heads, generator=gen)
    grad = torch.randn(4, 96, generator=gen).to(dtype)
    _check_case(AttentionCase(hidden, mask, query, None, True, grad, torch.randn(4, heads, 67, generator=gen)))


@pytest.mark.parametrize("capability", LOWER_CPU_CAPABILITIES)
def test_every_compiled_cpu_capability_matches_reference(capability):
    """The kernels are compiled per CPU capability and this machine runs its best; run the lower ones too, over the
    paths that differ between them: one wide head, narrow heads reduced a vector's width at a time (a full group and
    a partial one with AVX2's 8 lanes and AVX-512's 16), bfloat16 pair order, strided rows and several chunks."""
    run_under_cpu_capability(capability, """
from strategies import AttentionCase
from test_attention_pool import _check_case
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    for batch, seq_len, dim, heads, strided in ((3, 67, 96, 1, False), (3, 67, 192, 12, False), (2, 67, 192, 24, False),
                                                (2, 67, 768, 24, False), (2, 67, 96, 6, True), (1, 1100, 96, 3, False)):
        hidden = torch.randn(batch, dim, seq_len, generator=gen).transpose(1, 2) if strided else torch.randn(
            batch, seq_len, dim, generator=gen)
        query = torch.randn(heads, dim // heads, generator=gen)
        _check_case(AttentionCase(hidden.to(dtype), torch.rand(batch, seq_len, generator=gen) < 0.7, query, None, True,
                                  torch.randn(batch, dim, generator=gen).to(dtype),
                                  torch.randn(batch, heads, seq_len, generator=gen)))
""")


def test_heads_pool_their_own_slices():
    # Head h sees only features [h * D/H, (h+1) * D/H): changing another head's slice leaves its output alone.
    hidden = torch.randn(2, 9, 12)
    query = torch.randn(3, 4)
    out = lmk_ops.attention_pool(hidden, None, query)
    changed = hidden.clone()
    changed[:, :, 4:8] += torch.randn(2, 9, 4)
    again = lmk_ops.attention_pool(changed, None, query)
    assert torch.equal(out[:, :4], again[:, :4]) and torch.equal(out[:, 8:], again[:, 8:])
    assert not torch.equal(out[:, 4:8], again[:, 4:8])
    for h in range(3):
        alone = lmk_ops.attention_pool(hidden[:, :, 4 * h:4 * h + 4], None, query[h], scale=0.5)
        torch.testing.assert_close(lmk_ops.attention_pool(hidden, None, query, scale=0.5)[:, 4 * h:4 * h + 4], alone)


def test_zero_query_is_mean_pooling_and_weights_sum_to_one():
    hidden = torch.randn(3, 20, 16, dtype=torch.float64)
    mask = torch.rand(3, 20) < 0.6
    mask[0, 0] = True
    out, weights = lmk_ops.attention_pool(hidden, mask, torch.zeros(16, dtype=torch.float64), return_weights=True)
    torch.testing.assert_close(out, lmk_ops.mean_pool(hidden, mask))
    assert weights.shape == (3, 20) and weights.dtype == torch.float64
    torch.testing.assert_close(weights.sum(1), torch.ones(3, dtype=torch.float64))
    assert torch.equal(weights[~mask], torch.zeros_like(weights[~mask]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_text_without_valid_tokens_gives_zeros_and_zero_grad(dtype):
    hidden = torch.randn(3, 5, 8).to(dtype)
    query = torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    h, q = hidden.clone().requires_grad_(), query.clone().requires_grad_()
    out, weights = lmk_ops.attention_pool(h, mask, q, return_weights=True)
    assert torch.equal(out[1], torch.zeros(8, dtype=dtype)) and torch.equal(weights[1], torch.zeros(2, 5))
    (out.float().sum() + weights.sum()).backward()
    assert torch.equal(h.grad[1], torch.zeros(5, 8, dtype=dtype))
    assert h.grad.isfinite().all() and q.grad.isfinite().all()
    # The query's gradient comes from the other texts only.
    q_rest = query.clone().requires_grad_()
    out_rest, weights_rest = lmk_ops.attention_pool(hidden[[0, 2]], mask[[0, 2]], q_rest, return_weights=True)
    (out_rest.float().sum() + weights_rest.sum()).backward()
    torch.testing.assert_close(q.grad, q_rest.grad)
    # No valid token anywhere: the query gets a zero gradient.
    q_none = query.clone().requires_grad_()
    lmk_ops.attention_pool(hidden, torch.zeros(3, 5, dtype=torch.bool), q_none).sum().backward()
    assert torch.equal(q_none.grad, torch.zeros(2, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_extreme_scores_in_half_precision_do_not_overflow(dtype, magnitude):
    # Scores up to ~1e10: far past float16's range, and exp() of them far past float32's. The online softmax keeps
    # every exponent <= 0 and the scores in float32, so the result matches the float32 oracle.
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(4, 50, 64, generator=gen) * magnitude).to(dtype)
    mask = torch.rand(4, 50, generator=gen) < 0.8
    query = torch.randn(4, 16, generator=gen) * magnitude
    grad = torch.randn(4, 64, generator=gen).to(dtype)
    ours = _run(lmk_ops.attention_pool, hidden, mask, query, grad, None)
    oracle = _run(reference.attention_pool, hidden.float(), mask, query, grad.float(), None)
    for name, got, want in zip(["forward", "grad hidden", "grad query"], ours, oracle):
        assert got.isfinite().all(), f"{name}: not finite"
        torch.testing.assert_close(got, want.to(got.dtype), msg=lambda m: f"{name}: {m}")


def test_very_negative_and_very_large_scores_in_float32():
    # Scores around -3e37 (every exp() of them is 0 without the running maximum) and +3e37.
    hidden = torch.full((2, 6, 4), -1e18)
    hidden[0, 2] = -0.5e18
    hidden[1] *= -1
    query = torch.full((4,), 1e19)
    out, weights = lmk_ops.attention_pool(hidden, None, query, return_weights=True)
    ref_out, ref_weights = reference.attention_pool(hidden, None, query, return_weights=True)
    assert out.isfinite().all() and weights.isfinite().all()
    assert weights[0, 2] == 1 and torch.equal(out[0], hidden[0, 2])
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out)


def test_nan_in_a_valid_token_propagates_and_in_padding_does_not():
    hidden = torch.randn(2, 4, 6)
    hidden[0, 1, 2] = float("nan")
    hidden[1, 3] = float("nan")
    out = lmk_ops.attention_pool(hidden, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), torch.randn(6))
    assert out[0].isnan().all() and out[1].isfinite().all()


def test_padding_side_batch_and_thread_count_do_not_change_the_bits():
    query = torch.randn(12, 64)
    assert_same_bits_alone_and_padded(lambda hidden, mask: lmk_ops.attention_pool(hidden, mask, query), 768)
    right = torch.randn(5, 64, 768, dtype=torch.bfloat16)
    right_mask = (torch.arange(64) < 37).long().expand(5, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _run(lmk_ops.attention_pool, right, right_mask, query, torch.ones(5, 768, dtype=torch.bfloat16), None)
    finally:
        torch.set_num_threads(threads)
    again = _run(lmk_ops.attention_pool, right, right_mask, query, torch.ones(5, 768, dtype=torch.bfloat16), None)
    for a, b in zip(single, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_short_text_gives_the_same_bits_however_the_threads_split_its_heads(dtype):
    # One chunk and 16 narrow heads: the threads split the heads into feature blocks (1 thread: one block of 16;
    # 2: two of 8; 3: blocks of 6, 6 and 4; 8: four of 4), and each head's score must not depend on its block.
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 300, 1024, generator=gen).to(dtype)
    query = torch.randn(16, 64, generator=gen)
    upstream = torch.randn(1, 1024, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            results.append(_run(lmk_ops.attention_pool, hidden, None, query, upstream, None))
    finally:
        torch.set_num_threads(threads)
    for run in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], run))


def test_query_dtype_is_independent_of_hidden_dtype():
    # A float32 query (a module's parameter) with bfloat16 states, as under mixed precision: the gradient comes back
    # in float32, and the result equals that of the query rounded to nothing (it is used in float32 either way).
    hidden = torch.randn(2, 10, 8, dtype=torch.bfloat16)
    query = torch.randn(8, requires_grad=True)
    out = lmk_ops.attention_pool(hidden, None, query)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert query.grad.dtype == torch.float32
    torch.testing.assert_close(out, lmk_ops.attention_pool(hidden, None, query.detach().double()))


def test_attention_pooling_module_starts_as_mean_pooling_and_learns():
    module = AttentionPooling(32, heads=4)
    assert module.query.shape == (4, 8) and torch.equal(module.query, torch.zeros(4, 8))
    hidden = torch.randn(3, 9, 32)
    mask = torch.rand(3, 9) < 0.7
    mask[:, 0] = True
    out = module(hidden, {"attention_mask": mask})
    torch.testing.assert_close(out, lmk_ops.mean_pool(hidden, mask))
    out.square().sum().backward()
    assert module.query.grad.abs().sum() > 0, "the query must get a gradient at its zero initialisation"
    pooled, weights = module(hidden, attention_mask=mask, return_weights=True)
    assert weights.shape == (3, 4, 9)
    assert "dim=32, heads=4" in repr(module)
    with pytest.raises(ValueError, match="heads >= 1 dividing dim"):
        AttentionPooling(30, heads=4)


def test_per_sample_query_gradients_with_torch_func():
    """The usual torch.func recipe (functional_call, grad, vmap over the examples) gives each example's query
    gradient with the bits of a backward on that example alone."""
    module = AttentionPooling(16, heads=2).double()
    torch.nn.init.normal_(module.query, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    hidden, target = torch.randn(4, 7, 16, dtype=torch.float64, generator=gen), torch.randn(4, 16, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=gen) < 0.7

    def loss(params, h, m, t):
        pooled = torch.func.functional_call(module, params, (h[None], {"attention_mask": m[None]}))[0]
        return (pooled - t).square().sum()

    params = {name: p.detach() for name, p in module.named_parameters()}
    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(params, hidden, mask, target)
    one_by_one = [torch.autograd.grad(loss(dict(module.named_parameters()), *example), module.query)[0]
                  for example in zip(hidden, mask, target)]
    assert torch.equal(per_example["query"], torch.stack(one_by_one))


def test_pooling_attention_mode():
    pooling = Pooling("attention", dim=16, heads=2, normalize=True)
    hidden = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out = pooling(hidden, {"attention_mask": mask})
    torch.testing.assert_close(out, torch.nn.functional.normalize(lmk_ops.mean_pool(hidden, mask), dim=-1))
    assert [name for name, _ in pooling.named_parameters()] == ["attention.query"]
    with pytest.raises(ValueError, match="expected dim"):
        Pooling("attention")
    with pytest.raises(ValueError, match="expected dim"):
        Pooling("mean", dim=16)


class _TinyEncoder(torch.nn.Module):
    """Embeddings, one linear layer and attention pooling, then a classifier: small enough to train in a test."""

    def __init__(self, pool_fn, vocab=50, dim=24, heads=3, classes=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.pool = AttentionPooling(dim, heads)
        self.head = torch.nn.Linear(dim, classes)
        self.pool_fn = pool_fn

    def forward(self, ids, mask):
        states = torch.tanh(self.mix(self.embed(ids)))
        return self.head(self.pool_fn(states, mask, self.pool.query))


def test_training_gives_the_same_losses_as_the_reference():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (16, 30), generator=gen)
    mask = torch.arange(30) < torch.randint(1, 31, (16, 1), generator=gen)
    labels = torch.randint(0, 3, (16,), generator=gen)
    losses = {}
    for name, fn in (("lmk_ops", lmk_ops.attention_pool), ("reference", reference.attention_pool)):
        torch.manual_seed(0)
        model = _TinyEncoder(fn)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        losses[name] = []
        for _ in range(8):
            loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
        assert model.pool.query.abs().sum() > 0, "the query did not move"
    torch.testing.assert_close(torch.tensor(losses["lmk_ops"]), torch.tensor(losses["reference"]), rtol=1e-4, atol=1e-5)
    assert losses["lmk_ops"][-1] < losses["lmk_ops"][0], "the model did not learn"


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("return_weights", [False, True])
def test_forward_mode_and_forward_over_reverse_match_the_reference(packed, heads, return_weights):
    # The forward-mode rules of attention_pool and of its backward are closed forms (reference.attention_pool_jvp,
    # attention_pool_backward_jvp): checked against torch.func's own forward mode of the plain-PyTorch reference,
    # with NaN in masked rows, which count for nothing in lmk_ops (the reference is given zeros there), and a text
    # without valid tokens.
    gen = torch.Generator().manual_seed(heads + 2 * packed)
    kw = {"cu_seqlens": torch.tensor([0, 3, 3, 9, 14])} if packed else {}
    shape = (14, 8) if packed else (4, 6, 8)
    hidden = torch.randn(shape, dtype=torch.float64, generator=gen)
    mask = torch.rand(shape[:-1], generator=gen) < 0.7
    mask[3:9] = False  # no valid token: text 2 packed, text 3 padded
    hidden = hidden.masked_fill(~mask.unsqueeze(-1), float("nan"))
    query = torch.randn((8,) if heads == 1 else (heads, 8 // heads), dtype=torch.float64, generator=gen)
    tangents = (torch.randn(shape, dtype=torch.float64, generator=gen), torch.randn(query.shape, generator=gen,
                                                                                 dtype=torch.float64))

    def ours(h, q):
        return lmk_ops.attention_pool(h, mask, q, return_weights=return_weights, **kw)

    def theirs(h, q):
        return reference.attention_pool(h.where(mask.unsqueeze(-1), 0.0), mask, q, return_weights=return_weights, **kw)

    out = ours(hidden, query)
    cotangents = tuple(torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in (out if return_weights else (out,)))

    def gradients(fn):
        def of(h, q):
            result, pullback = torch.func.vjp(fn, h, q)
            return pullback(cotangents if return_weights else cotangents[0])
        return of

    for fn in (lambda f: f, gradients):  # forward mode, then forward over reverse
        got = torch.func.jvp(fn(ours), (hidden, query), tangents)[1]
        want = torch.func.jvp(fn(theirs), (hidden.nan_to_num(0.0), query), tangents)[1]
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
