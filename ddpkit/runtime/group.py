"""The rank processes of one run or pool, and the kernel-side rendezvous they join.

* The kernel owns the rendezvous: a ``TCPStore`` bound to port 0, so the OS picks a free port and
  two launches can never collide; it is closed when the group closes, freeing the port. It
  listens on ``host`` only (loopback by default), and so do the ranks' own gloo sockets: the
  store has no authentication, so nobody else on the network may reach it.
* Ranks are started by `ddpkit.runtime.start`: forkserver where no CUDA can exist (Linux, a
  CPU build of torch), else spawn; never fork (fork after CUDA init breaks). Each starts in
  `ddpkit.rank.entry.rank_main` with one duplex pipe.
* Closing ends every rank: a moment to exit by themselves, then SIGTERM, then SIGKILL, then
  reap (grandchildren too). Groups still open at interpreter exit are closed then.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta

import psutil
import torch.distributed as dist

from .. import devices
from ..rank.entry import rank_main
from .start import Start, startup_env

HOST = "127.0.0.1"  # the default: loopback, so no other machine can reach a run's sockets
_LIVE = weakref.WeakSet()  # groups still holding processes; ended at interpreter exit


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


@contextlib.contextmanager
def interrupts_held():
    """Hold a kernel interrupt (SIGINT, or ``_thread.interrupt_main``) while ranks start and a
    run is handed its group: the body runs to its end, and the list it yields says whether one
    came meanwhile. Raised in the middle, it could leave a rank started but not yet recorded,
    which nothing would then end. In a thread other than the main one there is nothing to hold."""
    held = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, old)


class RankGroup:
    """world_size rank processes, their pipes and the kernel-side store."""

    def __init__(self, world_size, backend, device, persistent, port=None, pg_timeout_s=120,
                 deterministic=False, host=HOST):
        self.world_size, self.backend, self.device = world_size, backend, device
        self.persistent = persistent
        self.deterministic = deterministic
        self.start_env = startup_env()
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
        self.procs, self.conns = [], []
        self.closed = False
        self._start = None
        try:
            with interrupts_held() as held, _main_not_reimported():
                self._start = start = Start(self.start_env)  # holds the server while ranks start
                try:
                    spec["start_method"] = start.method
                    if start.method == "forkserver":  # the server's are those of its start
                        spec.update(environ=dict(os.environ))
                    for r in range(world_size):
                        parent_end, child_end = start.context.Pipe(duplex=True)
                        p = start.context.Process(target=rank_main, name=f"ddpkit-rank{r}",
                                                  args=(r, world_size, child_end, spec), daemon=True)
                        p.start()
                        child_end.close()
                        self.procs.append(p)
                        self.conns.append(parent_end)
                finally:
                    start.started()
            if held:
                raise KeyboardInterrupt  # now that every rank is known, so closed below
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
        if self._start is not None:
            self._start.release()  # the forkserver, once no group uses it, ends after a while


@atexit.register
def _end_all():
    for g in list(_LIVE):
        g.close()
