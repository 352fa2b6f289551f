"""Run a function on N ranks from a notebook kernel: `launch`, `Pool`, `RunHandle`, `RunResult`.

Design, in the order things happen:

* Checks first. Bad settings and unpicklable arguments raise before any process exists.
* The kernel owns the rendezvous: a ``TCPStore`` bound to port 0, so the OS picks a free port and
  two launches can never collide; it is closed when the run (or pool) ends, freeing the port.
  It listens on ``host`` only (loopback by default), and so do the ranks' own gloo sockets: the
  store has no authentication, so nobody else on the network may reach it.
* Ranks are started with ``torch.multiprocessing``'s **spawn** context, never fork (fork after
  CUDA init breaks). The user's function travels as cloudpickle bytes to `rank.rank_main`.
* One drain thread per run reads every rank's pipe: records go to ``on_metric`` as they arrive,
  output lines to ``on_output``. The kernel stays free when ``block=False``.
* When a rank fails, the drain thread waits a moment for the others' reports, names the culprit
  (the earliest error that is not a peer's "connection closed"), and ends every rank:
  SIGTERM, then SIGKILL, then reap. A stall watchdog does the same for a silent rank.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import inspect
import os
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as _wait_ready

import cloudpickle
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from .. import devices
from ..rank import entry as _rank
from .. import shipping
from ..devices import BACKENDS, resolve_devices  # noqa: F401  (resolve_devices: public here too)
from ..errors import RankError, RankStalled

HOST = "127.0.0.1"  # the default: loopback, so no other machine can reach a run's sockets
_CONSEQUENCE_MARKERS = (
    "connection closed by peer", "connection reset", "broken pipe", "connection refused",
    "socket closed", "read error", "aborted", "remote process exited",
)
_LIVE = weakref.WeakSet()  # groups still holding processes; ended at interpreter exit


# ----------------------------------------------------------------------------- settings
def check_picklable(fn, args, kwargs):
    """cloudpickle the job now, so an unpicklable object is named before any process starts."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {type(fn).__name__} "
                        f"{fn!r}; pass a callable like `def work(ctx, ...)`")
    try:
        inspect.signature(fn).bind(None, *args, **kwargs)  # None stands for ctx
    except TypeError as exc:
        raise TypeError(f"{getattr(fn, '__name__', fn)}(ctx, ...) cannot take these arguments: "
                        f"{exc}. The first parameter receives the rank's Context; pass the rest "
                        f"after the function") from None
    except ValueError:
        pass  # no signature to check (some builtins)
    try:
        return shipping.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        named = [("the function", fn)] + [(f"argument {i} ({type(a).__name__})", a)
                                          for i, a in enumerate(args, 1)]
        named += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
        for label, obj in named:
            try:
                cloudpickle.dumps(obj)
            except Exception as inner:
                raise TypeError(
                    f"{label} cannot be sent to the ranks: {inner}. Each rank is a fresh process, so "
                    f"everything passed must pickle; create it inside the function instead "
                    f"(e.g. open files, locks, sockets, CUDA streams)") from inner
        raise TypeError(f"the job cannot be pickled: {exc}") from exc


def check_host(host):
    """``host=``: the one address the store and the ranks' sockets listen on."""
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be an address string such as '127.0.0.1', got {host!r}")
    try:
        socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"host={host!r} does not resolve ({exc.strerror}); pass "
                         f"host='127.0.0.1' (the default: loopback only) or an address of this "
                         f"machine") from None


def _listen_socket(host, port):
    """A listening socket bound to ``host`` alone. torch's TCPStore server binds *every*
    interface whatever host it is given (TORCH_NOTES: ``*:<port>``, IPv4 and IPv6); handed a
    socket through ``master_listen_fd`` it serves on that socket's address only."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as torch's own server does: a port whose last connections sit in TIME_WAIT is reusable
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def _new_store(port, host=HOST):
    """The kernel-side rendezvous, on ``host`` only. Port 0 lets the OS choose (no race: the
    socket holds the port from bind on); EADDRINUSE on a chosen port is reported with a fix."""
    try:
        sock = _listen_socket(host, port or 0)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port={port} is already in use on {host}; pass port=None and "
                             f"ddpkit picks a free one") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"host={host!r} is not an address of this machine ({exc.strerror}); "
                             f"pass host='127.0.0.1' (the default) or one of its addresses") from None
        raise
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now: it closes it when dropped (measured)
    return store


def _dying(pid):
    """Killed, but its threads not yet gone: waitpid still says alive, /proc already 'zombie'."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _end_processes(procs, settle_s=0.0, grace_s=2.0):
    """Let ranks exit by themselves for settle_s, then SIGTERM, then SIGKILL; reap every one.

    multiprocessing reaps its own children (``join``), so exit codes stay known; grandchildren
    (a DataLoader's workers, say) are found with psutil first and ended the same way.
    """
    kids = []
    for p in procs:
        try:
            kids += psutil.Process(p.pid).children(recursive=True)
        except (psutil.NoSuchProcess, ValueError):
            pass
    deadline = time.monotonic() + settle_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        p.terminate()
    for k in kids:
        try:
            k.terminate()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.exitcode is None:
            p.kill()
            p.join(timeout=grace_s)
    _, stubborn = psutil.wait_procs(kids, timeout=grace_s)
    for k in stubborn:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass


