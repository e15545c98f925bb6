"""The devices the suite runs on: the CPU always, CUDA when torch sees a GPU (the CUDA cases are skipped, and
reported as skipped, elsewhere); and the CPU kernels' lower capabilities, run in a subprocess."""

from __future__ import annotations

import dataclasses
import os
import re
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


# Set in the fresh process that expect_bad_value starts for a CUDA case.
_DEVICE_ASSERT_CHILD = "LMK_OPS_TEST_DEVICE_ASSERT_CHILD"


def expect_bad_value(device, message, call, request) -> None:
    """call() must refuse a value that only a kernel reads (an offset, a position, a mask value), naming the op with
    message (a regular expression). On the CPU the op raises. On CUDA the check runs on the device without a host
    sync: the device prints the message and the host sees a device-side assertion at its next synchronisation, which
    leaves the process's CUDA context unusable; so the test runs again in a fresh process that makes the call, and
    its output must hold the message."""
    if device != "cuda":
        with pytest.raises(RuntimeError, match=message):
            call()
        return
    if os.environ.get(_DEVICE_ASSERT_CHILD):
        # The launches are asynchronous, so the assertion surfaces wherever the host next meets the device: a launch
        # or a torch call inside the op, or the synchronisation. Through a torch call, torch before 2.13 gives the
        # stable ABI no text (error.cpp: "torch logged why above"); its log on stderr then holds it. The error is
        # printed for the parent to read (checked below).
        with pytest.raises(RuntimeError, match="device-side assert|torch logged why above") as raised:
            call()
            torch.cuda.synchronize()
        print(f"\nthe call raised: {raised.value}")
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist",
                           request.node.nodeid], cwd=request.config.rootpath, capture_output=True, text=True,
                          env=dict(os.environ, **{_DEVICE_ASSERT_CHILD: "1"}), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(message, done.stdout), done.stdout[-3000:]
    assert "device-side assert" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]


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
