"""bench/gpu_check.sh, the device check, on a machine without a GPU: a Python that fails is named
with its error (not taken for "no GPU"); no GPU exits 2, the GPU-only stages saying so; and, with a
stand-in interpreter, what it lacks is installed from the carried wheel folder only, a stage whose
tests all skipped reads "skipped" and a stage past its limit is stopped and fails loudly.
(bench/gpu_rehearsal.sh runs the whole check on Python 3.12 with torch 2.11, as the lent machines.)"""
import os
import re
import subprocess
import sys
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
    out = check(tmp_path, sys.executable, GPU_CHECK_STAGES="env launch")
    assert out.returncode == 2 and "no usable CUDA GPU here" in out.stdout
    assert "| env | pass |" in out.stdout
    assert "| launch | no GPU | 0 | not run: it needs a CUDA GPU |" in out.stdout
    # every stage at its limit, and 5 s of grace each, still ends inside the 8 minutes a lent
    # machine gives the check (its own start and the summary line take the rest)
    worst = int(re.search(r"== limits: worst case (\d+) s", out.stdout).group(1))
    assert worst <= 475


# plays a machine with GPUS GPUs: every stage answers at once, except bench.launch, which hangs;
# pip records how it was called; MISSING: the packages the interpreter lacks
FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *find_spec*) echo "$MISSING" ;;
  *"-m pip install"*) echo "$*" >"$CALLS"; echo "Successfully installed $(ls $WHEELS)" ;;
  *sys.version*) echo "torch 2.11.0+cu130, Python 3.12.3" ;;
  -c*) echo "GPU 0: fake, compute capability 9.0"; echo "backend for 2 ranks: ('gloo', 'cuda')"
       echo "GPUS $GPUS" ;;
  *tests/gpu*) echo "PYTHONPATH=$PYTHONPATH"; echo "sssss"; echo "5 skipped in 0.10s" ;;
  *nbmake*) echo ".."; echo "2 passed in 1.00s" ;;
  *bench.launch*) exec sleep 60 ;;
  *bench.overhead*) echo "all probes on / plain: 1.01; target <= 1.03: met" ;;
  *bench.peak*) echo "GPT-2 s128 b1: worst +0.100%, phases agree" ;;
  *bench.gpu_step_time*) echo "predicted vs measured: mean absolute error 9.0% on 1 GPU(s)" ;;
esac
"""


def fake_check(tmp_path, gpus=1, missing="", wheels=(), **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    folder = tmp_path / "whl"
    folder.mkdir()
    for name in wheels:
        (folder / name).write_bytes(b"")
    out = check(tmp_path / "out", str(fake), GPUS=str(gpus), MISSING=missing,
                WHEELS=str(folder), GPU_CHECK_WHEELS=str(folder), CALLS=str(tmp_path / "calls"),
                GPU_CHECK_SITE=str(tmp_path / "site"), **env)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.stdout.splitlines() if line.startswith("| ") and "stage" not in line}
    return out, rows


def test_skipped_stages_and_a_timeout_are_reported_as_such(tmp_path):
    # 4% of each limit: the hanging stage (bench.launch, 75 s) is stopped after 3 s
    out, rows = fake_check(tmp_path, GPU_CHECK_LIMIT_PERCENT="4")
    assert rows == {"wheels": "pass", "env": "pass", "gpu-tests": "skipped", "notebooks": "pass",
                    "launch": "TIMEOUT (limit 3s)", "overhead": "pass", "peak": "pass",
                    "step-time": "pass"}
    assert out.returncode == 1
    assert "!! TIMEOUT: stage 'launch' ran past its 3 s limit" in out.stderr


def test_what_the_interpreter_lacks_comes_from_the_carried_wheels_only(tmp_path):
    # the lent machines' python3 has no ipywidgets, plotly, anywidget, nbmake or jupyter, and
    # no index to fetch them from: they are installed from the carried folder, by file name
    wheels = ("plotly-7.1.0-py3-none-any.whl", "nbmake-1.5.5-py3-none-any.whl")
    out, rows = fake_check(tmp_path, gpus=0, missing="plotly nbmake", wheels=wheels)
    pip = (tmp_path / "calls").read_text().split()
    assert {"--no-index", "--no-deps", "--target"} <= set(pip)
    assert pip[pip.index("--target") + 1] == str(tmp_path / "site")
    assert sorted(Path(a).name for a in pip if a.endswith(".whl")) == sorted(wheels)
    log = (tmp_path / "out" / "gpu-tests.log").read_text()
    assert log.startswith("PYTHONPATH=" + str(ROOT)) and log.split()[0].endswith(
        ":" + str(tmp_path / "site"))  # the checkout first, the wheels last
    # no GPU: the CPU stages run and pass, the GPU-only ones say so and run nothing
    assert rows == {"wheels": "pass", "env": "pass", "gpu-tests": "no GPU", "notebooks": "pass",
                    "peak": "no GPU", "launch": "no GPU", "overhead": "no GPU",
                    "step-time": "no GPU"}
    assert out.returncode == 2 and "no usable CUDA GPU here" in out.stdout


def test_a_missing_package_and_no_wheel_folder_name_the_script_that_makes_it(tmp_path):
    out, rows = fake_check(tmp_path, missing="ipywidgets", GPU_CHECK_STAGES="wheels env")
    assert rows["wheels"].startswith("FAIL") and out.returncode == 1
    assert "lacks ipywidgets and there is no" in out.stderr
    assert "run bash bench/gpu_wheels.sh where pip works" in out.stderr
