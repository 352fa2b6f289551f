"""What a run trains: the model, its data and its loss, given by name, callable or import path.

``TrainConfig.model`` is ``"mlp"`` / ``"gpt"`` (the built-in teaching models), a callable that
returns an ``nn.Module`` (a notebook function ships to the ranks by value, like a launch job), or
``"package.module:factory"`` (what the CLI and torchrun take). ``data`` is ``(cfg) -> Dataset``
or an import path; ``loss`` is ``(model, batch) -> scalar`` or an import path, or None for the
conventions: a dict batch calls ``model(**batch)`` and takes ``.loss`` (transformers), a tuple
batch calls ``model(*batch)``, which returns the loss (the built-in models).

`model_info(cfg)` builds the model once on the ``meta`` device (no memory; `empty` says how,
and what it falls back to) to learn what the kernel needs before anything is spawned: where
the stacks of blocks are and how many blocks each holds, whether it is a
Hugging Face causal LM (then ``data=None`` means synthetic tokens), whether it switched on its
own checkpointing. It is cached per factory.

`build_model(plan)` builds the model a `RankPlan` names, as each rank does (seeded, prepared
for training); `build_fake` and `fake_model` build it on fake tensors for the predictions.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from . import rng
from .blocks import find_stacks
from .builtin import build_builtin
from .empty import build_empty
from .names import MODELS as BUILTIN

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


def factory_of(spec):
    """The callable ``model=`` names, checked to be callable with no arguments."""
    factory = resolve(spec, "model")
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise ValueError(f"TrainConfig.model={describe_spec(spec)} cannot be called with no "
                         f"arguments ({exc}); the factory must build the model with no "
                         f"arguments: wrap it, e.g. model=lambda: make_model(size)") from None
    except ValueError:
        pass  # no signature to read (a builtin): calling it will tell
    return factory


def check_module(model, spec):
    """``model`` if it is an ``nn.Module``, else an error naming ``model=``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"TrainConfig.model={describe_spec(spec)} returned a "
                         f"{type(model).__name__}, not an nn.Module; return the model, e.g. "
                         f"`def make_model(): return Net()`")
    return model


def call_factory(spec):
    """Call the model factory; errors name ``model=``."""
    factory = factory_of(spec)
    try:
        model = factory()
    except Exception as exc:
        raise ValueError(f"TrainConfig.model={describe_spec(spec)} raised {type(exc).__name__} "
                         f"while building the model: {exc}") from exc
    return check_module(model, spec)


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


class Stack(NamedTuple):
    """One stack of repeated blocks: its dotted path, how many blocks, their class."""
    path: str
    n_blocks: int
    block_class: str


@dataclass(frozen=True)
class ModelInfo:
    """What the kernel knows of a model without allocating it."""
    name: str                 # class name
    stacks: tuple             # every stack of repeated blocks (`Stack`), in the model's order
    causal_lm: bool
    vocab_size: int | None
    own_checkpointing: bool   # transformers' gradient_checkpointing_enable() was called
    use_cache: bool           # a transformers config asks for a KV cache (useless in training)
    n_params: int
    built: str = "meta"       # how it was built without memory (`empty.build_empty`)

    @property
    def blocks(self):
        """Where the blocks are, as ``blocks=`` names them: a path, or a tuple of several."""
        paths = tuple(s.path for s in self.stacks)
        return paths[0] if len(paths) == 1 else paths

    @property
    def n_blocks(self):
        """Blocks over all stacks."""
        return sum(s.n_blocks for s in self.stacks)

    @property
    def stack_sizes(self):
        return tuple(s.n_blocks for s in self.stacks)

    @property
    def block_class(self):
        """The blocks' class name (a tuple of them where the stacks differ)."""
        names = tuple(dict.fromkeys(s.block_class for s in self.stacks))
        return names[0] if len(names) == 1 else names


_INFO = {}  # (spec key, blocks, build key) -> (spec, ModelInfo): one meta build per factory


def model_info(model_spec, blocks=None, seed=0, build=None, build_key=None):
    """`ModelInfo` of a factory (cached per factory); ``build``: how to call it, when it is not
    the factory itself (a built-in model built from its config), cached per ``build_key`` (the
    values ``build`` reads) when one is given. Built on the meta device, else on fake tensors
    (`empty.build_empty`): no memory either way."""
    key = (model_spec if isinstance(model_spec, str) else id(model_spec), blocks, build_key)
    cached = build is None or build_key is not None
    hit = _INFO.get(key)
    if cached and hit is not None and (hit[0] is model_spec or isinstance(model_spec, str)):
        return hit[1]
    factory = build if build is not None else factory_of(model_spec)
    with rng.forked():
        torch.manual_seed(seed)
        model, how = build_empty(factory, f"TrainConfig.model={describe_spec(model_spec)}",
                                 who="TrainConfig (finding the blocks)")
    check_module(model, model_spec)
    stacks = find_stacks(model, blocks)
    config = getattr(model, "config", None)
    info = ModelInfo(type(model).__name__,
                     tuple(Stack(p, len(c), type(c[0]).__name__) for p, c in stacks),
                     is_causal_lm(model), getattr(config, "vocab_size", None),
                     own_checkpointing(model), bool(_caching_configs(model)),
                     sum(p.numel() for p in model.parameters()), how)
    if cached:
        _INFO[key] = (model_spec, info)
    return info


