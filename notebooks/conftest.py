"""Each notebook runs in a fresh kernel under nbmake; one that leaves a process behind fails.

After a notebook's kernel has shut down, no process that was started while it ran may still be
alive (ranks notice a dead kernel within a second and exit: launcher docs)."""
import os
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def _ours(p):
    """Started from this checkout by this pytest worker: a rank inherits its kernel's working
    folder (the notebook's) and environment, also once it is orphaned; another checkout's runs,
    and the notebooks another xdist worker runs at the same time, are not ours."""
    try:
        return (Path(p.cwd()).resolve().is_relative_to(ROOT)
                and p.environ().get("PYTEST_XDIST_WORKER", "") == WORKER)
    except (psutil.Error, OSError):
        return False


def _spawned():
    """Ranks, spawned or forked from a forkserver, and the forkserver itself (which ends when
    its kernel does)."""
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        started = "multiprocessing.spawn" in cmd or "multiprocessing.forkserver" in cmd
        if started and "resource_tracker" not in cmd and _ours(p):
            out.add(p.info["pid"])
    return out


def pytest_runtest_setup(item):
    item.stash[_KEY] = _spawned()


def pytest_runtest_teardown(item, nextitem):
    before = item.stash.get(_KEY, set())
    deadline = time.monotonic() + 5
    while True:
        left = []
        for pid in _spawned() - before:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{item.name} left rank processes behind: {left}")
        time.sleep(0.2)


_KEY = pytest.StashKey[set]()
