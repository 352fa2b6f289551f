#!/usr/bin/env bash
# The wheel folder bench/gpu_check.sh installs from on a lent GPU machine, where nothing can be
# fetched (the device tool's README, "carrying wheels"):
#
#   bash bench/gpu_wheels.sh            # fills .whl/ (git-ignored), checks it, prints its size
#
# Downloads each wheel of bench/gpu_wheels.txt for CPython 3.12 on x86-64 manylinux, with no
# dependencies (--no-deps: the list names each one), into a fresh .whl/ (one version of each:
# two stop the install there). Then checks, for Python 3.12 on Linux, that every requirement of
# every wheel is either carried or in the image (bench/gpu_image.txt), and that the folder is
# under the device tool's 64 MiB for all it carries. Exit status 1 when either fails. What the
# wheels need from the image is written to .whl/from-image.txt (bench/gpu_rehearsal.sh reads it).
# PYTHON: the interpreter whose pip downloads and which runs the check (needs `packaging`);
# default .venv/bin/python, else python3. GPU_WHEELS_DIR: another folder than .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.whl}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LIMIT_MIB=64
rm -rf "$DEST"
mkdir -p "$DEST"
grep -v '^#' bench/gpu_wheels.txt | grep . | xargs "$PY" -m pip download -q --no-deps \
  --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST"
"$PY" - "$DEST" "$LIMIT_MIB" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest, limit = Path(sys.argv[1]), int(sys.argv[2])
image = {canonicalize_name(line.strip()) for line in Path("bench/gpu_image.txt").read_text().splitlines()
         if line.strip() and not line.startswith("#")}
wheels, from_image = {}, set()
for whl in sorted(dest.glob("*.whl")):
    name = canonicalize_name(parse_wheel_filename(whl.name)[0])
    if name in wheels:
        sys.exit(f"two versions of {name} in {dest}: {wheels[name].name}, {whl.name}")
    wheels[name] = whl
wanted = {canonicalize_name(re.split(r"[=<>!~ ]", line)[0])
          for line in Path("bench/gpu_wheels.txt").read_text().splitlines()
          if line.strip() and not line.startswith("#")}
problems = [f"{n}: listed, not downloaded" for n in sorted(wanted - set(wheels))]
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
for name, whl in wheels.items():
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        need = canonicalize_name(req.name)
        if need not in wheels and need not in image:
            problems.append(f"{name} needs {req}: neither carried nor in the image")
        elif need not in wheels:
            from_image.add(need)
size = sum(w.stat().st_size for w in wheels.values())
print(f"{dest}: {len(wheels)} wheels, {size / 2**20:.1f} MiB (the device tool carries {limit} MiB "
      f"in all); every requirement carried or in the image" if not problems else "")
# what the wheels take from the image (bench/gpu_rehearsal.sh installs these beside torch)
(dest / "from-image.txt").write_text("\n".join(sorted(from_image)) + "\n")
if size >= limit * 2**20:
    problems.append(f"{size / 2**20:.1f} MiB: over the device tool's {limit} MiB")
if problems:
    sys.exit("bench/gpu_wheels.sh:\n  " + "\n  ".join(problems))
EOF
