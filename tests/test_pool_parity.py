"""mean_pool and max_pool against lmk_ops.reference: forward and gradients, over random shapes, masks, dtypes and
layouts, plus the edge cases their contracts name."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given

import lmk_ops
from lmk_ops import reference
from devices import DEVICES, LOWER_CPU_CAPABILITIES, on, run_under_cpu_capability
from parity import OPS, assert_same_bits_alone_and_padded, check_against_reference, forward_and_grad
from strategies import pool_cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@given(case=pool_cases())
def test_matches_reference(op, case, device):
    case = on(device, case)
    inputs = [t for t in (case.hidden, case.mask, case.grad) if t is not None]
    before = [t.clone() for t in inputs]
    check_against_reference(op, case.hidden, case.mask, case.grad)
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "an input tensor was modified"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_text_without_valid_tokens_gives_zeros_and_zero_grad(op, dtype):
    hidden = torch.randn(3, 5, 7).to(dtype)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    out, grad = forward_and_grad(OPS[op][0], hidden, mask, torch.ones(3, 7, dtype=dtype))
    assert torch.equal(out[1], torch.zeros(7, dtype=dtype))
    assert torch.equal(grad[1], torch.zeros(5, 7, dtype=dtype))
    assert not out.isnan().any() and not grad.isnan().any()


@pytest.mark.parametrize("op", OPS)
def test_integer_and_bool_masks_agree(op):
    hidden = torch.randn(4, 33, 65)
    mask = torch.rand(4, 33) < 0.5
    fn = OPS[op][0]
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        assert torch.equal(fn(hidden, mask.to(dtype)), fn(hidden, mask))


@pytest.mark.parametrize("op", OPS)
def test_padding_side_and_batch_do_not_change_the_bits(op):
    # A text pools to the same bits alone, right-padded or left-padded in a batch: no order depends on the batch.
    assert_same_bits_alone_and_padded(OPS[op][0], 1000)


@pytest.mark.parametrize("op", OPS)
def test_repeated_calls_give_identical_bits(op):
    hidden = torch.randn(8, 300, 257)
    mask = torch.rand(8, 300) < 0.7
    fn = OPS[op][0]
    assert torch.equal(fn(hidden, mask), fn(hidden, mask))


@pytest.mark.parametrize("op", OPS)
def test_thread_count_does_not_change_the_bits(op):
    # The work split (text x feature block) depends on the thread count; the per-element order must not.
    hidden = torch.randn(3, 500, 1500, dtype=torch.bfloat16)
    mask = torch.rand(3, 500) < 0.8
    fn = OPS[op][0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fn(hidden, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fn(hidden, mask), single)


def test_max_pool_ties_nan_and_infinities():
    hidden = torch.zeros(1, 5, 4)
    hidden[0, :, 0] = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])  # tie: first position wins
    hidden[0, :, 1] = torch.tensor([1.0, float("nan"), 9.0, float("nan"), 2.0])  # first NaN wins
    hidden[0, :, 2] = float("-inf")  # every valid value -inf: still a valid position
    hidden[0, :, 3] = torch.tensor([float("inf"), 0.0, float("inf"), 0.0, 0.0])
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    values, where = lmk_ops.max_pool(hidden, mask, return_indices=True)
    assert where.tolist() == [[1, 1, 1, 2]]
    assert values[0, 0] == 3 and values[0, 1].isnan() and values[0, 2] == float("-inf") and values[0, 3] == float("inf")
    h = hidden.clone().requires_grad_()
    lmk_ops.max_pool(h, mask).backward(torch.ones(1, 4))
    expected = torch.zeros(1, 5, 4)
    expected[0, 1, 0] = expected[0, 1, 1] = expected[0, 1, 2] = expected[0, 2, 3] = 1
    assert torch.equal(h.grad, expected)


MAX_16BIT_CHECK = """
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    for dim in (16, 40, 1000):  # one 32-byte vector, two and a tail of single features, 62 and a tail
        hidden = torch.randint(-3, 4, (3, 700, dim), generator=gen).to(dtype)  # many ties
        hidden[0, 350, : dim // 3] = float("nan")  # the first NaN wins, whatever its sign or a later one's
        hidden.view(torch.int16)[0, 300, 1::3] = -1  # a NaN with its sign bit set (0xFFFF)
        hidden[0, 400, : dim // 2] = float("nan")
        hidden[1, :, :] = -hidden[1, :, :].abs()  # maxima of 0 among -0 and 0: the first one, with its sign
        hidden[1, 5::7, :] = -0.0
        hidden[1, 3::7, :] = 0.0
        hidden[2, :, :] = -float("inf")
        hidden[2, 600:, 3] = float("inf")
        mask = torch.rand(3, 700, generator=gen) < 0.8
        for m in (None, mask):
            for rows in (hidden, hidden.transpose(1, 2).contiguous().transpose(1, 2)):  # contiguous and strided
                values, where = lmk_ops.max_pool(rows, m, return_indices=True)
                ref_values, ref_where = reference.max_pool(rows, m, return_indices=True)
                bits = lambda v: torch.where(v.isnan(), 1, v.view(torch.int16))  # (the reference's NaN bits differ)
                assert torch.equal(bits(values), bits(ref_values)) and torch.equal(where, ref_where), (dtype, dim)
                # The input's own value at that position, a -0 with its sign.
                kept = rows.gather(1, where.long().clamp_min(0).unsqueeze(1)).squeeze(1)
                assert torch.equal(bits(values), bits(kept))
        packed = lmk_ops.max_pool(hidden.reshape(-1, dim), cu_seqlens=torch.tensor([0, 700, 1400, 2100]))
        assert torch.equal(packed.view(torch.int16), lmk_ops.max_pool(hidden).view(torch.int16))
"""


def test_max_pool_of_16_bit_floats_compared_as_integers():
    # Contiguous bfloat16 and float16 rows are compared as int16 keys on AVX2 and AVX-512 (pool_kernels.cpp), with a
    # tail of single features as floats: ties, NaNs of either sign, -0 against 0, infinities, a mask, strided rows
    # and the packed form, value (a -0 keeps its sign) and position exactly as the reference's.
    exec(MAX_16BIT_CHECK, {"torch": torch, "lmk_ops": lmk_ops, "reference": reference})


@pytest.mark.parametrize("capability", LOWER_CPU_CAPABILITIES)
def test_max_pool_of_16_bit_floats_on_every_cpu_capability(capability):
    run_under_cpu_capability(capability, "from lmk_ops import reference\n" + MAX_16BIT_CHECK)


def test_mean_pool_propagates_nan_and_inf_of_valid_tokens_only():
    hidden = torch.ones(1, 3, 2)
    hidden[0, 0, 0] = float("nan")
    hidden[0, 2, 1] = float("inf")
    out = lmk_ops.mean_pool(hidden, torch.tensor([[0, 1, 1]]))
    assert out[0, 0] == 1 and out[0, 1] == float("inf")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(0, 5, 8), (3, 0, 8), (3, 5, 0), (0, 0, 0)])
def test_empty_inputs_give_the_natural_result(op, shape):
    b, l, d = shape
    hidden = torch.randn(shape, requires_grad=True)
    out = OPS[op][0](hidden, torch.ones(b, l, dtype=torch.bool))
    assert out.shape == (b, d) and torch.equal(out, torch.zeros(b, d))
    out.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros(shape))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("capability", LOWER_CPU_CAPABILITIES)
def test_every_compiled_cpu_capability_matches_reference(op, capability):
    """The vectorised kernels are compiled per CPU capability; run the lower ones too."""
    run_under_cpu_capability(capability, f"""
from parity import check_against_reference
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    for b, l, d in ((3, 41, 300), (2, 7, 37), (1, 1, 1), (2, 1100, 40)):  # the last: several chunks
        hidden = torch.randn(b, l, d, generator=gen).to(dtype)
        mask = torch.rand(b, l, generator=gen) < 0.6
        check_against_reference("{op}", hidden, mask, torch.randn(b, d, generator=gen).to(dtype))
        check_against_reference("{op}", hidden[:, :, ::2], mask, torch.randn(b, (d + 1) // 2, generator=gen).to(dtype))
""")


# The normalised means of every dtype, with tails of single features (D 1, 17, 769) and rows below eps: each within
# four ulps (of the feature, or of a typical feature, d^-1/2, where it is smaller: the mean's own rounding in float32
# and float64) of the float64 oracle's unit vector, F.normalize of the exact mean; their bytes' digest printed.
_NORMALIZED = """
import hashlib
import torch.nn.functional as F
digest = hashlib.sha256()
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    for d in (1, 17, 384, 769):
        scales = torch.tensor([1.0, 1e3, 1e-3, 1e-14])[:, None, None]
        hidden = (torch.randn(4, 9, d, generator=gen, dtype=torch.float64) * scales).to(dtype)
        mask = torch.rand(4, 9, generator=gen) < 0.7
        out = lmk_ops.mean_pool(hidden, mask, normalize=True)
        mean = (hidden.double() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        oracle = F.normalize(mean, dim=-1, eps=1e-12)
        ulp = torch.finfo(dtype).eps * oracle.abs().clamp_min(d ** -0.5)
        assert ((out.double() - oracle).abs() <= 4 * ulp).all(), (dtype, d)
        digest.update(out.contiguous().view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


@pytest.mark.parametrize("capability", LOWER_CPU_CAPABILITIES)
def test_normalize_on_every_cpu_capability(capability):
    # normalize's per-row pass (csrc/cpu/normalize_kernels.cpp) is compiled per capability: each copy is close to the
    # oracle and gives the best copy's bytes. (The rounding to the output type hides most last-bit differences in the
    # float64 norm, so the bytes guard the quotients and the narrowing more than the order of the sixteen sums.)
    best = subprocess.run([sys.executable, "-c", "import torch, lmk_ops\n" + _NORMALIZED],
                          capture_output=True, text=True, check=True).stdout.strip()
    run_under_cpu_capability(capability, _NORMALIZED.replace("print(digest.hexdigest())",
                                                             f"assert digest.hexdigest() == {best!r}"))


def test_capability_variable_never_selects_what_the_cpu_lacks():
    # ATen trusts ATEN_CPU_CAPABILITY=avx512 even on a CPU without AVX-512; lmk_ops caps it at what the CPU runs.
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("needs /proc/cpuinfo")
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    avx2 = {"avx2", "fma", "f16c", "bmi1", "bmi2"} <= flags
    expected = "AVX512" if avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else (
        "AVX2" if avx2 else "DEFAULT")
    script = """
import torch, lmk_ops
print(lmk_ops.build_info()["cpu_capability"])
assert torch.equal(lmk_ops.mean_pool(torch.ones(2, 3, 40)), torch.ones(2, 40))
"""
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ATEN_CPU_CAPABILITY="avx512"),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == expected

