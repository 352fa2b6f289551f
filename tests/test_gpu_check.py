"""bench/gpu_check.sh, the device check, on a machine without a GPU: a Python that fails is named
with its error (not taken for "no GPU"); no GPU exits 2; and, with a stand-in interpreter that
plays one GPU, a stage whose tests all skipped reads "skipped" and a stage past its limit is
stopped and fails loudly."""
import os
import subprocess
from pathlib import Path

import pytest

from ddpkit import devices

ROOT = Path(__file__).resolve().parents[1]


def check(tmp_path, python, **env):
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHON": python, "GPU_CHECK_OUT": str(tmp_path),
                               **env})


@pytest.mark.parametrize("python, error", [
    ("/bin/false", "it printed no error"),
    ("/no/such/python", "No such file or directory"),
])
def test_a_failing_interpreter_is_named_with_its_error(tmp_path, python, error):
    out = check(tmp_path, python)
    assert out.returncode == 1
    assert f"the interpreter '{python}' failed" in out.stderr and error in out.stderr
    assert "no usable CUDA GPU" not in out.stdout + out.stderr


@pytest.mark.skipif(bool(devices.cuda_gpus()), reason="this machine has a GPU")
def test_no_gpu_exits_2_and_says_so(tmp_path):
    out = check(tmp_path, str(ROOT / ".venv" / "bin" / "python"))
    assert out.returncode == 2 and "no usable CUDA GPU here" in out.stdout


# plays a one-GPU machine: every stage answers at once, except bench.launch, which hangs
FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *cuda_gpus\\(\\)\\)\\)*) echo 1 ;;
  -c*) echo "GPU 0: fake, compute capability 9.0"; echo "backend for 2 ranks: ('gloo', 'cuda')" ;;
  *tests/gpu*) echo "sssss"; echo "5 skipped in 0.10s" ;;
  *nbmake*) echo ".."; echo "2 passed in 1.00s" ;;
  *bench.launch*) exec sleep 60 ;;
  *bench.overhead*) echo "all probes on / plain: 1.01; target <= 1.03: met" ;;
  *bench.peak*) echo "GPT-2 s128 b1: worst +0.100%, phases agree" ;;
esac
"""


def test_skipped_stages_and_a_timeout_are_reported_as_such(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    # 4% of each limit: the hanging stage is stopped after 2 s
    out = check(tmp_path / "out", str(fake), GPU_CHECK_LIMIT_PERCENT="4")
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.stdout.splitlines() if line.startswith("| ") and "stage" not in line}
    assert rows == {"env": "pass", "gpu-tests": "skipped", "notebooks": "pass",
                    "launch": "TIMEOUT (limit 2s)", "overhead": "pass", "peak": "pass",
                    "step-time": "pass"}
    assert out.returncode == 1
    assert "!! TIMEOUT: stage 'launch' ran past its 2 s limit" in out.stderr
