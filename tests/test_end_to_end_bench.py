"""bench/end_to_end.py (the GPU issue's end-to-end measurement) runs: a smoke run on the CPU with a tiny encoder,
so that the script a GPU session depends on is known to work before one is lent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from packages import require

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "end_to_end.py"


def test_end_to_end_script_smoke_run(tmp_path):
    require("sentence_transformers")
    spec = importlib.util.spec_from_file_location("end_to_end", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "e2e.json"
    assert script.main(["--device", "cpu", "--layers", "1", "--hidden", "32", "--batch", "4", "--seq-len", "48",
                        "--texts", "8", "--steps", "1", "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["pooling"] for r in rows] == ["mean/lmk_ops", "mean/sentence-transformers", "lmk/lmk_ops",
                                             "lmk/sentence-transformers"]
    assert all(r["train_step_ms"] > 0 and r["inference_ms"] > 0 for r in rows)
