"""A step of many micro-steps, simulated with three: the first (it makes the gradients), one
middle one and the last (the sync, the optimizer step).

Every middle micro-step of a step runs the same ops on the same live bytes: the gradients exist
and are summed in place, the sync skipped (``no_sync``) or run alike. So a step of k > `SHORT`
micro-steps is simulated with `SHORT`, and the k - 3 left out are put back where they differ
from nothing: the rank collates all k micro-batches before the first forward
(`engine.step.train_step` lists them) and holds them to the step's end, so the batches of the
micro-steps left out are made and held too (`Batches`), each of the kind the middle one's is;
and in the stream the middle micro-step's entries stand for each one left out
(`repeat_middle`). The peak (bytes, phase, ledger, each phase's) and the stream are the whole
step's: tests/test_step_time.py holds both to the whole simulation for DDP, ZeRO-1, ZeRO-2 and
FSDP, ``no_sync`` on and off, 4 and 8 micro-steps. The planner's micro-batch 1 with
accumulation 8 took 16 micro-steps to simulate (two steps), now 6.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_map

from .datadep import tensors_in
from .optrace import Mark, Op

SHORT = 3
"""Micro-steps a step of more is simulated with."""


class Batches:
    """The micro-batches of one simulated step: ``count`` clones of ``template`` (`SHORT` of a
    shortened step, made when the step lists them, as `RankBatches.micro_batches` collates
    them), and ``held`` more, the batches of the middle micro-steps left out (made beside the
    middle one's, held until `release`)."""

    def __init__(self, template, count, held=0):
        self.template, self.count, self.held = template, count, held
        self.extra, self.pairs = [], []  # the held batches; (middle's key, a held one's key)

    def _one(self):
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.template)

    def __iter__(self):
        for j in range(self.count):
            batch = self._one()
            yield batch
            if j == 1 and self.held:
                mine = [t.untyped_storage()._cdata for t in tensors_in(batch)]
                for _ in range(self.held):
                    self.extra.append(self._one())
                    self.pairs += zip(mine, (t.untyped_storage()._cdata
                                             for t in tensors_in(self.extra[-1])))

    def seen(self, saved_keys, forward_ends):
        """The held batches' observations, as the middle micro-step's batch's: what its forward
        saved is an activation (``saved_keys`` and ``forward_ends``: each forward's)."""
        if not self.pairs:
            return []
        saved = set(saved_keys[1])
        return [("activations", held, forward_ends[1]) for mine, held in self.pairs
                if mine in saved]

    def release(self):
        """The step has returned: its batches die, the held ones with them."""
        self.extra.clear()


EVENTS = ("record", "wait_event", "sync_event")
"""A CUDA rank's marks that name an event (`cudastreams`): ``block`` is its number."""


def repeat_middle(stream, accum_steps, simulated=SHORT):
    """The stream of a step of ``accum_steps`` micro-steps from one simulated with ``simulated``
    (the first, one middle, the last): the middle micro-step's entries again for each middle
    micro-step left out, renumbered (micro-steps; op indices and the waits on them; a CUDA
    rank's events recorded in it and the waits on them), then the last. None where a middle
    micro-step waits on a collective or a CUDA event of the one before it (FSDP's prefetch on a
    CUDA rank: no copy could say which): simulate the whole step instead."""
    if accum_steps <= simulated:
        return stream
    where = [i for i, e in enumerate(stream) if e.micro == 1]
    a, b = where[0], where[-1] + 1
    middle = stream[a:b]
    ops = [e for e in middle if isinstance(e, Op)]
    if not ops or any(e.micro != 1 for e in middle):
        return None
    first, count = ops[0].index, len(ops)
    if any(isinstance(e, Mark) and e.what == "wait" and e.block < first for e in middle):
        return None
    recorded = {e.block for e in middle if isinstance(e, Mark) and e.what == "record"}
    if any(isinstance(e, Mark) and e.what in EVENTS and e.block not in recorded for e in middle):
        return None  # a CUDA stream waits on an event recorded before: simulated whole
    span = 1 + max((e.block for e in stream if isinstance(e, Mark) and e.what in EVENTS),
                   default=0)

    def moved(e, copies, micro):
        if isinstance(e, Op):
            return dataclasses.replace(e, index=e.index + copies * count, micro=micro)
        if e.what == "wait" and e.block >= first:
            return dataclasses.replace(e, block=e.block + copies * count, micro=micro)
        if e.what in EVENTS and e.block in recorded:
            return dataclasses.replace(e, block=e.block + copies * span, micro=micro)
        return dataclasses.replace(e, micro=micro)

    out = stream[:b]
    for m in range(2, accum_steps - 1):
        out += [moved(e, m - 1, m) for e in middle]
    left = accum_steps - simulated
    out += [moved(e, left, e.micro + left) for e in stream[b:]]
    return out
