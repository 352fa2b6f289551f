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

`wrap(cfg, model, ctx)` returns ``(wrapped, optimizer, comm_counter)``. Everything else in the
engine treats the wrapped model alike; `step.train_step` skips gradient sync on accumulation
micro-steps with DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)``.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .probes import CommCounter

STRATEGIES = ("ddp", "ddp_zero1", "zero2", "fsdp", "hsdp")
FSDP_STRATEGIES = ("zero2", "fsdp", "hsdp")  # FSDP2 underneath: no DDP buckets, no comm hooks
COMM_HOOKS = (None, "fp16", "bf16", "powersgd")
_COMPRESS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def is_fsdp(strategy):
    """Does ``strategy`` run on FSDP2 (sharded parameters as DTensors)?"""
    return strategy in FSDP_STRATEGIES


def strategy_problem(strategy, world_size, shard_size, comm_hook, powersgd_rank, start_iter):
    """The first bad one of HSDP's ``shard_size`` and PowerSGD's settings, as (setting, why,
    fix) for `TrainConfig` to raise; None when they are fine."""
    v, r = shard_size, powersgd_rank
    if strategy == "hsdp":
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return ("shard_size", "strategy='hsdp' needs the ranks of each shard group",
                    f"pass shard_size=2 (a divisor of world_size={world_size})")
        if world_size % v:
            return ("shard_size", f"must divide world_size={world_size} (groups of equal size)",
                    f"pass a divisor of {world_size}, e.g. shard_size=2 with world_size=4")
    elif v is not None:
        return ("shard_size", f"only strategy='hsdp' shards in groups (strategy='{strategy}')",
                "pass strategy='hsdp', or shard_size=None")
    if comm_hook != "powersgd" and (r is not None or start_iter != 2):
        name = "powersgd_rank" if r is not None else "powersgd_start_iter"
        return (name, f"is PowerSGD's setting (comm_hook={comm_hook!r})",
                f"pass comm_hook='powersgd', or leave {name} at its default")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        return ("powersgd_rank", "must be an int >= 1 (the approximation's rank)",
                "pass e.g. powersgd_rank=1, 2 or 4")
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 2:
        return ("powersgd_start_iter", "torch's PowerSGD with error feedback compresses from "
                "iteration 2 at the earliest", "pass powersgd_start_iter=2 or more")
    return None


def _compression(cfg, device=None):
    """(the hook to run instead of the plain all-reduce, its bytes per element or None).
    ``device``: the ranks' device, where PowerSGD's collectives must be put in order on gloo."""
    if cfg.comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # error feedback on (torch's default); torch requires start_powerSGD_iter > 1 with it
        state = psgd.PowerSGDState(process_group=None,
                                   matrix_approximation_rank=cfg.powersgd_rank or 1,
                                   start_powerSGD_iter=cfg.powersgd_start_iter,
                                   use_error_feedback=True, warm_start=True)
        hook = lambda _, bucket: psgd.powerSGD_hook(state, bucket)  # noqa: E731
        return (BucketsInOrder(hook) if device is not None and on_gloo(device) else hook), None
    hook = _COMPRESS.get(cfg.comm_hook)
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


def optimizer_class(cfg):
    return torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.AdamW


PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_dtype(cfg, precision=None):
    """The dtype FSDP's mixed precision computes in (its ``param_dtype``), or None: the FSDP2
    strategies (``"zero2"``, ``"fsdp"``, ``"hsdp"``) with bf16/fp16 run as practitioners run FSDP2 (torchtitan, Lightning, accelerate):
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, each block's parameters
    gathered in bf16 and its gradients reduced in fp32, no autocast. (Autocast over FSDP's
    fp32 parameters would keep a bf16 copy of every gathered weight for backward, on every
    rank: the sharding undone.)"""
    precision = precision or cfg.precision
    return PARAM_DTYPES.get(precision) if is_fsdp(cfg.strategy) else None


def autocast_precision(cfg):
    """The precision `train_step`'s autocast runs: DDP autocasts (what DDP users run); FSDP's
    mixed precision casts the parameters itself, so its forward runs without autocast."""
    return "fp32" if mixed_dtype(cfg) is not None else cfg.precision


def wrap(cfg, model, ctx, count_comm=True, mesh=None, precision=None, watch=None):
    """Wrap ``model`` (already on ctx.device, policy applied) for cfg.strategy. ``mesh``: FSDP's
    device mesh, if made already (the estimate makes it outside FakeTensorMode); ``precision``:
    the run's, when ``cfg`` is a copy for another device (the estimate's). ``watch``: the
    timeline's observer of each bucket's all-reduce (`CommCounter` calls it), DDP only."""
    if is_fsdp(cfg.strategy):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from .blocks import resolve_blocks

        mesh = mesh or fsdp_mesh(ctx.device.type, cfg)
        dtype = mixed_dtype(cfg, precision)
        kw = {} if dtype is None else dict(mp_policy=MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32))
        # zero2: each block keeps its gathered parameters from forward to the end of backward
        # (no second all-gather). fsdp/hsdp leave reshard_after_forward to torch: blocks
        # reshard, and the root does not (torch 2.13 `_fsdp_state._lazy_init`: its parameters
        # are needed at once by backward), so the root is gathered once a step in every
        # strategy. Passing True would reshard the root too (a second all-gather)
        if cfg.strategy == "zero2":
            kw["reshard_after_forward"] = False
        for block in resolve_blocks(model, cfg.blocks_path):  # one FSDP unit per block, every stack
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model, optimizer_class(cfg)(model.parameters(), lr=cfg.lr), None
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              static_graph=cfg.static_graph, find_unused_parameters=cfg.find_unused_parameters,
              gradient_as_bucket_view=cfg.gradient_as_bucket_view,
              bucket_cap_mb=cfg.bucket_cap_mb)
    comm = None
    if count_comm or cfg.comm_hook or watch is not None:  # one comm hook: DDP takes only one
        comm = CommCounter(*_compression(cfg, ctx.device), watch=watch).install(ddp)
    if cfg.strategy == "ddp_zero1" or cfg.optimizer == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class(cfg),
                                            lr=cfg.lr)
    else:
        optimizer = optimizer_class(cfg)(ddp.parameters(), lr=cfg.lr)
    return ddp, optimizer, comm if count_comm else None


def fsdp_mesh(device_type, cfg=None):
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

    if cfg is not None and cfg.strategy == "hsdp":
        return hsdp_mesh(device_type, cfg.shard_size)
    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def hsdp_mesh(device_type, shard_size):
    """The 2-D mesh of HSDP: ranks ``[r*S, (r+1)*S)`` shard one copy (S = ``shard_size``,
    consecutive ranks: on a cluster, one node's GPUs), rank ``i`` replicates with every rank
    ``i mod S``. Its groups are made here, by every rank in the same order, with the job's
    timeout (``init_device_mesh`` would give them torch's default), then handed to
    ``DeviceMesh.from_group``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = torch.arange(world).view(world // shard_size, shard_size)
    backend = dist.group.WORLD._get_backend(torch.device(device_type))
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    shard = replicate = None
    for row in layout.tolist():
        g = dist.new_group(row, timeout=timeout)
        shard = g if rank in row else shard
    for col in layout.t().tolist():
        g = dist.new_group(col, timeout=timeout)
        replicate = g if rank in col else replicate
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def full_state_dict(cfg, wrapped, model):
    """Rank 0's complete weights on CPU, keys as in the plain model. Collective under FSDP."""
    if is_fsdp(cfg.strategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    else:
        sd = model.state_dict()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None  # only rank 0 returns weights: no CPU copy elsewhere
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
