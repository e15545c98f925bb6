import pytest
import torch
import torch._functorch.config

from lmk_ops.bench import implementations


@pytest.fixture(autouse=True)
def no_donated_buffers():
    """Compiled graphs without donated buffers, while they compile and while their backward runs. test_pool's
    backward rows replay one graph's backward with retain_graph=True, which AOTAutograd refuses for a backward
    compiled to donate its saved tensors; whether it was depended on the test order on an xdist worker (a
    forward+backward row of the same graph first made it so). The setting must hold at backward time too: torch 2.13
    checks it there, and a graph compiled with it off has no donated-buffer list, which that check reads as one. The
    saved tensors of these graphs (masks, counts, indices) are smaller than any gradient, so no buffer could have been
    reused anyway."""
    with torch._functorch.config.patch(donated_buffer=False):
        yield


@pytest.fixture(scope="session")
def contenders():
    """lmk_ops / eager / compiled per op, built once per session so compiled graphs are reused."""
    cache = {}

    def get(op):
        if op not in cache:
            cache[op] = implementations(op)
        return cache[op]

    yield get
    torch._dynamo.reset()
