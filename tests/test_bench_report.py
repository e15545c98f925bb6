"""The benchmark report (python -m lmk_ops.bench) on tiny shapes: a clean table on stdout (progress on stderr), every
op's rows and the packed rows, and the JSON beside it; its timer takes turns between the functions it compares."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from lmk_ops import bench


def test_report_writes_a_clean_table_and_its_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert bench.main(["--shapes", "2x16x64", "--ops", "mean_pool,max_pool", "--dtype", "float32",
                       "--packed", "3x2-9x64,2x1-4x64", "--json", str(path)]) in (0, None)
    out, err = capsys.readouterr()
    assert "\r" not in out and "[1/" in err  # progress only on stderr
    report = json.loads(path.read_text())
    assert report["huge_pages"] == bench.huge_pages() and out.splitlines()[0].endswith(bench.huge_pages())
    assert report["complete"] is True and not path.with_name("report.json.partial").exists()
    assert {(r["op"], r["mode"]) for r in report["rows"]} == {
        (op, mode) for op in ("mean_pool", "max_pool") for mode in ("forward", "forward+backward")}
    assert all(r["x_floor"] > 0 for r in report["rows"] if r["mode"] == "forward")
    packed = [(r["op"], r["dtype"], r["batch"].split(",")[0], r["mode"]) for r in report["packed_rows"]]
    assert sorted(packed) == sorted((op, "float32", batch, mode) for op in ("mean_pool", "max_pool")  # each op, batch
                                    for batch in ("3 texts", "2 texts") for mode in ("forward", "forward+backward"))
    assert all(r["lmk_ops_ms"] > 0 and r["padded_ms"] > 0 and r["floor_ms"] > 0 and r["index_add_ms"] > 0
               for r in report["packed_rows"])
    assert all((r["x_floor"] is not None) == (r["mode"] == "forward") for r in report["packed_rows"])
    for line in out.splitlines():
        if line.startswith(("mean_pool", "max_pool")):
            assert len(line.split()) >= 6, line


def test_cpu_scaling_script_times_every_op_at_every_thread_count(tmp_path):
    """scripts/cpu_scaling.py, which gpu_check.sh runs on the GPU machine's cores, on a tiny shape."""
    path = pathlib.Path(__file__).parents[1] / "scripts" / "cpu_scaling.py"
    spec = importlib.util.spec_from_file_location("cpu_scaling", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    script.main(["--threads", "1,2", "--shape", "1x64x128", "--json", str(tmp_path / "scaling.json")])
    assert torch.get_num_threads() == threads
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert {(r["op"], r["dtype"], r["threads"]) for r in rows} == {
        (op, dtype, t) for op in ("mean_pool", "max_pool", "attention_pool@1h", "attention_pool@64d")
        for dtype in ("float32", "bfloat16") for t in (1, 2)}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)


