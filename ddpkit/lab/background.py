"""Simulated steps on the Lab's daemon threads (the read-out's peak, the peak panel's
predictions), which the interpreter's end waits for.

A daemon thread still inside torch's C++ when Python ends aborts the whole process ("terminate
called without an active exception", exit code 134): a script, a test run or a kernel that ends
while a read-out simulates a step would fail. `run` marks the simulation; at exit the marked ones
are waited for (seconds), and none starts after that: the thread ends quietly instead.
"""
from __future__ import annotations

import atexit
import threading
import time

_RUNNING = set()  # the threads now inside a simulation
_GUARD = threading.Lock()
_ENDING = []  # non-empty once the interpreter ends


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on this (daemon) thread, waited for at exit; once Python is ending,
    not called: the thread ends (SystemExit, which a thread takes silently)."""
    me = threading.current_thread()
    with _GUARD:
        if _ENDING:
            raise SystemExit
        _RUNNING.add(me)
    try:
        return fn(*args, **kwargs)
    finally:
        _RUNNING.discard(me)


@atexit.register
def _let_simulations_end(timeout=600):
    with _GUARD:
        _ENDING.append(True)
    deadline = time.monotonic() + timeout
    while _RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
