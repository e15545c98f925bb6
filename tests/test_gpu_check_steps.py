"""scripts/deadline_steps.sh, the steps of scripts/gpu_check.sh, with stub commands: a GPU machine is lent for a few
minutes now and then, so the deadline logic is checked here, where it costs nothing. Takes about 10 s."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

STEPS = Path(__file__).resolve().parents[1] / "scripts" / "deadline_steps.sh"

SCRIPT = r"""
set -uo pipefail
results="$1"
source "$2"
reserve=1 least=2  # gpu_check.sh's 10 s and 20 s, scaled down
slow() { echo started; sleep "$1"; echo finished; }
fails() { echo broken; return 3; }
export -f slow fails
step ok 100 "passes" ok.log echo hello
step capped 2 "runs past its cap" capped.log slow 30
step fails 100 "fails" fails.log fails
step skipped 100 "is skipped" skipped.log echo never
step cut 100 "is cut by the deadline" cut.log slow 60
step late 100 "comes too late" late.log echo never
print_summary
echo "exit $?"
"""


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None, reason="needs bash and timeout")
def test_steps_keep_to_their_caps_and_the_deadline(tmp_path):
    # Deadline 10 s, 1 kept for the summary: the capped step takes 2 s, the one cut by the deadline gets the 6-7 s
    # left (less on a loaded machine) and is stopped, and the last finds under 2 s left.
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "GPU_CHECK_SECONDS": "10", "GPU_CHECK_SKIP": "skipped"}
    result = subprocess.run(["bash", str(script), str(tmp_path), str(STEPS)], capture_output=True, text=True,
                            env=env, timeout=120)
    status = {name: rest.split()[0] for name, rest in
              (re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines()
               if re.match(r"^(passes|runs past|fails|is skipped|is cut|comes too late)", line))}
    assert status == {"passes": "ok", "runs past its cap": "TIMEOUT", "fails": "FAILED", "is skipped": "skipped",
                      "is cut by the deadline": "TIMEOUT", "comes too late": "no"}, result.stdout + result.stderr
    assert "exit 1" in result.stdout  # a failed or timed-out step fails the summary
    assert (tmp_path / "ok.log").read_text() == "hello\n"
    assert (tmp_path / "capped.log").read_text() == "started\n"  # killed before it finished
    assert not (tmp_path / "skipped.log").exists() and not (tmp_path / "late.log").exists()
    assert "(at most 2 s)" in result.stdout and re.search(r"is cut by the deadline \(at most [3-7] s\)", result.stdout)