def test_time_together_takes_turns_and_keeps_none():
    calls = []
    times = bench.time_together({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "c": None}, "cpu",
                                min_time=0.0, min_rounds=3, block_ms=0.0)
    assert times["c"] is None and times["a"] >= 0 and times["b"] >= 0
    # A warm-up call of each, then a first call of each (so that every first call comes after all the warm-ups),
    # then rounds of one block (here one call) of each in turn.
    assert calls == ["a", "b", "a", "b"] + ["a", "b"] * 3
    calls.clear()
    bench.time_together({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu", min_time=0.0,
                        min_rounds=3, block_ms=0.0, between_rounds=lambda: calls.append("move"))
    assert calls == ["a", "b", "a", "b"] + ["a", "b", "move", "a", "b", "move", "a", "b"]


def test_functions_that_compile_nothing_are_timed_from_their_first_call():
    """Only a compiled function needs a warm-up call; an eager one slower than slow_ms (and than once_over times the
    fastest) is timed by its first call alone (the report's slow eager baselines, once instead of twice)."""
    calls = []
    times = bench.time_together({"eager": lambda: calls.append("eager"), "compiled": lambda: calls.append("compiled")},
                                "cpu", slow_ms=-1.0, once_over=0.0, warm_up={"compiled"})
    assert calls == ["compiled", "eager", "compiled"] and min(times.values()) >= 0  # the warm-ups come first
    calls.clear()
    bench.time_together({"a": lambda: calls.append("a")}, "cpu", min_time=0.0, min_rounds=2, block_ms=0.0, warm_up=())
    assert calls == ["a"] + ["a"] * 2  # a fast first call is the warm-up: the rounds follow as before
    calls.clear()
    assert bench.time_ms(lambda: calls.append("slow"), "cpu", slow_ms=-1.0, warm_up=False) >= 0
    assert calls == ["slow"]


def test_a_slow_function_near_the_fastest_is_timed_in_turns_not_by_its_first_call():
    """Over slow_ms, only a function more than once_over times slower than the fastest is timed once: the others'
    ratios are what the report is read for, and a first call alone can be off by 2x."""
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    bench.time_together(fns, "cpu", min_time=0.0, min_rounds=2, block_ms=0.0, slow_ms=-1.0, once_over=float("inf"),
                        warm_up=())
    assert calls == ["a", "b"] + ["a", "b"] * 2
    calls.clear()
    times = bench.time_together({"slow": lambda: (time.sleep(0.03), calls.append("slow")),
                                 "fast": lambda: calls.append("fast")}, "cpu", min_time=0.0, min_rounds=2,
                                block_ms=0.0, slow_ms=-1.0, once_over=1.0, warm_up=())
    assert calls == ["slow", "fast"] + ["fast"] * 2 and times["slow"] >= 30.0
    calls.clear()  # the function under test is timed in turns however slow its first call
    times = bench.time_together({"slow": lambda: (time.sleep(0.03), calls.append("slow")),
                                 "fast": lambda: calls.append("fast")}, "cpu", min_time=0.0, min_rounds=2,
                                block_ms=0.0, slow_ms=-1.0, once_over=1.0, warm_up=(), in_turns={"slow"})
    assert calls == ["slow", "fast"] + ["slow", "fast"] * 2 and times["slow"] >= 30.0


class _FakeFuture:
    def __init__(self, error):
        self.error = error

    def result(self):
        if self.error is not None:
            raise self.error


def test_precompile_skips_its_workers_once_the_cache_holds_the_same_contenders(monkeypatch, tmp_path):
    """precompile leaves a marker in torch's compile cache after its workers succeeded; the same cases with the
    same cache skip the workers, other cases or a failed run do not."""
    submitted, failure = [], []

    class FakePool:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, part, *args):
            submitted.append(part)
            return _FakeFuture(failure[0] if failure else None)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "usable_cores", lambda: 2)
    monkeypatch.setattr(bench, "ProcessPoolExecutor", FakePool)
    cases = [("mean_pool", "float32", (2, 7, 24)), ("max_pool", "float32", (2, 7, 24))]
    failure.append(RuntimeError("a worker failed"))
    bench.precompile(cases, "cpu", 0.0)
    assert len(submitted) == 2 and not list(tmp_path.glob("lmk_ops_bench_contenders_*"))
    failure.clear()
    bench.precompile(cases, "cpu", 0.0)
    assert len(submitted) == 4 and len(list(tmp_path.glob("lmk_ops_bench_contenders_*"))) == 1
    bench.precompile(cases, "cpu", 0.0)
    assert len(submitted) == 4
    bench.precompile(cases + [("mean_pool", "bfloat16", (2, 7, 24))], "cpu", 0.0)
    assert len(submitted) == 6


