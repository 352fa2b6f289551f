#!/usr/bin/env bash
# The device check rehearsed on a CPU machine, the way a lent GPU machine runs it:
#
#   bash bench/gpu_wheels.sh && bash bench/gpu_rehearsal.sh
#
# 1. An interpreter like the machines' python3, outside the checkout and kept (DDPKIT_REHEARSAL_ENV,
#    default ~/.cache/ddpkit/image-py312-torch2.11): Python 3.12 (PYTHON312, default python3.12;
#    with pyenv, its version's own, e.g. ~/.pyenv/versions/3.12.1/bin/python3.12),
#    torch==2.11.0 (PyPI's CUDA build; it runs on CPU) and the image's packages the check uses
#    (transformers 5.17, peft, pandas, psutil, cloudpickle, tqdm, pytest, pytest-xdist) and
#    those the carried wheels take from the image (.whl/from-image.txt: attrs, packaging, ...),
#    none of bench/gpu_wheels.txt's. Its pip install lifts a pip constraint capping torch
#    (PIP_CONSTRAINT=/dev/null, for that command only).
# 2. What the device tool sends, copied to a fresh folder: the tracked and untracked-not-ignored
#    files, and .whl (the carried folder).
# 3. bash bench/gpu_check.sh there, with that interpreter as python3, no pip configuration,
#    PIP_NO_INDEX=1 and no find-links: only the carried wheels can be installed. The stage limits
#    are the GPU machine's x2.5 (GPU_CHECK_LIMIT_PERCENT=250, or as set): the notebooks stage
#    runs on CPU ranks here, on 2 cores shared with other work, where the lent machine has 16
#    (175-200 s for notebooks 01 and 02 at load 9-10, against the lent machine's 140 s limit).
# Then checks the table: the CPU stages (wheels, env, notebooks) pass, gpu-tests and the GPU-only
# stages (peak, launch, overhead, step-time) read "no GPU", and the check exits 2 (no GPU). Exit
# status 0 when all that holds, else 1.
set -u
cd "$(dirname "$0")/.."
ENV_DIR=${DDPKIT_REHEARSAL_ENV:-$HOME/.cache/ddpkit/image-py312-torch2.11}
PY312=${PYTHON312:-python3.12}
TREE=${TMPDIR:-/tmp}/ddpkit-gpu-rehearsal
IMAGE_PACKAGES="torch==2.11.0 transformers==5.17.0 peft pandas psutil cloudpickle tqdm numpy pytest pytest-xdist"

if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "bench/gpu_rehearsal.sh: no .whl/*.whl here: run bash bench/gpu_wheels.sh first" >&2
  exit 1
fi
if [ ! -x "$ENV_DIR/bin/python3" ]; then
  echo "== making the image-like interpreter $ENV_DIR ($PY312; log: $ENV_DIR.log)"
  "$PY312" -m venv "$ENV_DIR" >"$ENV_DIR.log" 2>&1 || { tail -n 3 "$ENV_DIR.log" >&2; exit 1; }
fi
# (each time: what the wheels take from the image may have changed; a no-op when all is there)
PIP_CONSTRAINT=/dev/null "$ENV_DIR/bin/python3" -m pip install -q $IMAGE_PACKAGES \
  $(cat .whl/from-image.txt) >>"$ENV_DIR.log" 2>&1 ||
  { echo "bench/gpu_rehearsal.sh: pip install failed: tail $ENV_DIR.log" >&2; exit 1; }
if "$ENV_DIR/bin/python3" -c "import ipywidgets" 2>/dev/null ||
   "$ENV_DIR/bin/python3" -c "import plotly" 2>/dev/null ||
   "$ENV_DIR/bin/python3" -c "import nbmake" 2>/dev/null; then
  echo "bench/gpu_rehearsal.sh: $ENV_DIR has a package the image lacks; make it again" >&2
  exit 1
fi

rm -rf "$TREE"
mkdir -p "$TREE"
git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$TREE"
cp -r .whl "$TREE/.whl"
echo "== $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== sent: $(du -sm "$TREE" | cut -f1) MiB ($(du -sm "$TREE/.whl" | cut -f1) MiB of it .whl;" \
     "the device tool carries 64 MiB); interpreter: $("$ENV_DIR/bin/python3" -c \
     'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")')"

cd "$TREE"
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PYTHONPATH -u GPU_CHECK_OUT -u GPU_CHECK_STAGES \
  PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PATH="$ENV_DIR/bin:$PATH" \
  GPU_CHECK_SITE="$TREE.site" GPU_CHECK_LIMIT_PERCENT=${GPU_CHECK_LIMIT_PERCENT:-250} \
  bash bench/gpu_check.sh 2>&1 | tee "$TREE.out"
rc=${PIPESTATUS[0]}
rm -rf "$TREE.site"

want="wheels=pass env=pass gpu-tests=no GPU notebooks=pass peak=no GPU launch=no GPU overhead=no GPU step-time=no GPU"
got=$(grep -E '^\| [a-z-]+ \|' "$TREE.out" | grep -v '^| stage' |
      awk -F'|' '{gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3); print $2 "=" $3}' | sort)
bad=0
for pair in wheels=pass env=pass "gpu-tests=no GPU" notebooks=pass "peak=no GPU" \
            "launch=no GPU" "overhead=no GPU" "step-time=no GPU"; do
  grep -qxF "$pair" <<<"$got" || { echo "rehearsal: expected '$pair'" >&2; bad=1; }
done
[ "$rc" = 2 ] || { echo "rehearsal: gpu_check.sh exited $rc, not 2 (no GPU)" >&2; bad=1; }
if [ "$bad" = 0 ]; then
  echo "rehearsal: as on a lent machine, without its GPU: $want; exit 2"
fi
exit $bad
