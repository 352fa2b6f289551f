"""Rank code of the checkpointing pitfalls: reentrant variants, inputs without grad, torch's
default, BatchNorm and dropout inside a checkpoint, a recompute that differs."""
from __future__ import annotations

import warnings

import torch

from .models import (BNNet, CkptNet, DropNet, LayerDropNet, build, ddp_steps, max_diff,
                     unique_messages)


def rank_variants(ctx, net_kw, base_ddp, variants):
    """Each variant (label -> (use_reentrant, extra DDP keywords)) against the un-checkpointed
    reference: the largest gradient difference, and which parameters got no gradient."""
    out = {}
    for label, (reentrant, extra) in variants.items():
        got = ddp_steps(ctx, build(CkptNet, reentrant=reentrant, **net_kw), {**base_ddp, **extra})
        ref = ddp_steps(ctx, build(CkptNet, reentrant=None, **net_kw), base_ddp)
        out[label] = {"max_grad_diff_vs_plain": max_diff(got, ref),
                      "params_without_grad": got["no_grad"]}
    return out


def rank_input_no_grad(ctx, fixed, steps=3):
    # broken: the data go straight into a reentrant checkpoint. find_unused_parameters=True is
    # what DDP's own error message asks for when those parameters never report; it hides it.
    model = build(CkptNet, reentrant=not fixed, stem=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ddp_steps(ctx, model, {} if fixed else {"find_unused_parameters": True}, steps)
    change = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    return {"params_without_grad": got["no_grad"], "steps": steps,
            "block_weight_change": change["block.0.weight"],
            "head_weight_change": change["head.weight"], "warnings": unique_messages(caught)}


def rank_default_reentrant(ctx, fixed):
    model = build(CkptNet, reentrant=False if fixed else "unset")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ddp_steps(ctx, model, steps=1)
    node = model.checkpoint_node
    return {"warnings": unique_messages(caught), "checkpoint_node": node, "raised": False,
            "variant_used": "reentrant" if node == "CheckpointFunctionBackward" else "non-reentrant",
            "params_without_grad": got["no_grad"], "torch": torch.__version__}

def rank_batchnorm(ctx, fixed, steps=3):
    got = ddp_steps(ctx, build(BNNet, segment="around" if fixed else "all"), steps=steps)
    ref = ddp_steps(ctx, build(BNNet, segment=None), steps=steps)
    bn, ref_bn = got["model"].bn, ref["model"].bn
    return {"steps": steps, "num_batches_tracked": int(bn.num_batches_tracked),
            "reference_num_batches_tracked": int(ref_bn.num_batches_tracked),
            "running_mean_max_diff": (bn.running_mean - ref_bn.running_mean).abs().max().item(),
            "running_var_max_diff": (bn.running_var - ref_bn.running_var).abs().max().item(),
            "max_grad_diff_vs_plain": max_diff(got, ref)}


def rank_dropout(ctx, fixed):
    got = ddp_steps(ctx, build(DropNet, preserve_rng_state=bool(fixed)))
    ref = ddp_steps(ctx, build(DropNet, preserve_rng_state=None))
    return {"max_grad_diff_vs_plain": max_diff(got, ref),
            "grad_norm": max(g.norm().item() for g in ref["grads"])}

def rank_recompute(ctx, fixed, steps=4):
    import random

    random.seed(10)  # the first draw keeps the layer (0.57), the recompute's drops it (0.43)
    # a dropped layer's parameters get no gradient: LayerDrop needs find_unused_parameters
    got = ddp_steps(ctx, build(LayerDropNet, draw="torch" if fixed else "python"),
                 {"find_unused_parameters": True}, steps)
    ref = ddp_steps(ctx, build(LayerDropNet, draw="torch", checkpointed=False),
                 {"find_unused_parameters": True}, steps)
    return {"steps": steps, "max_grad_diff_vs_plain": max_diff(got, ref)}
