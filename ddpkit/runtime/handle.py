"""`RunHandle`: a run in progress, followed by one drain thread; `RunResult`: what it gave back.

The drain thread reads every rank's pipe: records go to ``on_metric`` as they arrive, output
lines to ``on_output``; the kernel stays free when ``block=False``. When a rank fails, it waits
a moment for the others' reports, names the culprit (the earliest error that is not a peer's
"connection closed"), and closes the group. A stall watchdog does the same for a silent rank.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _wait_ready

from ..errors import RankError, RankStalled
from ..rank.returns import loads_from_rank, read_buffers

_CONSEQUENCE_MARKERS = (
    "connection closed by peer", "connection reset", "broken pipe", "connection refused",
    "socket closed", "read error", "aborted", "remote process exited",
)


@dataclass
class RunResult:
    """What a finished run gives back. ``returns[r]`` is rank r's return value."""
    returns: list
    metrics: list
    prints: list = field(default_factory=list)
    world_size: int = 1
    backend: str = "gloo"
    device: str = "cpu"
    wall_s: float = 0.0
    stopped: bool = False
    port: int | None = None

    def __repr__(self):
        state = "stopped" if self.stopped else "ok"
        return (f"RunResult({state}, world_size={self.world_size}, backend={self.backend!r}, "
                f"records={len(self.metrics)}, wall_s={self.wall_s:.2f})")


def _is_consequence(err):
    text = (err.get("message") or "").lower()
    return any(m in text for m in _CONSEQUENCE_MARKERS)


class RunHandle:
    """A run in progress. ``metrics`` and ``prints`` grow live; ``wait()`` returns a `RunResult`
    or raises `RankError` / `RankStalled`; ``stop()`` ends every rank now."""

    def __init__(self, group, job, *, on_metric=None, on_output=None, stall_timeout_s=None,
                 owns_group=True, start_timeout_s=120.0):
        self.world_size = group.world_size
        self.metrics, self.prints = [], []
        self.returns = [None] * group.world_size
        self.error = None
        self.result = None
        self._group, self._owns = group, owns_group
        self._on_metric = on_metric
        self._on_output = on_output if on_output is not None else _print_output
        self._stall_s, self._start_s = stall_timeout_s, start_timeout_s
        self._stop = threading.Event()
        self._done = threading.Event()
        self._t0 = time.monotonic()
        self.ended_at = None  # time.monotonic() when the run ended (a pool's idle clock)
        self._callback_error = None
        self._job = job
        self._thread = threading.Thread(target=self._drain, name="ddpkit-drain", daemon=True)
        self._thread.start()

    # -- public
    @property
    def done(self):
        return self._done.is_set()

    def join(self, timeout=None):
        """Wait up to ``timeout`` s for the run to end, without raising its error; True if ended."""
        return self._done.wait(timeout)

    def wait(self, timeout=None):
        """Block until the run ends; Ctrl-C / kernel interrupt stops every rank, then re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.05):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run still going after {timeout}s; call stop() to end it")
        except KeyboardInterrupt:
            self.stop()
            raise
        if self.error is not None:
            raise self.error
        return self.result

    def stop(self):
        """End every rank now (SIGTERM, then SIGKILL) and wait until they are reaped.
        Called from an ``on_metric`` callback (the drain thread) it only asks."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def send_control(self, **settings):
        """Hand settings to rank 0; `Context.sync_controls` delivers them to all ranks together."""
        if not self.done:
            try:
                self._group.send(0, ("control", settings))
            except OSError:
                pass

    def __repr__(self):
        return f"<RunHandle {'done' if self.done else 'running'}, records={len(self.metrics)}>"

    # -- drain thread
    def _drain(self):
        stopped = False
        try:
            stopped = self._loop()
        except BaseException as exc:  # a bug here must not leave ranks behind
            self.error = exc
        finally:
            failed = self.error is not None or stopped
            if self._owns or failed:
                self._group.close(settle_s=0.0 if failed else 2.0)
            if self._callback_error is not None and self.error is None:
                self.error = self._callback_error
            self.result = RunResult(
                returns=self.returns, metrics=self.metrics, prints=self.prints,
                world_size=self.world_size, backend=self._group.backend,
                device=self._group.device, wall_s=time.monotonic() - self._t0,
                stopped=stopped, port=self._group.port)
            self.ended_at = time.monotonic()
            self._done.set()

    def _send_jobs(self):
        """From the drain thread: a big job blocks until each rank has joined the group, and a
        rank that failed at start-up closes its pipe (its own error is read from it below)."""
        for r in range(self.world_size):
            try:
                self._group.send(r, ("job", self._job))
            except OSError:
                pass
        self._job = None

    def _loop(self):
        """Read the ranks until each has returned; True when stopped. Sets ``error`` on failure."""
        self._send_jobs()
        seen = _Seen(self._group)
        while len(seen.returned) < self.world_size:
            if self._stop.is_set():
                return True
            ready = _wait_ready(seen.waitables(), timeout=0.05)
            now = time.monotonic()
            for obj in ready:
                # a process sentinel only wakes us: its pipe's EOF tells the rest
                if obj in seen.rank_of:
                    self._receive(seen, obj, now)
            seen.note_silent_deaths(ready)
            self.error = self._failure(seen, now)
            if self.error is not None:
                return False
        return False

    def _receive(self, seen, conn, now):
        """One message from a rank's pipe, or its EOF (the rank is gone)."""
        r = seen.rank_of[conn]
        try:
            kind, _, payload, t = conn.recv()
            if kind == "return":  # the value's tensor bytes follow on the same pipe
                blob, sizes = payload
                buffers = read_buffers(conn, sizes)
        except (EOFError, OSError):
            seen.open_conns.discard(conn)
            if seen.running(r):
                self._group.procs[r].join(timeout=1)
                seen.errors[r] = _death_report(self._group.procs[r].exitcode, seen.last_step.get(r))
            return
        seen.last_seen[r] = now
        if kind == "metric":
            record = {"rank": r, **payload}
            if "step" in payload:
                seen.last_step[r] = payload["step"]
            self.metrics.append(record)
            self._call(self._on_metric, record)
        elif kind == "print":
            self.prints.append((r, payload))
            self._call(self._on_output, r, payload)
        elif kind == "started":
            seen.started_at[r] = now
        elif kind == "return":
            self.returns[r] = loads_from_rank(blob, buffers)  # its own errors are its own
            seen.returned.add(r)
        elif kind == "error":
            seen.errors[r] = dict(payload, t=t)

    def _failure(self, seen, now):
        """The run's error once it is clear: the culprit a moment after the first error (its
        peers' reactions arrive meanwhile), or the ranks silent past the watchdog's limit."""
        if seen.errors:
            seen.first_error_at = seen.first_error_at or now
            if len(seen.returned) + len(seen.errors) == self.world_size or \
                    now - seen.first_error_at > 0.3:
                return _culprit_error(seen.errors, seen.returned)
        stalled = self._stalled(now, seen.started_at, seen.last_seen, seen.returned)
        if not stalled:
            return None
        # peers silent in the same collective cross the line a moment later: let them
        seen.stall_seen = seen.stall_seen or now
        if now - seen.stall_seen < min(1.0, 0.25 * (self._stall_s or 1.0)):
            return None
        starting = len(seen.started_at) < self.world_size
        return RankStalled(stalled, {r: seen.last_step.get(r) for r in stalled},
                           self._start_s if starting else self._stall_s, starting=starting)

    def _stalled(self, now, started_at, last_seen, returned):
        if len(started_at) < self.world_size:  # still importing / joining the group
            if self._start_s and now - self._t0 > self._start_s:
                return sorted(set(range(self.world_size)) - set(started_at))
            return []
        if not self._stall_s:
            return []
        return [r for r in range(self.world_size) if r not in returned
                and now - max(last_seen.get(r, 0), started_at[r]) > self._stall_s]

    def _call(self, callback, *args):
        if callback is None:
            return
        try:
            callback(*args)
        except Exception as exc:  # keep draining; report once at wait()
            if self._callback_error is None:
                self._callback_error = exc


