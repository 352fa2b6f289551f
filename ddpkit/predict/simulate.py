"""One rank's step, simulated: the rank's own code run once more in the kernel, on fake tensors.

`simulate(cfg, rank)` builds the config's model under ``FakeTensorMode`` (nothing allocated),
makes torch's ``FakeProcessGroup`` the default group for rank ``rank`` of ``cfg.world_size``
(collectives return at once; no other process), and runs the rank's own code on top: the
checkpoint policy, `strategies.wrap` (real DDP, ZeroRedundancyOptimizer, FSDP2
``fully_shard``), `train_step` with its phase marks, `zero_grad`. A dispatch mode sees every
storage an op makes (DDP's buckets too: the reducer allocates them through the dispatcher) and
a weak reference sees it die, so the live bytes are known after every op, and the same
`ddpkit.engine.memory.summarize` that reads a rank's profiler window turns them into a `Peak`:
bytes, phase, and the ledger by kind. This is what torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` does on one process; ddpkit adds the
process group, the wrappers and the ledger of its measurement, and is ~15x faster on a GPT-2
step (it keeps no per-module snapshots).

Where the simulation is not the rank's code, `fakeworld` says so, each with why the bytes
agree; and:

* A CUDA rank is simulated on CPU fake tensors (the CPU build cannot run CUDA kernels, not even
  fake ones): every size is rounded up to the caching allocator's 512-byte blocks; attention
  keeps what the CUDA kernel the rank would pick keeps (`attention.on_cuda`); the optimizer
  runs torch's foreach implementation, its default on CUDA; and cuBLAS's workspaces, which
  torch allocates through the caching allocator on a thread's first matmul and keeps, are in
  the ledger's "other" (`cublas_workspaces`). These CUDA figures are read from torch's sources,
  not measured here (no GPU): ``bench/gpu_check.sh`` compares them with
  ``max_memory_allocated`` the day one is lent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import threading
import types
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..devices import cublas_workspace_config, resolve_devices
from ..engine import memory, strategies
from ..engine.memory import optimizer_tensors, storages
from ..engine.policies import install
from ..engine.probes import ActivationProbe
from ..engine.step import train_step, zero_grad
from ..spec import empty, rng
from ..spec.blocks import resolve_blocks
from ..spec.model import describe_spec, fake_model
from ..spec.setting import CheckpointSetting
from . import cudastreams
from .micro import SHORT, Batches, repeat_middle
from .optrace import OpTrace, dtensor_class, is_dtensor_op
from .datadep import DataDependence, tensors_in
from .trace import as_real_for_transformers, example_batch, on_device, run_target
from .fakeworld import (Accumulations, fake_world, gloo_buffers, late_note, mark_fsdp_collectives,
                        skip_dtensor_meta, watch_buckets, watch_rng_states, watch_storage_resizes)

_LOCK = threading.RLock()  # one fake world at a time (the Lab's threads)
CUDA_BLOCK = 512


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates, from creation to death, as allocator-like events
    ``(size, key, fsdp, phase)`` with the running total after each (``totals``)."""

    def __init__(self, block=1):
        super().__init__()
        self.block = block
        self.events, self.totals = [], []
        self.total, self.phase, self.fsdp = 0, None, False
        self.ignore = False  # inside DTensor's sharding propagation (see `skip_dtensor_meta`)
        self.forward_ends = []  # event index at the end of each forward
        self.points = []        # (event index, name): where the blocks' forward/backward begin, end
        self._refs = {}
        self.accumulations = Accumulations(self)  # autograd's in-place sums (`fakeworld`)
        self.observer = None  # a `pieces.Recorder`: which block each op's storages are for
        self.rng_states = set()  # keys of the CPU generator states taken (`watch_rng_states`)

    def _size(self, nbytes):
        return -(-nbytes // self.block) * self.block if nbytes else 0

    def _log(self, size, key):
        self.total += size
        self.events.append((size, key, self.fsdp, self.phase))
        self.totals.append(self.total)

    def add(self, storage):
        key = storage._cdata
        if key in self._refs or not storage.nbytes():
            return
        size = self._size(storage.nbytes())
        self._refs[key] = (weakref.ref(storage, functools.partial(self._gone, key)), size)
        self._log(size, key)

    def adopt(self, tensors):
        """Track storages made before the mode was entered (the model's)."""
        while tensors:
            self.add(tensors.pop().untyped_storage())

    def _gone(self, key, _ref):
        entry = self._refs.pop(key, None)
        if entry is not None:
            self._log(-entry[1], key)
            self.accumulations.died(key, len(self.events) - 1)

    def resized(self, storage, old):
        """FSDP2 frees and refills its unsharded parameters with ``storage.resize_``."""
        key = storage._cdata
        entry = self._refs.pop(key, None)
        if entry is not None:
            self._log(-entry[1], key)
        elif old:
            self._log(-self._size(old), key)
        self.add(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_dtensor_op(types):
            return NotImplemented  # FSDP's DTensors: see the local ops they run instead
        self.accumulations.settle()
        out = func(*args, **(kwargs or {}))
        if self.ignore:
            return out
        made = len(self.events)
        dtensor = dtensor_class() or ()
        for t in tensors_in(out):
            if not isinstance(t, dtensor):
                self.add(t.untyped_storage())
        self.accumulations.added(func, args, kwargs, out,
                                 len(self.events) - 1 if len(self.events) > made else None)
        if self.observer is not None:
            self.observer.seen_op(func, args, list(range(made, len(self.events))))
        return out

    def point(self, name):
        self.accumulations.settle()
        self.points.append((len(self.events), name))

    @contextlib.contextmanager
    def mark(self, name):
        """`train_step`'s phase marks."""
        self.accumulations.settle()
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.accumulations.settle()
            self.phase = outer
            if name == "forward":
                self.forward_ends.append(len(self.events))


# ----------------------------------------------------------------------------- the step
@dataclasses.dataclass
class Simulation:
    """One simulated rank: ``peaks[s]`` is step s's `Peak` (step 0 makes the optimizer state;
    step 1 is the steady state: see the module's note on DDP's rebuild). ``loads``: the
    parameters each rank's optimizer updates (numel), which says which rank is heaviest."""
    rank: int
    peaks: list
    loads: list
    how: str = "simulated"
    """'simulated' (the whole model) or 'composed' (`compose.py`: from per-block pieces of the
    model cut to a few blocks; ``composition`` says which were simulated and how each carried)."""
    stream: list = dataclasses.field(default_factory=list, repr=False)
    """The last step's ops and marks, in the order they ran (`optrace.OpTrace`): what the
    step-time prediction times. None for a composed step (composed bytes, not ops:
    `peak.streamed` gives a large model's stream)."""
    assumed: tuple = ()
    """What sized each data-dependent op of the step (`datadep`: the batch's values, the
    routing assumption, an upper bound), one line each; empty when there was none."""
    composition: object = None
    """How a composed step was made (`compose.Composition`); None when simulated whole."""


def simulate(cfg, rank=0, steps=2, keep=None, target=None, setting=None, recorder=None,
             short=True):
    """Run ``steps`` optimizer steps of rank ``rank`` of ``cfg`` on fake tensors: a
    `Simulation`. ``target``: an `attention.CudaTarget` to simulate the rank as a CUDA rank on
    that GPU (a named device's, `hardware.target`) whatever this machine has; None: the
    config's own device (a CUDA rank where the config runs on CUDA here). For `compose.py` and
    `scale.py`: ``keep``, only the first ``keep`` blocks of each stack (an int, or one per
    stack); ``setting``, a `CheckpointSetting` of those blocks to run instead of the config's;
    ``recorder``, a `pieces.Recorder` that marks the blocks and keeps each step's pieces.
    ``short``: a step of more than `micro.SHORT` micro-steps simulated with that many (`micro`;
    False: all of them)."""
    short = short and recorder is None and cfg.accum_steps > SHORT
    with _new_objects_only() as thaw:
        sim = _simulate(cfg, rank, steps, keep, thaw, target, setting, recorder, short)
        if sim is None:  # data-dependent ops (counted per call), or a wait across micro-steps
            sim = _simulate(cfg, rank, steps, keep, thaw, target, setting, recorder, False)
        return sim


_FREEZE_LOCK = threading.Lock()


@contextlib.contextmanager
def _new_objects_only():
    """What exists before a simulation is no concern of its ``gc.collect()``: frozen
    (``gc.freeze``) it is left out, where a full collection in a kernel that has imported torch
    and transformers walks millions of objects (~0.25 s, a third of a small simulation). Yields
    ``thaw()``, called before the step so that the step runs with the collector as it was. The
    freeze is process-wide: one simulation freezes at a time (the Lab's threads collect as
    before), and a freeze of the user's own is left alone."""
    if not _FREEZE_LOCK.acquire(blocking=False):
        yield lambda: None
        return
    try:
        if gc.get_freeze_count():
            yield lambda: None
            return
        done = []

        def thaw():
            if not done:
                done.append(gc.unfreeze())

        gc.freeze()
        try:
            yield thaw
        finally:
            thaw()
    finally:
        _FREEZE_LOCK.release()


def _simulate(cfg, rank, steps, keep, thaw, target=None, setting=None, recorder=None,
              short=False):
    backend, device = resolve_devices(cfg.world_size, cfg.backend, cfg.device)
    if target is None:
        target = run_target(cfg) if device == "cuda" else None
    cuda = target is not None
    plan = cfg.rank_plan()  # what the rank's code reads
    # the rank's wrapping, less what a fake group cannot run (the module's notes)
    wrap_plan = plan.replace(comm_hook=None, find_unused_parameters=False, static_graph=False,
                             precision="fp32")
    real_batch = example_batch(cfg)
    ctx = types.SimpleNamespace(rank=rank, world_size=cfg.world_size, device=torch.device("cpu"))
    live, largest = LiveStorages(CUDA_BLOCK if cuda else 1), []
    mode = FakeTensorMode()
    datadep = DataDependence(cfg.routing)  # data-dependent ops: how each was sized, noted
    template = tree_map(lambda t: datadep.fake(mode, t) if isinstance(t, torch.Tensor) else t,
                        real_batch)
    with rng.forked():
        model, how = fake_model(plan, mode, keep)  # no initialisation: `ddpkit.spec.empty`
    stage = functools.partial(empty.stage, who="ddpkit.estimate(cfg).peak()",
                              model_name=f"TrainConfig.model={describe_spec(cfg.model)}, built by {how}")
    blocks = resolve_blocks(model, plan.blocks)
    if setting is None:  # a model cut to its first blocks: the config's value on those
        setting = plan.checkpoint if keep is None else CheckpointSetting.of(
            plan.checkpoint.value, tuple(keep) if isinstance(keep, tuple) else len(blocks))
    with _LOCK, fake_world(rank, cfg.world_size), rng.forked(), mode, datadep, \
            live, watch_storage_resizes(live), mark_fsdp_collectives(live), \
            skip_dtensor_meta(live), gloo_buffers(backend == "gloo" and not cuda, largest), \
            watch_rng_states(live, not cuda):
        # made before the tracking began (no name left holding the last of them: FSDP frees
        # the originals once sharded, and so must the simulation)
        live.adopt([*model.parameters(), *model.buffers()])
        with stage("installing the checkpoint policy"):
            policy = install(plan, model, setting)
        with unset_fake_temporarily():  # a device mesh's rank table is real data
            mesh_ready = _premade_mesh(wrap_plan, ctx)
        wrapped, optimizer, _ = strategies.wrap(wrap_plan, model, ctx, count_comm=False,
                                                mesh=mesh_ready, precision=plan.precision)
        trace = OpTrace(live)
        buckets = watch_buckets(wrapped, plan, trace.bucket)
        gc.collect()  # fake tensors sit in reference cycles: what a rank frees at once, now
        thaw()
        if cuda:  # torch's default on CUDA: the foreach implementation
            for group in optimizer.param_groups:
                if "foreach" in group:
                    group["foreach"] = True
        rank_parts = (model, wrapped, optimizer, policy)
        peaks = _steps(plan, steps, live, rank_parts, (template, real_batch, buckets, short),
                       (trace, recorder, blocks), (stage, target))
        live.observer = None
        loads = _loads(optimizer, model, cfg.world_size)
    stream = repeat_middle(trace.stream, plan.accum_steps) if short else trace.stream
    if short and (stream is None or datadep.notes):
        return None
    assumed = tuple(datadep.lines()) + ((late_note(largest[0]),) if largest else ())
    for p in peaks:
        p.assumed = assumed
    return Simulation(rank, peaks, loads, stream=stream, assumed=assumed)


def _steps(plan, steps, live, rank_parts, data, watchers, where):
    """The simulated steps' `Peak` s: ``rank_parts`` (model, wrapped, optimizer, policy) run on
    ``data`` (the fake template batch, the real one, DDP's buckets seen, whether the step is
    simulated with `micro.SHORT` micro-steps), ``watchers`` (the
    `OpTrace`, a `pieces.Recorder` or None, the blocks), ``where`` (the error stage, a CUDA
    target or None)."""
    model, wrapped, optimizer, _ = rank_parts
    template, real_batch, buckets, short = data
    count = SHORT if short else plan.accum_steps
    trace, recorder, blocks = watchers
    stage, target = where
    peaks = []
    hooks = trace.watch(blocks, model, grads=hasattr(wrapped, "register_comm_hook"))
    if recorder:
        hooks += recorder.install(live, blocks)
        recorder.owners(model, blocks, optimizer)
    streams = cudastreams.recorded(trace) if target is not None else contextlib.nullcontext()
    try:
        for step in _within(streams, range(steps)):
            trace.reset()
            # collated inside the step, as `RankBatches.micro_batches` (a generator) does
            batches = Batches(template, count, plan.accum_steps - count)
            if recorder:
                recorder.begin()
            with on_device(target), stage("the step"):
                peak = _one_step(plan.replace(accum_steps=count), step, live, rank_parts, batches,
                                 buckets,
                                 as_real_for_transformers(real_batch), (trace, recorder))
            extra = cublas_workspaces(target) if target is not None else 0
            peaks.append(_plus(peak, extra))
            zero_grad(optimizer)
    finally:
        for h in hooks:
            h.remove()
    return peaks


def _within(context, items):
    """``items``, iterated inside ``context`` (FSDP2's CUDA streams, recorded)."""
    with context:
        yield from items


def _loads(optimizer, model, world_size):
    """Numel of the parameters each rank's optimizer updates: ZeRO-1's greedy partition, FSDP's
    dim-0 chunks (the first ranks take the larger), DDP's whole model on every rank."""
    if hasattr(optimizer, "_partition_parameters"):
        return [sum(p.numel() for group in groups for p in group["params"])
                for groups in optimizer._partition_parameters()]
    numel = [0] * world_size
    for p in model.parameters():
        if hasattr(p, "to_local"):  # torch.chunk's rows: ceil(n / N) each, the last ones fewer
            rows, row = p.shape[0], p.numel() // max(p.shape[0], 1)
            size = -(-rows // world_size)
            for r in range(world_size):
                numel[r] += min(size, max(rows - r * size, 0)) * row
        else:
            numel = [n + p.numel() for n in numel]
    return numel


def cublas_workspaces(target):
    """Bytes of cuBLAS workspace a CUDA rank's step holds: one per (thread, stream) that runs a
    matmul (the forward on the rank's thread, the backward on autograd's device thread), each
    the ``CUBLAS_WORKSPACE_CONFIG`` the ranks will run with (``:SIZE:COUNT`` in KiB, summed;
    `devices.cublas_workspace_config`: ``:4096:8`` when the kernel runs deterministic) or
    torch's default: 4096 KiB x 8 on compute capability 9.0 and up, else 4096 KiB x 2 + 16 KiB
    x 8 (``CublasHandlePool.cpp``, ``parseChosenWorkspaceSize``)."""
    import re

    config = cublas_workspace_config(torch.are_deterministic_algorithms_enabled())
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        each = sum(int(size) * 1024 * int(count) for size, count in pairs)
    else:
        each = 4096 * 1024 * 8 if target.capability >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    return 2 * each


def _plus(peak, extra):
    """``peak`` with ``extra`` bytes of "other" at every moment (cuBLAS's workspaces)."""
    if not extra or peak is None:
        return peak
    ledger = {**peak.ledger, "other": peak.ledger["other"] + extra}
    return memory.Peak(peak.bytes + extra, peak.phase, ledger,
                       {p: b + extra for p, b in peak.by_phase.items()})


def _premade_mesh(plan, ctx):
    return strategies.fsdp_mesh(ctx.device.type, plan) if strategies.is_fsdp(plan.strategy) \
        else None


def _one_step(plan, step, live, rank, batches, buckets, real_transformers, watchers):
    """One simulated step. ``rank``: (model, wrapped, optimizer, checkpoint policy);
    ``watchers``: the `optrace.OpTrace` that records its ops, and a `pieces.Recorder` (or
    None) that keeps its pieces."""
    model, wrapped, optimizer, policy = rank
    trace, recorder = watchers
    start = len(live.events)
    census = {"parameters": storages(model.parameters(), by="impl"),
              "gradients": storages((p.grad for p in model.parameters()), by="impl"),
              "optimizer_state": storages(optimizer_tensors(optimizer), by="impl")}
    base = live.total
    live.forward_ends, live.points = [], []
    acts = ActivationProbe()
    acts.new_step(policy)
    with real_transformers, trace:
        train_step(wrapped, optimizer, batches, accum_steps=plan.accum_steps,
                   no_sync=plan.no_sync and not (plan.static_graph and step == 0),
                   precision=strategies.autocast_precision(plan), device="cpu",
                   activation_probe=acts, inner=model, loss_fn=plan.loss_fn, phase=trace.phase,
                   read_loss=False)
        batches.release()  # its list died as it returned: the batches held die with it
    live.accumulations.settle()
    end = len(live.events) - start
    census["ddp_buckets"] = dict(buckets.values())
    seen = [("parameters", key, 0) for key in census["parameters"]]
    seen += [(kind, key, end) for kind, tensors in (
        ("gradients", [p.grad for p in model.parameters()]),
        ("optimizer_state", optimizer_tensors(optimizer))) for key in storages(tensors, by="impl")]
    seen += [("ddp_buckets", key, end) for key in census["ddp_buckets"]]
    for keys, index in zip(acts.saved_keys, live.forward_ends):
        seen += [("activations", key, index - start) for key in keys]
    seen += [(k, key, i - start) for k, key, i in batches.seen(acts.saved_keys, live.forward_ends)]
    seen = live.accumulations.seen_through(seen, start)
    events, totals = live.events[start:], live.totals[start:]
    peak = memory.summarize(events, totals, base, census, seen)
    if recorder is not None:
        recorder.end(start, events, [(i - start, name) for i, name in live.points],
                     memory.Ledger([e[:3] for e in events], base, census, seen), census)
    return peak
