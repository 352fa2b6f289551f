"""``ddpkit check``: can this machine run the curriculum? Asked in seconds, before a workshop.

One line per check as it finishes (stderr), then one table, one verdict ("ready", "ready,
notebooks 12 and 13 will take about N min", or what to fix, each with its fix) and the exit
code (0 ready, 1 not); ``--json`` prints the same as one JSON object for a facilitator
collecting the room's results. The checks: Python and torch (version, build, CUDA),
``torch.distributed`` with gloo, the cores and free memory against what the notebooks were
measured to need, the loopback rendezvous (a free port bound on 127.0.0.1 and connected to), a
real 2-rank gloo launch with ddpkit's own `Pool` and a warm re-run of a fixed job (timed: how
much slower than the machine that timed the notebooks, so their times can be scaled), JupyterLab
and its kernel, the widget front-ends and transformers/peft (`packages`).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import socket
import sys
import time

from ..devices import cuda_gpus
from . import curriculum, packages

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"
BROKEN_FIX = f"reinstall ddpkit and what it needs: {packages.LAB_FIX}"  # a check that broke
PROBE_ROUNDS = 60  # the warm re-run's fixed job: about 0.2 s of matmuls and all-reduces


@dataclasses.dataclass
class Row:
    name: str
    status: str  # ok | warn (runs, with a note) | fail (to fix) | skipped (a row above failed)
    found: str
    fix: str = ""
    seconds: float = 0.0


def python_row(ctx):
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    try:
        wanted = SpecifierSet(metadata.metadata("ddpkit")["Requires-Python"] or "")
    except metadata.PackageNotFoundError:
        wanted = SpecifierSet(">=3.10")
    found = (f"{platform.python_version()} ({platform.python_implementation()}, "
             f"{platform.system()} {platform.machine()})")
    if platform.python_version() not in wanted:
        return FAIL, found, f"use a Python {wanted} (python.org, or conda) and a fresh venv"
    return OK, found, ""


def torch_row(ctx):
    try:
        import torch
    except ImportError as exc:
        return FAIL, f"torch cannot be imported: {exc}", "pip install torch"
    problem = packages.versions_problem(("torch",), packages.ddpkit_requires(),
                                        "pip install -U torch")
    build = (f"CUDA {torch.version.cuda} build" if torch.version.cuda
             else f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None)
             else "CPU build")
    gpus = cuda_gpus()  # NVML: no CUDA context is made here
    seen = (f"{len(gpus)} GPU(s), compute capability " + ", ".join(f"{a}.{b}" for a, b in gpus)
            if gpus else "no GPU: ranks run on CPU with gloo")
    if problem:
        return FAIL, *problem[1:]
    return OK, f"{torch.__version__}, {build}; {seen}", ""


def distributed_row(ctx):
    import torch.distributed as dist

    fix = ("this torch was built without distributed support (USE_DISTRIBUTED=0, as some "
           "source and conda builds are): install PyTorch's own wheel, pip install --force-"
           "reinstall torch --index-url https://download.pytorch.org/whl/cpu")
    if not dist.is_available():
        return FAIL, "torch.distributed is not available in this torch", fix
    if not dist.is_gloo_available():
        return FAIL, "torch.distributed has no gloo backend", fix
    ctx["distributed"] = True
    return OK, "available, with gloo" + (", NCCL" if dist.is_nccl_available() else ""), ""


def cores_row(ctx):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    found = f"{cores} core(s) for this process"
    if cores < 2:
        return WARN, found, "the notebooks' 2 ranks share one core: every notebook runs, slower"
    return OK, found + ("" if cores >= 4 else "; notebook 15 runs 4 ranks on them (fine)"), ""


def memory_row(ctx):
    """Too little for a notebook of the short track: to fix; for others only: a note naming
    them (the rest of the curriculum runs)."""
    import psutil

    free = psutil.virtual_memory().available
    need = curriculum.memory_needed()
    over = [curriculum.BY_NAME[n] for n, b in need.items() if b > free]
    found = (f"{free / curriculum.GiB:.1f} GiB available; the notebooks need up to "
             f"{max(need.values()) / curriculum.GiB:.1f} GiB")
    if not over:
        return OK, found, ""
    most = max(need[nb.name] for nb in over)
    fix = (f"free {(most - free) / curriculum.GiB:.1f} GiB (close other programs) for "
           f"notebook{'s' if len(over) > 1 else ''} {curriculum.numbers(over)}, or skip "
           f"{'them' if len(over) > 1 else 'it'}")
    track = {name for name, _ in curriculum.SHORT_TRACK}
    return (FAIL if any(nb.name in track for nb in over) else WARN), found, fix


def loopback_row(ctx):
    """The ranks meet on 127.0.0.1: a port the OS picks, bound, listened on and connected to."""
    try:
        with socket.socket() as server, socket.socket() as client:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            client.settimeout(5)
            client.connect(("127.0.0.1", port))
            server.accept()[0].close()
    except OSError as exc:
        return (FAIL, f"no port on 127.0.0.1: {exc}",
                "let Python listen on 127.0.0.1 (a firewall or sandbox forbids it; on Linux "
                "bring loopback up: sudo ip link set lo up)")
    ctx["loopback"] = True
    return OK, f"127.0.0.1:{port} bound, listened on and connected to", ""


def _hello(ctx):
    """Every rank's all-reduce of its rank + 1: 3 on each of 2 ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _probe(ctx, rounds=PROBE_ROUNDS):
    """A fixed job of matmuls and all-reduces; its seconds on this rank."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    for _ in range(rounds):
        a = torch.tanh(a @ a)
        dist.all_reduce(a)
        a /= ctx.world_size
    return time.perf_counter() - t


def launch_and_probe():
    """A real 2-rank gloo launch on loopback with ddpkit's `Pool`, then warm re-runs of
    `_probe`: (cold start and first run s, one warm re-run s, the probe's s: best of 3)."""
    # the launch is the last check: where the runtime cannot even be imported (a torch without
    # torch.distributed), every check before it has still been made and reported
    from ..runtime.pool import Pool, shutdown

    t = time.monotonic()
    try:
        with Pool(world_size=2, backend="gloo", device="cpu") as pool:
            summed = pool.launch(_hello, stall_timeout_s=60).returns
            if summed != [3.0, 3.0]:
                raise RuntimeError(f"an all-reduce of 1 and 2 gave {summed} on the 2 ranks")
            cold = time.monotonic() - t
            t = time.monotonic()
            pool.launch(_hello, stall_timeout_s=60)
            warm = time.monotonic() - t
            probe = min(max(pool.launch(_probe, stall_timeout_s=60).returns) for _ in range(3))
    finally:
        shutdown()  # the forkserver too: nothing is left running
    return cold, warm, probe


def launch_row(ctx):
    if not (ctx.get("distributed") and ctx.get("loopback")):
        return SKIPPED, "needs torch.distributed and the loopback port (above)", ""
    try:
        cold, warm, probe = launch_and_probe()
    except Exception as exc:
        return (FAIL, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}",
                "the error names the rank that failed and why; send `ddpkit check --json` "
                "to your facilitator")
    ref = curriculum.timings()["probe_s"]
    ctx["factor"] = probe / ref
    return OK, (f"2 ranks: cold start {cold:.1f} s, warm re-run {1000 * warm:.0f} ms; a fixed "
                f"job {probe:.2f} s ({probe / ref:.1f}x the machine that timed the notebooks)"), ""


