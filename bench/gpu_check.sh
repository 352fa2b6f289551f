#!/usr/bin/env bash
# The device check of issue #11: every CUDA path of ddpkit, in under 5 minutes on a GPU machine.
#
#   bash bench/gpu_check.sh            # from anywhere; uses .venv/bin/python if there, else python
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# Stages (each under its own time limit; the limits add up to 300 s):
#   env        torch, CUDA, NCCL, each GPU's name and compute capability, the backend ddpkit picks
#   gpu-tests  pytest tests/gpu (NCCL tests need 2 GPUs; the shared-GPU tests need 1)
#   notebooks  notebooks/01_launch.ipynb and 02_checkpointing.ipynb under nbmake
#   launch     python -m bench.launch --device cuda  (NCCL with 2+ GPUs, shared-GPU gloo with 1)
#   overhead   python -m bench.overhead --device cuda
# Ends with one summary table; every stage's full output is in $GPU_CHECK_OUT (gpu_check_out/).
# Exit status: 0 when every stage passed, 1 when one did not, 2 when there is no usable GPU.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${GPU_CHECK_OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ddpkit, not an installed one

GPUS=$("$PY" -c "from ddpkit.devices import cuda_gpus; print(len(cuda_gpus()))" 2>"$OUT/gpus.err")
if [ -z "$GPUS" ] || [ "$GPUS" -lt 1 ]; then
  echo "bench/gpu_check.sh: no usable CUDA GPU here (torch.cuda.is_available() is False or counts 0);"
  echo "nothing to check. Run it on a machine with a GPU and a CUDA build of torch."
  cat "$OUT/gpus.err"
  exit 2
fi
MODE=$([ "$GPUS" -ge 2 ] && echo "NCCL, one GPU per rank" || echo "1 GPU shared by 2 ranks over gloo")

ROWS=()
FAILED=0

# stage NAME LIMIT_S DETAIL_PATTERN CMD...: run CMD under a time limit, keep its output, add a row
stage() {
  local name=$1 limit=$2 pattern=$3; shift 3
  local t0=$SECONDS rc result detail
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) result=pass ;;
    124|137) result="TIMEOUT"; FAILED=1 ;;
    *) result="FAIL (rc $rc)"; FAILED=1 ;;
  esac
  detail=$(grep -E "$pattern" "$OUT/$name.log" | tail -n 2 | tr '\n' ' ' | tr '|' '/' | cut -c1-160)
  [ -z "$detail" ] && detail=$(tail -n 1 "$OUT/$name.log" | tr '|' '/' | cut -c1-160)
  ROWS+=("| $name | $result | $((SECONDS - t0)) | $detail |")
}

stage env 15 "GPU|backend" "$PY" -c '
import torch, ddpkit
from ddpkit.devices import cuda_gpus, resolve_devices
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "not built in"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", nccl)
for i, cap in enumerate(cuda_gpus()):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
print("backend for 2 ranks:", resolve_devices(2))'

stage gpu-tests 130 "passed|failed|error" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider

stage notebooks 80 "passed|failed|error" "$PY" -m pytest -q -p no:cacheprovider --nbmake \
  --nbmake-kernel=python3 --nbmake-timeout=75 notebooks/01_launch.ipynb notebooks/02_checkpointing.ipynb

stage launch 40 "target" "$PY" -m bench.launch --repeat 2 --device cuda

stage overhead 35 "target" "$PY" -m bench.overhead --rounds 1 --steps 8 --device cuda

echo
echo "### ddpkit GPU check: $GPUS GPU(s), $MODE"
echo
echo "| stage | result | seconds | detail |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "Full output of each stage: $OUT/<stage>.log (tests/gpu skips are listed with their reasons there)."
exit $FAILED
