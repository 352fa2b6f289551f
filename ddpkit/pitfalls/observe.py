"""The doctor's one watched step: checkpointing installed for the check, then one forward and
one backward with every probe on, returned as plain observations for the rules (`rules`).

What is watched: per-module calls in forward, under no_grad, and in backward (a recompute);
gradient-accumulator firings per parameter (DDP hooks the same accumulator); which parameters
the loss reaches in the forward graph (how ``find_unused_parameters`` decides); torch's RNG and
Python's ``random`` across backward; BatchNorm counters; torch's warnings; a ``CheckpointError``.
"""
from __future__ import annotations

import functools
import random
import warnings
from collections import Counter, defaultdict

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ..engine.policies import CheckpointPolicy, remove
from ..spec import rng
from ..spec.blocks import block_names, find_stacks, stack_sizes
from ..spec.setting import CheckpointSetting


def where(names, limit=4):
    names = sorted(set(names))
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def owner(param_name):
    return param_name.rpartition(".")[0] or "(root)"


def outermost(names):
    """Drop names that sit inside another name of the list (a checkpoint inside a checkpoint)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


class Watch:
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


def install_checkpoint(model, setting, use_reentrant, preserve_rng_state, watch, blocks=None):
    """Install the requested checkpointing for the check. Returns (segments, undo), where a
    segment is (name, [modules]) and undo() puts the model back as it was."""
    if setting is None or (isinstance(setting, CheckpointSetting) and setting.value is None):
        return [], lambda: None
    if callable(setting):
        names = outermost([n for n, m in model.named_modules() if n and setting(n, m)])
    elif isinstance(setting, (list, tuple)) and setting and all(isinstance(n, str) for n in setting):
        names = list(setting)
    else:
        return _install_setting(model, setting, use_reentrant, preserve_rng_state, blocks)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"doctor: checkpoint names {missing} are not submodules of "
                         f"{type(model).__name__}; see model.named_modules() for the names")
    undos = []
    for name in names:
        undos.append(_wrap_forward(modules[name], name, use_reentrant, preserve_rng_state, watch))
    return [(n, [modules[n]]) for n in names], lambda: [u() for u in reversed(undos)]


def _install_setting(model, value, use_reentrant, preserve_rng_state, blocks):
    """A block setting (an int, 'full', one bool per block): the very policy the ranks install,
    so doctor checks what will run."""
    try:
        stacks = find_stacks(model, blocks)
    except ValueError:
        if blocks is not None:
            raise
        raise ValueError(f"doctor: checkpoint={value!r} acts on repeated blocks, and this "
                         f"{type(model).__name__} has none; pass checkpoint= as a list of "
                         f"submodule names, or a callable (name, module) -> bool") from None
    flat = [b for _, container in stacks for b in container]
    try:
        setting = CheckpointSetting.of(value, stack_sizes(stacks))
    except ValueError as exc:
        raise ValueError(f"doctor: {exc}; or, to doctor, a list of submodule names or a "
                         f"callable (name, module) -> bool") from None
    CheckpointPolicy(setting, use_reentrant, preserve_rng_state).apply(
        model, [p for p, _ in stacks])
    names = block_names(stacks)

    def name(a, b):  # a region lies in one stack: 'transformer.h.3' or 'transformer.h[0:2]'
        (path, _), (start, _) = next((s, span) for s, span in zip(stacks, setting.spans)
                                     if span[0] <= a < span[1])
        return names[a] if b - a == 1 else f"{path}[{a - start}:{b - start}]"
    segs = [(name(a, b), flat[a:b]) for a, b in setting.regions]
    return segs, lambda: remove(model)


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


def loss_of(out, loss_fn):
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


def _torch_rng(device_types):
    """torch's RNG states (CPU, and CUDA where used): compared across backward, not saved."""
    state = [torch.get_rng_state()]
    if "cuda" in device_types and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state_all()
    return state


def measure(model, forward, segments, watch):
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
        # rng.LOCK: no other thread of ddpkit's forks (seeds) the process's RNG between the two
        # reads of it that tell whether backward drew random numbers
        with rng.LOCK, warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")
            watch.phase = "forward"
            loss = forward(model)
            watch.phase = "idle"
            reach = _reachable_params(loss) if loss.requires_grad else set()
            rng0, py_rng0 = _torch_rng(devices), random.getstate()
            checkpoint_error = None
            if loss.requires_grad:
                watch.phase = "backward"
                try:
                    loss.backward()
                except CheckpointError as exc:  # the recompute differed from forward
                    checkpoint_error = str(exc)
            watch.phase = "idle"
            rng_moved = any(not torch.equal(a, b) for a, b in zip(rng0, _torch_rng(devices)))
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
