"""The ZeRO paper's Table 1 and its communication analysis, for a config (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).

Table 1 counts model states per rank for Psi parameters on N ranks with mixed precision and
Adam: 2 Psi fp16 parameters, 2 Psi fp16 gradients, K Psi optimizer state (K = 12: fp32 master
weights and two moments). ddpkit trains in fp32 with AdamW, so the same rule reads 4 + 4 + 8:

=========  ==================  ==================  =====================
strategy   parameters          gradients           optimizer state
=========  ==================  ==================  =====================
ddp        4 Psi               4 Psi               8 Psi
ddp_zero1  4 Psi               4 Psi               8 Psi / N
zero2      4 Psi / N *         4 Psi / N           8 Psi / N
fsdp       4 Psi / N           4 Psi / N           8 Psi / N
hsdp       4 Psi / S           4 Psi / S           8 Psi / S   (S = shard_size)
=========  ==================  ==================  =====================

\\* the paper's ZeRO-2 keeps the parameters whole on every rank (4 Psi); torch's form of it,
FSDP2 with ``reshard_after_forward=False``, holds them whole only from the forward's
all-gather to the end of backward (where the step peaks) and sharded between steps.

Communication per rank per step, counted as `engine.collectives` counts it (what each rank
sends, and receives, in the bandwidth-optimal algorithms; B = 4 Psi bytes): DDP's all-reduce
2(N-1)/N B, the paper's 2 Psi; ZeRO-2 a reduce-scatter of the gradients and an all-gather of
the parameters, the same 2(N-1)/N B; ZeRO-3 all-gathers a block's parameters again in backward,
so 3(N-1)/N B, 1.5x, for every block resharded after forward; FSDP2 keeps the root module's
parameters (the embeddings and head outside the blocks) after forward, so those travel 2x.
torch's ZeRO-1 (``ZeroRedundancyOptimizer``) keeps DDP's all-reduce and then broadcasts each
updated shard, 3(N-1)/N B, where the paper's ZeRO-1 would reduce-scatter (2 Psi).
"""
from __future__ import annotations

import torch

from ..spec.blocks import resolve_blocks
from ..spec.model import build_model

PAPER = {"psi": 7.5e9, "n": 64, "k": 12,  # Table 1's example row, GB per device
         "ddp": 120, "ddp_zero1": 31.4, "zero2": 16.6, "fsdp": 1.88}


def param_counts(cfg):
    """(parameters in the blocks, parameters outside them: the root's), from one build on the
    meta device."""
    with torch.device("meta"):
        model = build_model(cfg.rank_plan())[0]
    blocks = {id(p) for b in resolve_blocks(model, cfg.blocks_path) for p in b.parameters()}
    inside = sum(p.numel() for p in model.parameters() if id(p) in blocks and p.requires_grad)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return inside, total - inside


def model_states(cfg, psi=None):
    """Table 1's bytes per rank for ``cfg`` (fp32, Adam: 4 + 4 + 8 bytes a parameter; SGD
    keeps no state), as {'param_bytes', 'grad_bytes', 'optimizer_bytes'}."""
    psi = sum(param_counts(cfg)) if psi is None else psi
    n, s = cfg.world_size, cfg.shard_size
    shards = {"zero2": n, "fsdp": n, "hsdp": s}.get(cfg.strategy, 1)
    opt = 0 if cfg.optimizer == "sgd" else 8 * psi
    opt_shards = n if cfg.strategy in ("ddp_zero1", "zero2", "fsdp") or cfg.optimizer == "zero1" \
        else shards
    return {"param_bytes": 4 * psi / shards, "grad_bytes": 4 * psi / shards,
            "optimizer_bytes": opt / opt_shards}


def comm_volume(cfg):
    """The rule's bytes each rank sends per optimizer step, by collective (accum_steps=1, no
    compression)."""
    if cfg.accum_steps != 1 or cfg.comm_hook:
        raise ValueError("comm_volume(cfg): the rule is for one micro-batch per step and no "
                         "compression; pass a config with accum_steps=1 and comm_hook=None")
    inside, root = param_counts(cfg)
    b, n = 4 * (inside + root), cfg.world_size
    part = (n - 1) / n
    if cfg.strategy == "ddp":
        return {"allreduce": 2 * part * b}
    if cfg.strategy == "ddp_zero1":
        return {"allreduce": 2 * part * b, "broadcast": part * b}
    gathered = 4 * (inside + root) if cfg.strategy == "zero2" else 4 * (2 * inside + root)
    if cfg.strategy in ("zero2", "fsdp"):
        return {"allgather": part * gathered, "reduce_scatter": part * b}
    s = cfg.shard_size
    r = n // s
    return {"allgather": (s - 1) / s * gathered, "reduce_scatter": (s - 1) / s * b,
            "allreduce": 2 * (r - 1) / r * b / s}


def zero_table(results):
    """One row per run (`TrainResult`s): measured model-state bytes and communication of rank
    0's last step beside Table 1's rule and the communication rule for its config."""
    import pandas as pd

    rows = []
    for res in results:
        cfg = res.config
        last = [m for m in res.metrics if m["rank"] == 0][-1]
        want = model_states(cfg)
        try:
            comm = sum(comm_volume(cfg).values())
        except ValueError:
            comm = float("nan")
        rows.append({"strategy": cfg.strategy, "world_size": cfg.world_size,
                     **{f"{k}": last[k] for k in want}, **{f"{k}_rule": v for k, v in want.items()},
                     "comm_bytes": last["comm_bytes"], "comm_bytes_rule": comm,
                     "comm_by_op": last["comm_by_op"]})
    return pd.DataFrame(rows)
