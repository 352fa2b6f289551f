"""What a run trains: the model, its data and its loss, given by name, callable or import path.

``TrainConfig.model`` is ``"mlp"`` / ``"gpt"`` (the built-in teaching models), a callable that
returns an ``nn.Module`` (a notebook function ships to the ranks by value, like a launch job), or
``"package.module:factory"`` (what the CLI and torchrun take). ``data`` is ``(cfg) -> Dataset``
or an import path; ``loss`` is ``(model, batch) -> scalar`` or an import path, or None for the
conventions: a dict batch calls ``model(**batch)`` and takes ``.loss`` (transformers), a tuple
batch calls ``model(*batch)``, which returns the loss (the built-in models).

`model_info(cfg)` builds the model once on the ``meta`` device (no memory) to learn what the
kernel needs before anything is spawned: where the blocks are and how many, whether it is a
Hugging Face causal LM (then ``data=None`` means synthetic tokens), whether it switched on its
own checkpointing. It is cached per factory.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn as nn

BUILTIN = ("mlp", "gpt")


def describe_spec(spec):
    """How a model/data/loss spec prints: a name, an import path, or the function's name."""
    if spec is None or isinstance(spec, str):
        return repr(spec)
    return getattr(spec, "__qualname__", None) or type(spec).__name__


def import_path(spec):
    """``pkg.mod:name`` for a spec the CLI can name, else None (a notebook function)."""
    if isinstance(spec, str) or spec is None:
        return spec
    mod, name = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in name:
        return None
    return f"{mod}:{name}"


def resolve(spec, setting):
    """The callable a spec names. ``setting`` ('model', 'data', 'loss') is named in errors."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        hint = " or 'mlp'/'gpt'" if setting == "model" else ""
        raise ValueError(f"TrainConfig.{setting}={spec!r}: pass a callable or an import path "
                         f"'package.module:function'{hint}")
    module, _, name = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # ImportError, AttributeError, or the module's own error
        raise ValueError(f"TrainConfig.{setting}={spec!r} does not import ({type(exc).__name__}: "
                         f"{exc}); check the module is on sys.path (run from the project root "
                         f"or pip install it) and the name after ':' exists") from exc
    if not callable(obj):
        raise ValueError(f"TrainConfig.{setting}={spec!r} is a {type(obj).__name__}, not a "
                         f"callable; name a function")
    return obj


def call_factory(spec):
    """Call the model factory; errors name ``model=``."""
    factory = resolve(spec, "model")
    try:
        model = factory()
    except Exception as exc:
        raise ValueError(f"TrainConfig.model={describe_spec(spec)} raised {type(exc).__name__}: "
                         f"{exc}; the factory must build the model with no arguments") from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"TrainConfig.model={describe_spec(spec)} returned a "
                         f"{type(model).__name__}, not an nn.Module; return the model, e.g. "
                         f"`def make_model(): return Net()`")
    return model


def is_causal_lm(model):
    """A Hugging Face causal language model (it takes input_ids and labels, returns .loss);
    also wrapped by peft (``get_peft_model``: its forward passes both on to the base model)."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    name = type(model).__name__
    return (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")) and \
        hasattr(getattr(model, "config", None), "vocab_size")


def own_checkpointing(model):
    """Is the model's own (transformers) gradient checkpointing switched on?"""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    return bool(layers)


@dataclass(frozen=True)
class ModelInfo:
    """What the kernel knows of a model without allocating it."""
    name: str                 # class name
    blocks: str               # dotted path of the block container
    n_blocks: int
    block_class: str
    causal_lm: bool
    vocab_size: int | None
    own_checkpointing: bool   # transformers' gradient_checkpointing_enable() was called
    use_cache: bool           # a transformers config asks for a KV cache (useless in training)
    n_params: int


_INFO = {}  # (spec key, blocks) -> (spec, ModelInfo): one meta build per factory


def model_info(model_spec, blocks=None, seed=0, build=None):
    """`ModelInfo` of a factory (cached per factory); ``build``: how to call it, when it is not
    the factory itself (a built-in model built from its config)."""
    from .blocks import find_blocks

    key = (model_spec if isinstance(model_spec, str) else id(model_spec), blocks)
    hit = _INFO.get(key)
    if build is None and hit is not None and hit[0] is model_spec:
        return hit[1]
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        torch.manual_seed(seed)
        model = build() if build is not None else call_factory(model_spec)
    path, container = find_blocks(model, blocks)
    config = getattr(model, "config", None)
    info = ModelInfo(type(model).__name__, path, len(container), type(container[0]).__name__,
                     is_causal_lm(model), getattr(config, "vocab_size", None),
                     own_checkpointing(model), bool(getattr(config, "use_cache", False)),
                     sum(p.numel() for p in model.parameters()))
    if build is None:
        _INFO[key] = (model_spec, info)
    return info


def prepare_for_training(model):
    """What ddpkit changes on a user model before training, and why (returned as notes):
    transformers' own checkpointing goes off (ddpkit's policy is the one that runs), and its KV
    cache too (generation only; under training it keeps every block's keys and values)."""
    notes = []
    if own_checkpointing(model) and hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()
        notes.append("the model's own gradient checkpointing was on: ddpkit turned it off and "
                     "runs TrainConfig.checkpoint instead")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        notes.append("use_cache=True in the model's config: set to False for training (a KV "
                     "cache is for generation)")
    return notes


# ----------------------------------------------------------------------------- the loss
def compute_loss(model, batch, loss_fn=None):
    """One micro-batch's scalar loss, by ``loss_fn`` or the conventions; errors name ``loss=``."""
    if loss_fn is not None:
        out = loss_fn(model, batch)
        how = f"loss={describe_spec(loss_fn)}"
    elif isinstance(batch, dict):
        out = model(**batch)
        out = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
        how = "loss=None with a dict batch (model(**batch).loss)"
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
        how = "loss=None with a tuple batch (model(*batch))"
    else:
        raise ValueError(f"TrainConfig.loss=None: a {type(batch).__name__} batch has no "
                         f"convention; pass loss=lambda model, batch: ... returning a scalar")
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
        got = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else "None" if out is None else f"a {type(out).__name__}")
        raise ValueError(f"TrainConfig.{how} gave {got}, not a scalar float tensor; pass "
                         f"loss=lambda model, batch: ... that returns one number to backpropagate "
                         f"(e.g. F.cross_entropy(model(x), y))")
    return out


def to_device(batch, device):
    """A batch (tensor, tuple, list or dict of tensors) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# ----------------------------------------------------------------------------- building
def build_model(cfg):
    """The model a config names, initialised from cfg.seed (the same on every rank), with the
    notes of what `prepare_for_training` changed."""
    from . import models

    torch.manual_seed(cfg.seed)
    if cfg.model in BUILTIN:
        return models.build_builtin(cfg), []
    model = call_factory(cfg.model)
    return model, prepare_for_training(model)
