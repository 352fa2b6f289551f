"""The words a run is described in, checked alike by `TrainConfig` (before any rank starts)
and read by the engine: the built-in models, precisions, optimizers, probes, strategies and
communication hooks, and how a strategy's settings combine (`strategy_problem`).
"""
from __future__ import annotations

MODELS = ("mlp", "gpt")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw", "zero1")
PROBES = ("activations", "peak", "comm")
STRATEGIES = ("ddp", "ddp_zero1", "zero2", "fsdp", "hsdp")
FSDP_STRATEGIES = ("zero2", "fsdp", "hsdp")  # FSDP2 underneath: no DDP buckets, no comm hooks
COMM_HOOKS = (None, "fp16", "bf16", "powersgd")


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
