#!/usr/bin/env bash
# The device check: every CUDA path of ddpkit, in under 8 minutes, on a GPU machine as it is.
#
#   bash bench/gpu_check.sh            # from anywhere
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#   GPU_CHECK_STAGES="env gpu-tests" bash bench/gpu_check.sh      # only the stages named
#
# The lent GPU machines (the device tool's KINDS.md): python3 is Python 3.12 with torch 2.11.0+cu130
# and no ipywidgets, plotly, anywidget, nbmake or jupyter packages, and nothing can be fetched
# there. So nothing is installed from an index: the interpreter is PYTHON, else .venv/bin/python
# where a checkout has one, else python3 with its own torch; ddpkit is this checkout, on the path;
# what the stages import and the interpreter lacks comes from the wheel folder .whl, which
# `bash bench/gpu_wheels.sh` fills here (cp312 manylinux wheels, git-ignored, under 64 MiB) and
# the device tool carries:
#   run(command="bash bench/gpu_check.sh; rc=$?; tar czf $OUT/gpu_check.tgz gpu_check_out; exit $rc",
#       carry=[".whl"], timeout_s=540)
# bench/gpu_rehearsal.sh runs all this on a CPU machine (Python 3.12, torch 2.11.0, no index, only
# the carried wheels).
#
# Stages, one line each at the bottom (`stage NAME LIMIT_S DETAIL_PATTERN CMD...`; `stage_bg`
# runs one beside the next ones until `join`):
#   wheels     pip install --no-index --no-deps --target $GPU_CHECK_SITE .whl/*.whl, when the
#              interpreter lacks one of NEEDED (none missing: "nothing missing")
#   env        torch, CUDA, cuDNN, NCCL, each GPU's name and capability, the backend ddpkit picks,
#              the SDPA kernel the estimate assumes for notebook 02's GPT; the GPU count
#   gpu-tests  pytest tests/gpu (NCCL tests need 2 GPUs; the shared-GPU tests need 1)
#   notebooks  notebooks/01_launch.ipynb and 02_checkpointing.ipynb under nbmake (beside gpu-tests)
#   peak       python -m bench.peak --device cuda (beside gpu-tests)
#   launch     python -m bench.launch --worlds 2 --device cuda (NCCL with 2+ GPUs, shared-GPU gloo with 1)
#   overhead   python -m bench.overhead --device cuda
#   step-time  python -m bench.gpu_step_time: predicted beside measured step times on the GPUs
# Without a GPU the CPU stages (wheels, env, gpu-tests: its tests skip with their reasons,
# notebooks: on CPU ranks) run and the GPU-only ones (peak, launch, overhead, step-time) read
# "no GPU".
# Ends with one summary table (paste it into bench/results.md); each stage's full output is in
# $GPU_CHECK_OUT (gpu_check_out/). A stage whose tests all skipped reads "skipped", not "pass".
# Exit status: 0 when every stage passed or skipped, 1 when one failed or ran out of time (or
# the interpreter does not work), 2 when there is no usable GPU (the CPU stages passed).
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu_check_out}
SITE_DIR=${GPU_CHECK_SITE:-/tmp/ddpkit-gpu-check-site}  # the carried wheels, installed
WHEEL_DIR=${GPU_CHECK_WHEELS:-.whl}
NEEDED="ipywidgets plotly anywidget nbmake ipykernel"  # imported by the stages; not in the image
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ddpkit, not an installed one
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
T_START=$SECONDS

