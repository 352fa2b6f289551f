"""A model built with no memory and without its weight initialisation, for what needs only its
shapes: where its blocks are (`model.model_info`), what a step saves and allocates (the
estimate's trace and the simulated step, on ``FakeTensorMode`` tensors).

Weight values do not change what a step saves or allocates, and a model's initialisation may
read them: ViT's ``trunc_normal_`` redraws until no value lies outside its bounds
(``mask.any()``), which a fake tensor cannot answer (``DataDependentOutputException:
aten._local_scalar_dense``). So the initialisation is left out, the way model libraries build
"empty" models, and the ways are tried in this order, the first that builds wins:

1. **fake tensors, initialisers off**: the factory runs under the caller's ``FakeTensorMode``
   with torch's ``nn.init`` functions (wherever a loaded module bound them: ``torch.nn.init``,
   ``torch.nn.modules.linear``, a model's own module) and transformers' init primitives
   returning the tensor untouched, as transformers' own ``no_init_weights`` does; everything
   else (buffers, weight tying) runs as written;
2. **meta, then fake**: the factory runs under ``torch.device("meta")`` (torch's initialisers do
   nothing there and transformers skips its own), which also lets construction code read a
   value it made with an explicit ``device="cpu"``; then every parameter and buffer is made
   again as an empty fake CPU tensor, a tied one once (so tied weights stay tied);
3. **fake tensors, the model's own initialisation** (how it was built before).

`model.model_info` needs no fake tensors: it builds on meta first, then tries 1.

When every way fails, `TraceError` names the stage (building the model, installing the
checkpoint policy, the forward, the step), the op that could not run on fake tensors (and where
in the model's code), and what the user can do.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
import types

import torch
import torch.nn as nn

from ..errors import TraceError

_INIT = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
         "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
         "orthogonal_", "sparse_")
_LOCK = threading.RLock()  # patched module globals: one build at a time (the Lab's threads)


def _untouched(*args, **kwargs):
    """An initialiser that leaves the tensor as it is (and returns it, as torch's do)."""
    return args[0] if args else kwargs.get("tensor")


@contextlib.contextmanager
def initialisers_off():
    """torch's ``nn.init`` functions, wherever a loaded module bound them, and transformers'
    init primitives, do nothing for the duration."""
    originals = {n: getattr(torch.nn.init, n) for n in _INIT if hasattr(torch.nn.init, n)}
    patched = []
    with _LOCK:
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            space = module.__dict__
            for name, fn in originals.items():
                if space.get(name) is fn:
                    patched.append((space, name, fn))
        hf = sys.modules.get("transformers.initialization")
        table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict):  # what transformers' own initialisers call
            patched += [(table, name, fn) for name, fn in table.items()]
        for space, name, _ in patched:
            space[name] = _untouched
        try:
            yield
        finally:
            for space, name, fn in patched:
                space[name] = fn
            _unbind_new_imports(originals)


def _unbind_new_imports(originals):
    """A module first imported inside the block bound the stand-in (``from torch.nn.init import
    normal_``; transformers builds its ``TORCH_INIT_FUNCTIONS`` table at import): give it the
    real initialisers, or every model built afterwards in this process would keep whatever
    memory held (an estimate of a transformers model run before its first import did that)."""
    spaces = [m.__dict__ for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        spaces.append(table)
    for space in spaces:
        for name, fn in originals.items():
            if space.get(name) is _untouched:
                space[name] = fn


def _materialise(model, device="cpu"):
    """Every parameter and buffer of a meta-built ``model`` made again, empty, on ``device`` (in
    the active fake mode: fake); a tensor held in two places (tied weights) is made once."""
    made = {}

    def fresh(t):
        if id(t) not in made:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)
    return model


