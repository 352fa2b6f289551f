"""A launch's job and the checks made before it: each check named for what it checks and saying
how to recover, all made before any process exists. The job (function, arguments, seed, the
kernel's determinism flags, the collective timeout, the kernel's environment) is cloudpickled
once and sent to every rank, whether they start fresh (`launch`) or wait in a `Pool`.
"""
from __future__ import annotations

import inspect
import os
import socket
import sys

from .. import shipping
from ..devices import mmap_threshold_problem
from ..rank.entry import capture_job_state
from .group import HOST


def finish(handle, block, held):
    """A started run's handle, or its result; a kernel interrupt held while it started stops it
    and is raised now (its ranks all known, so all ended)."""
    if held:
        handle.stop()
        raise KeyboardInterrupt
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
                shipping.dumps(obj)  # as the job is pickled (modules by name)
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


def collective_timeout(stall_timeout_s):
    """gloo/NCCL's own collective timeout: above the watchdog's, so the watchdog speaks first."""
    return max(120.0, 2 * stall_timeout_s) if stall_timeout_s else 1800.0


def make_job(fn, args, kwargs, seed, stall_timeout_s):
    """One job for the ranks (a spawned group's or a warm pool's), checked: the function and
    its arguments by value, the seed, the kernel's determinism flags, the collective timeout."""
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s={stall_timeout_s!r}: pass a number of seconds > 0, "
                         f"or None to turn the watchdog off")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    problem = mmap_threshold_problem()  # read by each CPU rank at its start
    if problem:
        raise ValueError(problem)
    payload = check_picklable(fn, args, kwargs)
    # the collective timeout travels with each job: a pool's ranks serve jobs of any
    # stall_timeout_s, and torch's own timeout must never fire before ddpkit's watchdog. So do
    # the kernel's environment and import path of this moment: what a fresh rank inherits, and
    # what a warm rank takes on before the job (ddpkit.rank.fresh.Baseline.enter)
    return {"payload": payload, "seed": seed, "flags": capture_job_state(),
            "pg_timeout_s": collective_timeout(stall_timeout_s), "environ": dict(os.environ),
            "sys_path": list(sys.path)}
