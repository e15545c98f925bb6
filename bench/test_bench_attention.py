"""pytest-benchmark suite for attention pooling: lmk_ops against the eager reference and torch.compile of it, one
head and 12 heads, forward and forward+backward (the gradients of hidden and of the query).

    pytest bench --benchmark-only -k attention --benchmark-group-by=group

The shape is one padded batch of BERT-base outputs (25% padding), as in the other suites.
"""

import pytest
import torch

from lmk_ops.bench import forward_backward, make_inputs

SHAPE = (16, 256, 768)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["lmk_ops", "eager", "compiled"])
@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("heads", [1, 12])
def test_attention_pool(benchmark, contenders, heads, mode, impl, dtype):
    fn = contenders("attention_pool@1h" if heads == 1 else "attention_pool@64d")[impl]
    hidden, mask = make_inputs(SHAPE, dtype, "cpu", padding=0.25)
    query = torch.randn(heads, SHAPE[2] // heads, dtype=dtype)
    benchmark.group = f"attention_pool {heads} head(s) {mode} {dtype}"
    if mode == "forward":
        with torch.no_grad():
            benchmark(fn, hidden, (mask, query))
    else:
        grad = torch.randn(SHAPE[0], SHAPE[2], dtype=dtype)
        benchmark(forward_backward, fn, hidden.requires_grad_(), (mask, query.requires_grad_()), grad)
