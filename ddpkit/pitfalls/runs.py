"""Run a pitfall: the broken setup, or its fix, on 2 real gloo ranks; the doctor's view first.

``run(name, fixed=False)`` returns a `PitfallResult`: ``error`` is the text torch raised,
verbatim, on the culprit rank; ``evidence`` holds numbers measured in the run that show a
*silent* fault (parameters without a gradient, a gradient-norm ratio, all-reduce counts,
BatchNorm counters). Before launching, `ddpkit.doctor` looks at the pitfall's model on this
process; its findings come back in ``findings``.

Rank code lives in `ranks` (module-level, so ranks import it by name; small on purpose: a toy
model of width 8, a few steps). Setups that crash or stall ranks always get a fresh launch, so a
warm ``pool`` passed in stays warm for the rest.
"""
from __future__ import annotations

import os
import random
import tempfile
import time
from dataclasses import dataclass, field

import torch

from ..engine.policies import CheckpointPolicy
from ..errors import RankError, RankStalled
from ..runtime.launch import check_pool, launch, resolve_pool
from ..runtime.pool import Pool
from ..spec.setting import CheckpointSetting
from .known import get
from .doctor import doctor
from .ranks import (BNNet, BranchNet, CkptNet, DropNet, LayerDropNet, batch, build, gpt2_tokens,
                    hf_checkpointing, rank_accum_loop, rank_accumulate, rank_batchnorm,
                    rank_default_reentrant, rank_dropout, rank_exception, rank_hf,
                    rank_input_no_grad, rank_lora, tiny_lora_gpt2, rank_nosync_static, rank_recompute, rank_state_dict,
                    rank_static_branch, rank_syncbn, rank_uneven, rank_unused, rank_variants,
                    tiny_gpt2)
from .scripts import fork_after_cuda, notebook_spawn


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
        said = [f"[{f.pitfall}]{' (note)' * (f.severity == 'note')} at {f.where}"
                for f in self.findings]
        lines.append("  doctor: " + ("; ".join(said) if said else "no findings"))
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
        handle = launch(fn, *args, world_size=2, backend="gloo", device="cpu",
                        pool="fresh" if fresh else self.pool, **kw)
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
    model = hf_checkpointing(tiny_gpt2(), use_reentrant=not fixed).train()
    ids = gpt2_tokens(0, 0)
    return (model, lambda m: m(input_ids=ids, labels=ids).loss,
            {} if fixed else {"find_unused_parameters": True})


def _peft_missing():
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"needs the peft and transformers packages (pip install 'ddpkit[hf]'): {exc}"
    return None


_LORA_BROKEN = {"use_reentrant=True": (True, False)}
_LORA_FIXES = {"use_reentrant=False": (False, False),
               "enable_input_require_grads()": (True, True)}


def _lora(lab, fixed):
    missing = _peft_missing()
    if missing:
        return dict(skipped=missing)
    run = lab.launch(rank_lora, _LORA_FIXES if fixed else _LORA_BROKEN, fresh=not fixed)
    if fixed:
        return _outcome(run)
    first = next((m for m in run.metrics if m.get("step") == 0 and "torch_warned" in m), {})
    return _outcome(run, {k: first.get(k) for k in ("torch_warned", "adapters_without_grad")})


def _lora_spec(fixed):
    """The LoRA GPT-2, its first block checkpointed as on the ranks (broken: reentrant)."""
    if _peft_missing():
        return None
    model = tiny_lora_gpt2().train()
    CheckpointPolicy(CheckpointSetting.of(2, 2), use_reentrant=not fixed).apply(
        model, "base_model.model.transformer.h")
    ids = gpt2_tokens(0, 0)
    return model, lambda m: m(input_ids=ids, labels=ids).loss, {}


def _recompute_spec(fixed):
    random.seed(10)  # as on the ranks (run() puts the kernel's random state back)
    # doctor sees one step, and in this one the layer runs: without find_unused_parameters
    # (which the ranks need for the steps that drop it), or doctor would call it unneeded
    return build(LayerDropNet, draw="torch" if fixed else "python"), batch(0, 0), {}


_PLAIN = _ckpt({"reentrant": None}, {"reentrant": None})


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
    "fork_after_cuda": (fork_after_cuda, None),
    "notebook_fn_spawn": (notebook_spawn, None),
    "hf_reentrant_find_unused": (_hf, _hf_spec),
    "lora_reentrant_no_input_grad": (_lora, _lora_spec),
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


def run(name, fixed=False, pool="shared"):
    """Run pitfall ``name`` on 2 real gloo ranks: the broken setup, or ``fixed=True`` its fix.

    ``pool``: the warm ranks for the setups that leave ranks healthy: ``"shared"`` (the
    default) is the kernel's shared pool of 2 gloo CPU ranks, a
    ``ddpkit.Pool(2, backend='gloo', device='cpu')`` is that pool, ``"fresh"`` launches ranks
    for every setup; the setups that crash or stall ranks get a fresh launch whatever is
    passed.
    `ddpkit.doctor` checks the setup's model first (``findings``). Returns a `PitfallResult`.
    """
    get(name)
    pool = resolve_pool(pool)
    if isinstance(pool, Pool):
        check_pool(pool, 2, "gloo", "cpu", named="the pitfall lab (2 CPU ranks with gloo): ")
    runner, spec = _SPECS[name]
    findings = []
    if spec is not None:
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
