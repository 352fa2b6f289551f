"""The pitfall lab: the known DDP + checkpointing + accumulation faults, each one a real run.

``catalog()`` lists them; ``run(name, fixed=False)`` runs the broken setup on 2 real gloo ranks
and returns what happened: ``error`` is the text torch raised, verbatim, on the culprit rank;
``evidence`` holds numbers measured in the run that show a *silent* fault (parameters without a
gradient, a gradient-norm ratio, all-reduce counts, BatchNorm counters). ``fixed=True`` runs the
same setup with the fix. Before launching, `ddpkit.doctor` looks at the pitfall's model on this
process; its findings come back in ``findings``.

Rank code is module-level here (so ranks import it by name) and small on purpose: a toy model of
width 8, a few steps. Setups that crash or stall ranks always get a fresh launch, so a warm
``pool`` passed in stays warm for the rest.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from .errors import RankError, RankStalled
from .probes import CommCounter

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


def rank_touch_cuda(ctx):
    return str(torch.zeros(1, device="cuda").device)


# ----------------------------------------------------------------------------- the catalogue
@dataclass(frozen=True)
class Pitfall:
    """One known fault. ``silent``: it raises nothing, only numbers show it."""
    name: str
    title: str
    symptom: str
    cause: str
    fix: str
    silent: bool

    def __repr__(self):
        kind = "silent" if self.silent else "raises"
        return (f"{self.name} ({kind}): {self.title}\n  symptom: {self.symptom}\n"
                f"  cause:   {self.cause}\n  fix:     {self.fix}")


_REENTRANT_FIX = ("use_reentrant=False (the autograd graph is built normally), or "
                  "DDP(static_graph=True) (DDP learns from the first iteration which gradients "
                  "come when)")
_CATALOG = [
    Pitfall("reentrant_find_unused",
            "reentrant checkpoint + find_unused_parameters=True",
            "backward raises 'Expected to mark a variable ready only once' in the first step",
            "a reentrant checkpoint runs its forward under no_grad, so its parameters are not in "
            "the graph DDP searches after forward: DDP marks them unused (ready), then the "
            "recompute in backward produces their gradients and marks them ready again",
            _REENTRANT_FIX, silent=False),
    Pitfall("reentrant_shared_module",
            "a module used twice in forward, each use in its own reentrant checkpoint",
            "backward raises 'Expected to mark a variable ready only once'",
            "each reentrant checkpoint is its own backward pass, so the shared parameters' "
            "gradients are accumulated (and reported to DDP) once per use",
            _REENTRANT_FIX, silent=False),
    Pitfall("reentrant_input_no_grad",
            "reentrant checkpoint whose input does not require grad",
            "no error, one UserWarning; the checkpointed parameters get no gradient and never "
            "train (with find_unused_parameters=True, which DDP's own error asks for, every step "
            "runs 'fine')",
            "reentrant checkpoint backpropagates only into inputs that require grad; the data "
            "(or a frozen embedding's output) does not, so its backward never runs",
            "use_reentrant=False, or checkpoint from a point whose input requires grad "
            "(after the first layer)", silent=True),
    Pitfall("default_use_reentrant",
            "checkpoint() called without use_reentrant",
            "a UserWarning saying it should be passed and that it will raise in the future; "
            "this torch still runs",
            "without the argument this torch picks the reentrant variant (and its DDP "
            "restrictions above), not the recommended non-reentrant one",
            "always pass use_reentrant explicitly (False unless you need True)", silent=True),
    Pitfall("loss_not_scaled",
            "gradient accumulation without loss / accum_steps",
            "training runs, but as if the learning rate were accum_steps times larger",
            "backward adds gradients over micro-batches; each micro-batch loss is a mean, so the "
            "sum is accum_steps times the big-batch gradient",
            "backward (loss / accum_steps)", silent=True),
    Pitfall("sync_every_micro_step",
            "gradient accumulation without no_sync()",
            "correct weights, but every micro-batch pays a full all-reduce",
            "DDP all-reduces in every backward unless told not to; only the last micro-batch's "
            "sum is needed",
            "wrap all but the last micro-batch in `with ddp_model.no_sync():`", silent=True),
    Pitfall("no_sync_with_static_graph",
            "no_sync() with static_graph=True (and/or reentrant checkpointing)",
            "the first backward raises an INTERNAL ASSERT in DDP's reducer "
            "(expect_autograd_hooks_)",
            "static_graph records which gradients arrive during the first iteration; under "
            "no_sync it records nothing and then expects hooks it never set up (a torch bug). "
            "Reentrant checkpointing with no_sync alone works in this torch",
            "sync every micro-batch of the first step (no no_sync there), then use no_sync; "
            "ddpkit.train does this", silent=False),
    Pitfall("batchnorm_in_checkpoint",
            "BatchNorm inside a checkpointed segment",
            "no error; running mean/var drift from the un-checkpointed model's, "
            "num_batches_tracked counts twice per step",
            "the recompute in backward runs BatchNorm's forward again in training mode, "
            "updating its running statistics a second time",
            "keep BatchNorm outside checkpointed segments (checkpoint the layers around it), or "
            "use LayerNorm/GroupNorm", silent=True),
    Pitfall("dropout_rng",
            "dropout inside checkpoint with preserve_rng_state=False",
            "no error; gradients differ from the un-checkpointed model's",
            "the recompute draws a new dropout mask, so backward differentiates a different "
            "network than forward ran",
            "keep preserve_rng_state=True (the default)", silent=True),
    Pitfall("uneven_inputs",
            "one rank gets an extra batch",
            "the run hangs: the rank with more data waits in all-reduce for peers that are done "
            "(30 minutes, gloo's default timeout); ddpkit's watchdog ends it with RankStalled",
            "every backward's all-reduce needs every rank; a rank out of data never joins it",
            "equal batches per rank (DistributedSampler(drop_last=True)), or "
            "`with ddp_model.join():` around the loop", silent=False),
    Pitfall("rank_exception",
            "one rank raises mid-step",
            "the peers sit in a collective; when the culprit's process exits they fail with "
            "'Connection closed by peer', often the first error a launcher shows",
            "collectives wait for every rank; a dead rank never arrives",
            "fix the culprit's error: ddpkit names that rank with its own traceback (RankError) "
            "and ends the peers", silent=False),
    Pitfall("state_dict_prefix",
            "saving ddp_model.state_dict() and loading it into a plain model",
            "load_state_dict raises: missing 'stem.weight'..., unexpected 'module.stem.weight'...",
            "DDP keeps your model as its .module, so every key gains a 'module.' prefix",
            "save ddp_model.module.state_dict() on rank 0, then dist.barrier() before anyone reads "
            "it (or strip the prefix with torch.nn.modules.utils."
            "consume_prefix_in_state_dict_if_present)", silent=False),
    Pitfall("unused_parameters",
            "a parameter forward never uses, without find_unused_parameters",
            "the second step raises 'Expected to have finished reduction in the prior "
            "iteration before starting a new one'",
            "DDP waits for every parameter's gradient before it all-reduces the last bucket; an "
            "unused one never comes",
            "find_unused_parameters=True (one graph traversal per step), or remove / freeze "
            "the parameter", silent=False),
    Pitfall("fork_after_cuda",
            "a fork-based launcher after the kernel touched CUDA",
            "each child raises 'Cannot re-initialize CUDA in forked subprocess'",
            "CUDA's state cannot be copied into a forked child; torch refuses to initialise it "
            "again there",
            "start ranks with spawn (ddpkit always does)", silent=False),
    Pitfall("notebook_fn_spawn",
            "plain mp.spawn of a function defined in a notebook",
            "each child dies with AttributeError: Can't get attribute 'work' on <module "
            "'__main__' (built-in)>; the parent only says a process exited with code 1",
            "spawn sends the function by name; a spawned child's __main__ is not the notebook, "
            "so the name is not there",
            "send the function by value (cloudpickle) to a module-level trampoline: "
            "ddpkit.launch", silent=False),
]


def catalog():
    """Every `Pitfall` the lab can run, in teaching order."""
    return list(_CATALOG)


def get(name):
    for p in _CATALOG:
        if p.name == name:
            return p
    raise ValueError(f"no pitfall named {name!r}; pitfalls: {', '.join(p.name for p in _CATALOG)}")


# ----------------------------------------------------------------------------- results
@dataclass
class PitfallResult:
    """What one run of a pitfall showed. ``error``: the exception text, verbatim, from the rank
    that raised it (None when nothing raised); ``evidence``: numbers measured in the run;
    ``findings``: what `ddpkit.doctor` said about the setup's model before launch."""
    name: str
    fixed: bool
    error: str | None = None
    evidence: dict = field(default_factory=dict)
    error_type: str | None = None
    culprit: int | None = None
    findings: list = field(default_factory=list)
    skipped: str | None = None
    wall_s: float = 0.0
    output: list = field(default_factory=list, repr=False)
    exception: BaseException | None = field(default=None, repr=False)

    @property
    def clean(self):
        return self.error is None and self.skipped is None

    def raise_(self):
        """Raise the run's error again (the real `RankError` where a rank raised)."""
        if self.exception is not None:
            raise self.exception
        if self.error is not None:
            import builtins

            cls = getattr(builtins, self.error_type or "", None)
            raise (cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError)(self.error)

    def __repr__(self):
        head = f"{self.name} ({'fixed' if self.fixed else 'broken'}), {self.wall_s:.1f}s: "
        if self.skipped:
            return head + f"skipped: {self.skipped}"
        lines = [head + ("raised" if self.error else "ran clean")]
        if self.error:
            who = f", rank {self.culprit}" if self.culprit is not None else ""
            lines.append(f"  error ({self.error_type}{who}): {self.error}")
        for k, v in self.evidence.items():
            lines.append(f"  {k}: {v!r}")
        lines.append("  doctor: " + ("no findings" if not self.findings else
                                     "; ".join(f"[{f.pitfall}] at {f.where}" for f in self.findings)))
        return "\n".join(lines)


