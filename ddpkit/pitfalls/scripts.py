"""Pitfalls that need a fresh Python: the code runs the way a notebook kernel holds it (in
``__main__``, with no file), so plain ``mp.spawn`` fails as it does in a notebook. Each script is
kept as a string because it must not be importable: that is the point of the pitfall."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch


_CHILD_ERRORS = ("ProcessRaisedException", "ProcessExitedException")


def _python_main(code, timeout=180):
    """Run code the way a notebook kernel holds it: in ``__main__`` with no ``__file__``.

    ``python -c`` does exactly that. (``python -`` does not: it sets ``__file__ = '<stdin>'``,
    and spawn's children then fail to open '<stdin>' as a script, another error.)
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds ddpkit/
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                          capture_output=True, timeout=timeout, env=env)


def _error_lines(stderr):
    """(child's exception line, parent's exception line) from a traceback-filled stderr."""
    lines = [l.strip() for l in stderr.splitlines()
             if re.match(r"^\s*[\w.]*(Error|Exception): ", l)]
    parent = [l for l in lines if any(c in l for c in _CHILD_ERRORS)]
    child = [l for l in lines if l not in parent]
    return (child[0] if child else None), (parent[-1] if parent else None)


def _subprocess_outcome(out, marker="RETURNS"):
    child, parent = _error_lines(out.stderr)
    if out.returncode == 0:
        line = [l for l in out.stdout.splitlines() if l.startswith(marker)]
        return dict(evidence={"returncode": 0, "returns": line[0][len(marker) + 1:] if line else None})
    err_type, _, text = (child or parent or "").partition(": ")
    return dict(error=text or out.stderr[-2000:], error_type=err_type.rpartition(".")[2] or None,
                evidence={"returncode": out.returncode, "parent_error": parent})


_NOTEBOOK_SPAWN = """
    import torch.multiprocessing as mp

    def work(rank):        # defined in a notebook cell: it lives in __main__, which has no file
        print("rank", rank, "running")

    mp.start_processes(work, nprocs=2, start_method="spawn")
"""


_NOTEBOOK_DDPKIT = """
    import ddpkit

    def work(ctx):         # the same notebook function, sent by value
        return ctx.rank

    print("RETURNS", ddpkit.launch(work, world_size=2, backend="gloo", device="cpu").returns)
"""


_FORK_AFTER_CUDA = """
    import torch, torch.multiprocessing as mp

    torch.zeros(1, device="cuda")      # the kernel touched CUDA (any .cuda() call does)

    def work(rank):
        torch.zeros(1, device="cuda")

    mp.start_processes(work, nprocs=2, start_method="fork")
"""


_SPAWN_AFTER_CUDA = """
    import torch, ddpkit

    torch.zeros(1, device="cuda")

    def work(ctx):
        return str(torch.zeros(1, device="cuda").device)

    print("RETURNS", ddpkit.launch(work, world_size=2, backend="gloo", device="cpu").returns)
"""


def notebook_spawn(lab, fixed):
    return _subprocess_outcome(_python_main(_NOTEBOOK_DDPKIT if fixed else _NOTEBOOK_SPAWN))


def fork_after_cuda(lab, fixed):
    if not torch.cuda.is_available():
        return dict(skipped="needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                            f"(torch {torch.__version__})")
    return _subprocess_outcome(_python_main(_SPAWN_AFTER_CUDA if fixed else _FORK_AFTER_CUDA))
