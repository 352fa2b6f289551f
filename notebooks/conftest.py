"""Each notebook runs in a fresh kernel under nbmake; one that leaves a process behind fails.

After a notebook's kernel has shut down, no process that was started while it ran may still be
alive (ranks notice a dead kernel within a second and exit: launcher docs).

Each notebook also gets a calibration cache of its own (``DDPKIT_CACHE``, an empty folder its
kernel inherits, removed after it): a notebook that calibrates this machine (16) keeps its
calibration to itself. With one in a shared cache every later notebook's ``train`` would predict
its step beside the run (a simulated step each), and run slower for it."""
import os
import shutil
import tempfile
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
    item.stash[_CACHE] = os.environ.get("DDPKIT_CACHE")
    os.environ["DDPKIT_CACHE"] = tempfile.mkdtemp(prefix="ddpkit-notebook-cache-")


def pytest_runtest_teardown(item, nextitem):
    _own_cache_ends(item)
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


def _own_cache_ends(item):
    """The notebook's calibration cache removed, and the one before it back."""
    shutil.rmtree(os.environ.pop("DDPKIT_CACHE", ""), ignore_errors=True)
    if item.stash.get(_CACHE, None) is not None:
        os.environ["DDPKIT_CACHE"] = item.stash[_CACHE]


_KEY = pytest.StashKey[set]()
_CACHE = pytest.StashKey[object]()
