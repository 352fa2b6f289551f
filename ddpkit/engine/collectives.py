"""Every collective a step issues, counted where all of them pass: torch's dispatcher.

`CollectiveCounter` puts a pass-through kernel on each ``c10d`` collective op (``allreduce_``,
``_reduce_scatter_base_``, ``_allgather_base_``, ``broadcast_``, ...) at the ``Autograd`` dispatch
key, with ``torch.library``. Every collective reaches that op whoever issues it: Python's
``dist.all_reduce``, FSDP2's all-gathers and reduce-scatters, ZeroRedundancyOptimizer's
broadcasts, **and** those DDP's C++ reducer makes (its bucket-order broadcasts at step 1, the
default all-reduce) or that a comm hook makes in a ``Future.then`` callback on gloo's own thread
(PowerSGD's P and Q all-reduces).

Why not torch's ``CommDebugMode`` (``torch.distributed.tensor.debug``)? It is a
``TorchDispatchMode``: thread-local. Measured on gloo (torch 2.13, 2 ranks): it does see the
all-reduce DDP's C++ reducer issues on the thread that runs backward, and FSDP2's collectives,
but with PowerSGD it saw one all-reduce a step where three ran (the P and Q all-reduces are
issued in future callbacks on gloo's thread, outside the mode); and a dispatch mode sends
*every* op of the step through Python, which slows the step it measures. A kernel on the
collective ops alone costs one Python call per collective (about 0.1 ms) and nothing else.
Not a wrapper around ``dist.*`` either: that misses what C++ issues (DDP's reducer).

Bytes are counted the way the ZeRO paper counts communication volume: what each rank sends
(and, in the same amount, receives) under the bandwidth-optimal algorithms for a group of n
ranks: an all-reduce of B bytes 2(n-1)/n B (a reduce-scatter then an all-gather); a
reduce-scatter (n-1)/n of its input; an all-gather (n-1)/n of its output; a broadcast (n-1)/n B
(n-1 copies of B leave somewhere, spread over n ranks). gloo's own algorithms may send more;
its wire bytes are not observable from here. ``payload`` keeps the plain tensor bytes too.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

# op -> (what the record calls it, which argument holds the bytes counted, the volume rule)
#   rule "ar": 2(n-1)/n B;  "part": (n-1)/n B;  "each": (n-1) B (B one rank's piece)
_OPS = {
    "allreduce_": ("allreduce", 0, "ar"),
    "allreduce_coalesced_": ("allreduce", 0, "ar"),
    "_reduce_scatter_base_": ("reduce_scatter", 1, "part"),
    "reduce_scatter_": ("reduce_scatter", 0, "each"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, "part"),
    "_allgather_base_": ("allgather", 0, "part"),
    "allgather_": ("allgather", 1, "each"),
    "allgather_coalesced_": ("allgather", 1, "each"),
    "allgather_into_tensor_coalesced_": ("allgather", 0, "part"),
    "broadcast_": ("broadcast", 0, "part"),
    "reduce_": ("reduce", 0, "part"),
    "alltoall_base_": ("alltoall", 1, "part"),
    "alltoall_": ("alltoall", 1, "part"),
    "gather_": ("gather", 1, "part"),
    "scatter_": ("scatter", 0, "part"),
}
_RULES = {"ar": lambda n: 2 * (n - 1) / n, "part": lambda n: (n - 1) / n, "each": lambda n: n - 1}
_GROUP_ARG = {"allreduce_": 1, "allreduce_coalesced_": 1, "_reduce_scatter_base_": 2,
              "reduce_scatter_": 2, "reduce_scatter_tensor_coalesced_": 2, "_allgather_base_": 2,
              "allgather_": 2, "allgather_coalesced_": 2, "allgather_into_tensor_coalesced_": 2,
              "broadcast_": 1, "reduce_": 1, "alltoall_base_": 2, "alltoall_": 2, "gather_": 2,
              "scatter_": 2}


def _bytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


def _group_size(pg):
    """The ranks of the collective's group: the op gets it as a TorchScript object, which
    ``ProcessGroup.unbox`` turns back into the ProcessGroup (as torch's functional collectives
    do)."""
    if isinstance(pg, torch.ScriptObject):
        pg = torch.distributed.ProcessGroup.unbox(pg)
    return pg.size()


class CollectiveCounter:
    """The collectives of this process while ``active``: ``calls``, ``by_op`` (bytes sent per
    collective, as above) and ``payload`` (tensor bytes per collective). One per process: the
    kernels are installed once and count into whichever counter is active (None: pass through)."""

    _lib = None
    _active = None
    _lock = threading.Lock()

    def __init__(self):
        self.calls = 0
        self.by_op = defaultdict(int)
        self.payload = defaultdict(int)

    def reset(self):
        with self._lock:
            self.calls = 0
            self.by_op, self.payload = defaultdict(int), defaultdict(int)

    @property
    def bytes(self):
        return sum(self.by_op.values())

    def start(self):
        CollectiveCounter._install()
        CollectiveCounter._active = self
        return self

    def stop(self):
        if CollectiveCounter._active is self:
            CollectiveCounter._active = None

    @classmethod
    def uninstall(cls):
        """Take the kernels off the ops again (at a run's end): in a warm rank the next job's
        collectives, DDP's own all-reduce included, would each pass through a Python call
        (~40 us a collective measured on gloo) for nothing. A ``torch.library.Library``'s
        registrations go with the object."""
        cls._active = None
        cls._lib = None

    @classmethod
    def note_allreduce(cls, nbytes, n):
        """Count an all-reduce of ``nbytes`` over ``n`` ranks issued below the Autograd key
        (where the kernel here does not see it: `probes.AllReduce`), into the active counter."""
        counter = cls._active
        if counter is not None:
            with counter._lock:
                counter.calls += 1
                counter.by_op["allreduce"] += round(nbytes * _RULES["ar"](n))
                counter.payload["allreduce"] += nbytes

    def _count(self, name, args):
        kind, arg, rule = _OPS[name]
        n = _group_size(args[_GROUP_ARG[name]])
        size = _bytes(args[arg])
        with self._lock:
            self.calls += 1
            self.by_op[kind] += round(size * _RULES[rule](n))
            self.payload[kind] += size

    @classmethod
    def _install(cls):
        if cls._lib is not None:
            return
        lib = torch.library.Library("c10d", "IMPL")  # noqa: TOR901 - kept until `uninstall`
        for name in _OPS:
            op = getattr(torch.ops.c10d, name).default

            def kernel(*args, _op=op, _name=name, **kwargs):
                counter = CollectiveCounter._active
                if counter is not None:
                    counter._count(_name, args)
                with torch._C._AutoDispatchBelowAutograd():  # on to the op's CPU/CUDA kernel
                    return _op(*args, **kwargs)

            lib.impl(name, kernel, "Autograd")
        cls._lib = lib

    def record_fields(self):
        """``comm_bytes``, ``comm_by_op`` and ``comm_calls`` for a step's record."""
        with self._lock:
            return dict(comm_bytes=self.bytes, comm_by_op=dict(self.by_op),
                        comm_calls=self.calls)
