"""The toy models the pitfalls run, and what every rank function shares: the same weights on
every rank (`build`), each rank's own batches (`batch`), plain DDP steps (`ddp_steps`) and
the numbers compared across runs and ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

D = 8  # width of every toy model: a step takes a millisecond


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

def flat_grads(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def params_without_grad(model):
    return [n for n, p in model.named_parameters() if p.grad is None]


def ddp_steps(ctx, model, ddp_kwargs=None, steps=2, lr=0.1):
    """Plain DDP steps, one micro-batch each. Returns each step's gradients (before the
    optimizer step) and the names of the parameters that got none."""
    ddp = DDP(model, **(ddp_kwargs or {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads, no_grad = [], []
    for step in range(steps):
        ctx.log(step=step)  # before the step: an error is then reported at the step it hit
        torch.manual_seed(100 + step)  # same dropout masks in a variant and its reference
        ddp(batch(ctx.rank, step)).backward()
        grads.append(flat_grads(model))
        no_grad = params_without_grad(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "no_grad": no_grad, "model": model}


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a["grads"], b["grads"]))


def unique_messages(ws):
    return list(dict.fromkeys(str(w.message) for w in ws))

def rank_spread(model):
    """Largest |weight on this rank - weight on rank 0| over every rank: 0.0 while DDP keeps the
    ranks in step. A broadcast and a max all-reduce, outside DDP (no comm hook counts them)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    spread = (flat - ref).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()
