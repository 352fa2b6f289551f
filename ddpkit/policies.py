"""Activation-checkpoint policies over ``model.blocks``.

A policy turns the config's ``checkpoint`` setting into *segments*: runs of consecutive blocks,
each either checkpointed (only its input is kept; its inside is recomputed in backward) or plain.

* ``None``: one plain segment.
* ``s`` (int): as ``torch.utils.checkpoint.checkpoint_sequential(segments=s)`` counts them:
  s segments of ``n // s`` blocks, the last one taking the rest, and **the last segment is never
  checkpointed** (its activations are needed at once by backward). So ``s=1`` checkpoints nothing
  and ``s=n`` checkpoints every block but the last.
* ``"full"``: every block is its own checkpointed segment (the last one too).
* a list of booleans (selective): block i is checkpointed on its own where the list says True.

``apply(model)`` installs the policy by replacing ``model.run_blocks``; parameters and state_dict
keys are untouched, so a policy can change between steps (the lab does this mid-run).
"""
from __future__ import annotations

import functools

from torch.utils.checkpoint import checkpoint as _checkpoint


def segments_for(setting, n_blocks):
    """[(start, stop, checkpointed), ...] covering range(n_blocks)."""
    if setting is None:
        return [(0, n_blocks, False)]
    if setting == "full":
        return [(i, i + 1, True) for i in range(n_blocks)]
    if isinstance(setting, int) and not isinstance(setting, bool):
        size = n_blocks // setting
        segs = [(i * size, (i + 1) * size, True) for i in range(setting - 1)]
        return segs + [((setting - 1) * size, n_blocks, False)]
    if isinstance(setting, (list, tuple)) and len(setting) == n_blocks:
        return [(i, i + 1, bool(on)) for i, on in enumerate(setting)]
    raise ValueError(f"checkpoint={setting!r} does not fit n_blocks={n_blocks}")


def parse_setting(text):
    """Back from ``str(setting)`` as records carry it: 'None', 'full', '4', '[True, False]'."""
    import ast

    return text if text == "full" else ast.literal_eval(text)


def checkpointed_blocks(setting, n_blocks):
    """One boolean per block: is it inside a checkpointed segment?"""
    mask = [False] * n_blocks
    for start, stop, on in segments_for(setting, n_blocks):
        for i in range(start, stop):
            mask[i] = on
    return mask


def _run(blocks, start, stop, h):
    for i in range(start, stop):
        h = blocks[i](h)
    return h


class CheckpointPolicy:
    """A checkpoint setting bound to a block count, applied to models with ``.blocks``."""

    def __init__(self, setting, n_blocks, use_reentrant=False, preserve_rng_state=True):
        self.setting, self.n_blocks = setting, n_blocks
        self.use_reentrant, self.preserve_rng_state = use_reentrant, preserve_rng_state
        self.segments = segments_for(setting, n_blocks)
        self.on_segment_input = None  # probe hook: called with each checkpointed segment's input

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.checkpoint, cfg.n_blocks, cfg.use_reentrant, cfg.preserve_rng_state)

    @property
    def n_checkpointed(self):
        return sum(checkpointed_blocks(self.setting, self.n_blocks))

    def run_blocks(self, blocks, h):
        for start, stop, on in self.segments:
            if not on:
                h = _run(blocks, start, stop, h)
                continue
            if self.on_segment_input is not None:
                self.on_segment_input(h)  # kept alive for the recompute: count it
            h = _checkpoint(functools.partial(_run, blocks, start, stop), h,
                            use_reentrant=self.use_reentrant,  # always explicit
                            preserve_rng_state=self.preserve_rng_state)
        return h

    def apply(self, model):
        """Install on ``model`` (a plain module, not the DDP wrapper)."""
        if len(model.blocks) != self.n_blocks:
            raise ValueError(f"policy for {self.n_blocks} blocks applied to a model with "
                             f"{len(model.blocks)}")
        model.run_blocks = functools.partial(self.run_blocks, model.blocks)
        model.checkpoint_policy = self
        return model

    def describe(self):
        if self.setting is None:
            return "no checkpointing"
        if self.setting == "full":
            return f"every block checkpointed ({self.n_blocks})"
        if isinstance(self.setting, int):
            return (f"{self.setting} segments: {self.n_checkpointed} of {self.n_blocks} blocks "
                    f"checkpointed (the last segment never is)")
        return f"selective: blocks {[i for i, b in enumerate(self.setting) if b]} checkpointed"

    def __repr__(self):
        return f"CheckpointPolicy({self.setting!r}, n_blocks={self.n_blocks}, " \
               f"use_reentrant={self.use_reentrant})"
