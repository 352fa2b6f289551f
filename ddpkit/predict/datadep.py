"""Data-dependent ops under fake tensors, and what sized each one.

A fake tensor has a shape and no values, so an op whose output's size depends on values
(``nonzero``, ``masked_select``, boolean indexing, ``unique``) or that reads one (``.item()``, an
``if`` on a tensor) cannot run on it: FakeTensorMode raises, and so did ddpkit's trace.
`DataDependence`, a dispatch mode under the trace's own modes, answers them in three ways and
notes which answered each op (`notes`: op, where in the model's code, how it was sized):

1. **From the data.** Every tensor of the batch keeps its real values beside it (a *shadow*), and
   so does every tensor made from shadows and constants alone (``arange``, ``zeros``, a Python
   list, ``labels >= 0``, a one-hot of routing indices): those ops run once more on the shadows,
   for real (small tensors only: `LIMIT`). A data-dependent op of such tensors is answered as the
   rank will answer it (DeBERTa's loss keeps ``(labels >= 0).nonzero()`` of the real labels).
2. **From the routing assumption.** ``topk`` and ``argmax`` of values no shadow holds (a router's
   scores, made from the weights) give their indices by ``routing``: ``"balanced"`` (row r takes
   ``(r*k + j) % E``, j < k: each of E choices gets rows*k/E, as a load-balanced router does) or
   ``"worst"`` (one expert's capacity filled: every row takes expert 0, its other k-1 choices
   spread over the rest, so every expert still runs; with k = 1 the rest get one row each: the
   most one expert can hold while all run, a dropless router's upper bound; a model with a
   capacity factor drops what is over it in its own code, from the shadows). Everything routed
   downstream (one-hot masks, ``where``, per-expert token lists, ``histc`` offsets) then has
   shadows and is exact under the assumption.
3. **At the upper bound.** ``nonzero``, ``masked_select``, boolean indexing and ``unique`` of
   values no shadow holds are sized at their input's size (every element counted): their output
   is never larger.

Anything else (a value read that no shadow holds, ``bincount``, ``repeat_interleave`` without
its size) fails as before, and `TraceError` names it. ``aten._grouped_mm`` (transformers' MoE
experts) runs on CPU in any float dtype, where torch's meta function allows bf16 only (it mirrors
the CUDA kernel's checks): its output is made as the meta function makes it.
"""
from __future__ import annotations

import os
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
ROUTINGS = ("balanced", "worst")
LIMIT = 1 << 20
"""Elements: a tensor larger than this keeps no shadow (its values are not computed)."""
_FACTORIES = {aten.arange, aten.zeros, aten.ones, aten.full, aten.scalar_tensor, aten.eye,
              aten.linspace, aten.zeros_like, aten.ones_like, aten.full_like}
_SIZED_BY = {  # op -> (argument positions whose values size the output, upper bound)
    aten.nonzero: ((0,), lambda a: (a[0].numel(), a[0].dim())),
    aten.masked_select: ((1,), lambda a: (torch.broadcast_shapes(a[0].shape, a[1].shape).numel(),)),
    aten._unique2: ((0,), None), aten.unique_dim: ((0,), None),
    aten.unique_consecutive: ((0,), None), aten._unique: ((0,), None),
}
UPPER = "upper bound: every element counted (the output is at most its input's size)"
DATA = "from the batch's values"