# ----------------------------------------------------------------------------- ranks
@contextlib.contextmanager
def _main_not_reimported():
    """Spawn re-runs the parent's main script in every child (hence the usual
    ``if __name__ == "__main__"`` guard). ddpkit ships the job by value, so children never need
    it: hide the main module's path while the children start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Group:
    """world_size spawned rank processes, their pipes and the kernel-side store."""

    def __init__(self, world_size, backend, device, persistent, port=None, pg_timeout_s=120,
                 deterministic=False, host=HOST):
        self.world_size, self.backend, self.device = world_size, backend, device
        self.persistent = persistent
        self.deterministic = deterministic
        note = devices.shared_note(world_size, backend, device)
        if note:
            print(note, flush=True)  # once per launch or pool, in the cell that started it
        self.store = _new_store(port, host)
        self.port = self.store.port
        threads = max(1, (os.cpu_count() or 1) // world_size)  # no oversubscription of cores
        gpus = len(devices.cuda_gpus()) if device == "cuda" else 0
        spec = dict(host=host, port=self.port, backend=backend, device_type=device, threads=threads,
                    persistent=persistent, pg_timeout_s=pg_timeout_s, ppid=os.getpid(), gpus=gpus,
                    deterministic=deterministic)
        mp = tmp.get_context("spawn")
        self.procs, self.conns = [], []
        self.closed = False
        try:
            with _main_not_reimported():
                for r in range(world_size):
                    parent_end, child_end = mp.Pipe(duplex=True)
                    p = mp.Process(target=_rank.rank_main, args=(r, world_size, child_end, spec),
                                   name=f"ddpkit-rank{r}", daemon=True)
                    p.start()
                    child_end.close()
                    self.procs.append(p)
                    self.conns.append(parent_end)
        except BaseException:
            self.close()
            raise
        _LIVE.add(self)

    def alive(self):
        return not self.closed and all(p.is_alive() and not _dying(p.pid) for p in self.procs)

    def send(self, rank, msg):
        self.conns[rank].send(msg)

    def close(self, settle_s=0.0, graceful=False):
        """End every rank and free the port. settle_s: time ranks get to exit by themselves
        (they do right after returning); graceful: first ask a pool's ranks to leave."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            for c in self.conns:
                try:
                    c.send(("close",))
                except OSError:
                    pass
            settle_s = max(settle_s, 3.0)
        _end_processes(self.procs, settle_s=settle_s)
        for p in self.procs:
            if p.exitcode is not None:
                p.close()  # releases the sentinel pipe; without it each run leaks fds
        for c in self.conns:
            c.close()
        self.store = None  # drops the TCPStore server: the port is free again
        _LIVE.discard(self)


@atexit.register
def _end_all():
    for g in list(_LIVE):
        g.close()