# Limits, in seconds. The sequential path (wheels, env, the longest of the three stages run side
# by side, launch, overhead, step-time) plus 5 s of grace each (timeout's --kill-after) is 475 s
# (printed as "worst case" at the start): the whole check ends inside 8 minutes even when every
# stage runs to its limit, leaving the device tool's 600 s call a margin. Measured on CPU (2 cores
# shared with other work, load 6-10, torch 2.13.0+cpu): a cold 2-rank launch 3.6 s and a 3-step
# tiny GPT train 7.7 s; notebooks 01 and 02 under nbmake 58 s and 56 s; bench.launch --repeat 2
# 59 s; bench.overhead --rounds 1 --steps 8 25 s; the wheels' install 11 s and env 6 s (the
# rehearsal, Python 3.12 + torch 2.11). On the GPU machine (16 cores, one GPU) each rank also
# starts CUDA (a context, ~1-3 s) and, on NCCL, a communicator, and the first import of a CUDA
# torch reads ~3 GB of libraries from a cold disk: env gets 40 s; launch (about a dozen cold
# starts of 2 ranks, each paying that; its CPU run took 59 s on 2 loaded cores) 75 s; overhead
# (one pool, 8 steps) 45 s; the three side-by-side stages (tests/gpu: on one GPU the shared-GPU
# runs, the NCCL ones skip; the notebooks; bench.peak's two GPT-2 runs) 140 s each; step-time
# (bench.gpu_step_time: a GPU calibration on one warm rank, three GPT-2-small-sized runs of 12
# steps, six simulated steps on 16 cores; each config's row is printed as it is done, so a
# timeout keeps those) 120 s. GPU_CHECK_LIMIT_PERCENT scales every limit (tests/test_gpu_check.py
# runs the script so).
L_WHEELS=25 L_ENV=40 L_TESTS=140 L_NB=140 L_PEAK=140 L_LAUNCH=75 L_OVERHEAD=45 L_STEPTIME=120
scale() { local v=$(( $1 * ${GPU_CHECK_LIMIT_PERCENT:-100} / 100 )); echo $(( v < 1 ? 1 : v )); }
L_WHEELS=$(scale $L_WHEELS) L_ENV=$(scale $L_ENV) L_TESTS=$(scale $L_TESTS) L_NB=$(scale $L_NB)
L_PEAK=$(scale $L_PEAK) L_LAUNCH=$(scale $L_LAUNCH) L_OVERHEAD=$(scale $L_OVERHEAD)
L_STEPTIME=$(scale $L_STEPTIME)
SIDE=$L_TESTS; for l in $L_NB $L_PEAK; do [ "$l" -gt "$SIDE" ] && SIDE=$l; done
echo "== limits: worst case $((L_WHEELS + L_ENV + SIDE + L_LAUNCH + L_OVERHEAD + L_STEPTIME + 6 * 5)) s" \
     "(each stage's limit on the sequential path, plus 5 s of grace each)"

ROWS=()
FAILED=0
BG=()
N_GPUS=
wanted() { [ -z "${GPU_CHECK_STAGES:-}" ] || [[ " $GPU_CHECK_STAGES " == *" $1 "* ]]; }

# stage NAME LIMIT_S DETAIL_PATTERN CMD...: run CMD under a time limit, keep its output, add a row
stage() {
  wanted "$1" || return 0
  _run "$@"
  _row "$1"
}

# stage_bg: the same, in the background, beside the stages after it; `join` collects its row
stage_bg() {
  wanted "$1" || return 0
  _run "$@" &
  BG+=("$1")
}

join() {
  wait
  for name in "${BG[@]}"; do _row "$name"; done
  BG=()
}

# gpu_stage: a stage that needs a GPU; without one, its row says so and nothing runs
gpu_stage() {
  wanted "$1" || return 0
  if [ "$N_GPUS" = 0 ]; then ROWS+=("| $1 | no GPU | 0 | not run: it needs a CUDA GPU |"); return; fi
  stage "$@"
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
    0) if [ "$N_GPUS" = 0 ] && [ "$name" = gpu-tests ]; then result="no GPU"
       elif [[ "$counts" == *skipped* && "$counts" != *passed* ]]; then result=skipped
       else result=pass; fi ;;
    124|137) result="TIMEOUT (limit ${limit}s)"; FAILED=1 ;;
    *) result="FAIL (rc $rc)"; FAILED=1 ;;
  esac
  detail=$(grep -E "$pattern" "$OUT/$name.log" | tail -n 2 | tr '\n' ' ' | tr '|' '/' | cut -c1-160)
  [ -z "$detail" ] && detail=$(tail -n 1 "$OUT/$name.log" | tr '|' '/' | cut -c1-160)
  ROWS+=("| $name | $result | $secs | $detail |")
}