def _where():
    """'file.py:123 in fn': the innermost frame outside torch and ddpkit (the model's code)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    for f in reversed(traceback.extract_stack()):
        if not f.filename.startswith(skip) and "contextlib" not in f.filename:
            return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
    return "?"


class DataDependence(TorchDispatchMode):
    """The mode (see the module's note). ``routing``: 'balanced' or 'worst'. ``notes``: one line
    per data-dependent op met and how it was sized, in the order first met."""

    def __init__(self, routing="balanced"):
        super().__init__()
        self.routing = routing
        self.shadows = WeakTensorKeyDictionary()  # fake tensor -> (real tensor, sources)
        self._given = set()  # id() of every fake ever given a shadow: `of`'s quick "no" for
        # the rest (an id reused by a later tensor only sends it to the dictionary)
        self._by_storage = {}  # storage -> weak refs to the shadowed tensors that view it
        self.notes = {}  # (op, where, how) -> calls
        self.assumed = {}  # a routing assumed, which sized an op since -> what it assumed
        self._routings = {}  # every routing assumed, used or not

    # ------------------------------------------------------------------ shadows
    def give(self, fake, real, sources=frozenset({DATA})):
        """``fake`` has ``real``'s values (the batch: `DATA`)."""
        if _is_fake(fake) and isinstance(real, torch.Tensor) and real.numel() <= LIMIT:
            self.shadows[fake] = (real, frozenset(sources))
            self._given.add(id(fake))
            if len(self._by_storage) > 4096:  # what has died since
                self._by_storage = {k: [r for r in refs if r() is not None]
                                    for k, refs in self._by_storage.items()}
                self._by_storage = {k: refs for k, refs in self._by_storage.items() if refs}
            self._by_storage.setdefault(fake.untyped_storage()._cdata, []).append(
                weakref.ref(fake))

    def fake(self, mode, real):
        """``real`` as a fake tensor of ``mode`` that keeps its values (a batch's tensor)."""
        out = mode.from_tensor(real)
        self.give(out, real)
        return out

    def of(self, t):
        """(real values, sources) of ``t``, or None. A real (non-fake) tensor is its own."""
        if not isinstance(t, torch.Tensor):
            return None
        if not _is_fake(t):
            return t, frozenset()
        return self.shadows.get(t) if id(t) in self._given else None

    def note(self, func, known):
        """``func`` (here in the model's code) was sized by the shadows ``known`` (or at its
        upper bound when None)."""
        every = frozenset().union(*(k[1] for k in known)) if known else frozenset({DATA})
        if not every:
            return  # constants only (an optimizer's step count): nothing data-dependent
        sources = sorted(every - {DATA})
        for source in sources:  # a routing assumed is said once it sized something
            self.assumed.setdefault(source, self._routings[source])
        verb = "its value from " if torch.Tag.data_dependent_output in func.tags else "sized by "
        how = UPPER if known is None else (verb + "; ".join(sources) if sources else DATA)
        key = (str(func.overloadpacket.__name__), _where(), how)
        self.notes[key] = self.notes.get(key, 0) + 1

    def lines(self):
        """Each routing assumed, then each data-dependent op and what sized it, one line each."""
        return [*self.assumed.values(), *(
            f"aten.{op} at {where}: {how}" + (f" ({n} calls)" if n > 1 else "")
            for (op, where, how), n in self.notes.items())]

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # FSDP's DTensors: their local ops come back here
        packet = func.overloadpacket
        tensors = tensors_in((args, kwargs))
        if tensors and not any(_is_fake(t) for t in tensors):
            return func(*args, **kwargs)  # real tensors (constants): nothing to answer
        if packet in _SPECIAL:
            if packet in _SIZED_BY or (packet is aten.index and _bool_index(args)):
                return self._sized(func, args, kwargs)
            if packet in (aten.topk, aten.argmax) and self.of(args[0]) is None:
                return self._routed(func, args, kwargs)
            if packet is aten._grouped_mm:
                return _grouped_mm(func, args, kwargs)
        return self._dispatch_plain(func, args, kwargs, tensors)

    def _dispatch_plain(self, func, args, kwargs, leaves=None):
        """Any other op: run on the fake tensors; its outputs get shadows when every input has
        one (a factory of constants too); an in-place op keeps or loses its target's."""
        if leaves is None:
            leaves = tensors_in((args, kwargs))
        known = [self.of(t) for t in leaves]
        if torch.Tag.data_dependent_output in func.tags and all(known):
            real = self._real(func, args, kwargs)
            self.note(func, known)
            return real
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            # what it writes is among its tensors: none viewing a shadowed storage, none to forget
            if all(known) or any(t.untyped_storage()._cdata in self._by_storage for t in leaves):
                self._mutated(func, args, kwargs, known)
        elif all(known) and (leaves or func.overloadpacket in _FACTORIES) and \
                torch.Tag.nondeterministic_seeded not in func.tags:
            self._shadow_out(out, self._real(func, args, kwargs),
                             frozenset().union(*(k[1] for k in known)))
        return out

    def _real(self, func, args, kwargs):
        """``func`` run for real on the shadows, no mode seeing it."""
        real = tree_map(lambda t: self.of(t)[0] if isinstance(t, torch.Tensor) else t,
                        (args, kwargs))
        with _disable_current_modes():
            return func(*real[0], **real[1])

    def _shadow_out(self, out, real, sources):
        fakes, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor) and \
                    tuple(f.shape) == tuple(r.shape):
                self.give(f, r, sources)

    def _mutated(self, func, args, kwargs, known):
        """An in-place op: the shadow follows it when every input has one, else its storage
        is no longer known."""
        written = [a for a, arg in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and arg.alias_info is not None
                   and arg.alias_info.is_write]
        if all(known) and torch.Tag.nondeterministic_seeded not in func.tags:
            self._real(func, args, kwargs)  # the shadows are written in place too
            return
        for t in written:  # every live view of what was written forgets its values
            key = t.untyped_storage()._cdata
            for ref in self._by_storage.pop(key, ()):
                f = ref()
                if f is not None and f.untyped_storage()._cdata == key:
                    self.shadows.pop(f, None)

    def _sized(self, func, args, kwargs):
        """An op whose output's size depends on values: from the shadows, else its upper
        bound."""
        packet = func.overloadpacket
        if packet is aten.index:
            return self._bool_indexed(func, args, kwargs)
        positions, _ = _SIZED_BY[packet]
        known = [self.of(args[i]) for i in positions]
        if not all(known):
            self.note(func, None)
            return _upper(func, args, kwargs)
        real = self._real_with(func, args, kwargs)
        self.note(func, known)
        out = tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype, device=args[0].device)
                       if isinstance(r, torch.Tensor) else r, real)
        if all(self.of(a) for a in args if isinstance(a, torch.Tensor)):
            self._shadow_out(out, real, frozenset().union(*(k[1] for k in known)))
        return out

    def _real_with(self, func, args, kwargs):
        """``func`` run for real on the shadows, zeros where a tensor has none (the op's
        `_SIZED_BY` positions have one: the values elsewhere do not size the output)."""
        def real(a):
            if not isinstance(a, torch.Tensor):
                return a
            hit = self.of(a)
            if hit is not None:
                return hit[0]
            return torch.zeros(a.shape, dtype=a.dtype)
        with _disable_current_modes():
            return func(*[real(a) for a in args], **kwargs)

    def _bool_indexed(self, func, args, kwargs):
        """``x[mask]``: each boolean index made the long indices it stands for (its nonzero,
        from its shadow or at its upper bound), then indexed as usual."""
        self_, indices = args[0], list(args[1])
        out = []
        for idx in indices:
            if idx is None or idx.dtype not in (torch.bool, torch.uint8):
                out.append(idx)
                continue
            cols = self._sized(aten.nonzero.default, (idx,), {})  # shadow or upper bound
            known = self.of(cols)
            parts = list(cols.unbind(1)) if idx.dim() > 1 else [cols.view(-1)]
            if known is not None:  # the long indices keep the values they came from
                with _disable_current_modes():
                    reals = list(known[0].unbind(1)) if idx.dim() > 1 else [known[0].view(-1)]
                for f, r in zip(parts, reals):
                    self.give(f, r, known[1])
            out += parts
        return self._dispatch_plain(aten.index.Tensor, (self_, out), {})

    def _routed(self, func, args, kwargs):
        """topk / argmax of values no shadow holds: the indices by the routing assumption."""
        out = func(*args, **kwargs)
        indices = out[1] if func.overloadpacket is aten.topk else out
        x = args[0]
        if func.overloadpacket is aten.topk:
            k = args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        else:
            k, dim = 1, args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                return out
        dim = dim % x.dim()
        choices, rows = x.shape[dim], indices.numel() // max(k, 1)
        if rows * k > LIMIT or choices == 0:
            return out
        with _disable_current_modes():
            real = _assumed(self.routing, rows, k, choices)
            filled = int((real == 0).sum())
            # rows x k, laid out as the indices are (the chosen dim last, then moved back)
            shape = [n for i, n in enumerate(indices.shape) if i != dim] + \
                ([indices.shape[dim]] if indices.dim() == x.dim() else [])
            real = real.reshape(shape)
            if indices.dim() == x.dim():
                real = real.movedim(-1, dim)
            real = real.reshape(indices.shape).contiguous()
        where = _where()
        source = f"the routing assumed at {where}"
        if source not in self._routings:
            self._routings[source] = f"{self.routing} routing assumed at {where}: " + (
                f"top-{k} of {choices} spread evenly, each choice (expert) picked by "
                f"{rows * k / choices:g} of the {rows} rows (tokens)"
                if self.routing == "balanced" else
                f"top-{k} of {choices} with one choice (expert) filled: choice 0 picked by "
                f"{filled} of the {rows} rows (tokens), every other choice by at "
                f"least one")
        self.give(indices, real, {source})
        return out


