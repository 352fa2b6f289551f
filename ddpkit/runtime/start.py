"""How rank processes start: ``torch.multiprocessing``'s forkserver or spawn, never fork.

* **spawn**: each rank is a fresh interpreter that imports torch (~1 CPU-second each, plus
  ~0.75 s for ``torch._dynamo``, which DDP imports; two ranks take ~1.5 s on two cores, eight
  ~5.5 s: ``python -m bench.launch``).
* **forkserver**: one fresh interpreter, the *server*, imports torch, torch.distributed,
  torch._dynamo and ddpkit's rank entry once; each rank is a fork of it (~0.05 s). The server
  is started by multiprocessing with exec, never as a fork of the kernel, so it holds none of the
  kernel's memory or CUDA state. Importing does not initialise CUDA (``torch.cuda`` is lazy), and
  the server runs no tensor operation, so no OpenMP pool exists when it forks: it forks from a
  single thread (torch's own DataLoader forks its workers, by default on Linux, from a process
  that has run far more). Each of these is a test (``tests/test_start.py``).
* **The default** is forkserver where CUDA cannot exist: Linux, and a torch built without CUDA,
  ROCm or XPU. Anywhere else spawn, the method torch documents for CUDA
  (a CUDA build keeps spawn until ``tests/gpu/test_cuda_launch.py`` has run the forkserver on a
  GPU). ``DDPKIT_START_METHOD=spawn|forkserver`` chooses; fork is refused.
* **The server's life**: it serves while ranks forked from it live; it ends with the last idle
  shared pool, at `ddpkit.shutdown()`, ``DDPKIT_POOL_IDLE_S`` seconds (600) after its last ranks
  ended otherwise, and with the kernel (the server exits when its parent does). A server started
  under other start-up variables (``OMP_NUM_THREADS``, say) than the kernel's now is started
  again once unused; while in use, ranks started meanwhile are spawned. A forkserver the kernel
  started before ddpkit (its own DataLoader's, say) is used and never stopped.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver, util

import torch
import torch.multiprocessing as tmp

START_ENV = "DDPKIT_START_METHOD"
IDLE_ENV = "DDPKIT_POOL_IDLE_S"
IDLE_DEFAULT_S = 600.0
# read when a rank starts (threads, devices, the communication libraries, torch itself): a warm
# rank, or the server, cannot take a change of these
STARTUP_PREFIXES = ("CUDA_", "NCCL_", "GLOO_", "OMP_", "MKL_", "PYTORCH_", "TORCH_", "CUBLAS_",
                    "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_", "LD_PRELOAD", "DDPKIT_MMAP_")
# what the server imports once; every fresh DDP rank imports torch._dynamo
# (torch/nn/parallel/distributed.py imports it in DistributedDataParallel.__init__)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddpkit.rank.entry"]


def startup_env():
    """The kernel's variables that only a rank's start reads."""
    return {k: v for k, v in os.environ.items() if k.startswith(STARTUP_PREFIXES)}


def idle_timeout():
    """Seconds an idle shared pool keeps its ranks: ``DDPKIT_POOL_IDLE_S`` (600 when unset)."""
    raw = os.environ.get(IDLE_ENV)
    if raw is None or raw == "":
        return IDLE_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{IDLE_ENV}={raw!r}: set it to a number of seconds > 0 (how long an "
                         f"idle shared pool keeps its ranks), or unset it for {IDLE_DEFAULT_S:g}")
    return value


def cuda_free_build():
    """True where no GPU runtime can exist in a rank: Linux and a torch built for CPU alone."""
    gpu_builds = (torch.version.cuda, torch.version.hip, getattr(torch.version, "xpu", None))
    return sys.platform.startswith("linux") and all(v is None for v in gpu_builds)


def default_method():
    return "forkserver" if cuda_free_build() else "spawn"


def start_method():
    """How ranks start: ``DDPKIT_START_METHOD`` when set, else `default_method`."""
    method = os.environ.get(START_ENV) or default_method()
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_ENV}={method!r}: set it to 'spawn' or 'forkserver', or unset "
                         f"it for this machine's default ({default_method()!r}); 'fork' is "
                         f"refused: a fork of a kernel that has used CUDA breaks the ranks")
    return method


# -- the server ddpkit started, and the groups using it
_LOCK = threading.RLock()  # held while ranks start, so the server is not stopped meanwhile
_users = 0                 # open groups whose ranks are forks of the server
_ours = None               # the server's pid when ddpkit started it (else None)
_ours_env = None           # the start-up variables it started under
_timer = None


def server_pid():
    """The kernel's forkserver's pid, while one runs (ddpkit's or not)."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


class Start:
    """Hold while ranks start (made before the first, `started` after the last): ``.method``
    and ``.context`` say how; `release` once the group using them has ended its ranks."""

    def __init__(self, env):
        global _users
        _LOCK.acquire()
        try:
            method = start_method()
            if method == "forkserver" and _ours is not None and _ours_env != env:
                if _users == 0:
                    _stop()
                else:
                    method = "spawn"  # the server's torch started under other variables
            self.method, self.env, self._released = method, env, False
            self.context = tmp.get_context(method)
            if method == "forkserver":
                self.context.set_forkserver_preload(PRELOAD)
                self._before = server_pid()
                _users += 1
        except BaseException:
            _LOCK.release()
            raise

    def started(self):
        """The ranks are started (or failed to): the lock goes; a server started now is ours."""
        global _ours, _ours_env
        try:
            pid = server_pid()
            if self.method == "forkserver" and pid is not None and pid != self._before \
                    and (self._before is None or self._before == _ours):
                _ours, _ours_env = pid, self.env
        finally:
            _LOCK.release()

    def release(self):
        """The group's ranks have ended: an unused server of ours ends after the idle time.
        Once per start, whoever calls it (a group may be closed by two threads at once)."""
        global _users, _timer
        if self.method != "forkserver":
            return
        with _LOCK:
            if self._released:
                return
            self._released = True
            _users -= 1
            if _users or _ours is None:
                return
            if _timer is not None:
                _timer.cancel()
            try:
                idle = idle_timeout()
            except ValueError:
                idle = IDLE_DEFAULT_S  # the shared pool reports the bad value
            _timer = threading.Timer(idle, _stop_if_idle)
            _timer.daemon = True
            _timer.start()


def stop_if_unused():
    """End ddpkit's forkserver now unless ranks forked from it are open; True if it ended."""
    with _LOCK:
        return _users == 0 and _stop()


def _stop_if_idle():
    with _LOCK:
        if threading.current_thread() is _timer:  # not a timer a later release replaced
            stop_if_unused()


def _stop():
    global _ours, _ours_env, _timer
    ended = False
    if _ours is not None and server_pid() == _ours:
        _end_server(forkserver._forkserver)
        ended = True
    if _timer is not None and threading.current_thread() is not _timer:
        _timer.cancel()
    _ours = _ours_env = _timer = None
    return ended


def _end_server(server, wait_s=2.0):
    """End the server without waiting on its alive pipe: the stdlib's own ``_stop`` (a helper of
    its tests) closes the pipe and waits for the server to see it closed, which never happens
    while any other holder of that pipe lives: every process forked from the kernel since the
    server started (a DataLoader's fork workers, say) holds it. SIGTERM ends the server (it has
    no handler for it; ranks of other groups are none: only an unused server is ended); it is
    reaped within ``wait_s``, else by a thread, so no zombie stays."""
    with server._lock:
        pid, fd = server._forkserver_pid, server._forkserver_alive_fd
        address = server._forkserver_address
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    if fd is not None:
        os.close(fd)
    if address and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.01)
    threading.Thread(target=_reap, args=(pid,), name="ddpkit-forkserver-reaper", daemon=True).start()


def _reap(pid):
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