class _Run:
    def __init__(self, returns, metrics, error):
        self.returns, self.metrics, self.error = returns, metrics, error


class _Lab:
    """Launches one pitfall's rank code: on the warm pool, or fresh where it may crash/stall."""

    def __init__(self, pool):
        self.pool, self.output = pool, []

    def launch(self, fn, *args, fresh=False, stall_timeout_s=60.0):
        kw = dict(block=False, stall_timeout_s=stall_timeout_s,
                  on_output=lambda rank, line: self.output.append((rank, line)))
        if self.pool is not None and not fresh:
            handle = self.pool.launch(fn, *args, **kw)
        else:
            from .launcher import launch

            handle = launch(fn, *args, world_size=2, backend="gloo", device="cpu", **kw)
        try:
            res = handle.wait()
        except (RankError, RankStalled) as exc:
            return _Run(None, handle.metrics, exc)
        return _Run(res.returns, handle.metrics, None)


def _outcome(run, evidence=None):
    """PitfallResult fields from a run: rank 0's return as evidence, or the error."""
    exc = run.error
    if exc is None:
        return dict(evidence=run.returns[0] if evidence is None else evidence)
    if isinstance(exc, RankStalled):
        return dict(error=str(exc), error_type="RankStalled", exception=exc,
                    evidence={"stalled_ranks": exc.ranks, "last_steps": exc.last_steps,
                              **(evidence or {})})
    return dict(error=exc.message, error_type=exc.exc_type, culprit=exc.rank, exception=exc,
                evidence={"culprit_rank": exc.rank, "step": exc.step, "peers": exc.peers,
                          **(evidence or {})})