def _assumed(routing, rows, k, choices):
    """rows x k indices into ``choices``: 'balanced' (round-robin) or 'worst' (choice 0 in
    every row it can be, the rest round-robin over the others, each of them picked)."""
    r = torch.arange(rows).unsqueeze(1)
    j = torch.arange(k).unsqueeze(0)
    if routing == "balanced" or choices == 1:
        return (r * k + j) % choices
    if k == 1:  # the others one row each, choice 0 the rest
        return torch.where(r < choices - 1, r + 1, 0)
    rest = 1 + (r * (k - 1) + j[:, :-1]) % (choices - 1)
    return torch.cat([torch.zeros(rows, 1, dtype=torch.long), rest], dim=1)


_SPECIAL = {*_SIZED_BY, aten.index, aten.topk, aten.argmax, aten._grouped_mm}


def tensors_in(values):
    """The tensors in an op's ``(args, kwargs)`` or output, in ``tree_leaves``'s order (tuples,
    lists and dicts opened; aten's arguments hold no other container of tensors), without
    pytree's cost on every op of a simulated step."""
    if isinstance(values, torch.Tensor):
        return [values]
    out = []
    if isinstance(values, (tuple, list, dict)):
        _collect(values, out)
    return out


def _collect(values, out):
    for v in values.values() if isinstance(values, dict) else values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list, dict)):
            _collect(v, out)


