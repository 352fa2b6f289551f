"""What each pitfall runs on its ranks: toy models and module-level rank functions.

Module-level on purpose (ranks import them by name); small on purpose: a toy model of width 8,
a few steps, so a pitfall takes about a second. `ddpkit.pitfalls` names, runs and explains them.
"""
from __future__ import annotations

import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ..engine.probes import CommCounter

D = 8  # width of every toy model: a step takes a millisecond


# ----------------------------------------------------------------------------- toy models
class CkptNet(nn.Module):
    """x -> stem -> block -> head -> loss, the block checkpointed as told.

    ``reentrant``: True / False (passed to checkpoint), "unset" (checkpoint called without it,
    torch's default), None (no checkpoint). ``stem=False`` feeds the data straight into the
    checkpointed block (an input that does not require grad). ``shared=True`` runs the block
    twice, each use in its own checkpoint. ``spare=True`` adds a layer forward never uses.
    """

    def __init__(self, reentrant=True, stem=True, shared=False, spare=False):
        super().__init__()
        self.reentrant, self.shared = reentrant, shared
        self.stem = nn.Linear(D, D) if stem else nn.Identity()
        self.block = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, 1)
        self.spare = nn.Linear(D, D) if spare else None
        self.checkpoint_node = None  # autograd node type of the checkpoint's output

    def run_block(self, h):
        if self.reentrant is None:
            return self.block(h)
        if self.reentrant == "unset":
            out = checkpoint(self.block, h)  # no use_reentrant: whatever this torch defaults to
        else:
            out = checkpoint(self.block, h, use_reentrant=self.reentrant)
        self.checkpoint_node = type(out.grad_fn).__name__ if out.grad_fn is not None else None
        return out

    def forward(self, x):
        h = self.run_block(self.stem(x))
        if self.shared:
            h = self.run_block(h)
        return self.head(h).pow(2).mean()


class BNNet(nn.Module):
    """stem -> fc1 -> BatchNorm -> tanh -> fc2 -> head. ``segment``: "all" checkpoints
    fc1..fc2 with the BatchNorm inside (the pitfall); "around" checkpoints fc1 and tanh->fc2,
    the BatchNorm between them outside (the fix); None checkpoints nothing (the reference)."""

    def __init__(self, segment="all"):
        super().__init__()
        self.segment = segment
        self.stem, self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, 1)

    def middle(self, h):
        return self.fc2(torch.tanh(self.bn(self.fc1(h))))

    def forward(self, x):
        h = self.stem(x)
        if self.segment == "all":
            h = checkpoint(self.middle, h, use_reentrant=False)
        elif self.segment == "around":
            h = self.bn(checkpoint(self.fc1, h, use_reentrant=False))
            h = checkpoint(lambda t: self.fc2(torch.tanh(t)), h, use_reentrant=False)
        else:
            h = self.middle(h)
        return self.head(h).pow(2).mean()


class DropNet(nn.Module):
    """stem -> fc1 -> dropout(0.5) -> fc2 -> head, the middle checkpointed (non-reentrant) with
    ``preserve_rng_state`` as given; None checkpoints nothing (the reference)."""

    def __init__(self, preserve_rng_state=False):
        super().__init__()
        self.preserve = preserve_rng_state
        self.stem, self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(D, 1)

    def middle(self, h):
        return self.fc2(self.drop(torch.tanh(self.fc1(h))))

    def forward(self, x):
        h = self.stem(x)
        h = self.middle(h) if self.preserve is None else checkpoint(
            self.middle, h, use_reentrant=False, preserve_rng_state=self.preserve)
        return self.head(h).pow(2).mean()


def build(cls, **kw):
    torch.manual_seed(0)  # the same initial weights on every rank and in every variant
    return cls(**kw)


def batch(rank, step, k=0, n=4):
    """Rank ``rank``'s micro-batch ``k`` of step ``step``: different per rank, fixed per run."""
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + k))