# ----------------------------------------------------------------------------- kernel side
_FIXES = {"use_reentrant=False": (False, {}), "static_graph=True": (True, {"static_graph": True})}
_BROKEN = {"use_reentrant=True": (True, {})}


def _variants(net_kw, base_ddp):
    def runner(lab, fixed):
        variants = _FIXES if fixed else _BROKEN
        return _outcome(lab.launch(rank_variants, net_kw, base_ddp, variants, fresh=not fixed))
    return runner


def _nosync_static(lab, fixed):
    run = lab.launch(rank_nosync_static, fixed, fresh=not fixed)
    checks = {m["check"]: "ok" for m in run.metrics if "check" in m and m["rank"] == 0}
    if run.error is not None:
        checks["static_graph=True + no_sync at the first step"] = "raised"
    return _outcome(run, None if fixed else checks)


def _uneven(lab, fixed):
    t0 = time.monotonic()
    run = lab.launch(rank_uneven, fixed, fresh=not fixed, stall_timeout_s=3.0)
    if fixed:
        return _outcome(run)
    steps = {r: sum(1 for m in run.metrics if m["rank"] == r and "step" in m) for r in (0, 1)}
    evaluating = sum(1 for m in run.metrics if m.get("phase") == "evaluate")
    return _outcome(run, {"steps_done": steps, "batches": {0: 3, 1: 2},
                          "records_from_rank_1_while_rank_0_waited": evaluating,
                          "ended_after_s": round(time.monotonic() - t0, 1)})


