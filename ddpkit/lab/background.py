"""The Lab's threads and pace: simulated steps on its one `Predictor` thread (the read-out's
peak, the peak panel's predictions), which the interpreter's end waits for (`run`), and `Pace`,
the bounded rate at which its figures are redrawn.

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


class Predictor:
    """A Lab's one thread for simulated steps (the read-out's peak, the peak panel's
    predictions): jobs run in the order given; a job given with a ``slot`` replaces one of that
    slot still waiting (the read-out wants only its latest config). A job says its own errors
    (in the read-out, in the panel's table). `close` ends the thread, after the job it runs."""

    def __init__(self, name="ddpkit-lab-predict"):
        self._jobs, self._closed = [], False  # [(slot, fn)], oldest first
        self._wake = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, slot=None):
        with self._wake:
            if self._closed:
                return
            self._jobs = [(s, f) for s, f in self._jobs if slot is None or s != slot]
            self._jobs.append((slot, fn))
            self._wake.notify()

    def _serve(self):
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                _, fn = self._jobs.pop(0)
            try:
                run(fn)  # Python's end waits for it; once Python is ending, none starts
            except SystemExit:
                return
            except Exception:  # noqa: BLE001 (a job that raised anyway must not end the thread)
                pass

    def close(self, timeout=None):
        """No more jobs; the thread ends once the one it runs has (returns whether it did)."""
        with self._wake:
            self._closed, self._jobs = True, []
            self._wake.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        return not self.thread.is_alive()


class Pace:
    """What arrived from the drain thread (`put`), handed out at most once per ``period``
    seconds (`take`): the one rate limit of the Lab's figures and tables."""

    def __init__(self, period):
        self.period = period
        self._lock, self._items, self._last = threading.Lock(), [], 0.0

    def put(self, item=None):
        with self._lock:
            self._items.append(item)

    def clear(self):
        with self._lock:
            self._items = []

    def take(self, force=False):
        """Everything put since the last take, when there is something and (unless ``force``)
        a period has passed since then; else None."""
        now = time.monotonic()
        if not force and now - self._last < self.period:
            return None
        with self._lock:
            items, self._items = self._items, []
        if not items:
            return None
        self._last = now
        return items