_FAKE = []


def _is_fake(t):
    if not _FAKE:  # imported on first use: a FakeTensor exists only once torch made it
        from torch._subclasses.fake_tensor import FakeTensor
        _FAKE.append(FakeTensor)
    return isinstance(t, _FAKE[0])


def _bool_index(args):
    return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                 for i in args[1])


def _upper(func, args, kwargs):
    """The op's output at the largest size it can have: every element counted."""
    packet, x = func.overloadpacket, args[0]
    if packet is aten.nonzero:
        n = x.numel()
        return torch.empty_strided((n, x.dim()), (1, n), dtype=torch.int64, device=x.device)
    if packet is aten.masked_select:
        n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
        return torch.empty((n,), dtype=x.dtype, device=x.device)
    # unique: (values, inverse, counts), as torch's fake implementation lays them out
    dim = None
    if packet is aten.unique_dim:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
    flags = dict(zip(("sorted", "return_inverse", "return_counts"), args[1:]))
    if packet in (aten.unique_consecutive, aten.unique_dim):
        flags = dict(zip(("return_inverse", "return_counts"),
                         args[1 if packet is aten.unique_consecutive else 3:]))
        flags.update(kwargs)
    else:
        flags.update(kwargs)
    n = x.numel() if dim is None else x.shape[dim]
    values = x.new_empty((n,)) if dim is None else \
        x.new_empty((*x.shape[:dim], n, *x.shape[dim + 1:]))
    if packet is aten._unique:
        return values, (x.new_empty(x.shape, dtype=torch.int64) if flags.get("return_inverse")
                        else x.new_empty(0, dtype=torch.int64))
    inverse = x.new_empty(x.shape if dim is None else (x.shape[dim],), dtype=torch.int64) \
        if flags.get("return_inverse") else x.new_empty(0, dtype=torch.int64)
    counts = x.new_empty((n,), dtype=torch.int64) if flags.get("return_counts") else \
        x.new_empty(0, dtype=torch.int64)
    return values, inverse, counts


def _grouped_mm(func, args, kwargs):
    """transformers' MoE experts call ``torch._grouped_mm``, which runs on CPU in fp32 too;
    torch's meta function (the CUDA kernel's checks) takes bf16 only: the output is made as
    that function makes it, whatever the float dtype."""
    a, b = args[0], args[1]
    if a.dtype == b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    names = ("offs", "bias", "out_dtype")
    rest = {**dict(zip(names, args[2:])), **kwargs}
    return _create_grouped_mm_output_tensor(a, b, rest.get("offs"), rest.get("out_dtype") or a.dtype)
