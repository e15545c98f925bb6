"""Optional packages the tests need (transformers, sentence-transformers, the real model)."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str):
    """A package these tests need: missing, it fails the run in CI (whose setup installs it) and skips elsewhere."""
    return importlib.import_module(module) if os.environ.get("CI") else pytest.importorskip(module)
