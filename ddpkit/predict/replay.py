"""Per-op times from a profile: each op a simulated step runs, run again for real on this
machine at its own shapes, strides and dtypes, and timed.

`optrace.OpTrace` keeps, for every op that moves data, a *recipe*: the op's overload and its
arguments with each tensor replaced by its shape, strides and dtype. `measure(recipe)` builds
real tensors to that recipe (floats uniform in [0.5, 1.5): no NaN, no division by zero; integers and booleans zero, a
valid index for any gather, embedding or loss), runs the op the way `rates.timed` times
anything (this thread's CPU time, the median of rounds: a loaded machine gives the op's own
cost), and the answer is kept per recipe in the machine's calibration, so each distinct op is
measured once on a machine. An op too large to run here (more than `LIMIT_BYTES` of tensors,
or `LIMIT_FLOPS`: a real-size model's) is not run: its time comes from the machine's rate
tables (`machine.Machine`).
"""
from __future__ import annotations

import threading
import time

import torch

from . import rates

LIMIT_BYTES = 64 * 2**20
LIMIT_FLOPS = 4e9
_THREADS_LOCK = threading.Lock()
LEARNING = threading.RLock()
"""Held while a machine learns (its figures grow) or is written out (`calibrate.remember`)."""


class Meta(tuple):
    """A tensor in a recipe: (shape, stride, dtype name, storage offset)."""


class Special(tuple):
    """A dtype, memory format, layout or device in a recipe: (kind, name)."""


def describe(value):
    """``value`` (an op's arguments) with each tensor as its `Meta`; None when an argument is
    of a kind a replay cannot rebuild (then the op is not replayed)."""
    if isinstance(value, torch.Tensor):
        return Meta((tuple(value.shape), tuple(value.stride()), str(value.dtype)[6:],
                     value.storage_offset()))
    if isinstance(value, (list, tuple)):
        items = [describe(v) for v in value]
        return _NO if any(i is _NO for i in items) else tuple(items)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return Special(("torch", str(value)[6:]))
    if isinstance(value, torch.device):
        return Special(("device", "cpu"))
    return _NO


_NO = object()


def recipe(func, args, kwargs):
    """A hashable recipe for ``func(*args, **kwargs)``, or None."""
    a, k = describe(args), describe(tuple(sorted(kwargs.items())))
    if a is _NO or k is _NO:
        return None
    return (str(func), a, k)


def _build(meta):
    if isinstance(meta, Meta):
        shape, stride, dtype, offset = meta
        dt = getattr(torch, dtype)
        size = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s)
        flat = torch.empty(max(size, 1), dtype=dt)
        if dt.is_floating_point or dt.is_complex:
            flat.uniform_(0.5, 1.5)  # no NaN from a square root, no zero to divide by
        else:
            flat.zero_()
        return flat.as_strided(shape, stride, offset)
    if isinstance(meta, Special):
        return torch.device("cpu") if meta[0] == "device" else getattr(torch, meta[1])
    if isinstance(meta, tuple):
        return tuple(_build(m) for m in meta)
    return meta


def _op(name):
    """The op overload of its name ('aten.div.Tensor')."""
    namespace, packet, overload = name.split(".", 2)
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def too_large(op):
    return op.bytes > LIMIT_BYTES or op.flops > LIMIT_FLOPS


def measure(item, threads=1):
    """Seconds (this thread's CPU time) of one run of the op a recipe describes, with
    ``threads`` intra-op threads (a rank's); None when the op cannot be rebuilt here."""
    name, args, kwargs = item
    try:
        fn = _op(name)
        real_args = _build(args)
        real_kwargs = dict(_build(kwargs))
    except Exception:  # an op or argument this torch cannot make: its rate tables instead
        return None
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                return rates.timed(lambda: fn(*real_args, **real_kwargs), min_s=0.001,
                                   rounds=3, clock=time.thread_time)
        except Exception:
            return None
        finally:
            torch.set_num_threads(before)


def key(item):
    """A recipe as a JSON key."""
    return repr(item)


def learn(machine, stream, threads=None):
    """Measure what ``stream`` needs of ``machine`` (this machine's) and it has not measured
    yet: each op small enough to run again here, and the rate tables (`rates.tables`) when an
    op cannot be run again. Returns how many things it measured."""
    threads = threads or machine.threads
    with LEARNING:  # the Lab's predictor and a cell's prediction may learn at once
        todo = {}
        for op in stream:
            item = getattr(op, "recipe", None)
            if item is not None and not too_large(op) and key(item) not in machine.replayed:
                todo[key(item)] = item
        for k, item in todo.items():
            machine.replayed[k] = measure(item, threads)
        if machine.needs_tables() and any(_unreplayed(machine, op) for op in stream):
            for name, table in rates.tables(threads).items():
                setattr(machine, name, table)
            return len(todo) + 1
        return len(todo)


def _unreplayed(machine, op):
    """An op whose time must come from the rate tables. Not one that moves no bytes: a profiler
    range's end (``_record_function_exit``, whose handle a recipe cannot hold) costs its
    dispatch alone (`Machine.op_s`), so a small step does not measure the tables for it."""
    return getattr(op, "kind", "view") not in ("view", "collective") and (
        op.recipe is None or machine.replayed.get(key(op.recipe)) is None) and not (
        op.kind == "memory" and op.bytes == 0)
