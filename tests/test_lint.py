"""Every Python file of the repository passes ruff with the rules in pyproject.toml (pycodestyle, pyflakes, bugbear;
lines of at most 120 characters): an unused import, a name used before it is bound or a shadowed test argument is
found here, not by a reader."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_python_files_pass_ruff():
    # scripts/setup.sh installs ruff, so the suite in .venv runs this; the environments that test a built wheel
    # against other torch versions (scripts/wheel_check.sh) have no linter, as they have no mypy.
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (scripts/setup.sh installs it)")
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("the repository is not beside the tests")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
