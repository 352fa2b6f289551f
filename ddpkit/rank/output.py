"""Everything a rank says to the kernel, over its one pipe.

Messages are small tuples ``(kind, rank, payload, t)``: ``started``, ``metric``, ``print``,
``return``, ``error``; a ``return``'s tensor bytes follow it on the pipe (`returns.py`). The
kernel never reads a rank's stdout: file descriptors 1 and 2 are re-pointed at a pipe whose
lines are forwarded as ``print`` messages, so rank output cannot land in whichever notebook cell
happens to be running. Tensors reach the kernel as CPU tensors.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import torch

from .returns import cpu_copy, write_buffers


_AS_IS = frozenset((int, float, str, bool, type(None)))  # most of a record: taken as they are


def plain(value):
    """Turn one-element tensors and numpy scalars into Python numbers so records pickle small;
    other tensors become CPU copies (see `returns.cpu_copy`), inside lists, tuples and dicts too."""
    if type(value) in _AS_IS:  # every step's record: ~2 us a field saved
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else cpu_copy(value)
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    return value


class Channel:
    """One rank's pipe to the kernel; thread-safe because output forwarding sends too."""

    def __init__(self, conn, rank):
        self.conn, self.rank = conn, rank
        self._lock = threading.Lock()

    def send(self, kind, payload=None, buffers=()):
        """One message; ``buffers`` (a return value's tensor bytes, `returns.dumps_for_kernel`)
        follow it on the pipe itself, the lock keeping any output line from landing between."""
        # Pickled here, by value. ``conn.send`` would use multiprocessing's pickler, for which
        # torch.multiprocessing registers its shared-memory reductions: a CPU tensor in a record
        # would travel as a file descriptor that the kernel fetches from this process's
        # resource sharer on reading it, which fails once this rank has exited (a record read
        # late, after the rank returned, was lost and the run called a crash).
        data = pickle.dumps((kind, self.rank, payload, time.time()), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                self.conn.send_bytes(data)
                write_buffers(self.conn, buffers)
            except (BrokenPipeError, EOFError, OSError):
                pass  # the kernel is gone or stopped us; nothing left to tell

    def poll(self):
        with self._lock:
            return self.conn.poll()

    def recv(self):
        return self.conn.recv()


class OutputForwarder:
    """Point fds 1 and 2 at a pipe and forward its lines as ``print`` messages.

    ``sync()`` waits until every line written so far has been sent, so a rank's prints always
    reach the kernel before its ``return`` message does.
    """

    _MARK = b"\x00ddpkit-sync\n"
    # kineto prints these on every profiler window (the CPU peak probe opens one per step);
    # they say nothing about the user's run, so they are not forwarded
    _NOISE = (b"ActivityProfilerHandler.cpp", b"was allocated before the profiling started")

    def __init__(self, channel):
        self.channel = channel
        self._synced = threading.Event()
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        self._thread = threading.Thread(target=self._pump, args=(read_fd,),
                                        name="ddpkit-output", daemon=True)
        self._thread.start()

    def _pump(self, read_fd):
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                if raw.endswith(self._MARK):  # after a partial line (print(..., end=""))
                    head = raw[:-len(self._MARK)]
                    if head:
                        self.channel.send("print", head.decode("utf-8", "replace"))
                    self._synced.set()
                elif not any(n in raw for n in self._NOISE):
                    self.channel.send("print", raw.decode("utf-8", "replace").rstrip("\n"))

    def sync(self, timeout=2.0):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._synced.clear()
        os.write(1, self._MARK)
        self._synced.wait(timeout)

    def finish(self):
        """Close our ends so the pump sees EOF after the last line, then wait for it."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.close(1)
        os.close(2)
        self._thread.join(timeout=2)