# the interpreter first: a Python that fails is not "no GPU"
missing=$("$PY" -c "import importlib.util as u, sys
print(' '.join(n for n in sys.argv[1:] if u.find_spec(n) is None))" $NEEDED 2>"$OUT/python.err")
rc=$?
if [ "$rc" != 0 ]; then
  echo "bench/gpu_check.sh: the interpreter '$PY' failed (exit status $rc);" >&2
  if [ -s "$OUT/python.err" ]; then
    echo "its error:" >&2
    tail -n 5 "$OUT/python.err" >&2
  else
    echo "it printed no error." >&2
  fi
  echo "Pass PYTHON=/path/to/python (a Python with torch), or run from a checkout with .venv." >&2
  exit 1
fi

# what the image lacks, from the carried wheels (pip reads no index: --no-index, the files named)
if [ -z "$missing" ]; then
  wanted wheels && ROWS+=("| wheels | pass | 0 | nothing missing ($NEEDED importable) |")
elif compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
  stage wheels "$L_WHEELS" "^Successfully installed|ERROR" "$PY" -m pip install --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --disable-pip-version-check \
    --target "$SITE_DIR" "$WHEEL_DIR"/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE_DIR"  # after the checkout and the interpreter's own path
else
  echo "bench/gpu_check.sh: '$PY' lacks $missing and there is no $WHEEL_DIR/*.whl to install them" \
       "from: run bash bench/gpu_wheels.sh where pip works, and carry $WHEEL_DIR." >&2
  wanted wheels && ROWS+=("| wheels | FAIL | 0 | $missing missing, no $WHEEL_DIR/*.whl (bash bench/gpu_wheels.sh) |")
  FAILED=1
fi

# the environment and the GPU count (the interpreter's first torch import)
stage env "$L_ENV" "GPU|backend|SDPA" "$PY" -c '
import torch, ddpkit
from ddpkit.devices import cuda_gpus, resolve_devices
from ddpkit.predict import attention
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "not built in"
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", cudnn, "NCCL", nccl)
gpus = cuda_gpus()
for i, cap in enumerate(gpus):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
print("backend for 2 ranks:", resolve_devices(2))
target = attention.run_target(2)
if target is None:
    print("SDPA kernel the estimate assumes for notebook 02 GPT: none, no GPU (CPU ranks)")
else:
    q, k, v = torch.empty(4, 32, 96, device="meta").view(4, 32, 3, 4, 8).permute(2, 0, 3, 1, 4)
    print("SDPA kernel the estimate assumes for notebook 02 GPT (fp32):",
          attention.cuda_kernel(q, k, v, target, is_causal=True))
print("GPUS", len(gpus))'
if wanted env; then
  read -r rc _ <"$OUT/env.rc"
  N_GPUS=$(sed -n 's/^GPUS \([0-9][0-9]*\)$/\1/p' "$OUT/env.log" | tail -n 1)
  if [ "$rc" != 0 ] || [ -z "$N_GPUS" ]; then
    echo "bench/gpu_check.sh: the interpreter '$PY' failed (exit status $rc) asking for torch and" \
         "the GPUs; its output ($OUT/env.log) ends:" >&2
    tail -n 5 "$OUT/env.log" >&2
    exit 1
  fi
else
  N_GPUS=$("$PY" -c "from ddpkit.devices import cuda_gpus; print(len(cuda_gpus()))") || exit 1
fi
MODE=$([ "$N_GPUS" -ge 2 ] && echo "NCCL, one GPU per rank" ||
       ([ "$N_GPUS" = 1 ] && echo "1 GPU shared by 2 ranks over gloo" || echo "no GPU: the CPU stages only"))

stage_bg gpu-tests "$L_TESTS" "passed|failed|error|skipped" "$PY" -m pytest tests/gpu -q -rs \
  -p no:cacheprovider
stage_bg notebooks "$L_NB" "passed|failed|error" "$PY" -m pytest -q -p no:cacheprovider --nbmake \
  --nbmake-kernel=python3 --nbmake-timeout="$L_NB" notebooks/01_launch.ipynb notebooks/02_checkpointing.ipynb
# the step's peak, measured by max_memory_allocated beside the simulated prediction: two rows
# of bench.peak's table (GPT-2 small), memory only, so it runs beside the tests
[ "$N_GPUS" != 0 ] && stage_bg peak "$L_PEAK" "worst|within 3%" "$PY" -m bench.peak --device cuda
join
[ "$N_GPUS" = 0 ] && gpu_stage peak

# timings last, alone on the machine
gpu_stage launch "$L_LAUNCH" "target" "$PY" -m bench.launch --repeat 2 --worlds 2 --device cuda
gpu_stage overhead "$L_OVERHEAD" "target" "$PY" -m bench.overhead --rounds 1 --steps 8 --device cuda
gpu_stage step-time "$L_STEPTIME" "mean absolute|calibrated" "$PY" -m bench.gpu_step_time

echo
echo "### ddpkit GPU check: $N_GPUS GPU(s), $MODE; $("$PY" -c 'import torch, sys; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")' 2>/dev/null); $((SECONDS - T_START)) s in all"
echo
echo "| stage | result | seconds | detail |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "Full output of each stage: $OUT/<stage>.log (tests/gpu skips are listed with their reasons there)."
if [ "$FAILED" != 0 ]; then
  echo "bench/gpu_check.sh: a stage failed or ran out of time (see the table above)." >&2
  exit 1
fi
if [ "$N_GPUS" = 0 ]; then
  echo "bench/gpu_check.sh: no usable CUDA GPU here ('$PY': torch.cuda.is_available() is False"
  echo "or counts 0): the CPU stages ran; run it on a machine with a GPU and a CUDA build of torch."
  exit 2
fi
exit 0
