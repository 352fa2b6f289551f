"""The pitfall lab: the known DDP + checkpointing + accumulation faults, each one a real run.

``catalog()`` lists them; ``run(name, fixed=False)`` runs the broken setup on 2 real gloo ranks
and returns what happened: ``error`` is the text torch raised, verbatim, on the culprit rank;
``evidence`` holds numbers measured in the run that show a *silent* fault (parameters without a
gradient, a gradient-norm ratio, all-reduce counts, BatchNorm counters). ``fixed=True`` runs the
same setup with the fix. Before launching, `ddpkit.doctor` looks at the pitfall's model on this
process; its findings come back in ``findings``.

Rank code lives in `pitfall_ranks` (module-level, so ranks import it by name; small on purpose:
a toy model of width 8, a few steps). Setups that crash or stall ranks always get a fresh
launch, so a warm ``pool`` passed in stays warm for the rest.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import RankError, RankStalled
from .ranks import (BNNet, BranchNet, CkptNet, DropNet, LayerDropNet, batch, build, gpt2_tokens,
                    hf_checkpointing, rank_accum_loop, rank_accumulate, rank_batchnorm,
                    rank_default_reentrant, rank_dropout, rank_exception, rank_hf,
                    rank_input_no_grad, rank_nosync_static, rank_recompute, rank_state_dict,
                    rank_static_branch, rank_syncbn, rank_uneven, rank_unused, rank_variants,
                    tiny_gpt2)


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
    Pitfall("hf_reentrant_find_unused",
            "a transformers model's own reentrant checkpointing + find_unused_parameters=True",
            "GPT-2 with gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': True}) under DDP(find_unused_parameters=True): the first backward "
            "raises 'Expected to mark a variable ready only once' (the crash forum threads report)",
            "transformers checkpoints each block with torch's checkpoint as told: reentrant, so "
            "the block's parameters are missing from the forward graph DDP searches for unused "
            "ones; DDP marks them ready, then the recompute marks them ready again (the first "
            "entry, on a real model)",
            "gradient_checkpointing_kwargs={'use_reentrant': False} (this transformers' default), "
            "or find_unused_parameters=False (GPT-2 uses every parameter)", silent=False),
    Pitfall("no_sync_backward_only",
            "no_sync() around the backward only, not the forward",
            "accumulation runs and the weights are right, but every micro-batch still pays a "
            "full all-reduce: no saving at all",
            "DDP decides whether to all-reduce in forward (it reads no_sync's flag there and "
            "prepares the reducer); a backward under no_sync after a forward outside it syncs",
            "put the forward and the backward inside `with ddp_model.no_sync():`", silent=True),
    Pitfall("no_sync_last_too",
            "no_sync() on every micro-step, the last one too",
            "no error; the ranks' weights drift apart from the first optimizer step",
            "under no_sync DDP never all-reduces; each rank steps with its own gradient",
            "leave the last micro-batch of each step outside no_sync (its backward all-reduces "
            "the accumulated sum)", silent=True),
    Pitfall("zero_grad_in_micro_loop",
            "optimizer.zero_grad() inside the micro-batch loop",
            "no error; the step uses only the last micro-batch's gradient (scaled by "
            "1/accum_steps), not the big batch's",
            "zero_grad wipes what the earlier micro-batches accumulated",
            "zero_grad once per optimizer step, after optimizer.step()", silent=True),
    Pitfall("forward_through_module",
            "forward through ddp_model.module instead of ddp_model",
            "no error, no all-reduce; the ranks' weights drift apart",
            "DDP's forward is what prepares the reducer for the backward; the inner module's "
            "forward skips it, so the gradient hooks do nothing",
            "call ddp_model(x); use .module only to save or inspect the model", silent=True),
    Pitfall("recompute_differs",
            "a forward whose recompute differs from the original (non-reentrant checkpoint)",
            "backward raises CheckpointError: 'A different number of tensors was saved during "
            "the original forward and recomputation'",
            "the recompute runs the forward again; state that changed in between (here Python's "
            "`random`, which preserve_rng_state does not restore, deciding a LayerDrop) takes "
            "another path",
            "draw random decisions from torch's RNG (restored for the recompute), or make them "
            "outside the checkpointed function and pass them in", silent=False),
    Pitfall("syncbatchnorm_cpu",
            "SyncBatchNorm on CPU ranks",
            "DDP(model) raises ValueError: 'SyncBatchNorm layers only work with GPU modules'",
            "SyncBatchNorm all-gathers batch statistics with kernels that exist for GPUs only; "
            "DDP refuses it on a CPU module",
            "convert_sync_batchnorm only when the ranks run on GPUs; on CPU plain BatchNorm "
            "normalises with each rank's own batch (DDP broadcasts rank 0's running statistics "
            "each forward), or use GroupNorm/LayerNorm", silent=False),
    Pitfall("static_graph_changes",
            "static_graph=True with a branch taken on some steps only",
            "the first step without the branch runs; the next forward raises 'Expected to have "
            "finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your training graph has changed in this iteration'",
            "static_graph=True promises DDP that the first iteration's set of used parameters "
            "holds for every iteration; a step that skips the branch leaves its gradients "
            "missing",
            "static_graph=False with find_unused_parameters=True (DDP searches the graph every "
            "step), or use every parameter on every step", silent=False),
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
            from ..runtime.launch import launch

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
    run = lab.launch(rank_uneven, fixed, fresh=not fixed, stall_timeout_s=6.0)
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
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds ddpkit/
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


def _hf_missing():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"needs the transformers package (pip install 'ddpkit[hf]'): {exc}")
    return None


_HF_BROKEN = {"use_reentrant=True, find_unused_parameters=True": (True, True)}
_HF_FIXES = {"use_reentrant=False": (False, True), "find_unused_parameters=False": (True, False)}


def _hf(lab, fixed):
    missing = _hf_missing()
    if missing:
        return dict(skipped=missing)
    run = lab.launch(rank_hf, _HF_FIXES if fixed else _HF_BROKEN, fresh=not fixed)
    if fixed:
        return _outcome(run)
    said = sorted({m["transformers_said"] for m in run.metrics if "transformers_said" in m})
    return _outcome(run, {"transformers_said": said})


def _hf_spec(fixed):
    """GPT-2 with its own checkpointing; broken: reentrant with find_unused_parameters=True,
    fixed: non-reentrant without it. None without transformers."""
    if _hf_missing():
        return None
    from .doctor import _Call

    model = hf_checkpointing(tiny_gpt2(), use_reentrant=not fixed).train()
    ids = gpt2_tokens(0, 0)
    return (model, _Call(lambda m: m(input_ids=ids, labels=ids).loss),
            {} if fixed else {"find_unused_parameters": True})


def _recompute_spec(fixed):
    import random

    random.seed(10)  # as on the ranks (run() puts the kernel's random state back)
    # doctor sees one step, and in this one the layer runs: without find_unused_parameters
    # (which the ranks need for the steps that drop it), or doctor would call it unneeded
    return build(LayerDropNet, draw="torch" if fixed else "python"), batch(0, 0), {}


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
    "hf_reentrant_find_unused": (_hf, _hf_spec),
    "no_sync_backward_only": (
        _on_pool(rank_accum_loop, ("backward_only", False), ("backward_only", True)), _PLAIN),
    "no_sync_last_too": (
        _on_pool(rank_accum_loop, ("no_sync_last_too", False), ("no_sync_last_too", True)), _PLAIN),
    "zero_grad_in_micro_loop": (
        _on_pool(rank_accum_loop, ("zero_grad_inside", False), ("zero_grad_inside", True)), _PLAIN),
    "forward_through_module": (
        _on_pool(rank_accum_loop, ("module_forward", False), ("module_forward", True)), _PLAIN),
    "recompute_differs": (_fresh_when_broken(rank_recompute), _recompute_spec),
    "syncbatchnorm_cpu": (
        _fresh_when_broken(rank_syncbn),
        lambda fixed: (build(BNNet, segment=None) if fixed else
                       torch.nn.SyncBatchNorm.convert_sync_batchnorm(build(BNNet, segment=None)),
                       batch(0, 0), {})),
    # doctor sees one step, here one without the branch: it cannot tell that the graph changes
    "static_graph_changes": (
        _fresh_when_broken(rank_static_branch),
        lambda fixed: (build(BranchNet), (batch(0, 1), False),
                       {"find_unused_parameters": True} if fixed else {"static_graph": True})),
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
        import random

        from .doctor import doctor

        state = random.getstate()  # a spec may seed Python's RNG as the ranks do
        try:
            setup = spec(bool(fixed))  # None: the setup needs a package this machine lacks
            if setup is not None:
                model, example, ddp_kwargs = setup
                findings = doctor(model, example, ddp_kwargs=ddp_kwargs)
        finally:
            random.setstate(state)
    t0 = time.monotonic()
    lab = _Lab(pool)
    fields = runner(lab, bool(fixed))
    return PitfallResult(name, bool(fixed), findings=findings, output=lab.output,
                         wall_s=time.monotonic() - t0, **fields)
