"""Loads the compiled extension, turning a build that does not match the installed torch into a clear error."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

REBUILD = (
    "Rebuild lmk_ops against the installed torch: from its source checkout run "
    "`pip install --no-build-isolation --force-reinstall --no-deps .`"
)


def _release(version: str) -> str:
    # "2.13.0+cpu" and "2.13.0+cu130" share an ABI for the CPU code; the local tag is not compared.
    return version.split("+", 1)[0]


def load_extension() -> ModuleType:
    try:
        build = importlib.import_module("lmk_ops._build_info")
    except ImportError as e:
        raise ImportError(f"lmk_ops: the compiled extension is missing (not built?). {REBUILD}") from e
    if _release(build.TORCH_VERSION) != _release(torch.__version__):
        raise ImportError(
            f"lmk_ops: the compiled extension was built against torch {build.TORCH_VERSION}, "
            f"but torch {torch.__version__} is installed. {REBUILD}"
        )
    try:
        return importlib.import_module("lmk_ops._C")
    except ImportError as e:  # e.g. a CUDA build imported by a CPU-only torch
        raise ImportError(
            f"lmk_ops: the compiled extension (built against torch {build.TORCH_VERSION}, "
            f"CUDA kernels: {build.CUDA}) failed to load under torch {torch.__version__}: {e}. {REBUILD}"
        ) from e
