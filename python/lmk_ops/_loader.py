"""Loads the compiled extension, turning a torch it cannot run with into a clear error.

The extension uses PyTorch's stable ABI only (compiled with TORCH_TARGET_VERSION), so one build runs with every torch
from the version it targets on, whatever torch it was compiled against. A build with CUDA kernels also needs a torch
built for the same CUDA major version (the CUDA runtime is the one torch brings). The extension reads
LMK_OPS_PREFETCH once as it loads, so its value is checked first.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType

import torch

REBUILD = (
    "Install the lmk_ops wheel that matches, or build lmk_ops against the installed torch: from its source checkout "
    "run `pip install --no-build-isolation --force-reinstall --no-deps .`"
)


def _major_minor(version: str) -> tuple[int, int]:
    """(2, 13) for "2.13.0+cpu", "2.13.0a0+git1234" or "2.13"."""
    major, minor = version.split("+", 1)[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(build, torch_version: str, torch_cuda: str | None) -> None:
    """Raises ImportError, saying what was found and what is needed, when this build cannot run with that torch.

    build: the build information (_build_info: MIN_TORCH, CUDA, CUDA_VERSION); torch_cuda: torch.version.cuda.
    """
    if _major_minor(torch_version) < _major_minor(build.MIN_TORCH):
        raise ImportError(
            f"lmk_ops: needs torch >= {build.MIN_TORCH} (the first release of the PyTorch stable ABI it is built on), "
            f"but torch {torch_version} is installed. Upgrade torch, or use an older lmk_ops.")
    if not build.CUDA:
        return  # CPU kernels run with any torch build (a CUDA tensor then finds no lmk_ops kernel)
    if not torch_cuda:
        raise ImportError(
            f"lmk_ops: this build has CUDA kernels (CUDA {build.CUDA_VERSION}), but torch {torch_version} is a "
            f"CPU-only build. Install torch built for CUDA {build.CUDA_VERSION.split('.')[0]}, or the CPU wheel of "
            f"lmk_ops. {REBUILD}")
    if torch_cuda.split(".")[0] != build.CUDA_VERSION.split(".")[0]:
        raise ImportError(
            f"lmk_ops: this build's CUDA kernels need torch built for CUDA {build.CUDA_VERSION.split('.')[0]}.x "
            f"(it was compiled with CUDA {build.CUDA_VERSION}), but torch {torch_version} is built for CUDA "
            f"{torch_cuda}. {REBUILD}")


def check_prefetch_variable(environ: Mapping[str, str]) -> None:
    """LMK_OPS_PREFETCH, where set, names the cache the CPU kernels prefetch into, for rows of every dtype: l1 or
    l2 (unset: chosen for this CPU and the rows' width, build_info()["cpu_prefetch"])."""
    value = environ.get("LMK_OPS_PREFETCH")
    if value not in (None, "", "l1", "l2"):
        raise ValueError(f"lmk_ops: expected LMK_OPS_PREFETCH to be 'l1' or 'l2' (or unset), got {value!r}")


def load_extension() -> ModuleType:
    try:
        build = importlib.import_module("lmk_ops._build_info")
    except ImportError as e:
        raise ImportError(f"lmk_ops: the compiled extension is missing (not built?). {REBUILD}") from e
    check_torch(build, torch.__version__, torch.version.cuda)
    check_prefetch_variable(os.environ)
    try:
        return importlib.import_module("lmk_ops._C")
    except ImportError as e:
        raise ImportError(
            f"lmk_ops: the compiled extension (built against torch {build.TORCH_VERSION}, for torch >= "
            f"{build.MIN_TORCH}; CUDA kernels: {build.CUDA}) failed to load under torch {torch.__version__}: {e}. "
            f"{REBUILD}") from e
