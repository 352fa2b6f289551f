"""Rank code of the pitfalls around the run itself: uneven inputs, a crashing rank, the
``module.`` prefix, unused parameters, ``SyncBatchNorm`` on CPU, ``static_graph`` with a branch."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .models import BNNet, BranchNet, CkptNet, batch, build, ddp_steps, rank_spread


def rank_uneven(ctx, fixed, eval_s=60.0):
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    n = 3 - ctx.rank  # rank 0 has one batch more than rank 1

    def epoch():
        for step in range(n):
            ctx.log(step=step)
            ddp(batch(ctx.rank, step)).backward()  # all-reduce: needs every rank
            opt.step()
            opt.zero_grad(set_to_none=True)

    if fixed:
        with ddp.join():  # a rank out of data shadows the others' all-reduces until all are done
            epoch()
        sums = [None] * ctx.world_size
        dist.all_gather_object(sums, sum(p.sum().item() for p in model.parameters()))
        return {"batches": n, "weight_sums": sums}
    epoch()
    # out of data: like real training it evaluates now (no collective), reporting progress,
    # while rank 0 waits in the all-reduce of a batch rank 1 does not have
    end = time.monotonic() + eval_s
    while time.monotonic() < end:
        ctx.log(phase="evaluate")
        time.sleep(0.2)
    return {"batches": n}


def rank_exception(ctx, fixed, culprit=1, bad_step=1, steps=3):
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x = batch(ctx.rank, step)
        if not fixed and ctx.rank == culprit and step == bad_step:
            x = x[:, :-1]  # a malformed batch, one feature short, on one rank only
        ctx.log(step=step, phase="forward")
        loss = ddp(x)
        ctx.log(step=step, phase="backward")  # the peer's last word before it waits in all-reduce
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return "done"


def rank_state_dict(ctx, fixed, path):
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    ddp(batch(ctx.rank, 0)).backward()
    if ctx.is_main:  # one writer; the others would race on the file
        torch.save(ddp.module.state_dict() if fixed else ddp.state_dict(), path)
    dist.barrier()  # nobody reads the file before rank 0 has written it
    saved = torch.load(path)
    plain = build(CkptNet, reentrant=None)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)  # so a successful load is visible as a difference of 0
    try:
        plain.load_state_dict(saved)
    except RuntimeError as exc:  # not inside DDP: the group is fine, the pool can stay warm
        return {"error": str(exc), "error_type": type(exc).__name__, "saved_keys": list(saved)}
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
    return {"error": None, "saved_keys": list(saved), "max_weight_diff_after_load": diff}


def rank_unused(ctx, fixed, steps=3):
    got = ddp_steps(ctx, build(CkptNet, reentrant=None, spare=True),
                 {"find_unused_parameters": True} if fixed else {}, steps)
    return {"params_without_grad": got["no_grad"], "steps": steps}

def rank_syncbn(ctx, fixed, steps=2):
    model = build(BNNet, segment=None)
    if not fixed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif ctx.device.type == "cuda":  # the fix: convert where it works, plain BatchNorm elsewhere
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    got = ddp_steps(ctx, model, steps=steps)  # the broken form raises in DDP(...)
    bn = got["model"].bn
    # plain BatchNorm normalises with each rank's own batch; DDP's broadcast_buffers copies
    # rank 0's running statistics to the others at the start of every forward
    ref = bn.running_mean.clone()
    dist.broadcast(ref, src=0)
    spread = (bn.running_mean - ref).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return {"norm_class": type(bn).__name__, "steps": steps,
            "num_batches_tracked": int(bn.num_batches_tracked),
            "running_mean_diff_between_ranks": spread.item()}

def rank_static_branch(ctx, fixed, steps=4, every=2):
    model = build(BranchNet)
    ddp = DDP(model, **({"find_unused_parameters": True} if fixed else {"static_graph": True}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    taken = []
    for step in range(steps):
        ctx.log(step=step)
        use_aux = step % every == 0  # the branch runs on steps 0, 2, ...
        ddp(batch(ctx.rank, step), use_aux).backward()
        taken.append(use_aux)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"branch_taken": taken, "weight_diff_between_ranks": rank_spread(model)}
