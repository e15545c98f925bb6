"""pytest-benchmark suites for LMK pooling and landmark insertion: lmk_ops against the eager reference (and
torch.compile of it for landmark_mean).

    pytest bench --benchmark-only -k landmark --benchmark-group-by=group

landmark_mean runs on one padded batch of BERT-base outputs (25% padding) with the LMK layout at interval 32;
insert_landmarks on the matching token batch.
"""

import pytest
import torch

import lmk_ops
from lmk_ops import reference
from lmk_ops.bench import forward_backward, landmark_layout, make_inputs, token_batch

SHAPE = (16, 256, 768)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["lmk_ops", "eager", "compiled"])
@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
def test_landmark_mean(benchmark, contenders, mode, impl, dtype):
    fn = contenders("landmark_mean@32")[impl]
    hidden, mask = make_inputs(SHAPE, dtype, "cpu", padding=0.25)
    landmarks = landmark_layout(mask, 32)
    benchmark.group = f"landmark_mean@32 {mode} {dtype}"
    if mode == "forward":
        with torch.no_grad():
            benchmark(fn, hidden, landmarks)
    else:
        grad = torch.randn(SHAPE[0], SHAPE[2], dtype=dtype)
        benchmark(forward_backward, fn, hidden.requires_grad_(), landmarks, grad)


@pytest.mark.parametrize("impl", ["lmk_ops", "eager"])
def test_insert_landmarks(benchmark, impl):
    ids, mask = token_batch(SHAPE, "cpu", padding=0.25)
    fn = lmk_ops.insert_landmarks if impl == "lmk_ops" else reference.insert_landmarks
    benchmark.group = "insert_landmarks interval 32"
    benchmark(fn, ids, mask, landmark_id=102, interval=32, max_length=SHAPE[1])