def _rank_exc(lab, fixed):
    run = lab.launch(rank_exception, fixed, fresh=not fixed)
    if fixed:
        return _outcome(run, {"returns": run.returns})
    last = [m for m in run.metrics if m["rank"] == 0][-1:]
    return _outcome(run, {"peer_last_record": last[0] if last else None})


def _state_dict(lab, fixed):
    with tempfile.TemporaryDirectory() as tmp:
        run = lab.launch(rank_state_dict, fixed, os.path.join(tmp, "model.pt"))
    if run.error is not None:
        return _outcome(run)
    ev = dict(run.returns[0])
    error, error_type = ev.pop("error"), ev.pop("error_type", None)
    ev["saved_keys"] = ev["saved_keys"][:3] + (["..."] if len(ev["saved_keys"]) > 3 else [])
    return dict(error=error, error_type=error_type, culprit=0 if error else None, evidence=ev)


_CHILD_ERRORS = ("ProcessRaisedException", "ProcessExitedException")


def _python_main(code, timeout=180):
    """Run code the way a notebook kernel holds it: in ``__main__`` with no ``__file__``.

    ``python -c`` does exactly that. (``python -`` does not: it sets ``__file__ = '<stdin>'``,
    and spawn's children then fail to open '<stdin>' as a script, another error.)
    """
    import ddpkit

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                          capture_output=True, timeout=timeout, env=env)


def _error_lines(stderr):
    """(child's exception line, parent's exception line) from a traceback-filled stderr."""
    import re

    lines = [l.strip() for l in stderr.splitlines()
             if re.match(r"^\s*[\w.]*(Error|Exception): ", l)]
    parent = [l for l in lines if any(c in l for c in _CHILD_ERRORS)]
    child = [l for l in lines if l not in parent]
    return (child[0] if child else None), (parent[-1] if parent else None)


def _subprocess_outcome(out, marker="RETURNS"):
    child, parent = _error_lines(out.stderr)
    if out.returncode == 0:
        line = [l for l in out.stdout.splitlines() if l.startswith(marker)]
        return dict(evidence={"returncode": 0, "returns": line[0][len(marker) + 1:] if line else None})
    err_type, _, text = (child or parent or "").partition(": ")
    return dict(error=text or out.stderr[-2000:], error_type=err_type.rpartition(".")[2] or None,
                evidence={"returncode": out.returncode, "parent_error": parent})


_NOTEBOOK_SPAWN = """
    import torch.multiprocessing as mp

    def work(rank):        # defined in a notebook cell: it lives in __main__, which has no file
        print("rank", rank, "running")

    mp.start_processes(work, nprocs=2, start_method="spawn")
"""
_NOTEBOOK_DDPKIT = """
    import ddpkit

    def work(ctx):         # the same notebook function, sent by value
        return ctx.rank

    print("RETURNS", ddpkit.launch(work, world_size=2, backend="gloo", device="cpu").returns)
"""
_FORK_AFTER_CUDA = """
    import torch, torch.multiprocessing as mp

    torch.zeros(1, device="cuda")      # the kernel touched CUDA (any .cuda() call does)

    def work(rank):
        torch.zeros(1, device="cuda")

    mp.start_processes(work, nprocs=2, start_method="fork")
"""
_SPAWN_AFTER_CUDA = """
    import torch, ddpkit

    torch.zeros(1, device="cuda")

    def work(ctx):
        return str(torch.zeros(1, device="cuda").device)

    print("RETURNS", ddpkit.launch(work, world_size=2, backend="gloo", device="cpu").returns)
"""


def _notebook_spawn(lab, fixed):
    return _subprocess_outcome(_python_main(_NOTEBOOK_DDPKIT if fixed else _NOTEBOOK_SPAWN))


