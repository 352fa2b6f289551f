"""Activation checkpointing installed on a model's blocks: `CheckpointPolicy`, a
`spec.setting.CheckpointSetting` plus how to checkpoint (``use_reentrant``,
``preserve_rng_state``), the torchtitan way: ``CheckpointPolicy(setting, use_reentrant=False)
.apply(model, blocks)``, or `install` with a `RankPlan`'s setting and way.

A checkpointed segment is **one region**, whatever the model's loop: only its input is kept, and
backward recomputes the whole segment at once. `CheckpointPolicy.apply` installs it without
wrapping anything (parameters and state_dict keys untouched; a new policy can replace the old
one between steps, as the Lab does mid-run), in one of three ways:

* the blocks live in an ``nn.Sequential`` the model calls as a whole (the built-in models): the
  container runs each segment under torch's ``checkpoint``, as ``checkpoint_sequential`` does;
* the model loops over the blocks itself (Hugging Face ``transformer.h``, ``model.layers``):
  forward hooks open torch's non-reentrant checkpoint at a segment's first block and close it at
  its last (`regions.LoopRegions`), the way ``torch.distributed._composable.checkpoint`` does
  for one module; the recompute replays the segment's blocks from its input;
* ``use_reentrant=True`` on such a loop: reentrant checkpointing is a function call around the
  region, which a loop ddpkit does not own cannot make, so each block of a segment is its own
  region; the policy says so (a warning, and `describe`).

The probes that watch a policy (the activation probe counts what a region keeps, the timeline
times each region's run) are handed it by the loop (`measure.Measure.step`); what a policy
installed is recorded here, by model, so that the next one (or `remove`) takes it off.
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..spec.blocks import find_stacks, stack_sizes
from ..spec.setting import CheckpointSetting
from .regions import LoopRegions

_INSTALLED = weakref.WeakKeyDictionary()  # model -> the policy installed on it (`remove`)


def _blocks_text(a, b):
    return f"block {a}" if b - a == 1 else f"blocks {a}-{b - 1}"


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class CheckpointPolicy:
    """A setting plus how to checkpoint (``use_reentrant``, ``preserve_rng_state``), installed
    on a model's blocks by `apply` (``CheckpointPolicy(setting, use_reentrant=False)``)."""

    def __init__(self, setting, use_reentrant=False, preserve_rng_state=True):
        if not isinstance(setting, CheckpointSetting):
            raise TypeError(f"CheckpointPolicy takes a CheckpointSetting, got "
                            f"{type(setting).__name__}; build one with "
                            f"CheckpointSetting.of(value, stacks) and pass it")
        self.setting = setting
        self.n_blocks = setting.n_blocks
        self.use_reentrant, self.preserve_rng_state = use_reentrant, preserve_rng_state
        self.on_segment_input = None  # probe hook: called with each tensor a region keeps
        self.on_region = None  # the timeline's: (fn, name) -> fn, timing each run of a region
        self.ran = set()              # how regions ran: 'sequential', 'loop', 'per-block'
        self.notes = []               # fallbacks, said once each (describe, and a warning)
        self.in_region = False        # a container region is running its blocks' own forwards
        self.containers = []          # the stacks `apply` installed it on (the timeline's blocks)
        self._loop = None             # the hooks on a loop ddpkit does not own

    @property
    def segments(self):
        return self.setting.segments

    def note(self, text):
        """Say a fallback once: in `describe`, and as a warning."""
        if text not in self.notes:
            self.notes.append(text)
            warnings.warn(f"ddpkit checkpointing: {text}", stacklevel=3)

    # --- running regions
    def report(self, tensors):
        """Tensors a region keeps for its recompute: counted by the activation probe."""
        if self.on_segment_input is not None:
            for t in tensors:
                self.on_segment_input(t)

    def timed(self, fn, name):
        """A region's function as the timeline sees it (a run inside backward: the recompute)."""
        return fn if self.on_region is None else self.on_region(fn, name)

    def _region(self, fn, args, kwargs, name="region"):
        self.report(_tensors(args, kwargs))
        fn = self.timed(fn, name)
        if self.use_reentrant and kwargs:  # the reentrant variant takes positional inputs only
            fn, kwargs = functools.partial(fn, **kwargs), {}
        return _checkpoint(fn, *args, use_reentrant=self.use_reentrant,  # always explicit
                           preserve_rng_state=self.preserve_rng_state, **kwargs)

    def _block_forward(self, inner, grouped, name="block"):
        """A reentrant block's forward: its own region (``grouped``: its segment is longer)."""
        def forward(*args, **kwargs):
            if self.in_region:  # the container's region runs it: no region of its own
                return inner(*args, **kwargs)
            self.ran.add("per-block")
            if grouped:
                self.note("use_reentrant=True cannot make one region of several blocks that the "
                          "model calls in its own loop, so each block of a segment is its own "
                          "region (it keeps its own input); use_reentrant=False groups them")
            return self._region(inner, args, kwargs, name)
        return forward

    def _sequence_forward(self, seq, offset):
        """The forward of a stack kept in an ``nn.Sequential`` the model calls as a whole: its
        segments (``offset``: its first block's index over all stacks), as
        ``checkpoint_sequential`` runs them."""
        segments = [(a - offset, b - offset, on) for a, b, on in self.segments
                    if offset <= a < offset + len(seq)]

        def run(start, stop, h):
            self.in_region = True
            try:
                for i in range(start, stop):
                    h = seq[i](h)
            finally:
                self.in_region = False
            return h

        def forward(h):
            self.ran.add("sequential")
            for start, stop, on in segments:
                if on:
                    h = self._region(functools.partial(run, start, stop), (h,), {},
                                     _blocks_text(start, stop))
                else:
                    for i in range(start, stop):
                        h = seq[i](h)
            return h
        return forward

    # --- installing
    def apply(self, model, blocks=None):
        """Install on ``model`` (the plain module, not a DDP wrapper). ``blocks``: where its
        stacks of blocks are (a dotted path, several, or a container); found with
        `find_stacks` when not given. Blocks are counted over all stacks in order."""
        stacks = [(None, blocks)] if isinstance(blocks, nn.Module) else find_stacks(model, blocks)
        flat = [b for _, container in stacks for b in container]
        if len(flat) != self.n_blocks:
            raise ValueError(f"policy for {self.n_blocks} blocks applied to a model with "
                             f"{len(flat)}")
        sizes = stack_sizes(stacks)
        if isinstance(self.setting.value, int) and self.setting.stacks != sizes:
            raise ValueError(f"policy of {self.setting.value} segments per stack made for stacks "
                             f"of {list(self.setting.stacks)} blocks, applied to stacks of "
                             f"{list(sizes)}; make the setting with "
                             f"CheckpointSetting.of(value, {sizes})")
        containers = [container for _, container in stacks]
        remove(model)  # what an earlier policy installed
        remove(model, containers)
        regions = self.setting.regions
        if self.use_reentrant:
            for a, b in regions:
                for i in range(a, b):
                    block = flat[i]
                    block.forward = self._block_forward(type(block).forward.__get__(block),
                                                        b - a > 1, _blocks_text(i, i + 1))
        elif regions:
            self._loop = LoopRegions(self, flat, regions).install(model)
        offset = 0
        for container in containers:
            if regions and isinstance(container, nn.Sequential):
                # used only if the model calls the Sequential as a whole; a model that loops
                # over it calls the blocks, whose hooks (or forwards) make the regions instead
                container.forward = self._sequence_forward(container, offset)
            offset += len(container)
        self.containers = containers
        _INSTALLED[model] = self
        return model

    def uninstall(self):
        if self._loop is not None:
            self._loop.remove()
            self._loop = None

    def describe(self):
        """The setting, how its regions ran (once a forward has run) and any fallback."""
        regions = self.setting.regions
        text = self.setting.label()
        if regions:
            text += ": " + ", ".join(_blocks_text(a, b) for a, b in regions) + " checkpointed"
            how = {"sequential": "each segment one region, in the blocks' nn.Sequential",
                   "loop": "each segment one region, by hooks on the model's own loop",
                   "per-block": "each block its own region (reentrant, the model's own loop)"}
            if self.ran:
                text += " (" + "; ".join(how[r] for r in sorted(self.ran)) + ")"
        return "; ".join([text, *self.notes])

    def __repr__(self):
        return (f"CheckpointPolicy({self.setting!r}, use_reentrant={self.use_reentrant})")


def remove(model, containers=None):
    """Take any installed policy off ``model``: every module runs its class's forward again.
    ``containers``: the stacks it was installed on (those recorded at install when not given)."""
    policy = _INSTALLED.pop(model, None)
    if policy is not None:
        policy.uninstall()
        containers = policy.containers if containers is None else containers
    if containers is None:
        return model
    if isinstance(containers, nn.Module):
        containers = [containers]
    for container in containers:
        container.__dict__.pop("forward", None)
        for block in container:
            block.__dict__.pop("forward", None)
    return model


def install(plan, model, setting=None):
    """The `CheckpointPolicy` of ``setting`` (``plan.checkpoint`` when not given), made the
    plan's way (``use_reentrant``, ``preserve_rng_state``), applied to ``model``'s stacks
    (``plan.blocks``); returns it, for the probes that watch it."""
    policy = CheckpointPolicy(plan.checkpoint if setting is None else setting,
                              use_reentrant=plan.use_reentrant,
                              preserve_rng_state=plan.preserve_rng_state)
    policy.apply(model, plan.blocks)
    return policy
