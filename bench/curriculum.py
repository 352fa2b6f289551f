"""Wall time of the whole curriculum under nbmake on this machine (each notebook in a fresh
kernel), as CI runs it.

    python -m bench.curriculum
"""
import subprocess
import sys
import time
from pathlib import Path

from bench._common import machine

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--nbmake", *notebooks, "--durations=0"], cwd=ROOT,
                         capture_output=True, text=True)
    wall = time.monotonic() - t0
    per = [l.split() for l in out.stdout.splitlines() if " call " in l and ".ipynb" in l]
    rows = "\n".join(f"| {p[-1].split('::')[0]} | {p[0]} |" for p in per)
    status = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    text = ("### Curriculum under nbmake (`python -m bench.curriculum`)\n\n"
            f"{len(notebooks)} notebooks, one run. Machine: {machine()}\n\n"
            f"| notebook | wall |\n|---|---|\n{rows}\n\n"
            f"total {wall:.0f} s ({status}); target under 5 minutes: "
            f"{'met' if wall < 300 and out.returncode == 0 else 'MISSED'}\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
