"""`doctor`: find DDP + checkpointing hazards in a model with one forward/backward, before launch.

One process, no process group: doctor runs the model once forward and once backward and watches
what DDP's reducer would see, so it needs no knowledge of how the model checkpoints itself:

* **gradient-accumulator firings** per parameter (``register_post_accumulate_grad_hook``; DDP
  hooks the same accumulator). Twice in one backward is DDP's "marked ready twice" error: a
  parameter used in more than one *reentrant* checkpoint region (each is its own backward pass);
  never is an unused parameter (or one inside a reentrant region whose input needs no grad).
* **reachability** from the loss through the autograd graph built in forward. That is how
  ``find_unused_parameters=True`` decides what is unused; parameters inside a reentrant region
  are invisible to it, yet get gradients later, which is the same error.
* **modules called during backward**: those are recomputed (inside a checkpoint). A training
  BatchNorm there updates its running statistics twice.
* **the RNG state across backward**: if backward moved it, random ops (dropout) were recomputed
  without ``preserve_rng_state``, so they drew a different mask than forward.
* **torch's own warnings** during forward (reentrant checkpoint with no input requiring grad;
  ``use_reentrant`` not passed).
* **the recompute itself**: a ``CheckpointError`` in backward (the recompute saved other tensors
  than forward did), or Python's ``random`` drawn from during backward (checkpoint restores
  torch's RNG for the recompute, not Python's, so the recompute may take another path).
* **the modules**: ``SyncBatchNorm`` on a machine without a GPU (DDP refuses it).

``doctor(cfg)`` also reads the user model *before* ddpkit prepares it: a transformers model's own
gradient checkpointing (and its ``use_reentrant``), and ``use_cache=True`` under checkpointing.

Checkpointing can be the model's own (seen through the measurements above) or installed by
doctor for the check through ``checkpoint=``; either way the model is left as it was: buffers,
gradients, train/eval flags, RNG state and forward methods are restored.
"""
from __future__ import annotations

import functools
import random
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

_NO_GRAD_INPUT_WARNING = "None of the inputs have requires_grad=True"
_DEFAULT_REENTRANT_WARNING = "the use_reentrant parameter should be passed explicitly"
_REENTRANT_FIX = "pass use_reentrant=False to checkpoint, or static_graph=True to DDP"


@dataclass(frozen=True)
class Finding:
    """One hazard: which pitfall (a name in `ddpkit.pitfalls.catalog()`), where (module path),
    what was measured, and the fix."""
    pitfall: str
    where: str
    message: str
    fix: str

    def __repr__(self):
        return f"[{self.pitfall}] at {self.where}: {self.message}\n    fix: {self.fix}"


class Findings(list):
    """A list of `Finding`; prints one per paragraph, or 'no findings'."""

    @property
    def pitfalls(self):
        return sorted({f.pitfall for f in self})

    def __repr__(self):
        return "\n".join(map(repr, self)) if self else "doctor: no findings"


def _where(names, limit=4):
    names = sorted(set(names))
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _owner(param_name):
    return param_name.rpartition(".")[0] or "(root)"