# ----------------------------------------------------------------------------- results
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
    first_record_s: float | None = None
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
        self._first_record = None
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
                first_record_s=self._first_record, stopped=stopped, port=self._group.port)
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
        self._send_jobs()
        g, n = self._group, self.world_size
        by_conn = {c: r for r, c in enumerate(g.conns)}
        open_conns = set(g.conns)
        returned, errors = set(), {}
        started_at = {}
        last_seen, last_step = {}, {}
        first_error_at = stall_seen = None
        while len(returned) < n:
            if self._stop.is_set():
                return True
            running = [p.sentinel for r, p in enumerate(g.procs)
                       if r not in returned and r not in errors]  # an exited rank's is always ready
            ready = _wait_ready(list(open_conns) + running, timeout=0.05)
            now = time.monotonic()
            for obj in ready:
                if obj not in by_conn:
                    continue  # a process sentinel: its pipe's EOF tells us the rest
                r = by_conn[obj]
                try:
                    kind, _, payload, t = obj.recv()
                except (EOFError, OSError):
                    open_conns.discard(obj)
                    if r not in returned and r not in errors:
                        g.procs[r].join(timeout=1)
                        errors[r] = _death_report(g.procs[r].exitcode, last_step.get(r))
                    continue
                last_seen[r] = now
                if kind == "metric":
                    if self._first_record is None:
                        self._first_record = now - self._t0
                    record = {"rank": r, **payload}
                    if "step" in payload:
                        last_step[r] = payload["step"]
                    self.metrics.append(record)
                    self._call(self._on_metric, record)
                elif kind == "print":
                    self.prints.append((r, payload))
                    self._call(self._on_output, r, payload)
                elif kind == "started":
                    started_at[r] = now
                elif kind == "return":
                    self.returns[r] = cloudpickle.loads(payload)
                    returned.add(r)
                elif kind == "error":
                    errors[r] = dict(payload, t=t)
            # a process can die with its pipe still open in a grandchild: trust the sentinel too
            for r, p in enumerate(g.procs):
                if r not in returned and r not in errors and not p.is_alive() and g.conns[r] not in ready:
                    if not g.conns[r].poll():
                        errors[r] = _death_report(p.exitcode, last_step.get(r))
            if errors:
                first_error_at = first_error_at or now
                if len(returned) + len(errors) == n or now - first_error_at > 0.3:
                    self.error = _culprit_error(errors, returned)
                    return False
            stalled = self._stalled(now, started_at, last_seen, returned)
            if stalled:
                # peers silent in the same collective cross the line a moment later: let them
                stall_seen = stall_seen or now
                if now - stall_seen >= min(1.0, 0.25 * (self._stall_s or 1.0)):
                    starting = len(started_at) < n
                    self.error = RankStalled(stalled, {r: last_step.get(r) for r in stalled},
                                             self._start_s if starting else self._stall_s,
                                             starting=starting)
                    return False
        return False

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


# ----------------------------------------------------------------------------- API
_LAUNCH_KW = ("world_size", "backend", "device", "block", "on_metric", "on_output",
              "stall_timeout_s", "seed", "pool", "port", "host")


def launch(fn, *args, world_size=None, backend=None, device=None, block=True, on_metric=None,
           on_output=None, stall_timeout_s=300.0, seed=0, pool=None, port=None, host=HOST,
           **kwargs):
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks (default 2); the group is up.

    block=True returns a `RunResult` (``returns`` of every rank, ``metrics`` of every rank);
    block=False returns a `RunHandle` at once. ``on_metric(record)`` and ``on_output(rank, line)``
    are called from ddpkit's drain thread as records and output lines arrive. ``pool`` runs on a
    warm `Pool` instead of spawning. ``stall_timeout_s``: end the run with `RankStalled` when a
    rank sends nothing (no ``ctx.log``) for that long; None turns the watchdog off.
    ``host``: the address the rendezvous store and the ranks' gloo sockets listen on; loopback
    by default, so nothing outside this machine can reach them. Pass another address of this
    machine only when something elsewhere must connect (the store has no authentication).
    The names above are the launcher's; every other keyword goes to ``fn``.
    """
    if pool is not None:
        if world_size not in (None, pool.world_size):
            raise ValueError(f"world_size={world_size} but the pool has {pool.world_size} ranks; "
                             f"pass world_size={pool.world_size} or make a new Pool")
        if host != pool.host:
            raise ValueError(f"host={host!r} but the pool listens on {pool.host!r}; pass "
                             f"host={pool.host!r} or make a Pool with host={host!r}")
        return pool.launch(fn, *args, block=block, on_metric=on_metric, on_output=on_output,
                           stall_timeout_s=stall_timeout_s, seed=seed, **kwargs)
    world_size = 2 if world_size is None else world_size
    check_options(block, on_metric, on_output, port, host)
    backend, device = resolve_devices(world_size, backend, device)
    job = _make_job(fn, args, kwargs, seed, stall_timeout_s)
    group = _Group(world_size, backend, device, persistent=False, port=port,
                   pg_timeout_s=job["pg_timeout_s"], deterministic=job["flags"]["deterministic"],
                   host=host)
    handle = RunHandle(group, job, on_metric=on_metric, on_output=on_output,
                       stall_timeout_s=stall_timeout_s, owns_group=True)
    return handle.wait() if block else handle


def check_options(block=True, on_metric=None, on_output=None, port=None, host=HOST):
    """The launcher's own keywords, checked before anything starts."""
    if not isinstance(block, bool):
        raise TypeError(f"block must be True or False, got {block!r}")
    for name, cb in (("on_metric", on_metric), ("on_output", on_output)):
        if cb is not None and not callable(cb):
            raise TypeError(f"{name} must be a callable (e.g. a function of the record) or None, "
                            f"got {type(cb).__name__}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):
        raise ValueError(f"port={port!r}: pass a TCP port in 1..65535, or port=None and ddpkit "
                         f"picks a free one")
    check_host(host)


def _collective_timeout(stall_timeout_s):
    """gloo/NCCL's own collective timeout: above the watchdog's, so the watchdog speaks first."""
    return max(120.0, 2 * stall_timeout_s) if stall_timeout_s else 1800.0


def _make_job(fn, args, kwargs, seed, stall_timeout_s):
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s={stall_timeout_s!r}: pass a number of seconds > 0, "
                         f"or None to turn the watchdog off")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    payload = check_picklable(fn, args, kwargs)
    # the collective timeout travels with each job: a pool's ranks serve jobs of any
    # stall_timeout_s, and torch's own timeout must never fire before ddpkit's watchdog
    return {"payload": payload, "seed": seed, "flags": _rank.capture_job_state(),
            "pg_timeout_s": _collective_timeout(stall_timeout_s)}


