"""The doctor's rules: one small function per hazard, each reading the watched step's
observations (`observe.measure`) and saying what it found, where, and the fix (from `fixes`).

Every `Finding` has its own name and a severity. A hazard the user must act on is a
``"warning"`` named after its entry in the catalogue (`ddpkit.pitfalls.catalog()`); what is no
pitfall (what ddpkit already did about something, a setting that only costs time) is a ``"note"``
named in `NOTES`, the doctor's own names. Each name is in one of the two, never both. The rules
run in teaching order; one that explains a parameter without a gradient (``case.explained``) keeps
the later "unused parameter" rule from blaming it twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import fixes
from .known import catalog
from .observe import outermost, owner, where

NO_GRAD_INPUT_WARNING = "None of the inputs have requires_grad=True"
DEFAULT_REENTRANT_WARNING = "the use_reentrant parameter should be passed explicitly"


SEVERITIES = ("note", "warning")  # lowest first; only a warning asks the user to act
# the doctor's own findings, which are no pitfall of the catalogue: each a note (nothing to fix)
NOTES = {
    "find_unused_not_needed": "find_unused_parameters=True where every parameter gets a "
                              "gradient: a search of the autograd graph every step, for nothing",
    "hf_own_checkpointing": "a transformers model's own (non-reentrant) gradient checkpointing, "
                            "which ddpkit switches off for its runs",
    "hf_use_cache": "a transformers config's use_cache=True under checkpointing, which ddpkit "
                    "switches off for its runs",
}


def severity_of(name):
    """``"note"`` for the doctor's own names (`NOTES`), ``"warning"`` for a catalogue pitfall;
    any other name is refused (ValueError naming both lists)."""
    if name in NOTES:
        return "note"
    if name not in {p.name for p in catalog()}:
        raise ValueError(f"Finding {name!r}: not a pitfall of the catalogue "
                         f"(ddpkit.pitfalls.catalog()) nor one of the doctor's notes "
                         f"({', '.join(NOTES)}); name it in one of the two")
    return "warning"


@dataclass(frozen=True)
class Finding:
    """One finding: its name (``pitfall``: a catalogue entry, or one of the doctor's `NOTES`),
    where (module path), what was measured or done, and the fix. ``severity``: ``"warning"``
    (act on it) or ``"note"`` (nothing to fix), from the name."""
    pitfall: str
    where: str
    message: str
    fix: str

    def __post_init__(self):
        severity_of(self.pitfall)  # an unnamed finding is a bug in a rule: refused at once

    @property
    def severity(self):
        return severity_of(self.pitfall)

    def __repr__(self):
        kind = "" if self.severity == "warning" else f" ({self.severity})"
        return f"[{self.pitfall}]{kind} at {self.where}: {self.message}\n    fix: {self.fix}"


class Findings(list):
    """A list of `Finding`; prints one per paragraph (warnings first), or 'no findings'.
    ``warnings``: those to act on; ``notes``: the rest."""

    @property
    def pitfalls(self):
        return sorted({f.pitfall for f in self})

    @property
    def warnings(self):
        return [f for f in self if f.severity == "warning"]

    @property
    def notes(self):
        return [f for f in self if f.severity == "note"]

    def __repr__(self):
        return "\n".join(map(repr, self.warnings + self.notes)) if self else "doctor: no findings"


@dataclass
class Case:
    """What every rule reads: the model, the observations, the installed segments, the settings."""
    model: nn.Module
    obs: dict
    segments: list
    use_reentrant: bool
    static: bool
    find_unused: bool
    explained: set = field(default_factory=set)

    def __post_init__(self):
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.no_grad = {n for n, p in self.params if p.grad is None}
        self.recomputed = outermost([n for n in self.obs["bwd"] if n])

    def regions(self, names):
        """Where parameters sit, as a person would name it: the installed checkpoint segment that
        holds them, else the outermost module run under no_grad in forward (the model's own
        reentrant checkpoint), else the module that owns them."""
        owner_of = {id(p): n for n, p in self.model.named_parameters()}
        by_seg = {owner_of[id(p)]: seg for seg, mods in self.segments for m in mods
                  for p in m.parameters()}
        quiet = outermost([n for n in self.obs["nograd"] if n])
        out = set()
        for n in names:
            own = owner(n)
            out.add(by_seg.get(n) or next((q for q in quiet if own == q or own.startswith(q + ".")),
                                          own))
        return where(out)


def syncbatchnorm_cpu(case):
    # DDP(model) refuses SyncBatchNorm on CPU ("SyncBatchNorm layers only work with GPU
    # modules"); without a GPU here the ranks cannot be on one
    sync_bn = [n for n, m in case.model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if not sync_bn or torch.cuda.is_available():
        return []
    return [Finding(
        "syncbatchnorm_cpu", where(sync_bn),
        f"{len(sync_bn)} SyncBatchNorm layer(s) and no GPU on this machine: DDP(model) on CPU "
        f"ranks raises 'SyncBatchNorm layers only work with GPU modules'",
        fixes.SYNCBATCHNORM_CPU)]


def recompute_raised(case):
    first = case.obs["checkpoint_error"].splitlines()[0]
    return [Finding(
        "recompute_differs", where(case.recomputed) if case.recomputed else "(a checkpointed function)",
        f"backward raised CheckpointError: the recompute differed from forward ('{first}')",
        "make the checkpointed code compute the same thing twice: random decisions from "
        "torch's RNG (restored for the recompute) or made outside and passed in, no state "
        "changed between forward and backward")]


def python_random_in_recompute(case):
    if not case.obs["py_rng_moved"]:
        return []
    return [Finding(
        "recompute_differs", where(case.recomputed) if case.recomputed else "(a checkpointed function)",
        "Python's random module was drawn from during backward, so a recompute draws from it: "
        "checkpoint restores torch's RNG for the recompute, not Python's, so the recompute can "
        "take another path than forward (CheckpointError, or silently different gradients)",
        fixes.RANDOM_IN_RECOMPUTE)]


def default_use_reentrant(case):
    # torch warns and uses reentrant checkpointing when use_reentrant is not passed
    if not any(DEFAULT_REENTRANT_WARNING in w for w in case.obs["warnings"]):
        return []
    at = outermost([n for n in case.obs["nograd"] if n]) or ["(model code)"]
    return [Finding("default_use_reentrant", where(at),
                    "checkpoint() was called without use_reentrant: this torch warns and runs "
                    "the reentrant variant (with its DDP restrictions)",
                    fixes.DEFAULT_USE_REENTRANT)]


def segment_input_no_grad(case):
    """An installed reentrant segment whose input needs no grad: nothing inside gets a gradient."""
    out = []
    for seg_name, mods in case.segments:
        if case.use_reentrant and not all(case.obs["seg_inputs"].get(seg_name, [True])):
            names = {n for n, p in case.params if any(p is q for m in mods for q in m.parameters())}
            lost = (names & case.no_grad) - case.explained
            if lost:
                case.explained |= lost
                out.append(Finding(
                    "reentrant_input_no_grad", seg_name,
                    f"its input does not require grad, so under use_reentrant=True its "
                    f"{len(lost)} parameter tensor(s) got no gradient (torch only warns: "
                    f"'{NO_GRAD_INPUT_WARNING}. Gradients will be None')",
                    "pass use_reentrant=False, or make the segment's input require grad "
                    "(checkpoint from after the first layer)"))
    return out


def own_checkpoint_input_no_grad(case):
    """The model's own reentrant checkpoint without an input needing grad: the modules run under
    no_grad in forward, never recomputed, and without gradients are the ones inside it."""
    obs = case.obs
    if not any(NO_GRAD_INPUT_WARNING in w for w in obs["warnings"]):
        return []
    lost = {n for n in case.no_grad - case.explained if obs["nograd"].get(owner(n), 0)
            and not obs["bwd"].get(owner(n), 0)}
    if not lost:
        return []
    case.explained |= lost
    return [Finding(
        "reentrant_input_no_grad", case.regions(lost),
        f"a reentrant checkpoint got no input that requires grad: {len(lost)} parameter "
        f"tensor(s) inside got no gradient (torch only warned: '{NO_GRAD_INPUT_WARNING}')",
        "pass use_reentrant=False, or make the checkpoint's input require grad")]


def shared_module(case):
    """Gradients accumulated twice in one backward: DDP's 'marked ready twice'."""
    twice = {n: c for n, c in case.obs["acc"].items() if c > 1}
    if case.static or not twice:
        return []
    mods = sorted({owner(n) for n in twice})
    fwd = case.obs["fwd"]
    calls = [f"{m} called {fwd[m]}x" for m in mods if fwd.get(m, 0) > 1]
    how = ", ".join(calls[:4]) if calls else "one parameter shared by several modules"
    return [Finding(
        "reentrant_shared_module", where(mods),
        f"the gradients of {where(twice, 3)} were accumulated {max(twice.values())}x in one "
        f"backward ({how}): used in more than one reentrant checkpoint region, or inside one "
        f"and outside it, and each region is its own backward pass. DDP raises 'Expected to "
        f"mark a variable ready only once'", fixes.REENTRANT)]


def hidden_from_find_unused(case):
    """Parameters find_unused_parameters cannot see in the forward graph, yet get gradients."""
    if case.static or not case.find_unused:
        return []
    hidden = {n for n, p in case.params if case.obs["acc"].get(n) and id(p) not in case.obs["reach"]}
    if not hidden:
        return []
    return [Finding(
        "reentrant_find_unused", case.regions(hidden),
        f"{len(hidden)} parameter tensor(s) are invisible in the forward graph (inside a "
        f"reentrant checkpoint) yet get gradients in backward: with find_unused_parameters=True "
        f"DDP marks them unused, then ready again, and raises 'Expected to mark a variable "
        f"ready only once'", fixes.REENTRANT)]


def batchnorm_recomputed(case):
    obs = case.obs
    return [Finding(
        "batchnorm_in_checkpoint", name,
        f"BatchNorm is recomputed in backward: its running statistics were updated "
        f"{n_updates}x for {obs['fwd'].get(name, 0)} forward call(s)",
        fixes.BATCHNORM_IN_CHECKPOINT)
        for name, n_updates in obs["bn_updates"].items() if obs["bwd"].get(name, 0)]


def dropout_without_rng_state(case):
    if not case.obs["rng_moved"]:
        return []
    bwd = case.obs["bwd"]
    drops = [n for n, m in case.model.named_modules() if bwd.get(n, 0)
             and isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    at = drops or outermost([n for n in bwd if n]) or ["(model code)"]
    return [Finding(
        "dropout_rng", where(at),
        "random ops ran again in backward without the RNG state of forward "
        "(preserve_rng_state=False): the recomputed dropout mask differs, so gradients "
        "differ from the un-checkpointed model", fixes.DROPOUT_RNG)]


def unused_parameters(case):
    """No gradient and nothing above explains it; or find_unused_parameters not needed."""
    backward = case.obs["has_backward"]
    unused = case.no_grad - case.explained if backward else set()
    if unused and not (case.find_unused or case.static):
        return [Finding(
            "unused_parameters", where(outermost({owner(n) for n in unused})),
            f"{len(unused)} parameter tensor(s) got no gradient: DDP with "
            f"find_unused_parameters=False raises 'Expected to have finished reduction in the "
            f"prior iteration before starting a new one' at the next step",
            fixes.UNUSED_PARAMETERS)]
    if case.find_unused and not case.no_grad and backward and not case.static:
        return [Finding(
            "find_unused_not_needed", "(ddp_kwargs)",
            "find_unused_parameters=True, but every parameter got a gradient: it is not needed "
            "and costs a traversal of the autograd graph every step",
            "drop find_unused_parameters=True")]
    return []


def frozen_base_input_no_grad(case):
    """The two rules above on a fine-tuned model (a frozen base with trainable adapters, as
    peft's LoRA leaves it): the same fault, with the fix for adapters (LoRA's entry)."""
    if all(p.requires_grad for p in case.model.parameters()):
        return []
    found = segment_input_no_grad(case) + own_checkpoint_input_no_grad(case)
    return [Finding("lora_reentrant_no_input_grad", f.where,
                    f.message + "; the base model is frozen (embeddings included), so nothing "
                    "entering the block requires grad: its adapters never train",
                    fixes.LORA_REENTRANT) for f in found]


# in teaching order; the input_no_grad rules run before unused_parameters (``explained``)
RULES = (python_random_in_recompute, default_use_reentrant, frozen_base_input_no_grad,
         segment_input_no_grad, own_checkpoint_input_no_grad, shared_module, hidden_from_find_unused,
         batchnorm_recomputed, dropout_without_rng_state, unused_parameters)


def findings(model, obs, segments, use_reentrant, ddp_kwargs):
    """Every rule over one watched step; `Findings`."""
    case = Case(model, obs, segments, use_reentrant,
                static=bool(ddp_kwargs.get("static_graph", False)),
                find_unused=bool(ddp_kwargs.get("find_unused_parameters", False)))
    out = Findings(syncbatchnorm_cpu(case))
    if obs["checkpoint_error"] is not None:
        # backward stopped half-way: every gradient-based rule would misread it
        return Findings(out + recompute_raised(case))
    for rule in RULES:
        out += rule(case)
    return out
