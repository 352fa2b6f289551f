"""Each notebook of the curriculum under nbmake on this machine, one fresh kernel each, as CI runs
them: its time (nbmake's call, the kernel's start included) and the memory its kernel and
everything the kernel started held together at their peak (PSS, so pages the forked ranks share
count once; sampled every 0.2 s). Then the fixed job `ddpkit check` times in a warm re-run, so
the check can scale these times to another machine.

    python -m bench.curriculum                 # prints the facilitator table
    python -m bench.curriculum --write         # and keeps the figures: ddpkit/workshop/timings.json
                                               # (the check reads them) and the README's table
    python -m bench.curriculum 01_launch ...   # some notebooks only (never written)

Run it on a quiet machine: a facilitator plans with these figures.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from bench._common import machine
from ddpkit.workshop import curriculum
from ddpkit.workshop.check import launch_and_probe

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ROOT / "ddpkit" / "workshop" / "timings.json"
README_BLOCK = re.compile(r"(<!-- facilitator table: python -m bench.curriculum --write -->\n)"
                          r".*?(<!-- end of the facilitator table -->)", re.S)


def _tree_bytes(root):
    total = 0
    try:
        tree = root.children(recursive=True)
    except psutil.Error:  # pytest has just ended
        return 0
    for p in tree:
        try:
            info = p.memory_full_info()
            total += getattr(info, "pss", info.rss)
        except (psutil.Error, OSError):
            pass
    return total


def run_one(nb):
    """(seconds, peak bytes, passed) of one notebook under nbmake in its own pytest."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--nbmake", f"notebooks/{nb.file}", "--durations=0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, root = [0], psutil.Process(proc.pid)

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_bytes(root))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    sampler.join()
    call = [l.split() for l in out.splitlines() if " call " in l and ".ipynb" in l]
    return float(call[0][0].rstrip("s")) if call else float("nan"), peak[0], proc.returncode == 0


def write_readme(measured):
    """The README's facilitator table, made again from ``measured``."""
    readme = ROOT / "README.md"
    text, n = README_BLOCK.subn(
        lambda m: m[1] + curriculum.facilitator_table(measured) + "\n" + m[2], readme.read_text())
    if n != 1:
        raise ValueError("README.md: the facilitator table's two markers are not there once")
    readme.write_text(text)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    write = "--write" in argv
    chosen = [a for a in argv if not a.startswith("--")]
    notebooks = [curriculum.BY_NAME[n] for n in chosen] if chosen else list(curriculum.NOTEBOOKS)
    load_before = os.getloadavg()
    rows, failed = {}, []
    for nb in notebooks:
        seconds, peak, passed = run_one(nb)
        rows[nb.name] = {"seconds": round(seconds, 1), "peak_bytes": peak}
        failed += [] if passed else [nb.name]
        print(f"{nb.name}: {seconds:.1f} s, {peak / 2**30:.2f} GiB"
              f"{'' if passed else ' FAILED'}", flush=True)
    probe = launch_and_probe()[2]
    load = [round(x, 1) for x in (*load_before, *os.getloadavg())]
    measured = {"machine": machine(), "load": f"{load[0]} before, {load[3]} after",
                "date": time.strftime("%Y-%m-%d %H:%M"), "probe_s": round(probe, 4),
                "notebooks": rows}
    print(f"the check's fixed job: {probe:.3f} s; load average {measured['load']}\n")
    if not chosen:
        print(curriculum.facilitator_table(measured))
    if write and not chosen and not failed:
        TIMINGS.write_text(json.dumps(measured, indent=1) + "\n")
        write_readme(measured)
        print(f"\nwritten: {TIMINGS.relative_to(ROOT)} and README.md's facilitator table")
    elif write:
        print("\nnot written: " + ("some notebooks only" if chosen else f"failed: {failed}"))
    return measured


if __name__ == "__main__":
    main()