def build_empty(factory, name, mode=None, who="ddpkit.estimate"):
    """``(model, how)``: ``factory()`` built without memory or initialisation, ``how`` the way
    that worked (the module's order). With ``mode`` (a ``FakeTensorMode`` the caller has entered)
    the model is on fake CPU tensors; without, on meta where it builds there (`model.model_info`),
    else on fake tensors of a mode of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    def fake_no_init():
        with initialisers_off():
            return factory()

    def meta_then_fake():
        with unset_fake_temporarily(), torch.device("meta"):
            model = factory()
        return _materialise(model) if isinstance(model, nn.Module) else model

    if mode is None:
        def on_meta():
            with torch.device("meta"):
                return factory()

        def own_mode():
            with FakeTensorMode():
                return fake_no_init()
        ways = [("meta", on_meta), ("fake tensors, initialisers off", own_mode)]
    else:
        ways = [("fake tensors, initialisers off", fake_no_init),
                ("meta, then fake", meta_then_fake),
                ("fake tensors, own initialisation", factory)]
    failed = []
    for how, way in ways:
        try:
            return way(), how
        except Exception as exc:  # noqa: BLE001 (each way's failure is reported if all fail)
            failed.append((how, exc))
    fake = next((e for _, e in failed if _op(e)), None)
    if fake is None:  # no way got as far as an op fake tensors lack: the factory's own error
        exc = failed[0][1]
        raise ValueError(f"{name} raised {type(exc).__name__} while building the model: "
                         f"{exc}") from exc
    raise trace_error("building the model", name, fake, tried=failed, who=who) from fake


# ----------------------------------------------------------------------------- errors
_WHY = {  # the fake-tensor exception -> what the op needed that a fake tensor has not
    "DataDependentOutputException": "a tensor's value is read: .item(), bool(tensor), an `if` "
                                    "or `while` on a tensor",
    "DynamicOutputShapeException": "its output's size depends on the data",
    "UnsupportedOperatorException": "torch has no fake-tensor (meta) implementation of it",
}
_FIX = {
    "building the model":
        "make the factory's construction read no tensor values it makes itself (compute such "
        "numbers in Python; a tensor made with an explicit device='cpu' is real in the meta "
        "build, which then works), or estimate a smaller config of the same model",
    "installing the checkpoint policy":
        "pass blocks= naming the stacks of repeated blocks to checkpoint (cfg.info lists those "
        "found), or checkpoint=None",
    "the forward":
        "ddpkit.train still runs it (real tensors); for the estimate, pass a loss= that avoids "
        "that op (a model's own loss may check its labels' values), data whose batch needs no "
        "data-dependent branch (no padding in attention_mask), blocks= naming other stacks "
        "(cfg.info lists those found), or estimate a smaller config of the same model",
}
_FIX["the step"] = _FIX["the forward"]


def _fake_failure(exc):
    """(op, why) of the aten op a fake tensor could not run, from the exception or its causes;
    (None, None) when none is named."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        func = getattr(exc, "func", None)
        if func is not None:
            return str(func), _WHY.get(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return None, None


def _op(exc):
    return _fake_failure(exc)[0]


def _where(exc):
    """The innermost frame of the failure outside torch's own code: 'file.py:123 in fn'."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((torch_dir, here)) and "contextlib" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def trace_error(stage, name, exc, tried=(), who="ddpkit.estimate"):
    """`TraceError` for a failure at ``stage`` of running ``name``'s model on fake tensors."""
    op, why = _fake_failure(exc)
    what = f"{op} ({why})" if why else (op or f"{type(exc).__name__}: {exc}")
    text = f"{who}: {stage} ({name}) on fake tensors (no memory) failed: {what}{_where(exc)}"
    if len(tried) > 1:
        text += ". Tried, in order: " + "; ".join(
            f"{how} ({_op(e) or type(e).__name__})" for how, e in tried)
    return TraceError(f"{text}. What you can do: {_FIX.get(stage, _FIX['the forward'])}",
                      stage=stage, op=op)


@contextlib.contextmanager
def stage(name, model_name, who="ddpkit.estimate"):
    """Run a stage of a fake run; a failure becomes a `TraceError` naming it (ddpkit's own
    ValueErrors, which name a setting already, pass as they are)."""
    try:
        yield
    except (TraceError, ValueError):
        raise
    except Exception as exc:
        raise trace_error(name, model_name, exc, who=who) from exc
