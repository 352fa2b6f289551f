#!/usr/bin/env bash
# The device check: every CUDA path of ddpkit, in under 5 minutes on a GPU machine.
#
#   bash bench/gpu_check.sh            # from anywhere. A fresh box: runs .ci/setup first
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# Stages, one line each at the bottom (`stage NAME LIMIT_S DETAIL_PATTERN CMD...`; `stage_bg`
# runs one beside the next ones until `join`). Their limits add up to at most 300 s, sized from
# CPU times measured on 2 cores and from the ranks each stage starts (see "Limits" below).
#   env        torch, CUDA, cuDNN, NCCL, each GPU's name and capability, the backend ddpkit picks,
#              the SDPA kernel the estimate assumes for notebook 02's GPT
#   gpu-tests  pytest tests/gpu (NCCL tests need 2 GPUs; the shared-GPU tests need 1)
#   notebooks  notebooks/01_launch.ipynb and 02_checkpointing.ipynb under nbmake (beside gpu-tests)
#   launch     python -m bench.launch --worlds 2 --device cuda (NCCL with 2+ GPUs, shared-GPU gloo with 1)
#   overhead   python -m bench.overhead --device cuda
# Ends with one summary table (paste it into bench/results.md); each stage's full output is in
# $GPU_CHECK_OUT (gpu_check_out/). A stage whose tests all skipped reads "skipped", not "pass".
# Exit status: 0 when every stage passed or skipped, 1 when one failed or ran out of time (or
# the interpreter does not work), 2 when there is no usable GPU.
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ddpkit, not an installed one

if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then
  echo "== setup: no .venv here; bash .ci/setup (keeps a CUDA torch it finds; log: $OUT/setup.log)"
  if ! bash .ci/setup >"$OUT/setup.log" 2>&1; then
    echo "bench/gpu_check.sh: bash .ci/setup failed, nothing was checked:" >&2
    tail -n 15 "$OUT/setup.log" >&2
    exit 1
  fi
fi
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

# the interpreter first: a Python that fails is not "no GPU"
GPUS=$("$PY" -c "from ddpkit.devices import cuda_gpus; print(len(cuda_gpus()))" 2>"$OUT/gpus.err")
rc=$?
if [ "$rc" != 0 ]; then
  echo "bench/gpu_check.sh: the interpreter '$PY' failed (exit status $rc) asking for the GPUs;" >&2
  if [ -s "$OUT/gpus.err" ]; then
    echo "its error:" >&2
    tail -n 5 "$OUT/gpus.err" >&2
  else
    echo "it printed no error." >&2
  fi
  echo "Pass PYTHON=/path/to/python (with torch and ddpkit's test tools: bash .ci/setup), or run from a checkout with .venv." >&2
  exit 1
fi
if ! [[ "$GPUS" =~ ^[0-9]+$ ]]; then
  echo "bench/gpu_check.sh: '$PY' answered '$GPUS' for the GPU count, not a number." >&2
  exit 1
fi
if [ "$GPUS" -lt 1 ]; then
  echo "bench/gpu_check.sh: no usable CUDA GPU here ('$PY': torch.cuda.is_available() is False"
  echo "or counts 0); nothing to check. Run it on a machine with a GPU and a CUDA build of torch."
  exit 2
fi
MODE=$([ "$GPUS" -ge 2 ] && echo "NCCL, one GPU per rank" || echo "1 GPU shared by 2 ranks over gloo")

# Limits. Measured on CPU (2 cores shared with other work, load about 6, torch 2.13.0+cpu):
# a cold 2-rank launch 3.6 s and a 3-step tiny GPT train 7.7 s; with 9 ranks 13 s and 33 s;
# notebooks 01 and 02 under nbmake 58 s and 56 s; bench.launch --repeat 2 59 s; bench.overhead
# --rounds 1 --steps 8 25 s. A GPU box has cores for every rank, and each rank pays CUDA's and
# NCCL's start-up (a few seconds). tests/gpu starts 20 runs: 17 of 1-2 ranks, 3 of GPUs+1 ranks
# (the shared-GPU runs), so its limit grows with the GPU count; capped so the whole stays <= 300.
# The sequential stages' limits plus 5 s of grace each (timeout's --kill-after) add up to 300 s.
# bench.peak --device cuda (two GPT-2 small runs, 3 steps each, and their simulations, about
# 30 s on CPU for the simulations) runs beside them, like the notebooks.
# GPU_CHECK_LIMIT_PERCENT scales every limit (tests/test_gpu_check.py runs the script that way).
RANKS=$((GPUS + 1))
L_ENV=20 L_NB=120 L_LAUNCH=50 L_OVERHEAD=35 L_PEAK=120
L_TESTS=$((100 + 10 * RANKS))
CAP=$((300 - L_ENV - L_LAUNCH - L_OVERHEAD - 4 * 5))
[ "$L_TESTS" -gt "$CAP" ] && L_TESTS=$CAP
scale() { local v=$(( $1 * ${GPU_CHECK_LIMIT_PERCENT:-100} / 100 )); echo $(( v < 1 ? 1 : v )); }
L_ENV=$(scale $L_ENV) L_NB=$(scale $L_NB) L_LAUNCH=$(scale $L_LAUNCH)
L_OVERHEAD=$(scale $L_OVERHEAD) L_TESTS=$(scale $L_TESTS) L_PEAK=$(scale $L_PEAK)

