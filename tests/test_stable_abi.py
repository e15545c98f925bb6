"""The compiled extension is on PyTorch's stable ABI: it references no libtorch or libc10 C++ symbol, only the stable
C shims (aoti_torch_*, torch_*), so that one build loads into every torch from the targeted version on."""

import re
import shutil
import subprocess

import pytest

import lmk_ops

# A C++ symbol of torch's namespaces (demangled), anywhere in the name: at::Tensor as a parameter type counts too.
TORCH_CPP = re.compile(r"\b(at|c10|torch|caffe2|aten)::")


def _undefined_symbols(library: str) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed to read the extension's symbols")
    listing = subprocess.run([nm, "-D", "--undefined-only", "--demangle", library], check=True, capture_output=True,
                             text=True).stdout
    # Each line: the symbol's kind (U, w) and its name, which may hold spaces once demangled.
    return [line.split(None, 1)[1] for line in listing.splitlines() if line.strip()]


def test_the_extension_references_no_libtorch_cpp_symbol():
    symbols = _undefined_symbols(lmk_ops._C.__file__)
    cpp = [s for s in symbols if TORCH_CPP.search(s)]
    assert not cpp, f"{len(cpp)} libtorch/libc10 C++ symbols referenced by {lmk_ops._C.__file__}: {cpp[:20]}"
    # What it does take from torch: the stable C shims (the test would pass vacuously on a file with no symbols).
    assert any(s.startswith("aoti_torch_") for s in symbols) and "torch_call_dispatcher" in symbols
