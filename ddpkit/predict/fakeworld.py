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
* autograd sums two gradients of one tensor in place when it holds the only reference to the
  buffered one and its storage (``InputBuffer::accumulate``: ``old.add_(new)``; a view is
  never summed into, its base holds the storage too), but never for a tensor subclass or
  while a dispatch mode is on (``isTensorSubclassLike``): a fake run always makes the sum anew,
  holding three tensors where the rank holds two (a residual stream's gradient, a weight read
  by slices: an MoE expert's, Mamba's scan). `Accumulations` puts the sum back in place: a
  buffered gradient, no view, that dies as soon as its sum is made is freed just before the
  sum is allocated (a tied weight's, whose buffered gradient is lm_head's transposed view, is
  summed anew on the rank as in the simulation).
* A checkpointed region keeps the CPU generator's state (``torch.get_rng_state()``, 5,056
  bytes) until its recompute, when ``preserve_rng_state`` is on: a real tensor made outside the
  dispatcher, so no dispatch mode sees it. On a CPU rank `watch_rng_states` counts it while it
  lives (on a CUDA rank it is host memory, not the GPU's).
* gloo's reduce-scatter copies its whole input (``input.clone()``, freed when the op ends) and
  its all-gather fills an output-sized buffer, twice; NCCL's need no tensor of torch's. On a
  CPU (gloo) rank the fake group's collectives allocate those too (`gloo_buffers`): FSDP's
  reduce-scatter, all-gather and ZeRO's broadcasts.
"""
from __future__ import annotations

import contextlib
import functools
import math
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

@contextlib.contextmanager
def watch_rng_states(live, on):
    """Each CPU generator state taken while ``on`` is one of the rank's storages (the note)."""
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        live.add(state.untyped_storage())
        live.rng_states.add(state.untyped_storage()._cdata)
        return state
    if on:
        torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


_GLOO = {  # collective -> (the argument gloo copies or fills, its position, how many times)
    "reduce_scatter_single": ("input", 1, 1), "reduce_scatter_tensor": ("input", 1, 1),
    "all_gather_single": ("output_tensor", 0, 2), "all_gather_into_tensor": ("output_tensor", 0, 2),
    "all_gather": ("tensor_list", 0, 2),
}


@contextlib.contextmanager
def gloo_buffers(on, largest=None):
    """On a CPU (gloo) rank, the fake group's collectives make the tensors gloo makes (the
    module's note): a reduce-scatter's copy of its input, held while it runs; an all-gather's
    output-sized buffer, made and freed twice. ``largest`` (a list) gets the largest in bytes:
    gloo frees it on its own thread as the collective ends, and on a busy machine it can outlive
    the collective while the rank allocates on (`late_note`)."""
    import torch.distributed.distributed_c10d as c10d

    names = [n for n in _GLOO if on and hasattr(c10d, n)]
    originals = {n: getattr(c10d, n) for n in names}

    def around(name, fn):
        arg, position, times = _GLOO[name]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            like = kwargs[arg] if arg in kwargs else args[position]
            shape = (len(like), *like[0].shape) if isinstance(like, (list, tuple)) else like.shape
            first = like[0] if isinstance(like, (list, tuple)) else like
            if largest is not None:
                largest.append(max(largest.pop() if largest else 0,
                                   math.prod(shape) * first.element_size()))
            if times == 1:  # held while the collective runs
                held = torch.empty(shape, dtype=first.dtype, device=first.device)
                try:
                    return fn(*args, **kwargs)
                finally:
                    del held
            for _ in range(times):  # made and freed, one after the other
                torch.empty(shape, dtype=first.dtype, device=first.device)
            return fn(*args, **kwargs)
        return run
    for n, fn in originals.items():
        setattr(c10d, n, around(n, fn))
        setattr(dist, n, getattr(c10d, n))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(c10d, n, fn)
            setattr(dist, n, fn)


def late_note(largest):
    """What the simulated peak cannot say of gloo's buffers: their timing (``largest``: bytes)."""
    return (f"fsdp_buffers: gloo frees its collective buffers (the largest {largest:,} B) on its "
            f"own thread as each collective ends; on a busy machine one can outlive it while the "
            f"rank allocates on, and the measured peak be up to {largest:,} B higher (its timing "
            f"is not modelled)")


class Accumulations:
    """autograd's in-place gradient sum, put back (the module's note). `LiveStorages` reports
    each ``aten.add.Tensor`` the autograd engine runs (`added`) and each free (`died`); at the
    next op (`settle`), a summand that died since is moved to just before the sum was allocated:
    the bytes the rank holds, which updates that summand in place."""

    def __init__(self, live):
        self.live, self.pending = live, None  # (index of the sum's allocation, the buffered
        # summand's key, index of its free or None)
        self.links = []  # (sum's key, event index of its allocation, summand's key): one block
        # (the summand's free is the event just before the sum's allocation)

    def seen_through(self, seen, start):
        """``seen`` (kind, key, index from ``start``) observations, plus the same kind for
        each summand a seen sum continues (the rank's one block, updated in place, is that
        kind all its life: a gradient summed over an MoE's experts is a gradient)."""
        events = self.live.events[start:]
        freed = {}  # (key, allocation index) -> index of its free
        alloc = {}
        for i, (size, key, _, _) in enumerate(events):
            if size > 0:
                alloc[key] = i
            elif key in alloc:
                freed[key, alloc.pop(key)] = i
        by_sum = {}
        for key, at, old in self.links:
            if at >= start:  # the sum's block: from its allocation to its free
                end = freed.get((key, at - start), len(events) + 1)
                by_sum.setdefault(key, []).append((at - start, end, old))
        out, todo = list(seen), list(seen)
        while todo:
            kind, key, index = todo.pop()
            for at, end, old in by_sum.get(key, ()):
                if at <= index < end:  # the summand lived until just before the sum was made
                    todo.append((kind, old, at - 2))
                    out.append((kind, old, at - 2))
        return out

    def added(self, func, args, kwargs, out, index):
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or \
                torch._C._current_autograd_node() is None or index is None:
            return
        from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

        # ``old + new``: only the buffered gradient (the first) is ever updated in place, and
        # only where its storage has no other holder: a view's base holds it too (lm_head's
        # gradient of a tied embedding weight is a transposed view: summed anew on the rank)
        old, new = args
        if not all(isinstance(t, torch.Tensor) and t.shape == out.shape and t.dtype == out.dtype
                   for t in (old, new)) or old._is_view() or not dense(old):
            return
        self.pending = (index, old.untyped_storage()._cdata, None)

    def died(self, key, index):
        if self.pending is not None and key == self.pending[1]:
            self.pending = (*self.pending[:2], index)

    def settle(self):
        """The pending sum: in place on the buffered gradient where it died as the sum was
        made (its last reference was the engine's), as the rank's autograd makes it."""
        if self.pending is None:
            return
        at, key, j = self.pending
        self.pending = None
        if j is None:
            return
        live = self.live
        total = live.totals[at] - live.events[at][0]  # before the sum was allocated
        live.events.insert(at, live.events.pop(j))
        self.links.append((live.events[at + 1][1], at + 1, key))
        for i in range(at, j + 1):
            total += live.events[i][0]
            live.totals[i] = total


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