def _outermost(names):
    """Drop names that sit inside another name of the list (a checkpoint inside a checkpoint)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


# ----------------------------------------------------------------------------- checkpoint set-up
class _Watch:
    """What phase the check is in, and per-module call counts in forward and in backward."""

    def __init__(self):
        self.phase = "idle"
        self.fwd, self.bwd, self.nograd = Counter(), Counter(), Counter()

    def called(self, name):
        if self.phase == "forward":
            self.fwd[name] += 1
            if not torch.is_grad_enabled():
                self.nograd[name] += 1
        elif self.phase == "backward":
            self.bwd[name] += 1  # recomputed by a checkpoint


def _install_checkpoint(model, setting, use_reentrant, preserve_rng_state, watch, blocks=None):
    """Install the requested checkpointing for the check. Returns (segments, undo), where a
    segment is (name, [modules]) and undo() puts the model back as it was."""
    if setting is None:
        return [], lambda: None
    is_block_setting = setting == "full" or (isinstance(setting, int) and not isinstance(setting, bool)) \
        or (isinstance(setting, (list, tuple)) and setting and all(isinstance(b, bool) for b in setting))
    if is_block_setting:
        from ..engine.blocks import block_names, find_blocks
        from ..engine.policies import CheckpointPolicy, remove

        try:
            path, blocks = find_blocks(model, blocks)
        except ValueError:
            if blocks is not None:
                raise
            raise ValueError(f"doctor: checkpoint={setting!r} acts on repeated blocks, and this "
                             f"{type(model).__name__} has none; pass checkpoint= as a list of "
                             f"submodule names, or a callable (name, module) -> bool") from None
        # the very policy the ranks install, so doctor checks what will run
        policy = CheckpointPolicy(setting, len(blocks), use_reentrant, preserve_rng_state)
        policy.apply(model, path)
        names = block_names(path, blocks)
        segs = [(names[a] if b - a == 1 else f"{path}[{a}:{b}]", list(blocks[a:b]))
                for a, b, on in policy.segments if on]
        return segs, lambda: remove(model)
    elif callable(setting):
        names = _outermost([n for n, m in model.named_modules() if n and setting(n, m)])
    elif isinstance(setting, (list, tuple)) and all(isinstance(n, str) for n in setting):
        names = list(setting)
    else:
        raise ValueError(f"doctor: checkpoint={setting!r}: pass None, an int, 'full' or one bool "
                         f"per block (models with .blocks), a list of submodule names, or a "
                         f"callable (name, module) -> bool")
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"doctor: checkpoint names {missing} are not submodules of "
                         f"{type(model).__name__}; see model.named_modules() for the names")
    undos = []
    for name in names:
        undos.append(_wrap_forward(modules[name], name, use_reentrant, preserve_rng_state, watch))
    return [(n, [modules[n]]) for n in names], lambda: [u() for u in reversed(undos)]


def _wrap_forward(module, name, use_reentrant, preserve_rng_state, watch):
    """Make module's forward a checkpointed call, as a user would; returns the undo."""
    had = "forward" in module.__dict__
    inner = module.forward

    def run(*args, **kwargs):
        if watch.phase == "backward":
            watch.called(name)  # the recompute calls forward directly, past the module's hooks
        return inner(*args, **kwargs)

    def forward(*args, **kwargs):
        fn = functools.partial(run, **kwargs) if kwargs else run  # reentrant takes no kwargs
        return _torch_checkpoint(fn, *args, use_reentrant=use_reentrant,
                                 preserve_rng_state=preserve_rng_state)

    module.forward = forward

    def undo():
        if had:
            module.forward = inner
        else:
            del module.__dict__["forward"]
    return undo


