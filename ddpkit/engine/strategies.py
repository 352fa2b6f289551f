"""How a model is spread over the ranks: ``"ddp"``, ``"ddp_zero1"`` (DDP + torch's
ZeroRedundancyOptimizer: optimizer state sharded), ``"zero2"`` (FSDP2 with
``reshard_after_forward=False``: gradients and optimizer state sharded, parameters whole from
the forward's all-gather to the end of backward), ``"fsdp"`` (torch's FSDP2 ``fully_shard`` per
block, then the root: parameters, gradients and optimizer state sharded: ZeRO-3), ``"hsdp"``
(FSDP2 on a 2-D mesh, replicate x shard: sharded within groups of ``shard_size`` ranks,
replicated across them; MiCS).

Gradient compression (DDP): ``comm_hook="fp16"``/``"bf16"`` (torch's cast hooks) or
``"powersgd"`` (torch's ``powerSGD_hook`` with ``PowerSGDState``: rank ``powersgd_rank``, error
feedback on, compressing from iteration ``powersgd_start_iter``; on gloo its buckets take turns,
`BucketsInOrder`).

`wrap(plan, model, ctx)` returns ``(wrapped, optimizer, comm_counter)``. Everything else in the
engine treats the wrapped model alike; `step.train_step` skips gradient sync on accumulation
micro-steps with DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)``.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..spec.blocks import resolve_blocks
from ..spec.names import is_fsdp
from .probes import CommCounter

_COMPRESS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def _compression(plan, device=None):
    """(the hook to run instead of the plain all-reduce, its bytes per element or None).
    ``device``: the ranks' device, where PowerSGD's collectives must be put in order on gloo."""
    if plan.comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # error feedback on (torch's default); torch requires start_powerSGD_iter > 1 with it
        state = psgd.PowerSGDState(process_group=None,
                                   matrix_approximation_rank=plan.powersgd_rank or 1,
                                   start_powerSGD_iter=plan.powersgd_start_iter,
                                   use_error_feedback=True, warm_start=True)
        hook = lambda _, bucket: psgd.powerSGD_hook(state, bucket)  # noqa: E731
        return (BucketsInOrder(hook) if device is not None and on_gloo(device) else hook), None
    hook = _COMPRESS.get(plan.comm_hook)
    return hook, (2 if hook is not None else None)


def on_gloo(device):
    """Does the job's group carry ``device``'s tensors over gloo (CPU ranks, or CUDA ranks
    sharing GPUs)? False where there is no group or a fake one (the estimate's)."""
    import torch.distributed as dist

    try:
        backend = dist.group.WORLD._get_backend(torch.device(device))
    except (AttributeError, RuntimeError):
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


class BucketsInOrder:
    """A comm hook run for one bucket after another, each bucket's collectives issued only once
    the previous bucket's hook has finished: what PowerSGD needs on gloo.

    gloo matches collectives across ranks by the order each rank issues them (a tag counted up
    per collective, ``ProcessGroupGloo::nextTag``: "Collectives are kicked off in identical
    order across processes"). torch's ``powerSGD_hook`` issues a bucket's first all-reduce when
    DDP calls it (the backward's thread), and its P and Q all-reduces in ``Future.then``
    callbacks, which gloo runs on its worker threads when the previous all-reduce completes. With
    one bucket the order is fixed; with two or more (DDP's first bucket holds 1 MiB after step 1,
    so an mlp of width 128 has two), bucket 1's first all-reduce races bucket 0's P on each rank,
    and the ranks disagree: gloo aborts the process ("op.preamble.length <= op.nbytes ...
    Is there a distributed collective mismatch") or both wait forever. On NCCL the futures are
    complete when the collective is queued, so the callbacks run at once, in order, on DDP's
    thread: there torch's hook runs as it is (`on_gloo`). DDP calls the hook for buckets 0, 1, ...
    in index order every backward (its reducer launches them in sequence)."""

    def __init__(self, hook):
        self.hook, self.last = hook, None

    def __call__(self, state, bucket):
        prev = None if bucket.index() == 0 else self.last
        if prev is None:
            fut = self.hook(state, bucket)
        else:
            device = bucket.buffer().device
            fut = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
            prev.then(self._launch(state, bucket, fut))
        self.last = fut
        return fut

    def _launch(self, state, bucket, out):
        """The callback that runs the hook on ``bucket`` once the previous bucket is done (on
        gloo's thread), and hands its result, or any error on the way, to ``out``."""
        def finish(f):
            try:
                out.set_result(f.value())
            except Exception as exc:  # the collective's own error, for DDP to raise
                out.set_exception(exc)

        def launch(prev):
            try:
                prev.value()  # a failed previous bucket fails this one too, never hangs it
                self.hook(state, bucket).then(finish)
            except Exception as exc:
                out.set_exception(exc)
        return launch


def optimizer_class(plan):
    return torch.optim.SGD if plan.optimizer == "sgd" else torch.optim.AdamW


PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_dtype(plan, precision=None):
    """The dtype FSDP's mixed precision computes in (its ``param_dtype``), or None: the FSDP2
    strategies (``"zero2"``, ``"fsdp"``, ``"hsdp"``) with bf16/fp16 run as practitioners run FSDP2 (torchtitan, Lightning, accelerate):
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, each block's parameters
    gathered in bf16 and its gradients reduced in fp32, no autocast. (Autocast over FSDP's
    fp32 parameters would keep a bf16 copy of every gathered weight for backward, on every
    rank: the sharding undone.)"""
    precision = precision or plan.precision
    return PARAM_DTYPES.get(precision) if is_fsdp(plan.strategy) else None


def autocast_precision(plan):
    """The precision `train_step`'s autocast runs: DDP autocasts (what DDP users run); FSDP's
    mixed precision casts the parameters itself, so its forward runs without autocast."""
    return "fp32" if mixed_dtype(plan) is not None else plan.precision


def wrap(plan, model, ctx, count_comm=True, mesh=None, precision=None, watch=None):
    """Wrap ``model`` (already on ctx.device, policy applied) for plan.strategy. ``mesh``: FSDP's
    device mesh, if made already (the estimate makes it outside FakeTensorMode); ``precision``:
    the run's, when ``plan`` is a copy for another device (the estimate's). ``watch``: the
    timeline's observer of each bucket's all-reduce (`CommCounter` calls it), DDP only."""
    if is_fsdp(plan.strategy):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = mesh or fsdp_mesh(ctx.device.type, plan)
        dtype = mixed_dtype(plan, precision)
        kw = {} if dtype is None else dict(mp_policy=MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32))
        # zero2: each block keeps its gathered parameters from forward to the end of backward
        # (no second all-gather). fsdp/hsdp leave reshard_after_forward to torch: blocks
        # reshard, and the root does not (torch 2.13 `_fsdp_state._lazy_init`: its parameters
        # are needed at once by backward), so the root is gathered once a step in every
        # strategy. Passing True would reshard the root too (a second all-gather)
        if plan.strategy == "zero2":
            kw["reshard_after_forward"] = False
        for block in resolve_blocks(model, plan.blocks):  # one FSDP unit per block, every stack
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model, optimizer_class(plan)(model.parameters(), lr=plan.lr), None
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              static_graph=plan.static_graph, find_unused_parameters=plan.find_unused_parameters,
              gradient_as_bucket_view=plan.gradient_as_bucket_view,
              bucket_cap_mb=plan.bucket_cap_mb)
    comm = None
    if count_comm or plan.comm_hook or watch is not None:  # one comm hook: DDP takes only one
        comm = CommCounter(*_compression(plan, ctx.device), watch=watch).install(ddp)
    if plan.strategy == "ddp_zero1" or plan.optimizer == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class(plan),
                                            lr=plan.lr)
    else:
        optimizer = optimizer_class(plan)(ddp.parameters(), lr=plan.lr)
    return ddp, optimizer, comm if count_comm else None