CHECKS = (("python", python_row), ("torch", torch_row), ("torch.distributed", distributed_row),
          ("cores", cores_row), ("memory", memory_row), ("loopback", loopback_row),
          ("2-rank launch", launch_row), ("jupyterlab", packages.jupyterlab_row),
          ("kernel", packages.kernel_row), ("widgets", packages.widgets_row),
          ("transformers/peft", packages.hf_row))
# These need nothing from the rows above (no ctx) and spend their time importing (plotly,
# jupyter_client): they run on a thread beside the others, while the launch waits for its ranks.
BESIDE = {"jupyterlab", "kernel", "widgets", "transformers/peft"}


def _timed(check, *args):
    t = time.monotonic()
    try:
        status, found, fix = check(*args)
    except Exception as exc:  # a check that breaks is a finding, not a crash
        status, found, fix = FAIL, f"{type(exc).__name__}: {exc}", BROKEN_FIX
    return status, found, fix, round(time.monotonic() - t, 2)


def run(progress=None):
    """Every check, one line each on ``progress`` (stderr) in order as it ends; a `Report`."""
    from concurrent.futures import ThreadPoolExecutor

    progress = progress or sys.stderr
    ctx, rows, t0 = {}, [], time.monotonic()
    with ThreadPoolExecutor(1) as side:  # one after another, beside the main thread
        ahead = {name: side.submit(_timed, check) for name, check in CHECKS if name in BESIDE}
        for i, (name, check) in enumerate(CHECKS, 1):
            row = Row(name, *(ahead[name].result() if name in BESIDE else _timed(check, ctx)))
            rows.append(row)
            print(f"[{i:2d}/{len(CHECKS)}] {name:<18} {row.status:<7} {row.found}",
                  file=progress, flush=True)
    return Report(rows, ctx.get("factor"), round(time.monotonic() - t0, 1))


@dataclasses.dataclass
class Report:
    rows: list
    factor: float | None  # this machine's probe time over the reference machine's
    seconds: float

    @property
    def ready(self):
        return not any(r.status == FAIL for r in self.rows)

    @property
    def verdict(self):
        if not self.ready:
            names = [r.name for r in self.rows if r.status == FAIL]
            return f"not ready: fix {', '.join(names)} (below)"
        est = curriculum.estimate_s(self.factor or 1.0)
        long = [curriculum.BY_NAME[n] for n, s in est.items() if s >= curriculum.LONG_S]
        notes = "; see the notes below" if any(r.status == WARN for r in self.rows) else ""
        if not long:
            return "ready" + notes
        minutes = max(1, round(sum(est[nb.name] for nb in long) / 60))
        return (f"ready, notebook{'s' if len(long) > 1 else ''} {curriculum.numbers(long)} "
                f"will take about {minutes} min{notes}")

    def table(self):
        width = max(len(r.name) for r in self.rows)
        lines = [f"{'check':<{width}}  {'status':<7}  found", "-" * (width + 60)]
        lines += [f"{r.name:<{width}}  {r.status:<7}  {r.found}" for r in self.rows]
        fixes = [r for r in self.rows if r.fix and r.status in (FAIL, WARN)]
        if fixes:
            lines.append("")
            lines += [f"{'to fix' if r.status == FAIL else 'note'}: {r.name}: {r.fix}"
                      for r in fixes]
        lines += ["", f"verdict: {self.verdict} (checked in {self.seconds:.0f} s)"]
        return "\n".join(lines)

    def as_json(self):
        return {"ready": self.ready, "verdict": self.verdict, "seconds": self.seconds,
                "ddpkit": curriculum.version(), "python": sys.version.split()[0],
                "platform": platform.platform(), "speed_vs_reference": self.factor,
                "checks": [dataclasses.asdict(r) for r in self.rows]}
