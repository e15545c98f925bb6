"""Dispatcher registration: opcheck (schema, fake kernels, autograd registration), gradcheck, torch.compile, the
build information, and the version guard on import."""

import importlib

import pytest
import torch

import lmk_ops
from lmk_ops import _loader
from parity import OPS

ops = torch.ops.lmk_ops


def _inputs(dtype=torch.float32, requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 13, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    mask = torch.tensor([[1] * 11, [1] * 4 + [0] * 7, [0] * 11])
    return hidden, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "int", "bool"])
def test_opcheck_forward_ops(dtype, mask_kind):
    hidden, mask = _inputs(dtype)
    mask = {"none": None, "int": mask, "bool": mask.bool()}[mask_kind]
    torch.library.opcheck(ops.mean_pool.default, (hidden, mask))
    torch.library.opcheck(ops.max_pool.default, (hidden, mask))


def test_opcheck_backward_ops():
    hidden, mask = _inputs()
    grad = torch.randn(3, 13, requires_grad=True)
    torch.library.opcheck(ops.mean_pool_backward.default, (grad, mask, 11))
    torch.library.opcheck(ops.mean_pool_backward.default, (grad, None, 11))
    _, argmax = ops.max_pool(hidden.detach(), mask)
    torch.library.opcheck(ops.max_pool_backward.default, (grad, argmax, 11))


@pytest.mark.parametrize("op", OPS)
def test_gradients_are_wired(op):
    # A missing autograd registration leaves .grad None while opcheck still passes: check it directly.
    hidden, mask = _inputs()
    OPS[op][0](hidden, mask).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("with_mask", [True, False])
def test_gradcheck_and_gradgradcheck_float64(op, with_mask):
    hidden, mask = _inputs(torch.float64)
    mask = mask if with_mask else None
    fn = OPS[op][0]
    assert torch.autograd.gradcheck(lambda h: fn(h, mask), (hidden,))
    assert torch.autograd.gradgradcheck(lambda h: fn(h, mask), (hidden,))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(op, dynamic):
    fn = OPS[op][0]

    def model(hidden, mask, weight):
        return torch.nn.functional.normalize(fn(hidden @ weight, mask), dim=-1)

    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    weight = torch.randn(13, 13, requires_grad=True)
    for seq_len in (11, 17):  # a second length exercises the dynamic graph (or a recompile)
        hidden = torch.randn(3, seq_len, 13, requires_grad=True)
        mask = torch.rand(3, seq_len) < 0.7
        eager_out = model(hidden, mask, weight)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), (hidden, weight))
        out = compiled(hidden, mask, weight)
        grads = torch.autograd.grad(out.square().sum(), (hidden, weight))
        torch.testing.assert_close(out, eager_out)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e)


def test_build_info():
    info = lmk_ops.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["version"] == lmk_ops.__version__
    assert info["openmp"] is True
    assert info["num_threads"] == torch.get_num_threads()
    assert info["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512")
    assert isinstance(info["cuda"], bool)


def test_mismatched_torch_build_raises_a_clear_import_error(monkeypatch):
    build = importlib.import_module("lmk_ops._build_info")
    monkeypatch.setattr(build, "TORCH_VERSION", "1.0.0+cpu")
    with pytest.raises(ImportError) as info:
        _loader.load_extension()
    message = str(info.value)
    assert "1.0.0+cpu" in message and torch.__version__ in message and "pip install --no-build-isolation" in message


def test_public_api_is_documented():
    for fn in (lmk_ops.mean_pool, lmk_ops.max_pool, lmk_ops.build_info):
        assert fn.__doc__ and "Returns" in fn.__doc__ or (fn is lmk_ops.build_info and "Keys" in fn.__doc__)