ROWS=()
FAILED=0
BG=()

# stage NAME LIMIT_S DETAIL_PATTERN CMD...: run CMD under a time limit, keep its output, add a row
stage() {
  _run "$@"
  _row "$1"
}

# stage_bg: the same, in the background, beside the stages after it; `join` collects its row
stage_bg() {
  _run "$@" &
  BG+=("$1")
}

join() {
  wait
  for name in "${BG[@]}"; do _row "$name"; done
  BG=()
}

_run() {
  local name=$1 limit=$2 pattern=$3; shift 3
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*"
  echo "$pattern" >"$OUT/$name.pattern"
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - t0)) $limit" >"$OUT/$name.rc"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "!! TIMEOUT: stage '$name' ran past its ${limit} s limit and was stopped; its output so far: $OUT/$name.log" >&2
  fi
}

_row() {
  local name=$1 rc secs limit result detail pattern counts
  read -r rc secs limit <"$OUT/$name.rc"
  pattern=$(cat "$OUT/$name.pattern")
  counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)" "$OUT/$name.log" | tail -n 1)
  case $rc in
    0) if [[ "$counts" == *skipped* && "$counts" != *passed* ]]; then result=skipped
       else result=pass; fi ;;
    124|137) result="TIMEOUT (limit ${limit}s)"; FAILED=1 ;;
    *) result="FAIL (rc $rc)"; FAILED=1 ;;
  esac
  detail=$(grep -E "$pattern" "$OUT/$name.log" | tail -n 2 | tr '\n' ' ' | tr '|' '/' | cut -c1-160)
  [ -z "$detail" ] && detail=$(tail -n 1 "$OUT/$name.log" | tr '|' '/' | cut -c1-160)
  ROWS+=("| $name | $result | $secs | $detail |")
}

stage env "$L_ENV" "GPU|backend|SDPA" "$PY" -c '
import torch, ddpkit
from ddpkit.devices import cuda_gpus, resolve_devices
from ddpkit.predict import attention
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "not built in"
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", cudnn, "NCCL", nccl)
for i, cap in enumerate(cuda_gpus()):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
print("backend for 2 ranks:", resolve_devices(2))
q, k, v = torch.empty(4, 32, 96, device="meta").view(4, 32, 3, 4, 8).permute(2, 0, 3, 1, 4)
print("SDPA kernel the estimate assumes for notebook 02 GPT (fp32):",
      attention.cuda_kernel(q, k, v, attention.run_target(2), is_causal=True))'

stage_bg gpu-tests "$L_TESTS" "passed|failed|error|skipped" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider
stage_bg notebooks "$L_NB" "passed|failed|error" "$PY" -m pytest -q -p no:cacheprovider --nbmake \
  --nbmake-kernel=python3 --nbmake-timeout="$L_NB" notebooks/01_launch.ipynb notebooks/02_checkpointing.ipynb
# the step's peak, measured by max_memory_allocated beside the simulated prediction: two rows
# of bench.peak's table (GPT-2 small), memory only, so it runs beside the tests
stage_bg peak "$L_PEAK" "worst|within 3%" "$PY" -m bench.peak --device cuda
join

# timings last, alone on the machine
stage launch "$L_LAUNCH" "target" "$PY" -m bench.launch --repeat 2 --worlds 2 --device cuda
stage overhead "$L_OVERHEAD" "target" "$PY" -m bench.overhead --rounds 1 --steps 8 --device cuda
stage step-time "$(scale 240)" "mean absolute|calibrated" "$PY" -m bench.gpu_step_time

echo
echo "### ddpkit GPU check: $GPUS GPU(s), $MODE"
echo
echo "| stage | result | seconds | detail |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "Full output of each stage: $OUT/<stage>.log (tests/gpu skips are listed with their reasons there)."
if [ "$FAILED" != 0 ]; then
  echo "bench/gpu_check.sh: a stage failed or ran out of time (see the table above)." >&2
fi
exit $FAILED
