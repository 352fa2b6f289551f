"""How a model is spread over the ranks: ``"ddp"``, ``"ddp_zero1"`` (DDP + torch's
ZeroRedundancyOptimizer: optimizer state sharded), ``"fsdp"`` (torch's FSDP2 ``fully_shard`` per
block, then the root: parameters, gradients and optimizer state sharded).

`wrap(cfg, model, ctx)` returns ``(wrapped, optimizer, comm_counter)``. Everything else in the
engine treats the wrapped model alike; `step.train_step` skips gradient sync on accumulation
micro-steps with DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)``.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .probes import CommCounter

STRATEGIES = ("ddp", "ddp_zero1", "fsdp")
COMM_HOOKS = (None, "fp16", "bf16")
_COMPRESS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def optimizer_class(cfg):
    return torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.AdamW


PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_dtype(cfg, precision=None):
    """The dtype FSDP's mixed precision computes in (its ``param_dtype``), or None: ``"fsdp"``
    with bf16/fp16 runs as practitioners run FSDP2 (torchtitan, Lightning, accelerate):
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, each block's parameters
    gathered in bf16 and its gradients reduced in fp32, no autocast. (Autocast over FSDP's
    fp32 parameters would keep a bf16 copy of every gathered weight for backward, on every
    rank: the sharding undone.)"""
    precision = precision or cfg.precision
    return PARAM_DTYPES.get(precision) if cfg.strategy == "fsdp" else None


def autocast_precision(cfg):
    """The precision `train_step`'s autocast runs: DDP autocasts (what DDP users run); FSDP's
    mixed precision casts the parameters itself, so its forward runs without autocast."""
    return "fp32" if mixed_dtype(cfg) is not None else cfg.precision


def wrap(cfg, model, ctx, count_comm=True, mesh=None, precision=None, watch=None):
    """Wrap ``model`` (already on ctx.device, policy applied) for cfg.strategy. ``mesh``: FSDP's
    device mesh, if made already (the estimate makes it outside FakeTensorMode); ``precision``:
    the run's, when ``cfg`` is a copy for another device (the estimate's). ``watch``: the
    timeline's observer of each bucket's all-reduce (`CommCounter` calls it), DDP only."""
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from .blocks import resolve_blocks

        mesh = mesh or fsdp_mesh(ctx.device.type)
        dtype = mixed_dtype(cfg, precision)
        mp = {} if dtype is None else dict(mp_policy=MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32))
        for block in resolve_blocks(model, cfg.blocks_path):  # one FSDP unit per block, every stack
            fully_shard(block, mesh=mesh, **mp)
        fully_shard(model, mesh=mesh, **mp)
        return model, optimizer_class(cfg)(model.parameters(), lr=cfg.lr), None
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              static_graph=cfg.static_graph, find_unused_parameters=cfg.find_unused_parameters,
              gradient_as_bucket_view=cfg.gradient_as_bucket_view,
              bucket_cap_mb=cfg.bucket_cap_mb)
    comm = None
    if count_comm or cfg.comm_hook or watch is not None:  # one comm hook: DDP takes only one
        comm = CommCounter(_COMPRESS.get(cfg.comm_hook), watch).install(ddp)
    if cfg.strategy == "ddp_zero1" or cfg.optimizer == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class(cfg),
                                            lr=cfg.lr)
    else:
        optimizer = optimizer_class(cfg)(ddp.parameters(), lr=cfg.lr)
    return ddp, optimizer, comm if count_comm else None


def fsdp_mesh(device_type):
    """FSDP's 1-D mesh over the job's own process group, on the ranks' device.

    Built from the existing group (``DeviceMesh.from_group``), not by ``init_device_mesh``:
    FSDP's default mesh takes the machine's accelerator, wrong for CPU ranks on a GPU machine;
    and ``init_device_mesh`` makes a group of its own, with torch's default timeout and a second
    rendezvous, whenever CUDA is available and the default group is gloo (torch 2.13
    ``device_mesh.py``, ``_init_one_process_group``): the shared-GPU mode and ``device="cpu"``
    on a GPU box. The job's group carries the job's timeout (`rank.process_group`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def full_state_dict(cfg, wrapped, model):
    """Rank 0's complete weights on CPU, keys as in the plain model. Collective under FSDP."""
    if cfg.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    else:
        sd = model.state_dict()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None  # only rank 0 returns weights: no CPU copy elsewhere
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
