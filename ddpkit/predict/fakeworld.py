"""The world a simulated rank runs in (`ddpkit.predict.simulate`): torch's ``FakeProcessGroup`` as
the default group, and the few places where the rank's own code cannot run on fake tensors or a
fake group, each adjusted here with why the bytes stay the same.

* DDP's constructor checks parameter shapes across ranks and broadcasts rank 0's weights; both
  read tensor data, which a fake tensor has not, and allocate nothing that lasts: skipped.
* The fake group's all-reduce returns no value, so the simulation registers its own DDP comm
  hook with the rank hook's memory: the plain all-reduce works in place on the bucket;
  ``comm_hook="fp16"/"bf16"`` (torch's ``_compress_hook``) allocates a 2-byte copy of the
  bucket, all-reduces it and copies it back.
* DDP rebuilds its buckets in step 1's forward. ``Reducer::initialize_buckets`` clears the old
  buckets before it allocates the new ones (the same bytes: one flat buffer per bucket of the
  gradients), and at that moment the gradients are None (`zero_grad` sets them so), so the
  rebuild never holds both: step 1's peak is the steady state's. The rebuild syncs the new
  order across ranks by reading tensors, so the simulation keeps the first layout.
* FSDP2 frees and refills its unsharded parameters with ``UntypedStorage.resize_``, which no
  dispatch mode sees: watched here. Blocks made inside its all-gather and reduce-scatter are
  marked FSDP's buffers (on a rank: the ``FSDP::all_gather*`` and ``FSDP::post_backward_reduce``
  profiler ranges).
* DTensor works out each new op's output metadata by running it on global-shape fake tensors,
  once per op and sharding: not a rank's bytes, so not counted.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.distributed as dist

_BACKEND = "ddpkit_fake"


def _register_backend():
    if _BACKEND.upper() in dist.Backend.backend_list or _BACKEND in dist.Backend.backend_list:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    dist.Backend.register_backend(
        _BACKEND, lambda common, opts: FakeProcessGroup._create_internal(
            common.group_rank, common.group_size), extended_api=True, devices=["cpu", "cuda"])


@contextlib.contextmanager
def fake_world(rank, world_size):
    """The default process group, for the duration, as rank ``rank`` of ``world_size`` in
    torch's FakeProcessGroup; DDP's two data-reading start-up checks skipped (see above)."""
    import torch.nn.parallel.distributed as ddp_module

    if dist.is_initialized():
        raise RuntimeError(
            "ddpkit.estimate(...).peak() simulates a rank with a fake default process group, "
            "and this process has a process group of its own: call it from a kernel (or "
            "script) that has not called torch.distributed.init_process_group")
    _register_backend()
    skipped = {"_verify_param_shape_across_processes": None, "_sync_module_states": None}
    for name in skipped:
        skipped[name] = getattr(ddp_module, name)
        setattr(ddp_module, name, lambda *args, **kwargs: None)
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:": once per world
    dist.init_process_group(_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        for name, fn in skipped.items():
            setattr(ddp_module, name, fn)


def _comm_hook(compress):
    """A DDP comm hook with the memory of ddpkit's (`probes.CommCounter`) on a fake group."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(compress)

    def hook(world_size, bucket):
        buffer = bucket.buffer()
        if dtype is None:
            buffer.div_(world_size)
        else:  # torch's _compress_hook: a 2-byte copy travels, then is copied back
            sent = buffer.to(dtype).div_(world_size)
            buffer.copy_(sent)
            del sent
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    return hook


# ----------------------------------------------------------------------------- live storages

@contextlib.contextmanager
def watch_storage_resizes(live):
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        old = storage.nbytes()
        out = original(storage, size)
        live.resized(storage, old)
        return out
    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def mark_fsdp_collectives(live):
    """Blocks made inside FSDP2's all-gather and reduce-scatter are FSDP's buffers (on a rank:
    the ``FSDP::all_gather*`` and ``FSDP::post_backward_reduce`` profiler ranges)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    except ImportError:
        yield
        return
    names = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
    originals = {n: getattr(group, n) for n in names if hasattr(group, n)}

    def flagged(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            outer, live.fsdp = live.fsdp, True
            try:
                return fn(*args, **kwargs)
            finally:
                live.fsdp = outer
        return run
    for n, fn in originals.items():
        setattr(group, n, flagged(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(group, n, fn)


@contextlib.contextmanager
def skip_dtensor_meta(live):
    """DTensor works out each new op's output metadata by running it on global-shape fake
    tensors (in the active fake mode: ours), then caches the answer per op and sharding: the
    first simulation would count those tensors, which no rank allocates."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield
        return
    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name, None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def unseen(self, *args, **kwargs):
        outer, live.ignore = live.ignore, True
        try:
            return original(self, *args, **kwargs)
        finally:
            live.ignore = outer
    setattr(ShardingPropagator, name, unseen)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)

def watch_buckets(wrapped, plan, handed=None):
    """Register the simulation's comm hook on DDP (``plan``: the rank's `RankPlan`); return what
    it saw of the buckets. ``handed(index, nbytes)``: told each time DDP hands a bucket over
    (its all-reduce starts)."""
    seen = {}
    if not hasattr(wrapped, "register_comm_hook"):
        return seen
    inner = _comm_hook(plan.comm_hook)

    def hook(state, bucket):
        st = bucket.buffer().untyped_storage()
        seen[bucket.index()] = (st._cdata, st.nbytes())
        if handed is not None:
            handed(bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size())
        return inner(state, bucket)
    wrapped.register_comm_hook(plan.world_size, hook)
    wrapped.reducer = _FirstLayout(wrapped.reducer)
    return seen


class _FirstLayout:
    """DDP's reducer, less the bucket rebuild (the module's note: it reads tensor data)."""

    def __init__(self, reducer):
        self.__dict__["_reducer"] = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self):
        return False

