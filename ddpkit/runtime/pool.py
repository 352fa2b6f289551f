"""`Pool`: ranks kept alive between runs, so a launch skips spawn, imports and rendezvous."""
from __future__ import annotations

import threading

import torch

from ..devices import resolve_devices
from .group import HOST, RankGroup
from .handle import RunHandle
from .launch import collective_timeout, make_job, check_options


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
            self._group = RankGroup(self.world_size, self.backend, self.device, persistent=True,
                                    port=self._port, pg_timeout_s=collective_timeout(300.0),
                                    deterministic=deterministic, host=self.host)

    @property
    def busy(self):
        return self._handle is not None and not self._handle.done

    def launch(self, fn, *args, block=True, on_metric=None, on_output=None,
               stall_timeout_s=300.0, seed=0, **kwargs):
        check_options(block, on_metric, on_output)
        job = make_job(fn, args, kwargs, seed, stall_timeout_s)
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
