"""Measurements, each a real reading (estimates live in estimate.py):

* `ActivationProbe`: bytes saved for backward, via ``torch.autograd.graph.saved_tensors_hooks``
  around the forward, counting each storage once and leaving parameters out (a saved
  ``weight.t()`` is a view of a parameter, not an activation). A checkpointed segment's input is
  held by the checkpoint for the recompute; non-reentrant checkpointing does not save it through
  the hooks, so the policy reports it (``on_segment_input``) and it is counted once too.
* The step's peak memory, its phase and what it is made of: `ddpkit.engine.memory.PeakProbe`.
* `CommCounter`: a DDP communication hook that wraps the default all-reduce and counts calls and
  bytes (and notes where DDP's bucket buffers are, for the peak's ledger); the timeline
  (``timeline.py``) watches each call through it.
* `count_flops`: FLOPs of a callable via ``FlopCounterMode``: noise-free, unlike a clock.
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

from .collectives import CollectiveCounter


def _local(t):
    """This rank's part of a tensor (a DTensor's local shard under FSDP)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t):
    t = _local(t)
    return t.numel() * t.element_size()


def storage(t):
    """(identity of ``t``'s storage, its bytes): what the activation probe counts once."""
    # keyed on the StorageImpl, not data_ptr(): under FakeTensorMode (the estimate) every
    # data_ptr() is 0, while views still share their base's StorageImpl there too
    st = t.untyped_storage()
    return st._cdata, st.nbytes()


