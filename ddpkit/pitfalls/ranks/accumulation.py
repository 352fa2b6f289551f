"""Rank code of the gradient-accumulation pitfalls: the unscaled loss, all-reduce on every
micro-step, ``no_sync`` with ``static_graph``, and the slips of a hand-written loop."""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ...engine.probes import CommCounter
from .models import CkptNet, batch, build, flat_grads, max_diff, rank_spread


def rank_accumulate(ctx, scale_loss, no_sync, k=4):
    """k micro-batches into one optimizer step, against one big batch of the same samples."""
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    comm = CommCounter().install(ddp)
    micro = [batch(ctx.rank, 0, j) for j in range(k)]
    ddp(torch.cat(micro)).backward()  # the reference: the whole batch at once
    ref, ref_calls = flat_grads(model), comm.calls
    model.zero_grad(set_to_none=True)
    comm.reset()
    for j, x in enumerate(micro):
        skip = no_sync and j < k - 1  # all-reduce on the last micro-batch only
        with ddp.no_sync() if skip else nullcontext():
            loss = ddp(x)
            (loss / k if scale_loss else loss).backward()
        ctx.log(step=0, micro_step=j)
    got = flat_grads(model)
    return {"accum_steps": k, "grad_norm_ratio": (got.norm() / ref.norm()).item(),
            "max_grad_diff_vs_big_batch": (got - ref).abs().max().item(),
            "allreduce_calls": comm.calls, "allreduce_bytes": comm.bytes,
            "big_batch_allreduce_calls": ref_calls}


def _accum_steps(ctx, net_kw, ddp_kwargs, sync_first, steps=3, k=2):
    """Accumulation with no_sync; ``sync_first`` syncs every micro-batch of step 0."""
    model = build(CkptNet, **net_kw)
    ddp = DDP(model, **ddp_kwargs)
    comm = CommCounter().install(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    calls, grads = [], []
    for step in range(steps):
        ctx.log(step=step)
        comm.reset()
        for j in range(k):
            skip = j < k - 1 and not (sync_first and step == 0)
            with ddp.no_sync() if skip else nullcontext():
                (ddp(batch(ctx.rank, step, j)) / k).backward()
        calls.append(comm.calls)
        grads.append(flat_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"allreduce_calls_per_step": calls, "grads": grads}


def rank_nosync_static(ctx, fixed):
    if fixed:  # static_graph with a fully synced first step, then no_sync as usual
        got = _accum_steps(ctx, {"reentrant": True}, {"static_graph": True}, sync_first=True)
        ref = _accum_steps(ctx, {"reentrant": None}, {}, sync_first=False)
        return {"allreduce_calls_per_step": got["allreduce_calls_per_step"],
                "max_grad_diff_vs_plain": max_diff(got, ref)}
    _accum_steps(ctx, {"reentrant": True}, {}, sync_first=False)
    ctx.log(check="reentrant checkpoint + no_sync, no static_graph", ok=1)
    _accum_steps(ctx, {"reentrant": True}, {"static_graph": True}, sync_first=False)  # raises

def rank_accum_loop(ctx, mistake, fixed, k=4, steps=2):
    """Gradient accumulation over k micro-batches per step, no_sync on all but the last: the
    correct loop (``fixed``), or with one ``mistake``:

    * ``"backward_only"``: ``loss = ddp(x)`` outside no_sync, only ``.backward()`` inside it;
    * ``"no_sync_last_too"``: no_sync around every micro-batch, the last one as well;
    * ``"zero_grad_inside"``: ``opt.zero_grad()`` inside the micro-batch loop;
    * ``"module_forward"``: forward through ``ddp.module`` instead of ``ddp``.

    Step 0's accumulated gradient is compared with one big batch of the same k micro-batches and
    with the last micro-batch alone (both through DDP, on the same weights); after ``steps``
    optimizer steps, the weights are compared across ranks."""
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    comm = CommCounter().install(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    micro = [[batch(ctx.rank, s, j) for j in range(k)] for s in range(steps)]
    ddp(torch.cat(micro[0])).backward()  # references: the big batch, then the last micro-batch
    big = flat_grads(model)
    model.zero_grad(set_to_none=True)
    (ddp(micro[0][-1]) / k).backward()
    last = flat_grads(model)
    model.zero_grad(set_to_none=True)
    calls = []
    broken = None if fixed else mistake
    for step in range(steps):
        ctx.log(step=step)
        comm.reset()
        for j, x in enumerate(micro[step]):
            if broken == "zero_grad_inside":
                opt.zero_grad(set_to_none=True)  # wipes the micro-batches summed so far
            skip = j < k - 1 or broken == "no_sync_last_too"
            if broken == "backward_only":
                loss = ddp(x) / k  # forward outside: DDP has already decided to sync
                with ddp.no_sync() if skip else nullcontext():
                    loss.backward()
            else:
                with ddp.no_sync() if skip else nullcontext():
                    out = ddp.module(x) if broken == "module_forward" else ddp(x)
                    (out / k).backward()  # / k: a mean over the big batch
        calls.append(comm.calls)
        if step == 0:
            got = flat_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"accum_steps": k, "allreduce_calls_per_step": calls,
            "grad_norm_ratio_vs_big_batch": (got.norm() / big.norm()).item(),
            "max_grad_diff_vs_big_batch": (got - big).abs().max().item(),
            "max_grad_diff_vs_last_micro_batch": (got - last).abs().max().item(),
            "steps": steps, "weight_diff_between_ranks": rank_spread(model)}
