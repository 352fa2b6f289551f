"""Activation checkpointing over a model's repeated blocks: the setting, and how it is installed.

`CheckpointSetting` is the one value type for "which blocks are checkpointed". The config, the
widgets, the ranks, the records and the estimate all use it; it validates, describes, prints
and parses itself. A setting lays the blocks out in *segments*: runs of consecutive blocks, each
either checkpointed (only its input is kept; its inside is recomputed in backward) or plain.

* ``None``: one plain segment.
* ``s`` (int): as ``torch.utils.checkpoint.checkpoint_sequential(segments=s)`` counts them:
  s segments of ``n // s`` blocks, the last one taking the rest, and **the last segment is never
  checkpointed** (its activations are needed at once by backward). So ``s=1`` checkpoints nothing
  and ``s=n`` checkpoints every block but the last.
* ``"full"``: every block is its own checkpointed segment (the last one too).
* a list of booleans (selective): block i is checkpointed on its own where the list says True.

`CheckpointPolicy(setting, n_blocks).apply(model)` installs a setting on any model whose blocks
`ddpkit.engine.blocks.find_blocks` finds, by giving the chosen modules an instance ``forward`` (as
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` does, but without wrapping the
module): parameters and state_dict keys are untouched, and a new policy can replace the old one
between steps (the lab does this mid-run).

Where the blocks live in an ``nn.Sequential`` that the model calls as a whole (the built-in
models; ``self.blocks(h)``), a checkpointed segment of several blocks is one region, exactly as
``checkpoint_sequential`` runs it. Where the model calls each block itself (an ``nn.ModuleList``
in a loop: Hugging Face ``transformer.h``, ``model.layers``), ddpkit cannot take the loop over,
so each block of a checkpointed segment is a region of its own: the same blocks are recomputed,
and each keeps its own input (`describe` says which of the two ran).
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint


@dataclass(frozen=True)
class CheckpointSetting:
    """A checkpoint setting checked against a block count. ``value`` is what people write:
    None, an int (segments), 'full', or a tuple of booleans (one per block)."""
    value: object
    n_blocks: int

    def __post_init__(self):
        v, n = self.value, self.n_blocks
        if isinstance(v, list):
            object.__setattr__(self, "value", v := tuple(v))
        if v is None or v == "full":
            return
        if isinstance(v, bool):
            raise ValueError(f"TrainConfig.checkpoint={v!r}: ambiguous; pass 'full', None, "
                             f"a segment count, or a list of {n} booleans")
        if isinstance(v, int):
            if not 1 <= v <= n:
                raise ValueError(f"TrainConfig.checkpoint={v}: segments must be between 1 and "
                                 f"n_blocks={n}; pass checkpoint<={n}, 'full', or None")
            return
        if isinstance(v, tuple):
            if len(v) != n or not all(isinstance(b, bool) for b in v):
                raise ValueError(f"TrainConfig.checkpoint: a selective list needs exactly "
                                 f"n_blocks={n} booleans (one per block), got {list(v)!r}")
            return
        raise ValueError(f"TrainConfig.checkpoint={v!r}: pass None, an int (segments), 'full', "
                         f"or a list of {n} booleans")

    @classmethod
    def of(cls, value, n_blocks):
        if isinstance(value, cls):
            return value if value.n_blocks == n_blocks else cls(value.value, n_blocks)
        return cls(value, n_blocks)

    @classmethod
    def parse(cls, text, n_blocks):
        """Back from ``str(setting)``: 'None', 'full', '4', '[True, False]'."""
        return cls(text if text == "full" else ast.literal_eval(text), n_blocks)

    @classmethod
    def from_mask(cls, mask):
        """A selective setting from one boolean per block (all False is None)."""
        mask = tuple(bool(b) for b in mask)
        return cls(mask if any(mask) else None, len(mask))

    @property
    def plain(self):
        """The value as config and records hold it (a list, not a tuple, for a selective one)."""
        return list(self.value) if isinstance(self.value, tuple) else self.value

    @property
    def segments(self):
        """[(start, stop, checkpointed), ...] covering range(n_blocks)."""
        v, n = self.value, self.n_blocks
        if v is None:
            return [(0, n, False)]
        if v == "full":
            return [(i, i + 1, True) for i in range(n)]
        if isinstance(v, int):
            size = n // v
            segs = [(i * size, (i + 1) * size, True) for i in range(v - 1)]
            return segs + [((v - 1) * size, n, False)]
        return [(i, i + 1, on) for i, on in enumerate(v)]

    @property
    def mask(self):
        """One boolean per block: is it inside a checkpointed segment?"""
        out = [False] * self.n_blocks
        for start, stop, on in self.segments:
            out[start:stop] = [on] * (stop - start)
        return out

    @property
    def n_checkpointed(self):
        return sum(self.mask)

    def describe(self):
        v, n = self.value, self.n_blocks
        if v is None:
            return "no checkpointing"
        if v == "full":
            return f"every block checkpointed ({n})"
        if isinstance(v, int):
            return (f"{v} segments: {self.n_checkpointed} of {n} blocks checkpointed (the last "
                    f"segment never is)")
        return f"selective: blocks {[i for i, b in enumerate(v) if b]} checkpointed"

    def __str__(self):
        return str(self.plain)


# --- kept for callers that think in plain values
def segments_for(setting, n_blocks):
    return CheckpointSetting.of(setting, n_blocks).segments


def checkpointed_blocks(setting, n_blocks):
    return CheckpointSetting.of(setting, n_blocks).mask


def parse_setting(text):
    """A record's ``checkpoint`` string back to the plain value."""
    return text if text == "full" else ast.literal_eval(text)