class ActivationProbe:
    """Use ``with probe.forward(model):`` around each forward; ``policy``: the `CheckpointPolicy`
    installed on the model (each tensor its regions keep is counted; `new_step` sets the one in
    force for a step). ``bytes``: the last forward's
    saved bytes; ``max_bytes``: the largest since ``new_step()`` (one micro-batch's worth).
    ``saved_keys`` / ``saved_addresses``: per forward since ``new_step()``, the StorageImpl ids
    and data addresses of what it saved (the peak's ledger names these blocks activations)."""

    def __init__(self, policy=None):
        self.bytes = self.max_bytes = 0
        self.saved_keys, self.saved_addresses = [], []
        self.owner = None     # who saves now (the estimate sets the running block's index)
        self.by_owner = {}    # owner -> bytes it saved, in the last forward
        self._seen = {}       # storage id -> (weak ref, bytes, owner, address): this forward's
        self._params = set()
        self._model = None
        self._known = None    # (model, its parameters' storages) when not sharded
        self.policy = policy  # the checkpoint policy in force (`new_step` sets it each step)

    def new_step(self, policy=None):
        """A new optimizer step, under ``policy`` (the `CheckpointPolicy` installed on the model
        the forwards run, if any: each tensor its regions keep is counted too)."""
        self.max_bytes = 0
        self.saved_keys, self.saved_addresses = [], []
        self.policy = policy

    def _count(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, nbytes = st._cdata, st.nbytes()
        if key in self._params or nbytes == 0:
            return
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is not None:
            return  # counted, and still alive (a dead one's address may be taken again)
        if self._model is not None:
            # FSDP's gathered (unsharded) parameters are plain tensors; its shards, DTensors,
            # are never saved by the forward: only the former are looked up
            self._params |= {storage(p)[0] for p in self._model.parameters()
                             if not hasattr(p, "to_local")}
            if key in self._params:
                return
        # a FakeTensor's storage has no address (the estimate's trace)
        address = None if is_fake(t) else st.data_ptr()
        self._seen[key] = (weakref.ref(st), nbytes, self.owner, address)

    def _settle(self):
        """What the forward saved and still holds: a saved tensor whose graph died before the
        forward ended (an output the model dropped, as a router's replaced top-k) is not
        held, and its address may have been taken by another since."""
        held = [(k, v) for k, v in self._seen.items() if v[0]() is not None]
        self.bytes = sum(v[1] for _, v in held)
        self.saved_keys[-1] = [k for k, _ in held]
        self.saved_addresses[-1] = [v[3] for _, v in held if v[3] is not None]
        self.by_owner = {}
        for _, (_, nbytes, owner, _) in held:
            if owner is not None:  # only the estimate's per-block trace names owners
                self.by_owner[owner] = self.by_owner.get(owner, 0) + nbytes

    @contextlib.contextmanager
    def forward(self, model):
        self.bytes = 0
        self.saved_keys.append([])
        self.saved_addresses.append([])
        self.by_owner = {}
        self._seen.clear()
        if self._known is not None and self._known[0] is model:
            # a frozenset: `_count` adds to the set only for sharded models, never cached
            self._params, self._model = self._known[1], None
        else:
            self._params = {storage(_local(p))[0] for p in model.parameters()}
            # FSDP2 swaps each block's sharded parameters for all-gathered ones during its
            # forward: those are parameters too, so look again whenever an unknown storage is
            # saved. Unsharded parameters are updated in place: looked up once per model
            sharded = any(hasattr(p, "to_local") for p in model.parameters())
            self._model = model if sharded else None
            self._known = None if sharded else (model, frozenset(self._params))
        policy = self.policy
        if policy is not None:
            policy.on_segment_input = self._count

        def pack(t):
            self._count(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            self._settle()
            self.max_bytes = max(self.max_bytes, self.bytes)
            if policy is not None:
                policy.on_segment_input = None


def state_bytes(model, optimizer):
    """Bytes of parameters, gradients and optimizer state, as torch holds them now."""
    params = grads = 0
    for p in model.parameters():
        params += _nbytes(p)
        if p.grad is not None:
            grads += _nbytes(p.grad)
    return params, grads, optimizer_state_bytes(optimizer)


def optimizer_state_bytes(optimizer):
    """This rank's optimizer-state bytes (ZeroRedundancyOptimizer: only the local shard)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += _nbytes(v)
    return total


class CommCounter:
    """Counts the all-reduces DDP issues and the bytes they carry. ``install(ddp_model)``
    registers the hook. ``compress``: a compression hook ``(state, bucket) -> Future`` to wrap
    instead of the plain all-reduce; ``element_bytes``: what each element then travels as (2
    for torch's fp16/bf16 hooks; None where the hook's sizes vary, as PowerSGD's: ``bytes`` is
    then None and the step's record takes them from `collectives.CollectiveCounter`)."""

    def __init__(self, compress=None, element_bytes=None, watch=None):
        self.calls = 0
        self.bytes = 0 if compress is None or element_bytes else None
        self.compress, self.element_bytes = compress, element_bytes
        self.watch = watch  # (bucket, nbytes, launch) -> future: the timeline's observer
        self.buckets = {}  # bucket index -> (data address, bytes) of DDP's flat buffer

    def reset(self):
        self.calls = 0
        self.bytes = None if self.bytes is None else 0

    @staticmethod
    def _hook(state, bucket):
        buf = bucket.buffer()
        state.calls += 1
        st = buf.untyped_storage()
        state.buckets[bucket.index()] = (st.data_ptr(), st.nbytes())
        if state.compress is not None:
            nbytes = buf.numel() * state.element_bytes if state.element_bytes else None
            launch = lambda: state.compress(None, bucket)  # noqa: E731
        else:
            nbytes = buf.numel() * buf.element_size()
            launch = lambda: state.allreduce(buf)  # noqa: E731
        if nbytes is not None:
            state.bytes += nbytes
        return launch() if state.watch is None else state.watch(bucket, nbytes, launch)

    def bucket_buffers(self):
        """{data address: bytes} of DDP's bucket buffers, as the last all-reduces saw them."""
        return dict(self.buckets.values())

    def install(self, ddp_model):
        self.allreduce = AllReduce(ddp_model.process_group)
        ddp_model.register_comm_hook(self, CommCounter._hook)
        return self


class AllReduce:
    """torch's ``allreduce_hook`` on one group (the bucket divided by the group's size, summed
    over its ranks, handed back as a future of the tensor), for the hook on every bucket of
    every step, at less Python: the group's size and the options made once, the all-reduce
    issued on the group itself (``dist.all_reduce``'s own checks, done once here), below the
    Autograd key, and counted here, directly, into the active `collectives.CollectiveCounter`
    (its kernel on the op costs ~0.1 ms of Python a call). Measured in a gloo rank, CPU time to
    issue one bucket's all-reduce (bench's GPT, 0.8 MB): 258-275 us through torch's hook and
    the counter's kernel, see the overhead section of bench/results.md for the step."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group, self.size = group, group.size()
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = dist.ReduceOp.SUM

    def __call__(self, buf):
        buf.div_(self.size)
        with torch._C._AutoDispatchBelowAutograd():  # straight to the backend's kernel
            fut = self.group.allreduce([buf], self.opts).get_future()
        CollectiveCounter.note_allreduce(buf.numel() * buf.element_size(), self.size)
        return fut.then(_first)


def _first(fut):
    return fut.value()[0]


class StepTimer:
    """Wall time of a block; on CUDA it synchronises first so queued kernels are counted."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = 0.0

    @contextlib.contextmanager
    def time(self):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield self
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t0


def count_flops(fn, *args, **kwargs):
    """Total FLOPs that ``fn(*args, **kwargs)`` runs (matmuls and attention), by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()