def prepare_for_training(model):
    """What ddpkit changes on a user model before training, and why (returned as notes):
    transformers' own checkpointing goes off (ddpkit's policy is the one that runs), and its KV
    cache too (generation only; under training it keeps every block's keys and values)."""
    notes = []
    # transformers 5's name, then the one before (which warns in 5 that it goes in v6)
    off = getattr(model, "activation_checkpointing_disable", None) or \
        getattr(model, "gradient_checkpointing_disable", None)
    if own_checkpointing(model) and off is not None:
        off()
        notes.append("the model's own gradient checkpointing was on: ddpkit turned it off and "
                     "runs TrainConfig.checkpoint instead")
    caching = _caching_configs(model)
    for config in caching:
        config.use_cache = False
    if caching:
        notes.append("use_cache=True in the model's config: set to False for training (a KV "
                     "cache is for generation)")
    return notes


def _caching_configs(model):
    """Every config in the model that asks for a KV cache: the model's own and its parts'
    (T5's decoder keeps a copy of its own, and builds a cache from it even when the model is
    called with labels; a checkpoint's recompute would then write that cache twice)."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "use_cache", False) is True}
    return list(configs.values())


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
def build_model(plan):
    """The model a `RankPlan` names, initialised from plan.seed (the same on every rank), with
    the notes of what `prepare_for_training` changed."""
    torch.manual_seed(plan.seed)
    if plan.model in BUILTIN:
        return build_builtin(plan.model, **builtin_shape(plan)), []
    model = call_factory(plan.model)
    return model, prepare_for_training(model)


def builtin_shape(c):
    """The sizes a built-in model is built from, read from a config or a plan."""
    return dict(n_blocks=c.n_blocks, width=c.width, mlp_ratio=c.mlp_ratio, seq_len=c.seq_len,
                vocab=c.vocab, n_heads=c.n_heads, dropout=c.dropout)


def build_fake(plan, mode):
    """`build_model` on fake tensors, without the weights' initialisation (`empty.build_empty`:
    what a step saves does not depend on it). Call it inside ``mode`` (a ``FakeTensorMode``).
    Returns ``(model, notes, how)``: ``how`` is the way it was built."""
    torch.manual_seed(plan.seed)
    if plan.model in BUILTIN:
        model, how = build_empty(lambda: build_builtin(plan.model, **builtin_shape(plan)),
                                 plan.model, mode)
        return model, [], how
    name = f"TrainConfig.model={describe_spec(plan.model)}"
    model, how = build_empty(factory_of(plan.model), name, mode)
    model = check_module(model, plan.model)
    return model, prepare_for_training(model), how


def fake_model(plan, mode, keep=None, dtype=None):
    """``(model, how)``: `build_fake`'s model in training mode, cut to its first ``keep`` blocks
    of each stack when asked (an int for one stack, a tuple for several: the estimate at real
    sizes traces and simulates a few blocks and carries their figures to all), its floating
    parameters and buffers in ``dtype`` when given (FSDP's mixed precision computes with them
    so: made again empty in that dtype, a tied weight once; ``Module.to`` cannot swap a fake
    tensor that FakeTensorMode's memo holds a weak reference to)."""
    with mode:
        model, _, how = build_fake(plan, mode)
        if keep is not None:  # an int: the one stack's; a tuple: each stack's
            stacks = find_stacks(model, plan.blocks)
            keeps = (keep,) if isinstance(keep, int) else tuple(keep)
            if len(keeps) != len(stacks):
                raise ValueError(f"a model cut to {keeps} blocks has {len(keeps)} stack(s); "
                                 f"this one has {len(stacks)}")
            for (_, container), k in zip(stacks, keeps):
                del container[k:]
        if dtype is not None:
            _recast(model, dtype)
    return model.train(), how


def _recast(model, dtype):
    """Each floating parameter and buffer of ``model`` (empty: fake or meta) made again in
    ``dtype``, a tensor held in two places once."""
    made = {}

    def recast(t):
        if id(t) not in made:
            new = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
            made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and t.is_floating_point():
                    table[name] = recast(t)