def _region_name(start, stop):
    return f"block {start}" if stop == start + 1 else f"blocks {start}-{stop - 1}"


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class CheckpointPolicy:
    """A setting plus how to checkpoint (``use_reentrant``, always passed to torch explicitly,
    and ``preserve_rng_state``), installed on a model's blocks by `apply`."""

    def __init__(self, setting, n_blocks=None, use_reentrant=False, preserve_rng_state=True):
        if n_blocks is None and not isinstance(setting, CheckpointSetting):
            raise TypeError("CheckpointPolicy(setting, n_blocks): pass the block count")
        self.setting = CheckpointSetting.of(setting, n_blocks)
        self.n_blocks = self.setting.n_blocks
        self.use_reentrant, self.preserve_rng_state = use_reentrant, preserve_rng_state
        self.on_segment_input = None  # probe hook: called with each checkpointed region's input
        self.whole_segments = False   # set by apply: did a container take the segments over?
        self._in_region = False       # a container region is running its blocks' own forwards
        self.on_region = None  # timeline probe: (fn, name) -> fn, timing each region's runs

    @classmethod
    def from_config(cls, cfg, setting="config"):
        """The config's policy, or another ``setting`` with the config's way of checkpointing."""
        return cls(cfg.checkpoint if setting == "config" else setting, cfg.n_blocks,
                   cfg.use_reentrant, cfg.preserve_rng_state)

    @property
    def segments(self):
        return self.setting.segments

    @property
    def n_checkpointed(self):
        return self.setting.n_checkpointed

    # --- running regions
    def _report(self, tensors):
        if self.on_segment_input is not None:
            for t in tensors:  # kept alive for the recompute: count them
                self.on_segment_input(t)

    def _region(self, fn, args, kwargs, name="region"):
        self._report(_tensors(args, kwargs))
        if self.on_region is not None:  # the timeline: a run inside backward is the recompute
            fn = self.on_region(fn, name)
        if self.use_reentrant and kwargs:  # the reentrant variant takes positional inputs only
            fn, kwargs = functools.partial(fn, **kwargs), {}
        return _checkpoint(fn, *args, use_reentrant=self.use_reentrant,  # always explicit
                           preserve_rng_state=self.preserve_rng_state, **kwargs)

    def _block_forward(self, inner, name="block"):
        def forward(*args, **kwargs):
            if self._in_region:  # the container's region runs it: no region of its own
                return inner(*args, **kwargs)
            return self._region(inner, args, kwargs, name)
        return forward

    def _sequence_forward(self, seq):
        def run(start, stop, h):
            self._in_region = True
            try:
                for i in range(start, stop):
                    h = seq[i](h)
            finally:
                self._in_region = False
            return h

        def forward(h):
            for start, stop, on in self.segments:
                if on:
                    h = self._region(functools.partial(run, start, stop), (h,), {},
                                     _region_name(start, stop))
                else:
                    for i in range(start, stop):
                        h = seq[i](h)
            return h
        return forward

    # --- installing
    def apply(self, model, blocks=None):
        """Install on ``model`` (the plain module, not a DDP wrapper). ``blocks``: the block
        container, or a dotted path to it; found with `find_blocks` when not given."""
        from .blocks import find_blocks, resolve_blocks

        container = resolve_blocks(model, blocks) if blocks is not None else find_blocks(model)[1]
        if len(container) != self.n_blocks:
            raise ValueError(f"policy for {self.n_blocks} blocks applied to a model with "
                             f"{len(container)}")
        remove(model, container)
        mask = self.setting.mask
        for i, (block, on) in enumerate(zip(container, mask)):
            if on:
                block.forward = self._block_forward(type(block).forward.__get__(block),
                                                    _region_name(i, i + 1))
        self.whole_segments = isinstance(container, nn.Sequential) and any(mask)
        if self.whole_segments:
            # used only if the model calls the Sequential as a whole; a model that loops over
            # it calls the blocks, whose own forwards checkpoint them one by one
            container.forward = self._sequence_forward(container)
        model.__dict__["checkpoint_policy"] = self
        model.__dict__["_ddpkit_blocks"] = container
        return model

    def describe(self):
        return self.setting.describe()

    def __repr__(self):
        return (f"CheckpointPolicy({self.setting.plain!r}, n_blocks={self.n_blocks}, "
                f"use_reentrant={self.use_reentrant})")


def remove(model, container=None):
    """Take any installed policy off ``model``: every module runs its class's forward again."""
    container = container if container is not None else model.__dict__.get("_ddpkit_blocks")
    if container is None:
        return model
    container.__dict__.pop("forward", None)
    for block in container:
        block.__dict__.pop("forward", None)
    model.__dict__.pop("checkpoint_policy", None)
    model.__dict__.pop("_ddpkit_blocks", None)
    return model