def fsdp_mesh(device_type, plan=None):
    """FSDP's 1-D mesh over the job's own process group, on the ranks' device; for
    ``strategy="hsdp"`` the 2-D mesh (replicate, shard) of `hsdp_mesh`.

    Built from the existing group (``DeviceMesh.from_group``), not by ``init_device_mesh``:
    FSDP's default mesh takes the machine's accelerator, wrong for CPU ranks on a GPU machine;
    and ``init_device_mesh`` makes a group of its own, with torch's default timeout and a second
    rendezvous, whenever CUDA is available and the default group is gloo (torch 2.13
    ``device_mesh.py``, ``_init_one_process_group``): the shared-GPU mode and ``device="cpu"``
    on a GPU box. The job's group carries the job's timeout (`rank.process_group`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if plan is not None and plan.strategy == "hsdp":
        return hsdp_mesh(device_type, plan.shard_size)
    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def hsdp_mesh(device_type, shard_size):
    """The 2-D mesh of HSDP: ranks ``[r*S, (r+1)*S)`` shard one copy (S = ``shard_size``,
    consecutive ranks: on a cluster, one node's GPUs), rank ``i`` replicates with every rank
    ``i mod S``. Its groups (`hsdp_groups`) carry the job's timeout (``init_device_mesh`` would
    give them torch's default) and are handed to ``DeviceMesh.from_group``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    layout = torch.arange(world).view(world // shard_size, shard_size)
    backend = dist.group.WORLD._get_backend(torch.device(device_type))
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    replicate, shard = hsdp_groups(layout, timeout)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


_HSDP_GROUPS = {}  # layout shape -> (default group, this rank's replicate group, shard group)


def hsdp_groups(layout, timeout=None):
    """This rank's (replicate, shard) groups of ``layout``, made by every rank in the same order
    on the first HSDP job of a default group and kept for the next ones: a warm pool's ranks run
    job after job, and new groups per job would pile up (with ``device_id`` bound, each one an
    NCCL communicator split at once, in memory the caching allocator does not count). Every rank
    of a pool runs the same job, so all make them or all reuse them; reused ones take the
    job's ``timeout``."""
    import torch.distributed as dist

    kept = _HSDP_GROUPS.get(tuple(layout.shape))
    if kept is not None and kept[0] is dist.group.WORLD:
        if timeout is not None:
            for group in kept[1:]:
                dist.distributed_c10d._set_pg_timeout(timeout, group)
        return kept[1:]
    rank, shard, replicate = dist.get_rank(), None, None
    for row in layout.tolist():
        g = dist.new_group(row, timeout=timeout)
        shard = g if rank in row else shard
    for col in layout.t().tolist():
        g = dist.new_group(col, timeout=timeout)
        replicate = g if rank in col else replicate
    _HSDP_GROUPS[tuple(layout.shape)] = (dist.group.WORLD, replicate, shard)
    return replicate, shard


def full_state_dict(plan, wrapped, model):
    """Rank 0's complete weights on CPU, keys as in the plain model. Collective under FSDP."""
    if is_fsdp(plan.strategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    else:
        sd = model.state_dict()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None  # only rank 0 returns weights: no CPU copy elsewhere
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
