import pytest
import torch

from lmk_ops.bench import implementations


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
