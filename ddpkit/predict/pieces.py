"""A simulated step cut into per-block pieces: the figures `compose` builds a step from.

`Recorder` is handed to `simulate.simulate`: it marks where each block's forward begins and
ends, where its backward begins (the gradient of its output arrives; of its input, for the
first block of each stack), where a checkpointed region's recompute runs each block again, and
in the optimizer step which block each tensor belongs to (a parameter's, its gradient's, its
state's). Each step's storage events, cut at those marks, become `Piece` figures: the bytes of
each kind (`memory.KINDS`) it leaves live (``net``), and its highest moment above its start
(``rise``, and the kinds then), from the same ledger that names the simulated peak's bytes.

A piece is named by what runs in it and where: ``(phase, micro-step, name, block)``: names
``stem`` (before the first block of the first stack), ``F`` (a block's forward), ``G`` (after
it, to the next block or the stack's end: the model's own code between), ``head`` (the backward
up to the last block's), ``B`` (a block's backward, to the next mark), ``R`` (a block run again
by its region's recompute) and ``r`` (the rest of the backward after the recompute), ``H``
(after the first block of a stack: the stem's backward, or the code between stacks), and in the
optimizer step one run per block's parameters (``O``) or the rest (``o``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_leaves

from ..engine.memory import KINDS, PHASES, Peak, phase_of

_K = len(KINDS)
_INDEX = {k: i for i, k in enumerate(KINDS)}


def _first_tensor(values):
    return next((t for t in tree_leaves(values) if isinstance(t, torch.Tensor)), None)


@dataclasses.dataclass
class Piece:
    """One piece of a step: ``net`` (bytes by kind it leaves live), ``rise`` (its highest total
    above its start) and ``at_rise`` (bytes by kind then, above its start), ``events``."""
    phase: str
    net: tuple
    rise: int
    at_rise: tuple
    events: int


def summarize(sizes, kinds, phase):
    """`Piece` of the events ``sizes`` (signed bytes) of ``kinds`` (indexes into KINDS): its
    highest total after any of its events (a piece of frees only rises below zero)."""
    net, total, rise, at = [0] * _K, 0, None, [0] * _K
    for size, kind in zip(sizes, kinds):
        net[kind] += size
        total += size
        if rise is None or total > rise:
            rise, at = total, list(net)
    return Piece(phase, tuple(net), rise or 0, tuple(at), len(sizes))


class Recorder:
    """Marks a simulated step and keeps each step's events cut into pieces (``steps[s]``: a
    list of ``(key, Piece)`` in the order they ran; ``bases[s]``: bytes by kind live when step
    s began; ``owners``: block of each parameter, for the optimizer step)."""

    def __init__(self, stacks, region_of=None):
        self.stacks = stacks  # [(first block, stop)] of each stack, blocks counted over all
        self.region_of = region_of or {}  # block -> (first, last) block of its region
        self.steps, self.bases = [], []
        self.live = None
        self.owner_of = {}  # storage key -> block (parameters, gradients, optimizer state)

    # -------------------------------------------------------------- marks
    def install(self, live, blocks):
        """Hooks on every block (``live``: the simulation's `LiveStorages`); returns them."""
        self.live = live
        firsts = {a for a, _ in self.stacks}
        hooks = []
        for i, b in enumerate(blocks):
            hooks.append(b.register_forward_pre_hook(self._pre(i), with_kwargs=True,
                                                     prepend=True))
            if i in firsts:
                hooks.append(b.register_forward_pre_hook(self._input(i), with_kwargs=True))
            hooks.append(b.register_forward_hook(self._post(i), with_kwargs=True,
                                                 always_call=True))
        live.observer = self
        return hooks

    def _pre(self, i):
        def hook(module, args, kwargs):
            self.live.point(("F" if self.live.phase == "forward" else "R", i))
            if self.live.phase == "forward":  # who is handed what (a tensor for all blocks?)
                at = len(self.live.events)
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        self.given.append((t.untyped_storage()._cdata, at, i))
        return hook

    def _input(self, i):  # after the other pre-hooks: the tensor the block really takes
        def hook(module, args, kwargs):
            t = _first_tensor((args, kwargs))
            if self.live.phase == "forward" and t is not None and t.requires_grad:
                t.register_hook(lambda g: self.live.point(("H", i)))
        return hook

    def _post(self, i):
        def hook(module, args, kwargs, out):
            if self.live.phase != "forward":
                self.live.point(("r", i))
                return
            self.live.point(("G", i))
            t = _first_tensor(out)
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: self.live.point(("B", i)))
        return hook

    def owners(self, model, blocks, optimizer):
        """Which block each parameter (and later its gradient and state) belongs to."""
        of = {}
        for i, b in enumerate(blocks):
            for p in b.parameters():
                of[id(p)] = i
        # a parameter outside the blocks (embeddings, the head) is the ends': "ends"
        self.param_owner = {id(p): of.get(id(p), "ends") for p in model.parameters()}
        self.optimizer = optimizer

    def seen_op(self, func, args, made):
        """In the optimizer step, each storage an op makes (``made``: event indexes) belongs to
        the block of the parameter, gradient or state it was made from."""
        if self.live.phase != "optimizer" or not made:
            return
        lists = [a for a in args if isinstance(a, (list, tuple))]
        if lists:  # a foreach op: its j-th output is its j-th input's
            owners = [self.owner_of.get(t.untyped_storage()._cdata) for t in lists[0]
                      if isinstance(t, torch.Tensor)]
        else:
            first = [t for t in args if isinstance(t, torch.Tensor)]
            owners = [next((self.owner_of[t.untyped_storage()._cdata] for t in first
                            if t.untyped_storage()._cdata in self.owner_of), None)]
        for j, index in enumerate(made):
            owner = owners[j] if j < len(owners) else (owners[-1] if owners else None)
            self.made_by[index] = owner
            if owner is not None:  # a state made now: later ops on it are that block's too
                self.owner_of[self.live.events[index][1]] = owner

    # -------------------------------------------------------------- a step
    def begin(self):
        """At a step's start: map the live parameters', gradients' and state's storages to
        their blocks (they move: FSDP reshards, zero_grad frees gradients)."""
        self.owner_of, self.made_by, self.given = {}, {}, []
        for p in self.optimizer_params():
            block = self.param_owner.get(id(p))
            tensors = [p, p.grad, *(v for v in self.optimizer.state.get(p, {}).values()
                                    if isinstance(v, torch.Tensor))]
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    t = t.to_local() if hasattr(t, "to_local") else t
                    self.owner_of[t.untyped_storage()._cdata] = block

    def _by_block(self, ledger, census):
        """{block or None: bytes by kind} live at the step's start: each parameter's, gradient's
        and state's with its block, DDP's buckets by the gradients each block puts there, the
        rest (None) what no block owns."""
        out = {None: list(ledger.before[k] for k in KINDS)}
        for kind, sizes in census.items():
            if kind == "ddp_buckets":
                continue
            for key, size in sizes.items():
                block = self.owner_of.get(key)
                if isinstance(block, int):
                    out.setdefault(block, [0] * _K)[_INDEX[kind]] += size
                    out[None][_INDEX[kind]] -= size
        if census.get("ddp_buckets"):
            for p in self.optimizer_params():
                block = self.param_owner.get(id(p))
                if isinstance(block, int) and p.requires_grad:
                    size = p.numel() * p.element_size()
                    out.setdefault(block, [0] * _K)[_INDEX["ddp_buckets"]] += size
                    out[None][_INDEX["ddp_buckets"]] -= size
        return {b: tuple(v) for b, v in out.items()}

    def loads(self, world_size):
        """{block or None: numel each rank's optimizer updates}, as `simulate._loads` counts."""
        out = {}
        for p in self.optimizer_params():
            block = self.param_owner.get(id(p))
            row = out.setdefault(block if isinstance(block, int) else None, [0] * world_size)
            if hasattr(p, "to_local"):  # FSDP: torch.chunk's rows
                rows, per = p.shape[0], p.numel() // max(p.shape[0], 1)
                size = -(-rows // world_size)
                for r in range(world_size):
                    row[r] += min(size, max(rows - r * size, 0)) * per
            else:
                for r in range(world_size):
                    row[r] += p.numel()
        return out

    def optimizer_params(self):
        opt = getattr(self.optimizer, "optim", self.optimizer)
        return [p for g in opt.param_groups for p in g["params"]]

    def end(self, start, events, points, ledger, census):
        """The step's events (from ``start`` in ``self.live``) cut into pieces, each ``(name,
        phase, sizes, kinds)``; what was live when it began, by kind and by block (``census``:
        kind -> {storage key: bytes}). A storage the model makes outside the blocks' forward
        (``shared``: a mask, positions, the embeddings' output) is freed wherever its last holder
        lets go, which depends on the other blocks: its free is left out of the piece it falls
        in and kept as ``(allocated at, bytes, kind, freed at, a region's, handed on)``, each
        place a (piece, offset); a region's: freed with the region whose block made it; handed
        on: passed to a block other than its maker (only such a block can hold it)."""
        self.bases.append(self._by_block(ledger, census))
        kinds = event_kinds(ledger, events)
        pieces, home, shared = [], {}, []
        first, by_key = len(self.live.events) - len(events), {}
        for key, at, block in self.given:
            by_key.setdefault(key, []).append((at - first, block))
        self._handed = by_key
        for a, b, name in self._regions_open(_cuts(events, points), events):
            if a == b:
                continue
            if events[a][3] == "optimizer":
                pieces += self._optimizer_runs(a, b, events, kinds, start)
                continue
            at, sizes, kind_of, made_any = len(pieces), [], [], False
            for i in range(a, b):
                size, key = events[i][0], events[i][1]
                if size > 0:
                    home[key] = (at, len(sizes), i)
                    made_any = True
                else:
                    made = home.pop(key, None)
                    given = made is not None and self._blocks_given(key, made[2], i)
                    why = made is not None and made[0] != at and self._left_out(
                        pieces[made[0]][0], name, given, not sizes, made_any)
                    if why:  # and whether a block other than its maker was handed it
                        shared.append((made[:2], -size, kinds[i], (at, len(sizes)),
                                       why == "region", bool(given - {pieces[made[0]][0][3]})))
                        continue
                sizes.append(size)
                kind_of.append(kinds[i])
            pieces.append((name, events[a][3], sizes, kind_of))
        self.steps.append((pieces, shared))

    def _regions_open(self, cuts, events):
        """``cuts`` with the CPU generator's state a region takes as it opens (torch's
        checkpoint around an ``nn.Sequential``'s segment, before its first block's hooks run) in
        that block's forward, not at the end of the piece before (which the block before it, or
        the model's stem, runs whatever follows)."""
        taken = getattr(self.live, "rng_states", ())
        cuts = list(cuts)
        for n in range(1, len(cuts)):
            a, b, name = cuts[n]
            if name[2] != "F" or self.region_of.get(name[3], (None,))[0] != name[3]:
                continue
            start = a
            while start > cuts[n - 1][0] and events[start - 1][0] > 0 and \
                    events[start - 1][1] in taken:
                start -= 1
            cuts[n - 1] = (cuts[n - 1][0], start, cuts[n - 1][2])
            cuts[n] = (start, b, name)
        return cuts

    def _blocks_given(self, key, born, died):
        """The blocks that were handed the storage at ``key`` while it lived (event indexes
        ``born`` to ``died``: an address is taken again once its storage has died)."""
        return {block for at, block in self._handed.get(key, ()) if born <= at <= died}

    def _left_out(self, made, freed, given, first=False, after_made=False):
        """Is this a storage whose free depends on other blocks: made outside the blocks'
        forward, by a block for all that follow (T5's position bias: handed to two or more),
        or by a block of a region and freed with the region (by its first or its last block:
        'region')? ``first``: the free is the first event of its piece (``freed``);
        ``after_made``: the piece made a storage before it."""
        if _outside(made):
            return True
        block, region = made[3], self.region_of.get(made[3])
        # a region's, freed with it (by its first or its last block); not what the end of the
        # forward frees (autocast's casts of the weights, its cache cleared as the forward's
        # context exits) where the region's last block is the stack's (a cut's region at its
        # end): a region lets go of its blocks' as its last returns, before the code after it
        # makes anything
        if made[2] in ("F", "R") and region is not None and freed[3] in region and \
                freed[3] != block and not (freed[2] == "G" and after_made):
            return "region"
        if made[0] != "forward" or made[2] != "F":
            return False
        lasts = {b - 1 for _, b in self.stacks}
        if freed[3] is None or (freed[0] == "forward" and freed[2] == "G" and
                                freed[3] in lasts and freed[3] != block and
                                not (first and freed[3] == block + 1)):
            # kept to the end of the forward (autocast's casts of the weights); not what the
            # next block lets go as it returns, as every block does its predecessor's (FSDP's
            # bf16 blocks): that one is the last block's own free, once
            return True
        return len(given - {block}) > 1

    def _optimizer_runs(self, a, b, events, kinds, start):
        """The optimizer step as runs of one block's tensors (``O``) or the ends' (``o``): a
        tensor made from none (a step count) goes with the next one made for a parameter."""
        who, keys = [], {}  # storage key -> owner, from its allocation
        for i in range(a, b):
            size, key = events[i][0], events[i][1]
            if size > 0:
                keys[key] = self.made_by.get(start + i)
                who.append(keys[key])
            else:
                who.append(keys.pop(key, self.owner_of.get(key)))
        for j in reversed(range(len(who) - 1)):
            if who[j] is None:
                who[j] = who[j + 1]
        # a new run where an allocation is another owner's: a block's run also frees what the
        # block before left (the step repeats block after block)
        out, run, owner = [], [], None
        for j, i in enumerate(range(a, b)):
            if run and events[i][0] > 0 and who[j] != owner:
                out.append(self._run(owner, run, events, kinds))
                run = []
            if not run:
                owner = who[j]
            run.append(i)
        if run:
            out.append(self._run(owner, run, events, kinds))
        return out

    def _run(self, owner, run, events, kinds):
        block = owner if isinstance(owner, int) else None
        name = ("optimizer", 0, "O" if block is not None else "o", block)
        return name, "optimizer", [events[i][0] for i in run], [kinds[i] for i in run]


def _outside(name):
    """A forward piece that is no block's own: before the blocks, between them, after."""
    phase, _, kind, _ = name
    return phase in ("forward", None) and kind != "F"


def _cuts(events, points):
    """[(start, stop, name)] of the step's events: a new piece at each mark and phase start."""
    marks = sorted(points, key=lambda p: p[0])
    out, micro, phase, last = [], -1, None, 0
    name = (None, 0, "begin", None)  # before the first phase: the first micro-batch made
    p = 0
    for i, event in enumerate(events + [(0, None, False, "end")]):
        starts = []
        if event[3] != phase:
            if event[3] == "forward":
                micro += 1
            # between phases (no phase), named by the one before: one per place in the step
            tag = "start" if event[3] is not None else f"after {phase}"
            phase = event[3]
            starts.append((phase, micro, tag, None))
        while p < len(marks) and marks[p][0] <= i:
            kind, block = marks[p][1]
            starts.append((phase, micro, kind, block))
            p += 1
        if starts:
            if name is not None:
                out.append((last, i, name))
            name, last = starts[-1], i
    return out


def event_kinds(ledger, events):
    """The kind (an index into KINDS) of each event, as the step's ledger names its block."""
    alloc, free = {}, {}
    for b in ledger.blocks:
        alloc[b[0]] = b
        free[b[1]] = b
    pre = {i: key for i, _, key in ledger.pre_freed}
    out = []
    for i, event in enumerate(events):
        b = alloc.get(i) if event[0] > 0 else free.get(i)
        if b is not None:
            kind = ledger.kind_of.get(id(b)) or ("fsdp_buffers" if b[4] else "temporaries")
        else:
            kind = ledger.pre_kind.get(pre.get(i), "other")
        out.append(_INDEX[kind])
    return out


def chain(pieces):
    """One `Piece` of ``pieces`` run one after another."""
    net, total, rise, at = [0] * _K, 0, None, [0] * _K
    for p in pieces:
        if rise is None or total + p.rise > rise:
            rise, at = total + p.rise, [a + b for a, b in zip(net, p.at_rise)]
        net = [a + b for a, b in zip(net, p.net)]
        total += sum(p.net)
    return Piece("optimizer", tuple(net), rise or 0, tuple(at), len(pieces))


def in_order(where):
    seen, out = set(), []
    for w in where:
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


class Walk:
    """The running total over composed pieces: the step's peak, its phase and ledger."""

    def __init__(self, base):
        self.level = list(base)
        self.base = sum(base)
        self.total = self.base
        self.best, self.by_phase = None, {}

    def add(self, piece, phase):
        if piece is None or not piece.events:
            return
        top = self.total + piece.rise
        if phase in PHASES:
            self.by_phase[phase] = max(self.by_phase.get(phase, top), top)
            if self.best is None or top > self.best[0]:
                self.best = (top, [a + b for a, b in zip(self.level, piece.at_rise)])
        self.level = [a + b for a, b in zip(self.level, piece.net)]
        self.total += sum(piece.net)

    def peak(self):
        by_phase = {p: self.by_phase[p] for p in PHASES if p in self.by_phase}
        ledger = dict(zip(KINDS, self.best[1]))
        return Peak(self.best[0], phase_of(by_phase), ledger, by_phase, base=self.base)