class _Seen:
    """What the drain loop has heard from each rank so far."""

    def __init__(self, group):
        self.group = group
        self.rank_of = {c: r for r, c in enumerate(group.conns)}
        self.open_conns = set(group.conns)
        self.returned, self.errors = set(), {}
        self.started_at, self.last_seen, self.last_step = {}, {}, {}
        self.first_error_at = self.stall_seen = None

    def running(self, r):
        return r not in self.returned and r not in self.errors

    def waitables(self):
        # an exited rank's sentinel is always ready, so only running ranks' are waited on
        running = [p.sentinel for r, p in enumerate(self.group.procs) if self.running(r)]
        return list(self.open_conns) + running

    def note_silent_deaths(self, ready):
        """A process can die with its pipe still open in a grandchild: trust the sentinel too."""
        for r, p in enumerate(self.group.procs):
            conn = self.group.conns[r]
            if self.running(r) and not p.is_alive() and conn not in ready and not conn.poll():
                self.errors[r] = _death_report(p.exitcode, self.last_step.get(r))


def _print_output(rank, line):
    print(f"[rank {rank}] {line}", flush=True)


def _death_report(exitcode, step):
    how = (f"was killed by signal {signal.Signals(-exitcode).name}" if exitcode and exitcode < 0
           else f"exited with code {exitcode}")
    return {"type": "ProcessDied", "message": f"the process {how} without a Python traceback",
            "traceback": "", "step": step, "phase": "run", "t": time.time(), "died": True}


def _culprit_error(errors, returned):
    """The rank whose failure came first and is not a peer's reaction to it."""
    ranked = sorted(errors.items(), key=lambda kv: (_is_consequence(kv[1]), kv[1]["t"]))
    culprit, err = ranked[0]
    peers = {r: f"{e['type']}: {e['message'].splitlines()[0] if e['message'] else ''}"
             for r, e in ranked[1:]}
    return RankError(culprit, err["type"], err["message"], err["traceback"], peers,
                     step=err.get("step"))
