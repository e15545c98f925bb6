# Sourced by the scripts that run tests.
#
# pytest_workers: the pytest-xdist arguments every run passes. Two worker processes: most tests wait on Python, the
# C++ compiler (torch.compile) or mypy rather than keeping both cores busy, so two at a time take about two thirds
# of the time one at a time does on a 2-core machine (the suite: 825 s -> 547 s on a 2-core AMD EPYC Zen 3).
# LMK_OPS_TEST_WORKERS sets another count; 0 runs the tests in pytest's own process.
pytest_workers=(-n "${LMK_OPS_TEST_WORKERS:-2}")
# without_static_checks: leaves out ruff and mypy (they read sources only: a run on another build of the same
# sources, the CPU twin's or the sanitizer's, has nothing new for them).
without_static_checks=(--deselect tests/test_lint.py --deselect tests/test_typing.py)
# kernel_tests: every op's forward and backward against the reference, padded and packed, bad input and the work
# split: what a build other than the one the whole suite ran on (a sanitizer's, another torch's, a wheel) must pass.
kernel_tests=(tests/test_pool_parity.py tests/test_landmark_ops.py tests/test_attention_pool.py tests/test_packed.py
              tests/test_errors.py tests/test_hostile.py tests/test_work_split.py)
