"""The installed package is typed (PEP 561: it ships py.typed), and a type checker sees what each public function
returns: code that uses lmk_ops checks clean under ``mypy --strict``, with each result's type asserted; and the
package's own sources check clean at mypy's defaults."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lmk_ops

USER_CODE = textwrap.dedent("""
    from typing import Any, assert_type

    import torch
    from torch import Tensor

    import lmk_ops
    from lmk_ops import LandmarkBatch, PackedLandmarkBatch, hf, nn

    hidden = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    query = torch.randn(8)
    flag: bool = bool(torch.rand(()) > 0.5)

    assert_type(lmk_ops.mean_pool(hidden, mask, normalize=True), Tensor)
    assert_type(lmk_ops.max_pool(hidden, mask), Tensor)
    assert_type(lmk_ops.max_pool(hidden, mask, return_indices=False), Tensor)
    assert_type(lmk_ops.max_pool(hidden, mask, return_indices=True), tuple[Tensor, Tensor])
    assert_type(lmk_ops.max_pool(hidden, mask, return_indices=flag), Tensor | tuple[Tensor, Tensor])
    assert_type(lmk_ops.attention_pool(hidden, mask, query), Tensor)
    assert_type(lmk_ops.attention_pool(hidden, mask, query, return_weights=True), tuple[Tensor, Tensor])
    assert_type(lmk_ops.attention_pool(hidden, None, query, return_weights=flag), Tensor | tuple[Tensor, Tensor])
    assert_type(lmk_ops.landmark_mean(hidden, mask), Tensor)
    assert_type(lmk_ops.landmark_gather(hidden, mask), tuple[Tensor, Tensor])
    assert_type(lmk_ops.landmark_positions(mask), Tensor)
    assert_type(lmk_ops.first_token_pool(hidden, mask), Tensor)
    assert_type(lmk_ops.last_token_pool(hidden.reshape(10, 8), cu_seqlens=torch.tensor([0, 4, 10])), Tensor)
    ids = torch.ones(2, 5, dtype=torch.long)
    assert_type(lmk_ops.insert_landmarks(ids, mask, landmark_id=7, interval=2), LandmarkBatch)
    assert_type(lmk_ops.sample_intervals(3), Tensor)
    tokenizer: Any = None
    assert_type(hf.tokenize_with_landmarks(tokenizer, ["a text"]), LandmarkBatch)
    assert_type(hf.tokenize_with_landmarks(tokenizer, "a text", packed=True), PackedLandmarkBatch)
    assert_type(hf.tokenize_with_landmarks(tokenizer, "a", packed=flag), LandmarkBatch | PackedLandmarkBatch)
    padded = hf.tokenize_with_landmarks(tokenizer, ["a"], interval=16)
    pooled: Tensor = nn.Pooling("lmk").forward(hidden, padded)
    weights: Tensor = nn.AttentionPooling(8, heads=2).query
""")


def test_the_package_is_typed_and_a_type_checker_sees_what_each_function_returns(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (scripts/setup.sh installs it)")
    assert (Path(lmk_ops.__file__).parent / "py.typed").is_file()
    (tmp_path / "user_code.py").write_text(USER_CODE)
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--python-version", "3.11", "--cache-dir",
                             str(tmp_path / "cache"), "user_code.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_package_itself_checks_clean_under_mypy(tmp_path):
    """The annotations inside the package hold too (Optional values narrowed before use, keyword dicts typed), so
    that a wrong one is found here rather than by a user reading a false signature. Checked at mypy's defaults:
    the internals call untyped torch and transformers APIs, which --strict would flag by the hundred."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (scripts/setup.sh installs it)")
    sources = Path(__file__).resolve().parents[1] / "python" / "lmk_ops"
    if not sources.is_dir():
        pytest.skip("the package's sources are not beside the tests")
    result = subprocess.run([sys.executable, "-m", "mypy", "--python-version", "3.11", "--cache-dir",
                             str(tmp_path / "cache"), str(sources)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
