"""Activation checkpointing over a model's repeated blocks: the setting, and how it is installed.

`CheckpointSetting` is the one value type for "which blocks are checkpointed", the torchtitan
way: ``setting.build(use_reentrant=...).apply(model, blocks)``. It validates itself against a
block count, lays the blocks out in *segments* (runs of consecutive blocks, each either
checkpointed or plain), has one text form (``str(setting)``: what the CLI takes and `parse`
reads back) and one label a person reads (`label`). Config and records hold its plain value.

Blocks are counted over all the model's stacks in order (`blocks.find_stacks`: T5's 4 encoder
blocks, then its 4 decoder blocks, are blocks 0-7), and no segment crosses a stack:

* ``None``: one plain segment per stack.
* ``s`` (int): as ``torch.utils.checkpoint.checkpoint_sequential(segments=s)`` counts them, in
  each stack: s segments of ``n // s`` blocks, the last one taking the rest, and **the last
  segment is never checkpointed** (its activations are needed at once by backward). So ``s=1``
  checkpoints nothing and ``s=n`` checkpoints every block but the last of each stack.
* ``"full"``: every block is its own checkpointed segment (the last one too).
* a list of booleans (selective): block i is checkpointed on its own where the list says True.

A checkpointed segment is **one region**, whatever the model's loop: only its input is kept, and
backward recomputes the whole segment at once (so its recompute peak grows with its length, as
``checkpoint_sequential``'s does). `CheckpointPolicy.apply` installs it without wrapping anything
(parameters and state_dict keys untouched; a new policy can replace the old one between steps,
as the Lab does mid-run), in one of three ways:

* the blocks live in an ``nn.Sequential`` the model calls as a whole (the built-in models): the
  container runs each segment under torch's ``checkpoint``, as ``checkpoint_sequential`` does;
* the model loops over the blocks itself (Hugging Face ``transformer.h``, ``model.layers``):
  forward hooks open torch's non-reentrant checkpoint at a segment's first block and close it at
  its last (`regions.LoopRegions`), the way ``torch.distributed._composable.checkpoint`` does
  for one module; the recompute replays the segment's blocks from its input;
* ``use_reentrant=True`` on such a loop: reentrant checkpointing is a function call around the
  region, which a loop ddpkit does not own cannot make, so each block of a segment is its own
  region; the policy says so (a warning, and `describe`).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from .regions import LoopRegions


@dataclass(frozen=True)
class CheckpointSetting:
    """A checkpoint setting checked against a block count. ``value`` is what people write:
    None, an int (segments), 'full', or a tuple of booleans (one per block). ``stacks``: the
    blocks of each stack, in order, where the model has several (T5's encoder and decoder:
    ``(4, 4)``); ``()`` is one stack of ``n_blocks``. Segments never cross a stack: an int
    setting makes its segments in each stack, as ``checkpoint_sequential`` would run each."""
    value: object
    n_blocks: int
    stacks: tuple = ()

    def __post_init__(self):
        v, n = self.value, self.n_blocks
        if isinstance(v, list):
            object.__setattr__(self, "value", v := tuple(v))
        stacks = tuple(self.stacks or ())
        if sum(stacks) not in (0, n) or any(not isinstance(k, int) or k < 1 for k in stacks):
            raise ValueError(f"CheckpointSetting: stacks={stacks} must be positive block counts "
                             f"adding up to n_blocks={n}")
        object.__setattr__(self, "stacks", stacks if len(stacks) > 1 else ())
        if v is None or v == "full":
            return
        if isinstance(v, bool):
            raise ValueError(f"TrainConfig.checkpoint={v!r}: ambiguous; pass 'full', None, "
                             f"a segment count, or a list of {n} booleans")
        if isinstance(v, int):
            self._check_segments(v)
            return
        if isinstance(v, tuple):
            if len(v) != n or not all(isinstance(b, bool) for b in v):
                raise ValueError(f"TrainConfig.checkpoint: a selective list needs exactly "
                                 f"n_blocks={n} booleans (one per block), got {list(v)!r}")
            return
        raise ValueError(f"TrainConfig.checkpoint={v!r}: pass None, an int (segments), 'full', "
                         f"or a list of {n} booleans")

    def _check_segments(self, v):
        n = self.n_blocks
        if not self.stacks:
            if not 1 <= v <= n:
                raise ValueError(f"TrainConfig.checkpoint={v}: segments must be between 1 and "
                                 f"n_blocks={n}; pass checkpoint<={n}, 'full', or None")
            return
        shortest = min(self.stacks)
        if not 1 <= v <= shortest:
            raise ValueError(f"TrainConfig.checkpoint={v}: segments are made in each of the "
                             f"model's {len(self.stacks)} stacks (as checkpoint_sequential runs "
                             f"each), and the shortest has {shortest} blocks; pass "
                             f"checkpoint<={shortest}, 'full', None, or a list of {n} booleans")

    @classmethod
    def of(cls, value, n_blocks, stacks=()):
        """A setting from its plain value (or a setting, re-checked for ``n_blocks`` and
        ``stacks``)."""
        if isinstance(value, cls):
            same = value.n_blocks == n_blocks and value.stacks == cls(None, n_blocks, stacks).stacks
            return value if same else cls(value.value, n_blocks, stacks)
        return cls(value, n_blocks, stacks)

    @classmethod
    def from_mask(cls, mask, stacks=()):
        """A selective setting from one boolean per block (all False is None)."""
        mask = tuple(bool(b) for b in mask)
        return cls(mask if any(mask) else None, len(mask), stacks)

    @property
    def spans(self):
        """[(start, stop), ...]: each stack's blocks, counted over all stacks in order."""
        out, start = [], 0
        for k in self.stacks or (self.n_blocks,):
            out.append((start, start + k))
            start += k
        return out

    @staticmethod
    def parse(text):
        """The plain value of the setting's text form (``str(setting)``, what the CLI takes):
        ``none`` | ``S`` (segments) | ``full`` | ``1,0,1,0,`` (one 0/1 per block; a list always
        has a comma, so ``1,`` is one block and ``1`` one segment)."""
        text = text.strip()
        if text.lower() in ("none", "off"):
            return None
        if text.lower() == "full":
            return "full"
        if "," in text:
            return [t.strip().lower() in ("1", "true") for t in text.split(",") if t.strip()]
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"TrainConfig.checkpoint={text!r}: write none, a segment count, "
                             f"full, or one 0/1 per block with commas (1,0,1,0,)") from None

    @property
    def plain(self):
        """The value as config and records hold it (a list, not a tuple, for a selective one)."""
        return list(self.value) if isinstance(self.value, tuple) else self.value

    @property
    def segments(self):
        """[(start, stop, checkpointed), ...] covering range(n_blocks), none crossing a stack."""
        v = self.value
        if v == "full":
            return [(i, i + 1, True) for i in range(self.n_blocks)]
        if isinstance(v, tuple):
            return [(i, i + 1, on) for i, on in enumerate(v)]
        out = []
        for a, b in self.spans:
            if v is None:
                out.append((a, b, False))
                continue
            size = (b - a) // v  # as checkpoint_sequential lays out one stack
            out += [(a + i * size, a + (i + 1) * size, True) for i in range(v - 1)]
            out.append((a + (v - 1) * size, b, False))
        return out

    @property
    def regions(self):
        """[(start, stop), ...]: the checkpointed segments, each recomputed as one region."""
        return [(a, b) for a, b, on in self.segments if on]

    @property
    def mask(self):
        """One boolean per block: is it inside a checkpointed segment?"""
        out = [False] * self.n_blocks
        for start, stop in self.regions:
            out[start:stop] = [True] * (stop - start)
        return out

    def label(self):
        """What a person reads, short at any block count: 'no checkpointing', '2 segments',
        'blocks 0, 2', 'blocks 0-9, 11', 'blocks 0-78, every 2nd', 'every block'."""
        v, mask = self.value, self.mask
        if not any(mask):
            return "no checkpointing"
        if v == "full" or (isinstance(v, tuple) and all(v)):
            return "every block"
        if isinstance(v, int):
            return f"{v} segments" + (" per stack" if self.stacks else "")
        on = [i for i, b in enumerate(mask) if b]
        return ("block " if len(on) == 1 else "blocks ") + _indices_text(on, self.n_blocks)

    def __str__(self):
        """The one text form: 'none', '2', 'full', '1,0,1,0,' (`parse` reads it back)."""
        v = self.value
        if v is None:
            return "none"
        if isinstance(v, tuple):
            return ",".join("1" if b else "0" for b in v) + ","
        return str(v)

    def build(self, use_reentrant=False, preserve_rng_state=True):
        """The `CheckpointPolicy` that runs this setting (``use_reentrant`` is always passed
        to torch explicitly)."""
        return CheckpointPolicy(self, use_reentrant, preserve_rng_state)