# ----------------------------------------------------------------------------- rank helpers
def _flat_grads(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def _no_grad(model):
    return [n for n, p in model.named_parameters() if p.grad is None]


def _steps(ctx, model, ddp_kwargs=None, steps=2, lr=0.1):
    """Plain DDP steps, one micro-batch each. Returns each step's gradients (before the
    optimizer step) and the names of the parameters that got none."""
    ddp = DDP(model, **(ddp_kwargs or {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads, no_grad = [], []
    for step in range(steps):
        ctx.log(step=step)  # before the step: an error is then reported at the step it hit
        torch.manual_seed(100 + step)  # same dropout masks in a variant and its reference
        ddp(batch(ctx.rank, step)).backward()
        grads.append(_flat_grads(model))
        no_grad = _no_grad(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "no_grad": no_grad, "model": model}


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a["grads"], b["grads"]))


def _unique(ws):
    return list(dict.fromkeys(str(w.message) for w in ws))


# ----------------------------------------------------------------------------- rank code
def rank_variants(ctx, net_kw, base_ddp, variants):
    """Each variant (label -> (use_reentrant, extra DDP keywords)) against the un-checkpointed
    reference: the largest gradient difference, and which parameters got no gradient."""
    out = {}
    for label, (reentrant, extra) in variants.items():
        got = _steps(ctx, build(CkptNet, reentrant=reentrant, **net_kw), {**base_ddp, **extra})
        ref = _steps(ctx, build(CkptNet, reentrant=None, **net_kw), base_ddp)
        out[label] = {"max_grad_diff_vs_plain": _max_diff(got, ref),
                      "params_without_grad": got["no_grad"]}
    return out


def rank_input_no_grad(ctx, fixed, steps=3):
    # broken: the data go straight into a reentrant checkpoint. find_unused_parameters=True is
    # what DDP's own error message asks for when those parameters never report; it hides it.
    model = build(CkptNet, reentrant=not fixed, stem=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps(ctx, model, {} if fixed else {"find_unused_parameters": True}, steps)
    change = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    return {"params_without_grad": got["no_grad"], "steps": steps,
            "block_weight_change": change["block.0.weight"],
            "head_weight_change": change["head.weight"], "warnings": _unique(caught)}


def rank_default_reentrant(ctx, fixed):
    model = build(CkptNet, reentrant=False if fixed else "unset")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps(ctx, model, steps=1)
    node = model.checkpoint_node
    return {"warnings": _unique(caught), "checkpoint_node": node, "raised": False,
            "variant_used": "reentrant" if node == "CheckpointFunctionBackward" else "non-reentrant",
            "params_without_grad": got["no_grad"], "torch": torch.__version__}


def rank_accumulate(ctx, scale_loss, no_sync, k=4):
    """k micro-batches into one optimizer step, against one big batch of the same samples."""
    model = build(CkptNet, reentrant=None)
    ddp = DDP(model)
    comm = CommCounter().install(ddp)
    micro = [batch(ctx.rank, 0, j) for j in range(k)]
    ddp(torch.cat(micro)).backward()  # the reference: the whole batch at once
    ref, ref_calls = _flat_grads(model), comm.calls
    model.zero_grad(set_to_none=True)
    comm.reset()
    for j, x in enumerate(micro):
        skip = no_sync and j < k - 1  # all-reduce on the last micro-batch only
        with ddp.no_sync() if skip else nullcontext():
            loss = ddp(x)
            (loss / k if scale_loss else loss).backward()
        ctx.log(step=0, micro_step=j)
    got = _flat_grads(model)
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
        grads.append(_flat_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"allreduce_calls_per_step": calls, "grads": grads}


def rank_nosync_static(ctx, fixed):
    if fixed:  # static_graph with a fully synced first step, then no_sync as usual
        got = _accum_steps(ctx, {"reentrant": True}, {"static_graph": True}, sync_first=True)
        ref = _accum_steps(ctx, {"reentrant": None}, {}, sync_first=False)
        return {"allreduce_calls_per_step": got["allreduce_calls_per_step"],
                "max_grad_diff_vs_plain": _max_diff(got, ref)}
    _accum_steps(ctx, {"reentrant": True}, {}, sync_first=False)
    ctx.log(check="reentrant checkpoint + no_sync, no static_graph", ok=1)
    _accum_steps(ctx, {"reentrant": True}, {"static_graph": True}, sync_first=False)  # raises


def rank_batchnorm(ctx, fixed, steps=3):
    got = _steps(ctx, build(BNNet, segment="around" if fixed else "all"), steps=steps)
    ref = _steps(ctx, build(BNNet, segment=None), steps=steps)
    bn, ref_bn = got["model"].bn, ref["model"].bn
    return {"steps": steps, "num_batches_tracked": int(bn.num_batches_tracked),
            "reference_num_batches_tracked": int(ref_bn.num_batches_tracked),
            "running_mean_max_diff": (bn.running_mean - ref_bn.running_mean).abs().max().item(),
            "running_var_max_diff": (bn.running_var - ref_bn.running_var).abs().max().item(),
            "max_grad_diff_vs_plain": _max_diff(got, ref)}


def rank_dropout(ctx, fixed):
    got = _steps(ctx, build(DropNet, preserve_rng_state=bool(fixed)))
    ref = _steps(ctx, build(DropNet, preserve_rng_state=None))
    return {"max_grad_diff_vs_plain": _max_diff(got, ref),
            "grad_norm": max(g.norm().item() for g in ref["grads"])}


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
    got = _steps(ctx, build(CkptNet, reentrant=None, spare=True),
                 {"find_unused_parameters": True} if fixed else {}, steps)
    return {"params_without_grad": got["no_grad"], "steps": steps}


# ----------------------------------------------------------------------------- the catalogue, grown
def _rank_spread(model):
    """Largest |weight on this rank - weight on rank 0| over every rank: 0.0 while DDP keeps the
    ranks in step. A broadcast and a max all-reduce, outside DDP (no comm hook counts them)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    spread = (flat - ref).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


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
    big = _flat_grads(model)
    model.zero_grad(set_to_none=True)
    (ddp(micro[0][-1]) / k).backward()
    last = _flat_grads(model)
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
            got = _flat_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"accum_steps": k, "allreduce_calls_per_step": calls,
            "grad_norm_ratio_vs_big_batch": (got.norm() / big.norm()).item(),
            "max_grad_diff_vs_big_batch": (got - big).abs().max().item(),
            "max_grad_diff_vs_last_micro_batch": (got - last).abs().max().item(),
            "steps": steps, "weight_diff_between_ranks": _rank_spread(model)}


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
            grads.append(_flat_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"grads": grads}

    out = {}
    for label, (reentrant, fup) in variants.items():
        got = run(hf_checkpointing(tiny_gpt2(), reentrant), fup)
        ref = run(tiny_gpt2(), False)
        out[label] = {"max_grad_diff_vs_plain": _max_diff(got, ref)}
    return out


class LayerDropNet(nn.Module):
    """stem -> block (checkpointed, non-reentrant, skipped with probability 0.5: LayerDrop) ->
    head. ``draw``: "python" decides with Python's ``random`` (not restored for the recompute),
    "torch" with torch's RNG (restored: preserve_rng_state). ``checkpointed=False``: the
    reference."""

    def __init__(self, draw="python", checkpointed=True):
        super().__init__()
        self.draw, self.checkpointed = draw, checkpointed
        self.stem, self.fc, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def block(self, h):
        import random

        u = random.random() if self.draw == "python" else torch.rand(()).item()
        if u < 0.5:
            return h  # the layer is dropped this time
        return h + self.fc(torch.tanh(h))

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.head(h).pow(2).mean()


def rank_recompute(ctx, fixed, steps=4):
    import random

    random.seed(10)  # the first draw keeps the layer (0.57), the recompute's drops it (0.43)
    # a dropped layer's parameters get no gradient: LayerDrop needs find_unused_parameters
    got = _steps(ctx, build(LayerDropNet, draw="torch" if fixed else "python"),
                 {"find_unused_parameters": True}, steps)
    ref = _steps(ctx, build(LayerDropNet, draw="torch", checkpointed=False),
                 {"find_unused_parameters": True}, steps)
    return {"steps": steps, "max_grad_diff_vs_plain": _max_diff(got, ref)}


def rank_syncbn(ctx, fixed, steps=2):
    model = build(BNNet, segment=None)
    if not fixed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif ctx.device.type == "cuda":  # the fix: convert where it works, plain BatchNorm elsewhere
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    got = _steps(ctx, model, steps=steps)  # the broken form raises in DDP(...)
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


class BranchNet(nn.Module):
    """stem -> [aux, on the steps that ask for it] -> head: a branch taken on some steps."""

    def __init__(self):
        super().__init__()
        self.stem, self.aux, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x, use_aux=True):
        h = self.stem(x)
        if use_aux:
            h = h + self.aux(torch.tanh(h))
        return self.head(h).pow(2).mean()


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
    return {"branch_taken": taken, "weight_diff_between_ranks": _rank_spread(model)}
