"""Each notebook of the curriculum under nbmake on this machine, one fresh kernel each, as CI runs
them: its time (nbmake's call, the kernel's start included) and the memory its kernel and
everything the kernel started held together at their peak (PSS, so pages the forked ranks share
count once; sampled every 0.2 s). Then the fixed job `ddpkit check` times in a warm re-run, so
the check can scale these times to another machine.

    python -m bench.curriculum                 # prints the facilitator table
    python -m bench.curriculum --write         # and keeps the figures everywhere they are said:
                                               # ddpkit/workshop/timings.json (the check reads
                                               # them), the README's facilitator table and its
                                               # targets row, bench/results.md's section
    python -m bench.curriculum 01_launch ...   # some notebooks only
    python -m bench.curriculum --write 16_step_time ...   # and those rows kept in place of
                                               # their old ones, each with its own date and load
                                               # (said beside the table: measured apart)

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

from bench._common import machine, table
from ddpkit.workshop import curriculum
from ddpkit.workshop.check import launch_and_probe

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ROOT / "ddpkit" / "workshop" / "timings.json"
README_BLOCK = re.compile(r"(<!-- facilitator table: python -m bench.curriculum --write -->\n)"
                          r".*?(<!-- end of the facilitator table -->)", re.S)
README_ROW = re.compile(r"^\| the whole curriculum under nbmake \|.*$", re.M)
RESULTS = ROOT / "bench" / "results.md"
RESULTS_SECTION = re.compile(r"^### Curriculum under nbmake \(`python -m bench.curriculum`\)\n.*?"
                             r"(?=^### )", re.S | re.M)
TARGET_S = 15 * 60  # the README's target for all of them, one after another


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


def total_s(measured):
    return sum(m["seconds"] for m in measured["notebooks"].values())


def readme_row(measured):
    """The README's targets row for the curriculum, from ``measured``."""
    total, n = total_s(measured), len(measured["notebooks"])
    return (f"| the whole curriculum under nbmake | {total:.0f} s ({total / 60:.1f} min) for "
            f"{n} notebooks, one after another (load average {measured['load']}) | "
            f"< {TARGET_S // 60} min |")


def results_section(measured):
    """bench/results.md's section for the curriculum, from ``measured``."""
    rows = [(f"{name}.ipynb", f"{m['seconds']:.1f} s", f"{m['peak_bytes'] / 2**30:.2f} GiB")
            for name, m in measured["notebooks"].items()]
    total = total_s(measured)
    met = "met" if total < TARGET_S else "MISSED"
    apart = [f"{name}.ipynb on {m['date']} (load average {m['load']})"
             for name, m in measured["notebooks"].items() if "date" in m]
    return "\n".join([
        "### Curriculum under nbmake (`python -m bench.curriculum`)", "",
        f"{len(rows)} notebooks, one after another, each in a fresh kernel, on {measured['date']}. "
        f"Machine: {measured['machine']}; load average {measured['load']}. Memory: the kernel "
        f"and its ranks together at their peak (PSS). `python -m bench.curriculum --write` "
        "writes this section, the README's facilitator table and targets row, and "
        "`ddpkit/workshop/timings.json` from one run.", "",
        table(["notebook", "time", "memory"], rows), "",
        *([f"Measured apart from the others, after a change: {', '.join(apart)}.", ""]
          if apart else []),
        f"total {total:.0f} s ({total / 60:.1f} min); target under {TARGET_S // 60} min: {met}",
        "", ""])


def _rewrite(path, pattern, new):
    text, n = pattern.subn(lambda m: new, path.read_text())
    if n != 1:
        raise ValueError(f"{path.name}: {pattern.pattern[:40]!r}... is not there once")
    path.write_text(text)


def write_readme(measured):
    """The README's facilitator table and targets row, and bench/results.md's section, made
    again from ``measured``: every place that says the curriculum's times."""
    readme = ROOT / "README.md"
    text, n = README_BLOCK.subn(
        lambda m: m[1] + curriculum.facilitator_table(measured) + "\n" + m[2], readme.read_text())
    if n != 1:
        raise ValueError("README.md: the facilitator table's two markers are not there once")
    readme.write_text(text)
    _rewrite(readme, README_ROW, readme_row(measured))
    _rewrite(RESULTS, RESULTS_SECTION, results_section(measured))


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
    if write and not failed:
        if chosen:  # these rows in place of their old ones, each saying when it was measured
            rows = {name: dict(row, date=measured["date"], load=measured["load"])
                    for name, row in rows.items()}
            measured = merged(json.loads(TIMINGS.read_text()), rows)
        TIMINGS.write_text(json.dumps(measured, indent=1) + "\n")
        write_readme(measured)
        print(f"\nwritten: {TIMINGS.relative_to(ROOT)}, README.md's facilitator table and "
              "targets row, bench/results.md's section")
    elif write:
        print(f"\nnot written: failed: {failed}")
    return measured


def merged(kept, rows):
    """``kept`` (timings.json) with ``rows`` in place of its rows of those notebooks, in the
    curriculum's order; the machine, load and date it states stay those of its full run."""
    every = {**kept["notebooks"], **rows}
    return dict(kept, notebooks={nb.name: every[nb.name] for nb in curriculum.NOTEBOOKS
                                 if nb.name in every})


if __name__ == "__main__":
    main()