# Run as a script: its __main__ holds `torch` as `python -m lmk_ops.bench`'s does, so its spawned workers re-import
# it as __mp_main__, the module whose place in sys.modules changed their compile cache keys (bench._compile_cases).
PRECOMPILE_THEN_LOAD = """
import json, torch
from torch._dynamo.utils import counters
from lmk_ops import bench

if __name__ == "__main__":
    bench.usable_cores = lambda: 2  # two workers even on a one-core machine
    case = ("attention_pool@1h", "float32", (3, 19, 24))
    bench.precompile([case, ("mean_pool", "float32", (2, 7, 24))], "cpu", 0.0)
    counters.clear()
    bench._compile_cases([case], "cpu", 0.0, torch.get_num_threads())
    print(json.dumps(dict(counters["inductor"])))
"""


def test_precompile_fills_the_compile_cache_the_report_then_loads(tmp_path):
    """The contenders compiled in worker processes (bench.precompile) are cache hits in the report's own process."""
    script = tmp_path / "precompile_then_load.py"
    script.write_text(PRECOMPILE_THEN_LOAD)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}  # empty: no marker skips the workers
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    inductor = json.loads(done.stdout.strip().splitlines()[-1])
    assert inductor.get("fxgraph_cache_hit", 0) >= 1 and inductor.get("fxgraph_cache_miss", 0) == 0, inductor


@pytest.mark.parametrize("environ,separate", [
    ({"ATEN_CPU_CAPABILITY": "avx2"}, True),
    ({"ATEN_CPU_CAPABILITY": "AVX2", "TORCHINDUCTOR_CACHE_DIR": "/chosen"}, False),  # the user's choice stands
    ({}, False),
])
def test_a_capability_set_by_hand_compiles_into_its_own_cache(environ, separate):
    """torch's compile cache does not tell CPU capabilities apart (a contender compiled with AVX-512 and loaded
    under ATEN_CPU_CAPABILITY=avx2 computed out-of-range indices): such a report keeps its own folder."""
    before = dict(environ)
    folder = bench.capability_compile_cache(environ)
    if separate:
        assert folder is not None and folder.endswith("_avx2") and environ["TORCHINDUCTOR_CACHE_DIR"] == folder
    else:
        assert folder is None and environ == before


@pytest.mark.parametrize("environ,switch", [
    ({}, "THP_MEM_ALLOC_ENABLE unset"),
    ({"THP_MEM_ALLOC_ENABLE": "1"}, "THP_MEM_ALLOC_ENABLE =1"),
    ({"THP_MEM_ALLOC_ENABLE": "yes"}, "THP_MEM_ALLOC_ENABLE ='yes' (off: torch takes only 1)"),
])
def test_the_report_says_how_cpu_tensors_get_their_pages(environ, switch):
    """A CPU backward's time is mostly the page faults of its fresh gradient: the report names the kernel's
    transparent-huge-page mode and torch's THP_MEM_ALLOC_ENABLE, which change them."""
    assert re.fullmatch(rf"THP (always|madvise|never|unknown), {re.escape(switch)}", bench.huge_pages(environ))