class Pool:
    """Ranks kept alive with the process group up, so `launch` skips spawn, imports and rendezvous.

    ``pool = ddpkit.Pool(world_size=2)``; ``pool.launch(work, ...)`` takes `launch`'s arguments.
    A failed or stopped run ends the pool's ranks; the next launch starts fresh ones.
    Use it as a context manager, or call ``close()``; ranks also end with the kernel.
    ``host``: as for `launch` (loopback by default).
    """

    def __init__(self, world_size=2, backend=None, device=None, port=None, host=HOST):
        check_options(port=port, host=host)
        self.backend, self.device = resolve_devices(world_size, backend, device)
        self.world_size = world_size
        self.host = host
        self._port = port
        self._group = None
        self._handle = None
        self._lock = threading.Lock()
        self._ensure_group()

    def _ensure_group(self, deterministic=None):
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        # CUDA reads CUBLAS_WORKSPACE_CONFIG when it initialises, which a pool's ranks did at
        # start: a deterministic job on ranks started without it needs fresh ranks
        stale = (self._group is not None and self.device == "cuda" and deterministic
                 and not self._group.deterministic)
        if self._group is None or stale or not self._group.alive():
            if self._group is not None:
                self._group.close(graceful=stale)
            # each job sets its own collective timeout (rank._run_job); this one covers start-up
            self._group = _Group(self.world_size, self.backend, self.device, persistent=True,
                                 port=self._port, pg_timeout_s=_collective_timeout(300.0),
                                 deterministic=deterministic, host=self.host)

    @property
    def busy(self):
        return self._handle is not None and not self._handle.done

    def launch(self, fn, *args, block=True, on_metric=None, on_output=None,
               stall_timeout_s=300.0, seed=0, **kwargs):
        check_options(block, on_metric, on_output)
        job = _make_job(fn, args, kwargs, seed, stall_timeout_s)
        with self._lock:
            if self.busy:
                raise RuntimeError("this pool is already running a job; wait() or stop() it "
                                   "before launching another (one run at a time per pool)")
            self._ensure_group(job["flags"]["deterministic"])
            self._handle = RunHandle(self._group, job, on_metric=on_metric, on_output=on_output,
                                     stall_timeout_s=stall_timeout_s, owns_group=False)
        return self._handle.wait() if block else self._handle

    def close(self):
        if self._handle is not None and not self._handle.done:
            self._handle.stop()
        if self._group is not None:
            self._group.close(graceful=True)
            self._group = None

    @property
    def pids(self):
        """The pool's rank processes now (empty while it has none)."""
        if self._group is None or self._group.closed:
            return []
        return [p.pid for p in self._group.procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._group is None else ("busy" if self.busy else "ready")
        return f"<ddpkit.Pool world_size={self.world_size} backend={self.backend!r} {state}>"
