"""pytest-benchmark suites for mean_pool and max_pool: lmk_ops against the eager reference and torch.compile of it.

    pytest bench --benchmark-only                      # all
    pytest bench --benchmark-only -k "max_pool and forward" --benchmark-group-by=param:op,param:mode

The shape is one padded batch of BERT-base outputs (25% padding); `python -m lmk_ops.bench` covers larger shapes.
"""

import pytest
import torch

from lmk_ops.bench import forward_backward, make_inputs

SHAPE = (16, 256, 768)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["lmk_ops", "eager", "compiled"])
@pytest.mark.parametrize("mode", ["forward", "backward", "forward+backward"])
@pytest.mark.parametrize("op", ["mean_pool", "max_pool"])
def test_pool(benchmark, contenders, op, mode, impl, dtype):
    fn = contenders(op)[impl]
    hidden, mask = make_inputs(SHAPE, dtype, "cpu", padding=0.25)
    grad = torch.randn(SHAPE[0], SHAPE[2], dtype=dtype)
    benchmark.group = f"{op} {mode} {dtype}"
    if mode == "forward":
        with torch.no_grad():
            benchmark(fn, hidden, mask)
    elif mode == "backward":
        h = hidden.requires_grad_()
        out = fn(h, mask)  # also compiles the graph before timing
        benchmark(lambda: torch.autograd.grad(out, h, grad, retain_graph=True))
    else:
        benchmark(forward_backward, fn, hidden.requires_grad_(), mask, grad)


def test_backward_rows_replay_a_graph_whatever_ran_first(contenders):
    """The backward rows replay a compiled graph's backward with retain_graph=True; a forward+backward row of the same
    graph running first on the worker made that fail (a backward compiled to donate its saved tensors) until the
    bench conftest turned donated buffers off. This runs that order on purpose."""
    fn = contenders("mean_pool")["compiled"]
    hidden, mask = make_inputs((2, 8, 16), torch.float32, "cpu", padding=0.25)
    grad = torch.randn(2, 16)
    (expected,) = forward_backward(fn, hidden.clone().requires_grad_(), mask, grad)
    h = hidden.clone().requires_grad_()
    out = fn(h, mask)
    for _ in range(2):
        (got,) = torch.autograd.grad(out, h, grad, retain_graph=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
