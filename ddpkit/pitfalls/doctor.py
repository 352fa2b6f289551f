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
gradient checkpointing (and its ``use_reentrant``), and ``use_cache=True`` under checkpointing;
what ddpkit switches off for its runs is reported as a note, not a warning.

Checkpointing can be the model's own (seen through the measurements above) or installed by
doctor for the check through ``checkpoint=``; either way the model is left as it was: buffers,
gradients, train/eval flags, RNG state and forward methods are restored.

The watched step is `observe.measure`; each hazard is one rule in `rules`.
"""
from __future__ import annotations

import contextlib
import random
import warnings

import torch
import torch.nn as nn

from ..config import TrainConfig
from ..engine.data import first_batch, make_dataset
from ..spec.model import BUILTIN, build_model, call_factory, compute_loss, prepare_for_training
from .observe import Watch, install_checkpoint, loss_of, measure, where
from .rules import Finding, Findings, findings

__all__ = ["Finding", "Findings", "doctor"]


def _hf_checkpointing(model):
    """A transformers model's own checkpointing as the factory left it: (on, use_reentrant, where).
    ``use_reentrant`` is the set of what its layers pass to torch's checkpoint ("not passed" when
    they pass nothing: torch's default, the reentrant variant in this torch)."""
    layers = [(n, m) for n, m in model.named_modules()
              if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        return False, set(), None
    kws = {n: getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", None) or {}
           for n, m in layers}
    values = {str(kw.get("use_reentrant", "not passed")) for kw in kws.values()}
    names = [n or "(root)" for n, _ in layers]  # the layers, not the model that holds them
    return True, values, where([n for n in names if not any(o.startswith(n + ".") for o in names)])


def _own_settings(model, cfg):
    """Findings on a user model's own settings, read before `prepare_for_training` changes them.
    What ddpkit switches off for its runs is a note; the model's own *reentrant* checkpointing
    is a warning: ddpkit's runs are safe, the factory is not, in a trainer of your own."""
    out = Findings()
    on, values, at = _hf_checkpointing(model)
    if on:
        with warnings.catch_warnings():  # transformers 5 renamed it is_activation_checkpointing
            warnings.simplefilter("ignore")
            flag = getattr(model, "is_gradient_checkpointing", True)
        shown = ", ".join(sorted(values)) if len(values) > 1 else next(iter(values))
        said = (f"the model's own gradient checkpointing is on (is_gradient_checkpointing="
                f"{flag}, use_reentrant={'mixed: ' * (len(values) > 1)}{shown}): ddpkit turns it "
                f"off for its runs and checkpoints by TrainConfig.checkpoint={cfg.checkpoint.plain!r} "
                f"instead.")
        if values & {"True", "not passed"}:
            out.append(Finding(
                "hf_reentrant_find_unused", at,
                said + " Under plain DDP with find_unused_parameters=True (a common trainer "
                "default) this setting raises 'Expected to mark a variable ready only once' in "
                "the first backward",
                "choose the checkpointing with TrainConfig.checkpoint and use_reentrant; outside "
                "ddpkit, activation_checkpointing_kwargs={'use_reentrant': False} "
                "(gradient_checkpointing_kwargs before transformers 5) or "
                "find_unused_parameters=False"))
        else:
            out.append(Finding("hf_own_checkpointing", at, said,
                               "nothing for ddpkit's runs; TrainConfig.checkpoint chooses what "
                               "they checkpoint"))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and (on or cfg.checkpoint.value is not None):
        out.append(Finding(
            "hf_use_cache", "config.use_cache",
            "use_cache=True in the model's config with checkpointing on: ddpkit sets "
            "config.use_cache=False for its runs. A KV cache is for generation (in training it "
            "keeps every block's keys and values); transformers' own checkpointing switches it "
            "off with a warning ('`use_cache=True` is incompatible with gradient checkpointing. "
            "Setting `use_cache=False`.')",
            "nothing for ddpkit's runs; in a trainer of your own, set "
            "model.config.use_cache = False"))
    return out


def _doctor_config(cfg):
    """doctor on a config's model (built-in or yours), one micro-batch of its data, its loss.
    A user model is read before ddpkit prepares it (its own checkpointing, use_cache), then
    prepared exactly as `ddpkit.spec.model.build_model` does for the ranks."""
    own, plan = Findings(), cfg.rank_plan()
    if isinstance(cfg.model, str) and cfg.model in BUILTIN:
        model = build_model(plan)[0]
    else:
        torch.manual_seed(cfg.seed)  # build_model's steps, with a look in between
        model = call_factory(cfg.model)
        own = _own_settings(model, cfg)
        prepare_for_training(model)
    batch = first_batch(plan, make_dataset(plan, n_samples=cfg.micro_batch))
    found = doctor(model, lambda m: compute_loss(m, batch, plan.loss_fn),
                   checkpoint=cfg.checkpoint, blocks=cfg.blocks_path,
                   use_reentrant=cfg.use_reentrant, preserve_rng_state=cfg.preserve_rng_state,
                   ddp_kwargs=dict(find_unused_parameters=cfg.find_unused_parameters,
                                   static_graph=cfg.static_graph))
    return Findings(own + found)


def doctor(model, example_input=None, *, checkpoint=None, use_reentrant=False,
           preserve_rng_state=True, ddp_kwargs=None, loss_fn=None, blocks=None):
    """Check ``model`` for DDP + checkpointing hazards with one forward/backward on this process.

    ``doctor(cfg)`` checks a `TrainConfig`, built-in model or yours (its model, one micro-batch of
    its data through its loss, its checkpoint, reentrancy and DDP settings). A bare model takes
    ``example_input``: a tensor, a tuple of positional arguments, or a whole call, a function
    ``run(model) -> loss`` (keyword arguments, a loss of your own); and, if the model does not
    checkpoint itself, ``checkpoint=``: an int / 'full' / one bool per block (over the repeated
    blocks `ddpkit.spec.blocks.find_stacks` finds, or those at the dotted path ``blocks=``), a list of
    submodule names to checkpoint, or a callable ``(name, module) -> bool``.
    ``ddp_kwargs``: the keywords you will give DDP (``find_unused_parameters``, ``static_graph``).
    ``loss_fn(output)``: a scalar to backpropagate (default: the output if scalar, else its sum).
    Returns `Findings` (a list of `Finding`); empty when nothing is wrong.
    """
    if isinstance(model, TrainConfig):
        if example_input is not None:
            raise TypeError("doctor(cfg) builds its own input; pass a model to use example_input")
        return _doctor_config(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor() takes an nn.Module or a ddpkit.TrainConfig, got "
                        f"{type(model).__name__}")
    if example_input is None:
        raise TypeError("doctor(model, example_input): pass one example batch (a tensor, or a "
                        "tuple of the forward's positional arguments), or a function "
                        "model -> loss")
    if callable(example_input):  # a whole call (a tensor is not callable)
        forward = example_input
    else:
        inputs = example_input if isinstance(example_input, tuple) else (example_input,)
        forward = lambda m: loss_of(m(*inputs), loss_fn)  # noqa: E731
    watch = Watch()
    with _left_as_it_was(model):
        segments, undo = install_checkpoint(model, checkpoint, use_reentrant, preserve_rng_state,
                                            watch, blocks)
        try:
            model.train()  # BatchNorm and dropout hazards exist in training mode only
            obs = measure(model, forward, segments, watch)
            # read before anything is put back: the rules look at the gradients of this step
            return findings(model, obs, segments, use_reentrant, dict(ddp_kwargs or {}))
        finally:
            undo()


@contextlib.contextmanager
def _left_as_it_was(model):
    """Everything the check touches is put back: nothing of it may leak into training (train/eval
    flags, buffers such as BatchNorm's statistics, gradients, torch's and Python's RNG)."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    rng, py_rng = torch.get_rng_state(), random.getstate()
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(rng)
        random.setstate(py_rng)
