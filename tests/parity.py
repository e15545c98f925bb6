"""Comparison against lmk_ops.reference, with the project's rule for low precision: in float16/bfloat16 the error
against a float32 oracle may be at most twice the error of the reference computed in that dtype."""

from __future__ import annotations

import torch

import lmk_ops
from lmk_ops import reference
from lmk_ops.bench import OPS  # op name -> (lmk_ops function, reference function)

LOW_PRECISION = (torch.float16, torch.bfloat16)


def forward_and_grad(fn, hidden, mask, grad):
    """Output and d(output . grad)/d(hidden) of fn."""
    h = hidden.detach().requires_grad_()
    out = fn(h, mask)
    (g,) = torch.autograd.grad(out, h, grad)
    return out.detach(), g


def _max_err(a, b) -> float:
    """Largest |a - b|, b the oracle; an infinity in a where b rounds to that infinity in a's dtype counts as exact
    (normalize's gradient at a zero pooled vector is 1/eps = 1e12, past float16's range: inf is its rounding)."""
    if not a.numel():
        return 0.0
    err = (a.double() - b.double()).abs()
    return err.masked_fill(a.isinf() & (a == b.to(a.dtype)), 0.0).max().item()


def assert_matches(name: str, actual: torch.Tensor, oracle: torch.Tensor, same_dtype_ref: torch.Tensor,
                   rule_dtypes=LOW_PRECISION, slack: float = 0.0) -> None:
    """actual: lmk_ops in dtype X; oracle: reference on inputs upcast to float32 (float64 for float32 and float64),
    or to float64 where rule_dtypes holds float32 too; same_dtype_ref: reference computed in dtype X. slack: error the
    rule allows beyond twice the reference's, for an op whose conditioning makes the reference's own error luck."""
    assert actual.dtype == same_dtype_ref.dtype and actual.shape == same_dtype_ref.shape, name
    assert not actual.isnan().any(), f"{name}: NaN in the output"
    reference_broke = (~same_dtype_ref.isfinite() & oracle.isfinite()).any()
    if actual.dtype in rule_dtypes and not reference_broke:
        ours, theirs = _max_err(actual, oracle), _max_err(same_dtype_ref, oracle)
        # The slack only covers float32 summation order deciding a rounding tie.
        slack += 2.0**-20 * max(1.0, oracle.abs().max().item() if oracle.numel() else 0.0)
        assert ours <= 2 * theirs + slack, f"{name}: error {ours:.3g} > 2 x reference's {theirs:.3g} in {actual.dtype}"
    else:
        # float32/float64, or a low-precision reference that overflowed where the oracle did not (e.g. F.normalize's
        # backward on an empty row in float16): the dtype's standard tolerance against the oracle.
        torch.testing.assert_close(actual, oracle.to(actual.dtype), msg=lambda m: f"{name}: {m}")


def check_pair(name: str, ours, ref, hidden, arg, grad) -> None:
    """ours(hidden, arg) against ref(hidden, arg): output and gradient, by the low-precision rule."""
    out, g = forward_and_grad(ours, hidden, arg, grad)
    # The oracle for float32 is float64: the reference in float32 is itself off where the computation is ill
    # conditioned (normalize's gradient for a pooled vector of small norm: 1.5e-5 where the exact value, and lmk_ops',
    # is 0).
    wide = torch.float32 if hidden.dtype in LOW_PRECISION else torch.float64
    oracle_out, oracle_g = forward_and_grad(ref, hidden.to(wide), arg, grad.to(wide))
    ref_out, ref_g = forward_and_grad(ref, hidden, arg, grad)
    assert_matches(f"{name} forward", out, oracle_out, ref_out)
    assert_matches(f"{name} grad", g, oracle_g, ref_g)


def check_against_reference(op: str, hidden, mask, grad) -> None:
    ours, ref = OPS[op]
    if op == "max_pool":
        out, g = forward_and_grad(ours, hidden, mask, grad)
        ref_out, ref_g = forward_and_grad(ref, hidden, mask, grad)
        # Max is exact in every dtype: same values, same positions, same gradient, bit for bit.
        assert torch.equal(out, ref_out), "max_pool: values differ from the reference"
        assert torch.equal(g, ref_g), "max_pool: gradient differs from the reference"
        assert torch.equal(lmk_ops.max_pool(hidden, mask, return_indices=True)[1],
                           reference.max_pool(hidden, mask, return_indices=True)[1]), "max_pool: positions differ"
        return
    check_pair(op, ours, ref, hidden, mask, grad)


def assert_same_bits_alone_and_padded(fn, dim: int) -> None:
    """fn(hidden, mask) -> [B, D]: a text pools to the same bits alone, right-padded and left-padded in a batch."""
    text = torch.randn(1, 37, dim, dtype=torch.bfloat16)
    alone = fn(text, None)
    right = torch.randn(5, 64, dim, dtype=torch.bfloat16)
    right[2, :37] = text[0]
    right_mask = torch.zeros(5, 64, dtype=torch.long)
    right_mask[:, :37] = 1
    left = torch.randn(5, 64, dim, dtype=torch.bfloat16)
    left[3, -37:] = text[0]
    assert torch.equal(fn(right, right_mask)[2], alone[0])
    assert torch.equal(fn(left, right_mask.flip(1))[3], alone[0])