def _fork_after_cuda(lab, fixed):
    if not torch.cuda.is_available():
        return dict(skipped="needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                            f"(torch {torch.__version__})")
    return _subprocess_outcome(_python_main(_SPAWN_AFTER_CUDA if fixed else _FORK_AFTER_CUDA))


def _on_pool(fn, *args_of_fixed):
    """A pitfall whose broken and fixed forms are both safe on a warm pool."""
    def runner(lab, fixed):
        return _outcome(lab.launch(fn, *args_of_fixed[int(fixed)]))
    return runner


def _fresh_when_broken(fn):
    def runner(lab, fixed):
        return _outcome(lab.launch(fn, fixed, fresh=not fixed))
    return runner


def _ckpt(fixed_kw, broken_kw, ddp_fixed=None, ddp_broken=None):
    """The doctor's view of a CkptNet pitfall: (model, example input, DDP keywords)."""
    def spec(fixed):
        return (build(CkptNet, **(fixed_kw if fixed else broken_kw)), batch(0, 0),
                (ddp_fixed if fixed else ddp_broken) or {})
    return spec


_PLAIN = _ckpt({"reentrant": None}, {"reentrant": None})
# name -> (runner(lab, fixed) -> PitfallResult fields, doctor spec(fixed) or None)
_SPECS = {
    "reentrant_find_unused": (
        _variants({"spare": True}, {"find_unused_parameters": True}),
        _ckpt({"reentrant": False, "spare": True}, {"reentrant": True, "spare": True},
              {"find_unused_parameters": True}, {"find_unused_parameters": True})),
    "reentrant_shared_module": (
        _variants({"shared": True}, {}),
        _ckpt({"reentrant": False, "shared": True}, {"reentrant": True, "shared": True})),
    "reentrant_input_no_grad": (
        _on_pool(rank_input_no_grad, (False,), (True,)),
        _ckpt({"reentrant": False, "stem": False}, {"reentrant": True, "stem": False},
              {}, {"find_unused_parameters": True})),
    "default_use_reentrant": (
        _on_pool(rank_default_reentrant, (False,), (True,)),
        _ckpt({"reentrant": False}, {"reentrant": "unset"})),
    "loss_not_scaled": (_on_pool(rank_accumulate, (False, True), (True, True)), _PLAIN),
    "sync_every_micro_step": (_on_pool(rank_accumulate, (True, False), (True, True)), _PLAIN),
    "no_sync_with_static_graph": (
        _nosync_static,
        _ckpt({"reentrant": True}, {"reentrant": True}, {"static_graph": True},
              {"static_graph": True})),
    "batchnorm_in_checkpoint": (
        _on_pool(rank_batchnorm, (False,), (True,)),
        lambda fixed: (build(BNNet, segment="around" if fixed else "all"), batch(0, 0), {})),
    "dropout_rng": (
        _on_pool(rank_dropout, (False,), (True,)),
        lambda fixed: (build(DropNet, preserve_rng_state=fixed), batch(0, 0), {})),
    "uneven_inputs": (_uneven, _PLAIN),
    "rank_exception": (_rank_exc, _PLAIN),
    "state_dict_prefix": (_state_dict, _PLAIN),
    "unused_parameters": (
        _fresh_when_broken(rank_unused),
        _ckpt({"reentrant": None, "spare": True}, {"reentrant": None, "spare": True},
              {"find_unused_parameters": True}, {})),
    "fork_after_cuda": (_fork_after_cuda, None),
    "notebook_fn_spawn": (_notebook_spawn, None),
}


def run(name, fixed=False, pool=None):
    """Run pitfall ``name`` on 2 real gloo ranks: the broken setup, or ``fixed=True`` its fix.

    ``pool``: a warm ``ddpkit.Pool(2, backend='gloo', device='cpu')`` for the setups that leave
    ranks healthy; the ones that crash or stall ranks get a fresh launch whatever is passed.
    `ddpkit.doctor` checks the setup's model first (``findings``). Returns a `PitfallResult`.
    """
    get(name)
    if pool is not None and (pool.world_size != 2 or pool.backend != "gloo" or pool.device != "cpu"):
        raise ValueError(f"the pitfall lab runs on 2 CPU ranks with gloo; got {pool!r}. Pass "
                         f"ddpkit.Pool(2, backend='gloo', device='cpu'), or pool=None")
    runner, spec = _SPECS[name]
    findings = []
    if spec is not None:
        from .doctor import doctor

        model, example, ddp_kwargs = spec(bool(fixed))
        findings = doctor(model, example, ddp_kwargs=ddp_kwargs)
    t0 = time.monotonic()
    lab = _Lab(pool)
    fields = runner(lab, bool(fixed))
    return PitfallResult(name, bool(fixed), findings=findings, output=lab.output,
                         wall_s=time.monotonic() - t0, **fields)
