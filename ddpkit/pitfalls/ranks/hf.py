"""Rank code of the transformers pitfall: a tiny GPT-2 (from a config, nothing downloaded)
with its own checkpointing switched on as forum answers and trainers do."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .models import flat_grads, max_diff


def tiny_gpt2():
    """A 2-layer GPT-2 of width 16 from a config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # lazily: transformers is optional

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32,
                                      n_positions=16, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_checkpointing(model, use_reentrant):
    """Switch on the model's own checkpointing the way forum answers and trainers do, with the
    name this transformers has for it: ``activation_checkpointing_enable`` (5.x; the old name
    warns that it goes in v6), ``gradient_checkpointing_enable`` before."""
    if use_reentrant is None:
        return model
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model


def gpt2_tokens(rank, step, n=2, t=8):
    return torch.randint(0, 32, (n, t), generator=torch.Generator().manual_seed(1000 * rank + step))


def rank_hf(ctx, variants, steps=2):
    """Each variant (label -> (use_reentrant, find_unused_parameters)) of a GPT-2 whose own
    (transformers) checkpointing runs, against the same GPT-2 without checkpointing."""
    import logging

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    hf_log = logging.getLogger("transformers")
    hf_log.addHandler(Keep())

    def run(model, fup):
        ddp = DDP(model.train(), find_unused_parameters=fup)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        for step in range(steps):
            ctx.log(step=step)
            ids = gpt2_tokens(ctx.rank, step)
            loss = ddp(input_ids=ids, labels=ids).loss
            for msg in said:
                if "use_cache" in msg:
                    ctx.log(transformers_said=msg)  # before the backward that may raise
            said.clear()
            loss.backward()
            grads.append(flat_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"grads": grads}

    out = {}
    for label, (reentrant, fup) in variants.items():
        got = run(hf_checkpointing(tiny_gpt2(), reentrant), fup)
        ref = run(tiny_gpt2(), False)
        out[label] = {"max_grad_diff_vs_plain": max_diff(got, ref)}
    return out
