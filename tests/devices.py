"""The devices the suite runs on: the CPU always, CUDA when torch sees a GPU (the CUDA cases are skipped, and
reported as skipped, elsewhere); and the CPU kernels' lower capabilities, run in a subprocess."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def on(device, value):
    """value moved to device: a tensor, None, or a dataclass of them (a Hypothesis case)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return dataclasses.replace(value, **{
        f.name: on(device, getattr(value, f.name)) for f in dataclasses.fields(value)
        if isinstance(getattr(value, f.name), torch.Tensor)})


LOWER_CPU_CAPABILITIES = ["default", "avx2"]


def run_under_cpu_capability(capability: str, body: str) -> None:
    """Runs body (Python, in the tests' directory, lmk_ops and torch imported) in a process whose CPU kernels are
    those compiled for capability (ATen honours ATEN_CPU_CAPABILITY; this machine runs its best otherwise)."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    script = (f"import torch, lmk_ops\n"
              f"assert lmk_ops.build_info()['cpu_capability'] == {capability.upper()!r}, lmk_ops.build_info()\n"
              f"{body}")
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ATEN_CPU_CAPABILITY=capability),
                            cwd=os.path.dirname(__file__), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
