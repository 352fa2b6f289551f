"""The CUDA streams and events a CUDA rank's FSDP2 uses, recorded while its step is simulated.

FSDP2 overlaps its collectives with compute through CUDA streams (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`` and ``_fsdp_collectives.py``):
each all-gather's copy-in runs on an ``all_gather_copy_in_stream``, the all-gather on an
``all_gather_stream`` (both high priority; in forward and in backward's prefetch), the copy-out
on the compute stream after waiting for the all-gather's event; gradients are copied into the
reduce-scatter input on the compute stream, and the reduce-scatter with its division and the
sharded gradient's accumulation run on a ``reduce_scatter_stream``, which waits for the compute
stream first. Events bound how far ahead each stream runs (the next all-gather waits for the
previous copy-out; a block's post-backward waits for the previous reduce-scatter; the end of
backward for the last).

FSDP2 asks for streams and events through a device handle: on a CPU rank (and in the
simulation, which runs on CPU fake tensors) that is ``torch.cpu``, whose ``Stream`` and
``Event`` do nothing. `recorded(trace)` puts stand-ins there for the steps of a CUDA rank's
simulation: each stream FSDP2 makes gets a number (0 is the compute stream), every op runs
tagged with the stream current when it ran (`optrace.Op.stream`), and every
``record_event``/``wait_event``/``wait_stream``/``synchronize`` becomes a mark in the trace.
`gpuplay` replays them with CUDA's semantics. The stand-ins are process-wide while a simulation
runs (it holds `simulate._LOCK`); nothing else in a kernel uses ``torch.cpu``'s streams.
"""
from __future__ import annotations

import contextlib
import itertools

import torch


class _Recorder:
    def __init__(self, trace):
        self.trace = trace
        self.streams = itertools.count(1)
        self.events = itertools.count(1)
        self.default = Stream.__new__(Stream)
        self.default.id, self.default.rec = 0, self
        self.current = self.default

    def mark(self, what, block, stream):
        self.trace.mark(what, block, stream=stream)


_ACTIVE = []  # the recorder of the simulation under way


class Stream:
    """A stand-in for ``torch.cpu.Stream`` that FSDP2 makes for one of its streams."""

    def __init__(self, priority=-1, **_):
        self.rec = _ACTIVE[-1]
        self.id = next(self.rec.streams)

    def wait_stream(self, other):
        self.rec.mark("wait_stream", other.id, self.id)

    def wait_event(self, event):
        if event is not None:
            self.rec.mark("wait_event", event.id, self.id)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event


class Event:
    """A stand-in for ``torch.cpu.Event``: each record and wait is a mark."""

    def __init__(self, *_, **__):
        self.rec = _ACTIVE[-1]
        self.id = next(self.rec.events)

    def record(self, stream=None):
        self.rec.mark("record", self.id, (stream or self.rec.current).id)
        return self

    def wait(self, stream=None):
        self.rec.mark("wait_event", self.id, (stream or self.rec.current).id)

    def synchronize(self):
        self.rec.mark("sync_event", self.id, 0)

    def query(self):
        return True


def _current_stream(device=None):
    return _ACTIVE[-1].current


@contextlib.contextmanager
def _stream(stream):
    rec = _ACTIVE[-1]
    if stream is None:
        yield
        return
    outer, rec.current = rec.current, stream
    rec.trace.cuda_stream = stream.id
    try:
        yield
    finally:
        rec.current = outer
        rec.trace.cuda_stream = outer.id


@contextlib.contextmanager
def recorded(trace):
    """While active, ``torch.cpu``'s streams and events are `Stream` and `Event`, which record
    into ``trace`` (an `optrace.OpTrace`)."""
    rec = _Recorder(trace)
    names = ("Stream", "Event", "current_stream", "stream")
    saved = {n: getattr(torch.cpu, n) for n in names}
    _ACTIVE.append(rec)
    torch.cpu.Stream, torch.cpu.Event = Stream, Event
    torch.cpu.current_stream, torch.cpu.stream = _current_stream, _stream
    try:
        yield rec
    finally:
        _ACTIVE.pop()
        for n, fn in saved.items():
            setattr(torch.cpu, n, fn)
        trace.cuda_stream = 0