@pytest.mark.parametrize("args,message", [
    (["--shapes", "0x16x64"], r"expected shapes like 32x512x768\[,8x4096x1024\], sizes >= 1, got '0x16x64'"),
    (["--packed", "3x0-0x64"], r"expected a packed batch like 120x16-2048x768 \(B, the longest text and D >= 1"),
    (["--json", "{blocked}/report.json"], r"--json: cannot create the folder .*blocked"),
    (["--json", "{tmp}"], r"--json: expected a file path, got the folder"),
])
def test_bad_arguments_fail_before_anything_is_timed(args, message, tmp_path, capsys):
    # A zero size used to time empty tensors; an unwritable --json path failed after the whole report.
    (tmp_path / "blocked").write_text("a file where the folder would go")
    args = [a.format(blocked=tmp_path / "blocked", tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit):
        bench.main([*args, "--ops", "mean_pool", "--dtype", "float32"])
    _, err = capsys.readouterr()
    assert re.search(message, err), err
    assert "[1/" not in err


def test_a_report_cut_short_leaves_the_cases_it_finished(tmp_path, monkeypatch):
    """The JSON is rewritten after every case: a run stopped by a time limit (gpu_check.sh's) keeps what it timed."""
    def stopped(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "bench_packed", stopped)
    path = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--shapes", "1x4x8", "--ops", "mean_pool", "--dtype", "float32", "--packed", "2x1-4x8",
                    "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["complete"] is False and {r["mode"] for r in report["rows"]} == {"forward", "forward+backward"}
    assert report["packed_rows"] == []


def test_json_folders_are_created(tmp_path):
    path = tmp_path / "new" / "folder" / "report.json"
    bench.main(["--shapes", "1x4x8", "--ops", "first_token_pool", "--dtype", "float32", "--packed", "none",
                "--json", str(path)])
    assert json.loads(path.read_text())["rows"]


def test_cuda_trace_script_traces_every_case(tmp_path):
    """scripts/cuda_trace.py, which gpu_check.sh runs on the GPU machine, on the CPU and tiny shapes: every case is
    traced (forward and forward+backward for each op, then the packed ones), each with a table of what it called."""
    path = pathlib.Path(__file__).parents[1] / "scripts" / "cuda_trace.py"
    done = subprocess.run([sys.executable, str(path), "--device", "cpu", "--small", "--rows", "3"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    titles = [line for line in done.stdout.splitlines() if line.startswith("=== ")]
    assert len(titles) == 2 * (2 * 6 + 2) + 2, titles
    assert "lmk_ops::mean_pool" in done.stdout and "=== packed first_token_pool" in done.stdout


def test_compare_reports_script_sets_two_reports_side_by_side(tmp_path):
    """scripts/compare_reports.py, which gpu_check.sh runs after the CUDA report against the last committed one of
    the same GPU: the rows both hold, new over old, each one's time over its floor; an older report's packed rows
    (no mode: forward only) still match; a file that is not a report is a clear error."""
    path = pathlib.Path(__file__).parents[1] / "scripts" / "compare_reports.py"

    def run(*args):
        return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True,
                              timeout=60)

    def row(mode, ms, **key):  # as the report writes a row: x_floor for forward rows only
        return {"op": "mean_pool", "dtype": "float32", "mode": mode, "lmk_ops_ms": ms, "floor_ms": 0.5,
                "x_floor": ms / 0.5 if mode == "forward" else None, **key}

    old = {"machine": "GPU A", "rows": [row("forward", 2.0, shape="8x64x32"), row("forward+backward", 4.0,
                                                                                   shape="8x64x32")],
           "packed_rows": [{k: v for k, v in row("forward", 1.0, batch="3 texts, 9x32").items() if k != "mode"}]}
    new = {"machine": "GPU B", "complete": False,
           "rows": [row("forward", 1.0, shape="8x64x32"), row("forward", 1.0, shape="1x9x32")],
           "packed_rows": [row("forward", 1.5, batch="3 texts, 9x32")]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    done = run(tmp_path / "old.json", tmp_path / "new.json")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "(incomplete: cut short)" in lines[1] and "different machines" in lines[2]
    assert re.search(r"8x64x32 +forward +2\.000 +1\.000 +0\.50x +4\.00x +2\.00x$", done.stdout, re.M), done.stdout
    assert re.search(r"3 texts, 9x32 +forward +1\.000 +1\.500 +1\.50x +2\.00x +3\.00x$", done.stdout, re.M)
    assert "1x9x32" not in done.stdout and "forward+backward" not in done.stdout.split("\n", 4)[-1]
    assert lines[-1] == "2 rows in both; 1 only in the new one; 1 only in the old one"
    committed = pathlib.Path(__file__).parents[1] / "bench" / "results" / "cuda-h200.json"
    same = run(committed, committed)
    rows = same.stdout.splitlines()[3:-1]
    assert same.returncode == 0 and len(rows) > 100 and all(re.search(r" 1\.00x( |$)", line) for line in rows)
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = run(tmp_path / "bad.json", tmp_path / "new.json")
    assert bad.returncode == 1 and "expected a report of python -m lmk_ops.bench --json" in bad.stderr