def _indices_text(on, n, most=6):
    """Block indices as a person reads them: '0, 2'; runs of three or more as '0-9'; a regular
    stride as '0-78, every 2nd'; past ``most`` parts, the first and the last with the count."""
    step = on[1] - on[0] if len(on) > 1 else 0
    if len(on) >= 4 and step > 1 and all(b - a == step for a, b in zip(on, on[1:])):
        nth = {2: "2nd", 3: "3rd"}.get(step, f"{step}th")
        return f"{on[0]}-{on[-1]}, every {nth}"
    runs = []
    for i in on:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [p for a, b in runs for p in ([f"{a}-{b}"] if b - a >= 2 else map(str, range(a, b + 1)))]
    if len(parts) > most:
        return ", ".join(parts[:most - 2] + ["…", parts[-1]]) + f" ({len(on)} of {n})"
    return ", ".join(parts)


def _blocks_text(a, b):
    return f"block {a}" if b - a == 1 else f"blocks {a}-{b - 1}"


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class CheckpointPolicy:
    """A setting plus how to checkpoint (``use_reentrant``, ``preserve_rng_state``), installed
    on a model's blocks by `apply`. Build it with `CheckpointSetting.build`."""

    def __init__(self, setting, use_reentrant=False, preserve_rng_state=True):
        if not isinstance(setting, CheckpointSetting):
            raise TypeError(f"CheckpointPolicy takes a CheckpointSetting, got "
                            f"{type(setting).__name__}; build one with "
                            f"CheckpointSetting.of(value, n_blocks).build(use_reentrant=...)")
        self.setting = setting
        self.n_blocks = setting.n_blocks
        self.use_reentrant, self.preserve_rng_state = use_reentrant, preserve_rng_state
        self.on_segment_input = None  # probe hook: called with each tensor a region keeps
        self.on_region = None  # the timeline's: (fn, name) -> fn, timing each run of a region
        self.ran = set()              # how regions ran: 'sequential', 'loop', 'per-block'
        self.notes = []               # fallbacks, said once each (describe, and a warning)
        self._in_region = False       # a container region is running its blocks' own forwards
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
            if self._in_region:  # the container's region runs it: no region of its own
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
            self._in_region = True
            try:
                for i in range(start, stop):
                    h = seq[i](h)
            finally:
                self._in_region = False
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
        from .blocks import find_stacks, stack_sizes

        stacks = [(None, blocks)] if isinstance(blocks, nn.Module) else find_stacks(model, blocks)
        flat = [b for _, container in stacks for b in container]
        if len(flat) != self.n_blocks:
            raise ValueError(f"policy for {self.n_blocks} blocks applied to a model with "
                             f"{len(flat)}")
        sizes = stack_sizes(stacks)
        if isinstance(self.setting.value, int) and self.setting.spans != \
                CheckpointSetting(None, len(flat), sizes).spans:
            raise ValueError(f"policy of {self.setting.value} segments per stack made for stacks "
                             f"of {[b - a for a, b in self.setting.spans]} blocks, applied to "
                             f"stacks of {list(sizes)}; make the setting with "
                             f"CheckpointSetting.of(value, n_blocks, stacks={sizes})")
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
        model.__dict__["checkpoint_policy"] = self
        model.__dict__["_ddpkit_blocks"] = containers
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
        return (f"CheckpointPolicy({self.setting.plain!r}, n_blocks={self.n_blocks}, "
                f"use_reentrant={self.use_reentrant})")


def remove(model, containers=None):
    """Take any installed policy off ``model``: every module runs its class's forward again.
    ``containers``: the stacks it was installed on (those recorded at install when not given)."""
    if containers is None:
        containers = model.__dict__.get("_ddpkit_blocks")
    policy = model.__dict__.pop("checkpoint_policy", None)
    if policy is not None:
        policy.uninstall()
    if containers is None:
        return model
    if isinstance(containers, nn.Module):
        containers = [containers]
    for container in containers:
        container.__dict__.pop("forward", None)
        for block in container:
            block.__dict__.pop("forward", None)
    model.__dict__.pop("_ddpkit_blocks", None)
    return model
