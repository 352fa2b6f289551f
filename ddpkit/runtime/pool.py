"""`Pool`: ranks kept alive between runs, so a launch skips spawn, imports and rendezvous;
`shared_pool`: the kernel's one warm pool per (world size, backend, device, host), which
``pool="shared"`` names (`train`, `sweep`, `pitfalls.run`, the Lab and the CLI use it by
default); `shutdown` ends them.

A shared pool ends its ranks by itself after ``DDPKIT_POOL_IDLE_S`` seconds without a job
(600 by default), and at interpreter exit, so an idle kernel does not hold CPU memory or CUDA
contexts; its next job starts fresh ranks. What a job leaves in a rank is undone before the next
(`ddpkit.rank.fresh.Baseline`), so a job sees what a fresh launch would.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch

from ..devices import resolve_devices
from . import start
from .group import HOST, RankGroup, interrupts_held, startup_env
from .start import IDLE_DEFAULT_S, IDLE_ENV, idle_timeout  # noqa: F401  (this module's setting)
from .handle import RunHandle
from .job import check_options, collective_timeout, finish, make_job




class PoolBusy(RuntimeError):
    """The pool is running a job already (one run at a time per pool)."""


class Pool:
    """Ranks kept alive with the process group up, so `launch` skips spawn, imports and rendezvous.

    ``pool = ddpkit.Pool(world_size=2)``; ``pool.launch(work, ...)`` takes `launch`'s arguments.
    A failed or stopped run ends the pool's ranks; the next launch starts fresh ones.
    Use it as a context manager, or call ``close()``; ranks also end with the kernel.
    ``host``: as for `launch` (loopback by default). ``idle_timeout_s``: end the ranks after
    that many seconds without a job (None: keep them until ``close()``); the next launch
    starts fresh ones.
    """

    def __init__(self, world_size=2, backend=None, device=None, port=None, host=HOST,
                 idle_timeout_s=None):
        check_options(port=port, host=host)
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s!r}: pass a number of seconds > 0, "
                             f"or None to keep the ranks until close()")
        self.backend, self.device = resolve_devices(world_size, backend, device)
        self.world_size = world_size
        self.host = host
        self._port = port
        self._group = None
        self._handle = None
        self._lock = threading.Lock()
        self.idle_timeout_s = idle_timeout_s
        self._used_at = time.monotonic()
        self._ensure_group()
        if idle_timeout_s is not None:
            _watch_idle(self)

    def _ensure_group(self, deterministic=None):
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        # CUDA reads CUBLAS_WORKSPACE_CONFIG when it initialises, which a pool's ranks did at
        # start: a deterministic job on ranks started without it needs fresh ranks
        stale = (self._group is not None and self.device == "cuda" and deterministic
                 and not self._group.deterministic)
        # a variable read at a rank's start (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, NCCL_*...)
        # changed in the kernel since these ranks started: fresh ones see it, so must these
        stale = stale or (self._group is not None and self._group.start_env != startup_env())
        if self._group is None or stale or not self._group.alive():
            if self._group is not None:
                self._group.close(graceful=stale)
            # each job sets its own collective timeout (rank._run_job); this one covers start-up
            self._group = RankGroup(self.world_size, self.backend, self.device, persistent=True,
                                    port=self._port, pg_timeout_s=collective_timeout(300.0),
                                    deterministic=deterministic, host=self.host)

    def warm(self):
        """Start the ranks now if they are not up (a launch would start them anyway)."""
        with self._lock:
            if not self.busy:
                self._ensure_group()
                self._used_at = time.monotonic()
        return self

    @property
    def busy(self):
        return self._handle is not None and not self._handle.done

    def launch(self, fn, *args, block=True, on_metric=None, on_output=None,
               stall_timeout_s=300.0, seed=0, **kwargs):
        check_options(block, on_metric, on_output)
        job = make_job(fn, args, kwargs, seed, stall_timeout_s)
        with self._lock, interrupts_held() as held:
            if self.busy:
                raise PoolBusy("this pool is already running a job; wait() or stop() it "
                               "before launching another (one run at a time per pool)")
            self._ensure_group(job["flags"]["deterministic"])
            self._used_at = time.monotonic()
            self._handle = RunHandle(self._group, job, on_metric=on_metric, on_output=on_output,
                                     stall_timeout_s=stall_timeout_s, owns_group=False)
        return finish(self._handle, block, held)

    def close(self):
        """Stop a running job and end the ranks (a later launch starts fresh ones)."""
        if self._handle is not None and not self._handle.done:
            self._handle.stop()
        with self._lock:
            if self._group is not None:
                self._group.close(graceful=True)
                self._group = None

    def idle_for(self):
        """Seconds since the last job ended (0 while one runs or none has been sent yet)."""
        if self.busy:
            return 0.0
        ended = self._handle.ended_at if self._handle is not None else None
        return time.monotonic() - max(self._used_at, ended or 0.0)

    def _close_if_idle(self):
        """The idle watcher's call: end the ranks once idle past ``idle_timeout_s``."""
        with self._lock:
            if (self._group is None or self.idle_timeout_s is None or self.busy
                    or self.idle_for() < self.idle_timeout_s):
                return False
            group, self._group = self._group, None
        group.close(graceful=True)
        start.stop_if_unused()  # the forkserver too, unless other ranks are forks of it
        return True

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


# -- the idle watcher: one daemon thread for every pool with an idle timeout
_WATCHED = weakref.WeakSet()
_WATCHER = None
_WATCH_LOCK = threading.Lock()


def _watch_idle(pool):
    global _WATCHER
    with _WATCH_LOCK:
        _WATCHED.add(pool)
        if _WATCHER is None or not _WATCHER.is_alive():
            _WATCHER = threading.Thread(target=_idle_loop, name="ddpkit-pool-idle", daemon=True)
            _WATCHER.start()


def _idle_loop():
    while True:
        pools = list(_WATCHED)
        tick = min([p.idle_timeout_s for p in pools] + [4.0]) / 4
        time.sleep(max(0.05, tick))
        for p in pools:
            try:
                p._close_if_idle()
            except Exception:  # a pool being closed meanwhile: the next look settles it
                pass


# -- the kernel's shared pools
_SHARED = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(world_size=2, backend=None, device=None, host=HOST):
    """The kernel's warm pool for ``world_size`` ranks on (backend, device) listening on
    ``host``: started on first use, reused by every later job, its ranks ended after
    ``DDPKIT_POOL_IDLE_S`` idle seconds (started again by the next job) or by `shutdown`."""
    backend, device = resolve_devices(world_size, backend, device)
    key = (world_size, backend, device, host)
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None:
            pool = _SHARED[key] = Pool(world_size, backend, device, host=host,
                                       idle_timeout_s=idle_timeout())
        else:
            pool.idle_timeout_s = idle_timeout()
        return pool


def shared_pids():
    """Every rank process of the shared pools now (what a leftover-process check leaves out)."""
    with _SHARED_LOCK:
        return {pid for pool in _SHARED.values() for pid in pool.pids}


def shutdown():
    """End every shared pool's ranks now (a running job is stopped), and the forkserver they
    were forked from (`ddpkit.runtime.start`). The next `train` starts fresh ranks. Pools made
    with ``ddpkit.Pool(...)`` are yours to close."""
    with _SHARED_LOCK:
        pools = list(_SHARED.values())
        _SHARED.clear()
    for pool in pools:
        pool.close()
    start.stop_if_unused()  # the forkserver, unless a Pool of the user's still uses it