# ----------------------------------------------------------------------------- one measured step
def _loss_of(out, loss_fn):
    if loss_fn is not None:
        return loss_fn(out)
    if isinstance(out, torch.Tensor):
        return out if out.numel() == 1 else out.float().sum()
    parts = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    tensors = [t.float().sum() for t in parts
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError(f"doctor: cannot make a loss from a {type(out).__name__} output; pass "
                         f"loss_fn=lambda out: ... returning a scalar tensor")
    return sum(tensors)


def _reachable_params(loss):
    """Parameters reachable from the loss in the graph built by forward (DDP's unused test)."""
    seen, found, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(n for n, _ in node.next_functions)
    return found


def _rng_state(device_types):
    state = [torch.get_rng_state()]
    if "cuda" in device_types and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state_all()
    return state


def _measure(model, forward, segments, watch):
    """One forward + backward with every probe on. Returns the raw observations."""
    acc = Counter()
    seg_inputs = defaultdict(list)  # segment name -> [does the input require grad?] per call
    handles = []
    named = list(model.named_modules())
    for name, mod in named:
        handles.append(mod.register_forward_pre_hook(lambda m, args, name=name: watch.called(name)))
    for seg_name, mods in segments:
        def seg_pre(m, args, seg_name=seg_name):
            if watch.phase == "forward":
                seg_inputs[seg_name].append(any(isinstance(a, torch.Tensor) and a.requires_grad
                                                for a in args))
        handles.append(mods[0].register_forward_pre_hook(seg_pre))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for n, p in params:
        handles.append(p.register_post_accumulate_grad_hook(lambda p, n=n: acc.update([n])))
    bn_before = {n: int(m.num_batches_tracked) for n, m in named
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.num_batches_tracked is not None}
    devices = {p.device.type for _, p in params}
    try:
        with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")
            watch.phase = "forward"
            loss = forward(model)
            watch.phase = "idle"
            reach = _reachable_params(loss) if loss.requires_grad else set()
            rng0, py_rng0 = _rng_state(devices), random.getstate()
            checkpoint_error = None
            if loss.requires_grad:
                watch.phase = "backward"
                try:
                    loss.backward()
                except CheckpointError as exc:  # the recompute differed from forward
                    checkpoint_error = str(exc)
            watch.phase = "idle"
            rng_moved = any(not torch.equal(a, b) for a, b in zip(rng0, _rng_state(devices)))
            py_rng_moved = random.getstate() != py_rng0
    finally:
        watch.phase = "idle"
        for h in handles:
            h.remove()
    bn_updates = {n: int(m.num_batches_tracked) - bn_before[n] for n, m in named if n in bn_before}
    return dict(fwd=watch.fwd, bwd=watch.bwd, nograd=watch.nograd, acc=acc, reach=reach,
                seg_inputs=seg_inputs, rng_moved=rng_moved, bn_updates=bn_updates,
                checkpoint_error=checkpoint_error, py_rng_moved=py_rng_moved,
                warnings=[str(w.message) for w in caught], has_backward=loss.requires_grad)


# ----------------------------------------------------------------------------- findings
def _regions(names, model, obs, segments):
    """Where parameters sit, as a person would name it: the installed checkpoint segment that
    holds them, else the outermost module run under no_grad in forward (the model's own reentrant
    checkpoint), else the module that owns them."""
    owner_of = {id(p): n for n, p in model.named_parameters()}
    by_seg = {owner_of[id(p)]: seg for seg, mods in segments for m in mods for p in m.parameters()}
    quiet = _outermost([n for n in obs["nograd"] if n])
    out = set()
    for n in names:
        own = _owner(n)
        out.add(by_seg.get(n) or next((q for q in quiet if own == q or own.startswith(q + ".")), own))
    return _where(out)


def _findings(model, obs, segments, use_reentrant, ddp_kwargs):
    static = bool(ddp_kwargs.get("static_graph", False))
    find_unused = bool(ddp_kwargs.get("find_unused_parameters", False))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_grad = {n for n, p in params if p.grad is None}
    out, explained = Findings(), set()

    # SyncBatchNorm: DDP(model) refuses it on CPU ("SyncBatchNorm layers only work with GPU
    # modules"); without a GPU here the ranks cannot be on one
    sync_bn = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if sync_bn and not torch.cuda.is_available():
        out.append(Finding(
            "syncbatchnorm_cpu", _where(sync_bn),
            f"{len(sync_bn)} SyncBatchNorm layer(s) and no GPU on this machine: DDP(model) on CPU "
            f"ranks raises 'SyncBatchNorm layers only work with GPU modules'",
            "convert_sync_batchnorm only when the ranks run on GPUs; on CPU keep BatchNorm (each "
            "rank normalises with its own batch), or use GroupNorm/LayerNorm"))

    recomputed = _outermost([n for n in obs["bwd"] if n])
    if obs["checkpoint_error"] is not None:
        # backward stopped half-way: every gradient-based rule below would misread it
        first = obs["checkpoint_error"].splitlines()[0]
        out.append(Finding(
            "recompute_differs", _where(recomputed) if recomputed else "(a checkpointed function)",
            f"backward raised CheckpointError: the recompute differed from forward ('{first}')",
            "make the checkpointed code compute the same thing twice: random decisions from "
            "torch's RNG (restored for the recompute) or made outside and passed in, no state "
            "changed between forward and backward"))
        return out
    if obs["py_rng_moved"]:
        out.append(Finding(
            "recompute_differs", _where(recomputed) if recomputed else "(a checkpointed function)",
            "Python's random module was drawn from during backward, so a recompute draws from it: "
            "checkpoint restores torch's RNG for the recompute, not Python's, so the recompute can "
            "take another path than forward (CheckpointError, or silently different gradients)",
            "draw random decisions from torch's RNG (torch.rand), or make them outside the "
            "checkpointed function and pass them in"))

    # torch warns and uses reentrant checkpointing when use_reentrant is not passed
    if any(_DEFAULT_REENTRANT_WARNING in w for w in obs["warnings"]):
        where = _outermost([n for n in obs["nograd"] if n]) or ["(model code)"]
        out.append(Finding("default_use_reentrant", _where(where),
                           "checkpoint() was called without use_reentrant: this torch warns and "
                           "runs the reentrant variant (with its DDP restrictions)",
                           "pass use_reentrant=False (or True) to every checkpoint call"))

    # reentrant region whose input needs no grad: nothing inside gets a gradient
    for seg_name, mods in segments:
        if use_reentrant and not all(obs["seg_inputs"].get(seg_name, [True])):
            names = {n for n, p in params if any(p is q for m in mods for q in m.parameters())}
            lost = names & no_grad
            if lost:
                explained |= lost
                out.append(Finding(
                    "reentrant_input_no_grad", seg_name,
                    f"its input does not require grad, so under use_reentrant=True its "
                    f"{len(lost)} parameter tensor(s) got no gradient (torch only warns: "
                    f"'{_NO_GRAD_INPUT_WARNING}. Gradients will be None')",
                    "pass use_reentrant=False, or make the segment's input require grad "
                    "(checkpoint from after the first layer)"))
    if any(_NO_GRAD_INPUT_WARNING in w for w in obs["warnings"]):
        # the model's own reentrant checkpoint: modules run under no_grad in forward, never
        # recomputed, and without gradients are the ones inside it
        lost = {n for n in no_grad - explained if obs["nograd"].get(_owner(n), 0)
                and not obs["bwd"].get(_owner(n), 0)}
        if lost:
            explained |= lost
            out.append(Finding(
                "reentrant_input_no_grad", _regions(lost, model, obs, segments),
                f"a reentrant checkpoint got no input that requires grad: {len(lost)} parameter "
                f"tensor(s) inside got no gradient (torch only warned: '{_NO_GRAD_INPUT_WARNING}')",
                "pass use_reentrant=False, or make the checkpoint's input require grad"))

    if not static:
        twice = {n: c for n, c in obs["acc"].items() if c > 1}
        if twice:
            mods = sorted({_owner(n) for n in twice})
            calls = [f"{m} called {obs['fwd'][m]}x" for m in mods if obs["fwd"].get(m, 0) > 1]
            how = ", ".join(calls[:4]) if calls else "one parameter shared by several modules"
            out.append(Finding(
                "reentrant_shared_module", _where(mods),
                f"the gradients of {_where(twice, 3)} were accumulated {max(twice.values())}x "
                f"in one backward ({how}): used in more than one reentrant checkpoint region, or "
                f"inside one and outside it, and each region is its own backward pass. DDP "
                f"raises 'Expected to mark a variable ready only once'", _REENTRANT_FIX))
        if find_unused:
            hidden = {n for n, p in params if obs["acc"].get(n) and id(p) not in obs["reach"]}
            if hidden:
                out.append(Finding(
                    "reentrant_find_unused", _regions(hidden, model, obs, segments),
                    f"{len(hidden)} parameter tensor(s) are invisible in the forward graph (inside "
                    f"a reentrant checkpoint) yet get gradients in backward: with "
                    f"find_unused_parameters=True DDP marks them unused, then ready again, and "
                    f"raises 'Expected to mark a variable ready only once'", _REENTRANT_FIX))

    for name, n_updates in obs["bn_updates"].items():
        if obs["bwd"].get(name, 0):
            out.append(Finding(
                "batchnorm_in_checkpoint", name,
                f"BatchNorm is recomputed in backward: its running statistics were updated "
                f"{n_updates}x for {obs['fwd'].get(name, 0)} forward call(s)",
                "keep BatchNorm outside checkpointed segments (checkpoint the layers around it), "
                "or use LayerNorm/GroupNorm there"))

    if obs["rng_moved"]:
        drops = [n for n, m in model.named_modules() if obs["bwd"].get(n, 0)
                 and isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
        where = drops or _outermost([n for n in obs["bwd"] if n]) or ["(model code)"]
        out.append(Finding(
            "dropout_rng", _where(where),
            "random ops ran again in backward without the RNG state of forward "
            "(preserve_rng_state=False): the recomputed dropout mask differs, so gradients "
            "differ from the un-checkpointed model",
            "keep preserve_rng_state=True (the default) for segments with dropout"))

    unused = no_grad - explained if obs["has_backward"] else set()
    if unused and not (find_unused or static):
        out.append(Finding(
            "unused_parameters", _where(_outermost({_owner(n) for n in unused})),
            f"{len(unused)} parameter tensor(s) got no gradient: DDP with "
            f"find_unused_parameters=False raises 'Expected to have finished reduction in the "
            f"prior iteration before starting a new one' at the next step",
            "pass find_unused_parameters=True to DDP (one graph traversal per step), or delete "
            "or freeze (requires_grad_(False)) the unused parameters"))
    elif find_unused and not no_grad and obs["has_backward"] and not static:
        out.append(Finding(
            "unused_parameters", "(ddp_kwargs)",
            "find_unused_parameters=True, but every parameter got a gradient: it is not needed "
            "and costs a traversal of the autograd graph every step",
            "drop find_unused_parameters=True"))
    return out


# ----------------------------------------------------------------------------- API
def _hf_checkpointing(model):
    """A transformers model's own checkpointing as the factory left it: (on, use_reentrant, where).
    ``use_reentrant`` is what its layers pass to torch's checkpoint ("not passed" when they pass
    nothing: torch's default, the reentrant variant in this torch)."""
    layers = [(n, m) for n, m in model.named_modules()
              if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        return False, None, None
    kws = {n: getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", None) or {}
           for n, m in layers}
    values = sorted({str(kw.get("use_reentrant", "not passed")) for kw in kws.values()})
    reentrant = {"True": True, "False": False}.get(values[0], values[0]) if len(values) == 1 \
        else "mixed: " + ", ".join(values)
    names = [n or "(root)" for n, _ in layers]  # the layers, not the model that holds them
    return True, reentrant, _where([n for n in names if not any(o.startswith(n + ".") for o in names)])


def _own_settings(model, cfg):
    """Findings on a user model's own settings, read before `prepare_for_training` changes them."""
    out = Findings()
    on, reentrant, where = _hf_checkpointing(model)
    if on:
        with warnings.catch_warnings():  # transformers 5 renamed it is_activation_checkpointing
            warnings.simplefilter("ignore")
            flag = getattr(model, "is_gradient_checkpointing", True)
        crash = (" Under plain DDP with find_unused_parameters=True (a common trainer default) "
                 "this setting raises 'Expected to mark a variable ready only once' in the first "
                 "backward" if reentrant is True or reentrant == "not passed" else "")
        out.append(Finding(
            "hf_reentrant_find_unused", where,
            f"the model's own gradient checkpointing is on (is_gradient_checkpointing={flag}, "
            f"use_reentrant={reentrant}): ddpkit turns it off for its runs and checkpoints by "
            f"TrainConfig.checkpoint={cfg.checkpoint!r} instead.{crash}",
            "choose the checkpointing with TrainConfig.checkpoint and use_reentrant; outside "
            "ddpkit, gradient_checkpointing_kwargs={'use_reentrant': False} or "
            "find_unused_parameters=False"))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and (on or cfg.checkpoint is not None):
        out.append(Finding(
            "hf_reentrant_find_unused", "config.use_cache",
            "use_cache=True in the model's config with checkpointing on: a KV cache is for "
            "generation (in training it keeps every block's keys and values); transformers' own "
            "checkpointing switches it off with a warning ('`use_cache=True` is incompatible with "
            "gradient checkpointing. Setting `use_cache=False`.'), and ddpkit sets "
            "config.use_cache=False for its runs",
            "set model.config.use_cache = False in the factory"))
    return out


def _doctor_config(cfg):
    """doctor on a config's model (built-in or yours), one micro-batch of its data, its loss.
    A user model is read before ddpkit prepares it (its own checkpointing, use_cache), then
    prepared exactly as `ddpkit.spec.build_model` does for the ranks."""
    from ..engine.data import first_batch, make_dataset
    from ..engine.spec import BUILTIN, build_model, call_factory, compute_loss, prepare_for_training

    own = Findings()
    if isinstance(cfg.model, str) and cfg.model in BUILTIN:
        model = build_model(cfg)[0]
    else:
        torch.manual_seed(cfg.seed)  # build_model's steps, with a look in between
        model = call_factory(cfg.model)
        own = _own_settings(model, cfg)
        prepare_for_training(model)
    batch = first_batch(cfg, make_dataset(cfg, n_samples=cfg.micro_batch))
    found = doctor(model, _Call(lambda m: compute_loss(m, batch, cfg.loss_fn)),
                   checkpoint=cfg.checkpoint, blocks=cfg.blocks_path,
                   use_reentrant=cfg.use_reentrant, preserve_rng_state=cfg.preserve_rng_state,
                   ddp_kwargs=dict(find_unused_parameters=cfg.find_unused_parameters,
                                   static_graph=cfg.static_graph))
    return Findings(own + found)


class _Call:
    """An example input that is a whole call: ``run(model)`` returns the loss."""

    def __init__(self, run):
        self.run = run


def doctor(model, example_input=None, *, checkpoint=None, use_reentrant=False,
           preserve_rng_state=True, ddp_kwargs=None, loss_fn=None, blocks=None):
    """Check ``model`` for DDP + checkpointing hazards with one forward/backward on this process.

    ``doctor(cfg)`` checks a `TrainConfig`, built-in model or yours (its model, one micro-batch of
    its data through its loss, its checkpoint, reentrancy and DDP settings). A bare model takes
    ``example_input`` (a tensor, or a tuple of positional arguments) and, if the model does not
    checkpoint itself, ``checkpoint=``: an int / 'full' / one bool per block (over the repeated
    blocks `ddpkit.blocks.find_blocks` finds, or those at the dotted path ``blocks=``), a list of
    submodule names to checkpoint, or a callable ``(name, module) -> bool``.
    ``ddp_kwargs``: the keywords you will give DDP (``find_unused_parameters``, ``static_graph``).
    ``loss_fn(output)``: a scalar to backpropagate (default: the output if scalar, else its sum).
    Returns `Findings` (a list of `Finding`); empty when nothing is wrong.
    """
    from ..config import TrainConfig

    if isinstance(model, TrainConfig):
        if example_input is not None:
            raise TypeError("doctor(cfg) builds its own input; pass a model to use example_input")
        return _doctor_config(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor() takes an nn.Module or a ddpkit.TrainConfig, got "
                        f"{type(model).__name__}")
    if example_input is None:
        raise TypeError("doctor(model, example_input): pass one example batch (a tensor, or a "
                        "tuple of the forward's positional arguments)")
    if isinstance(example_input, _Call):
        forward = example_input.run
    else:
        inputs = example_input if isinstance(example_input, tuple) else (example_input,)
        forward = lambda m: _loss_of(m(*inputs), loss_fn)  # noqa: E731
    # everything doctor touches, to put back: nothing of the check may leak into training
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    rng, py_rng = torch.get_rng_state(), random.getstate()
    for p, _ in grads:
        p.grad = None
    watch = _Watch()
    segments, undo = _install_checkpoint(model, checkpoint, use_reentrant, preserve_rng_state,
                                         watch, blocks)
    try:
        model.train()  # BatchNorm and dropout hazards exist in training mode only
        obs = _measure(model, forward, segments, watch)
        return _findings(model, obs, segments, use_reentrant, dict(ddp_kwargs or {}))
    finally:
        undo()
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(rng)
        random.setstate(py_rng)
