"""Rank code of the transformers pitfalls: a tiny GPT-2 (from a config, nothing downloaded)
with its own checkpointing switched on as forum answers and trainers do; the same GPT-2 with
LoRA adapters (peft) under torch's reentrant checkpoint."""
from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ...engine.policies import CheckpointPolicy
from ...spec.setting import CheckpointSetting
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


def tiny_lora_gpt2():
    """The tiny GPT-2 with LoRA adapters (rank 4) on each block's attention (peft): the base
    model frozen, embeddings included."""
    from peft import LoraConfig, get_peft_model  # lazily: peft is optional

    base = tiny_gpt2()
    # no KV cache, as ddpkit's runs: a cache filled in forward is filled again by a reentrant
    # recompute, which then attends to every key twice (other gradients, no error)
    base.config.use_cache = False
    with warnings.catch_warnings():  # peft: GPT-2's Conv1D needs fan_in_fan_out (it sets it)
        warnings.simplefilter("ignore", UserWarning)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["c_attn"]))


def _adapter_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_lora(ctx, variants, steps=2):
    """Each variant (label -> (use_reentrant, enable_input_require_grads)) of the LoRA GPT-2
    with its first block checkpointed by torch's checkpoint (ddpkit's `CheckpointSetting`:
    2 segments, the last never checkpointed), under plain DDP; against no checkpointing."""
    def run(reentrant, input_grads):
        model = tiny_lora_gpt2().train()
        if input_grads:
            model.enable_input_require_grads()
        if reentrant is not None:
            CheckpointPolicy(CheckpointSetting.of(2, 2), use_reentrant=reentrant).apply(
                model, "base_model.model.transformer.h")
        ddp = DDP(model)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        grads = []
        for step in range(steps):
            ids = gpt2_tokens(ctx.rank, step)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                loss = ddp(input_ids=ids, labels=ids).loss
            warned = sorted({str(w.message) for w in said if "requires_grad" in str(w.message)})
            loss.backward()  # under DDP, a step that left adapters without grad fails the next
            grads.append(_adapter_grads(model))
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
            ctx.log(step=step, torch_warned=warned,
                    adapters_without_grad=sorted(set(trainable) - set(grads[-1])))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return grads

    out = {}
    for label, (reentrant, input_grads) in variants.items():
        got, ref = run(reentrant, input_grads), run(None, False)
        out[label] = {"max_grad_diff_vs_plain": max(
            (a[k] - b[k]).abs().max().item() for a, b in zip(got, ref) for k in b),
            "adapters_without_grad": sum(len(set(b) - set(a)) for a, b in zip(got, ref))}
    return out
