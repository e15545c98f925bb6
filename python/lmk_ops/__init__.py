"""lmk_ops: fused, mask-aware pooling for embedding models (mean, max, landmark, attention), on CPU and CUDA."""

from __future__ import annotations

from . import _schemas  # noqa: F401  (the ops' schemas, which the compiled kernels register under)
from ._loader import load_extension

_C = load_extension()

from . import _autograd, _meta, _vmap  # noqa: E402,F401  (register fake kernels, autograd and vmap rules)
from . import reference  # noqa: E402,F401
from .landmarks import LandmarkBatch, PackedLandmarkBatch, insert_landmarks, sample_intervals  # noqa: E402
from . import hf, nn  # noqa: E402  (hf needs no transformers: it takes any tokenizer object)
from .ops import (  # noqa: E402
    attention_pool, first_token_pool, landmark_gather, landmark_mean, landmark_positions, last_token_pool, max_pool,
    mean_pool,
)

__version__: str = _C.build_info()["version"]


def build_info() -> dict:
    """What this build was compiled against and uses at run time.

    Keys: ``version``, ``torch_version`` (torch it was built against), ``min_torch`` (the oldest torch it runs with:
    it uses PyTorch's stable ABI only), ``cuda`` (CUDA kernels compiled in),
    ``num_threads`` (threads the CPU kernels use: torch's own pool, ``torch.get_num_threads()``),
    ``cpu_capability`` (the vectorised kernel set in use: DEFAULT, AVX2 or AVX512), ``cpu_prefetch`` (the cache the
    CPU kernels prefetch the rows they read next into: L1; L2 on AMD Zen 4, where L1 prefetches were slow; on Intel
    CPUs "L1 for 16-bit rows, L2 for wider", where float32 rows read faster so; the variable
    ``LMK_OPS_PREFETCH=l1`` or ``l2`` chooses one for every row), ``cpu_twin`` (a test build whose
    CPU tensors take the op-layer paths a CUDA build runs; False in every release).
    """
    return dict(_C.build_info())


__all__ = [
    "LandmarkBatch", "PackedLandmarkBatch", "__version__", "attention_pool", "build_info", "first_token_pool", "hf",
    "insert_landmarks", "landmark_gather", "landmark_mean", "landmark_positions", "last_token_pool", "max_pool",
    "mean_pool", "nn", "reference", "sample_intervals",
]
