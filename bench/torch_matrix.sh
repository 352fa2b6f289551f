#!/usr/bin/env bash
# The quick tier on each torch ddpkit supports, on CPU, one version after another (the machine's
# cores go to one run at a time):
#
#   bash bench/torch_matrix.sh                 # torch 2.11.0, 2.13.0 (the default) and 2.15.0
#   bash bench/torch_matrix.sh 2.15.0          # the versions named
#
# Each version runs in a venv of its own, outside the checkout, made on its first use and kept
# (DDPKIT_MATRIX_DIR, default ~/.cache/ddpkit/torch-matrix/torch-X.Y.Z): torch==X.Y.Z and
# ddpkit's dev extras, by the interpreter .ci/setup uses (PYTHON to choose another). The version
# .venv already holds (.ci/setup's torch==2.13.0) runs in .venv. PyPI's Linux torch wheels are
# CUDA builds (with their nvidia-* packages, about 3 GB a version); they run on CPU too, and a
# +cpu build, where the machine's index has one, serves the same way.
# Where a pip constraint file caps torch (these machines' /etc/xdg/pip/constraints.txt caps it at
# 2.14.1), PIP_CONSTRAINT=/dev/null lifts the cap for these installs only; the file is left as is.
#
# Each run: `pytest tests -m "not slow"` with this checkout first on the path; its log is
# $DIR/torch-X.Y.Z.log. Ends with one table (version, torch, seconds, pytest's summary); exit
# status 1 when a version failed or could not be installed.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${DDPKIT_MATRIX_DIR:-$HOME/.cache/ddpkit/torch-matrix}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VERSIONS=("$@")
[ ${#VERSIONS[@]} = 0 ] && VERSIONS=(2.11.0 2.13.0 2.15.0)
mkdir -p "$DIR"
ROWS=()
FAILED=0

env_for() {  # the interpreter that has torch==$1, made if needed; empty when it cannot be made
  local v=$1 venv="$DIR/torch-$1"
  if [ -x .venv/bin/python ] &&
     [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$v" ]; then
    echo .venv/bin/python
    return
  fi
  if [ ! -x "$venv/bin/python" ] ||
     ! "$venv/bin/python" -c "import torch, ddpkit, pytest" >/dev/null 2>&1; then
    echo "== torch $v: making $venv (log: $venv.setup.log)" >&2
    { "$PY" -m venv "$venv" &&
      PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-compile \
        "torch==$v" -e ".[dev]" &&
      "$venv/bin/python" .ci/bytecode.py \
        "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" ddpkit
    } >"$venv.setup.log" 2>&1 || { echo "   failed: tail $venv.setup.log" >&2; return; }
  else  # an editable install points at one checkout: this one, for this run
    "$venv/bin/python" -m pip install -q --no-deps --no-compile -e . >"$venv.setup.log" 2>&1
  fi
  echo "$venv/bin/python"
}

for v in "${VERSIONS[@]}"; do
  py=$(env_for "$v")
  if [ -z "$py" ]; then
    ROWS+=("| $v | - | - | FAIL: could not install (see $DIR/torch-$v.setup.log) |")
    FAILED=1
    continue
  fi
  got=$("$py" -c "import torch; print(torch.__version__)")
  log="$DIR/torch-$v.log"
  echo "== torch $got ($py): pytest tests -m 'not slow' (log: $log)"
  t0=$SECONDS
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest tests -m "not slow" -q \
    -p no:cacheprovider >"$log" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
  counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$log" | tail -n 1 | tr -d '=' | xargs)
  [ "$rc" != 0 ] && FAILED=1
  ROWS+=("| $v | $got | $secs | $([ "$rc" = 0 ] && echo pass || echo "FAIL (rc $rc)"): $counts |")
  echo "   $secs s: ${counts:-no summary; see the log}"
done

echo
echo "### quick tier by torch version (CPU, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo
echo "| torch asked | torch | seconds | result |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit $FAILED
