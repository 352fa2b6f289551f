"""A rank's step composed from per-block pieces: real sizes at the speed of a slider (#45).

A model's step runs the same few pieces again and again: each block's forward, its backward
(with its region's recompute when checkpointed), the code between blocks, and in the optimizer
step each block's parameters. `Library` simulates the model cut to `CUT` blocks per stack
(`simulate.simulate` with a `pieces.Recorder`), once per *layout* of checkpoint states it needs,
and keeps every piece's figures by where it ran: its stack, the block's **role** there (the
first, the second, a middle one, the last: FSDP prefetches its neighbour, T5's first block has
its own bias) and its **state** (plain, a region of one block, or the first, a middle or the last
block of a longer region). `compose` then lays the pieces of any setting on any number of blocks
end to end, as the rank runs them, and reads the step's peak off their running total: what was
live at each piece's start plus its highest rise, the ledger with it. No new simulation is needed
for a setting whose (role, state) pieces are in the library: a selective list on 80 blocks is
arithmetic on a few hundred numbers.

Composed = simulated whole, to the byte, where the pieces do not depend on anything but their
own block (tests/test_compose.py holds it to the whole simulation for every kind of setting,
DDP and FSDP, two stacks, accumulation). Two things reach across blocks, and are put where the
rank puts them: what the model makes once for every block (a mask, positions: `shared`), freed
by the last block that holds it, and what a checkpointed region holds for each of its blocks
(the CPU generator's state), freed with the region. ZeRO-1's optimizer updates a partition of
the parameters that depends on all of them: its optimizer step is carried along the line through
cuts of `CUT` and `CUT + 1` blocks (said in the result).

`Composition` (the result's ``composition``) is the interface a composed figure is read by:
which cut simulations ran, and for each block of the model which simulated block's pieces it
runs; the step-time prediction composes per-block times the same way.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import threading

from ..engine.memory import KINDS
from ..engine.strategies import is_fsdp
from .layouts import (CUT, Layout, candidates, head_of, layout_text, micro_class, passed, role,
                      segment_like, states)
from .layouts import composable, proven  # noqa: F401 - asked of the composition, kept here
from .pieces import Piece, Recorder, Walk, chain, in_order, summarize
from .simulate import Simulation, _plus, cublas_workspaces
from .trace import run_target

_K = len(KINDS)


@dataclasses.dataclass
class Composition:
    """How a composed step was made. ``simulated``: each cut simulation run, as (blocks kept per
    stack, its segments); ``carried``: for each block of the model, (stack, role, state) whose
    pieces it runs, simulated in ``simulated[source]``; ``extrapolated``: figures that are no
    simulated block's (ZeRO-1's optimizer step, along a line)."""
    simulated: list
    carried: list
    extrapolated: list = dataclasses.field(default_factory=list)

    def __str__(self):
        runs = "; ".join(f"{k} blocks per stack, {layout_text(s)}" for k, s in self.simulated)
        text = f"composed from {len(self.simulated)} simulation(s) of the model cut ({runs})"
        if self.extrapolated:
            text += "; extrapolated: " + "; ".join(self.extrapolated)
        return text


class Library:
    """The pieces of one config's rank (all of it but the checkpoint setting)."""

    def __init__(self, cfg, rank, simulate, target=None):
        """``simulate``: `simulate.simulate`, as a CUDA rank on ``target`` where one is given."""
        self.cfg, self.rank, self.target = cfg.replace(checkpoint=None), rank, target
        self.simulate = simulate if target is None else functools.partial(simulate, target=target)
        self.stacks = list(cfg.checkpoint.stacks)
        self.fine = is_fsdp(cfg.strategy)  # regions' blocks told apart by length and neighbours
        self._covers, self._all = {}, None
        # ZeRO-1 updates a partition of the parameters that depends on all of them: its state
        # and optimizer step go along the line through two cuts (``per_cut``: k -> figures)
        self.zero = cfg.optimizer == "zero1" or cfg.strategy == "ddp_zero1"
        self.per_cut = {}
        self.raw = {}         # key -> (phase, sizes, kinds) of a piece
        self.shared = {}      # (key, offset) of a storage made outside the blocks -> its rule
        self.held = {}        # (key, offset, first's state) of a region's -> where it frees
        self.covered = {}     # (stack, role, state) -> index into simulated
        self.simulated = []   # (cut blocks per stack, segments)
        self.skeletons = {}   # step -> [(phase, micro)] as the cut ran them
        self.optimizer = {}   # step -> [(stack, role) or None, key]: the optimizer's runs
        self.bases, self.loads, self.assumed = {}, {}, ()
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ simulating
    def _cut_blocks(self, k):
        return [(s, role(i, k)) for s in range(len(self.stacks)) for i in range(k)]

    def need(self, setting):
        """Simulate the cut layouts that bring every (stack, role, state) of ``setting``:
        greedily, the layout that brings the most of those missing, the smaller cut first."""
        missing = {(s, r, x) for (s, r), x in zip(self._where(setting), states(setting, self.fine))
                   if (s, r, x) not in self.covered}
        while missing:
            k, layout = max(self._candidates(), key=lambda c: (
                len(missing & set(self._coverage(*c))), -c[0]))
            got = set(self._coverage(k, layout)) & missing
            if not got:
                raise ValueError(f"no cut layout brings {sorted(missing)}")
            self.add(layout, k)
            missing -= got

    def _candidates(self):
        if self._all is None:  # no cut longer than the shortest stack
            most = min(self.stacks)
            self._all = [(k, lay) for k in (CUT, CUT + 2) if k <= most
                         for lay in candidates(k, len(self.stacks))]
            self._all += [(k, lay) for k in (CUT + 4,) if k <= most
                          for lay in segment_like(k, len(self.stacks))]
        return self._all

    def _where(self, setting):
        out = []
        for s, n in enumerate(self.stacks):
            out += [(s, role(i, n)) for i in range(n)]
        return out

    def _coverage(self, k, segments):
        hit = self._covers.get((k, segments))
        if hit is None:
            cut = Layout(None, (k,) * len(self.stacks), layout=tuple(segments))
            hit = self._covers[k, segments] = [
                (s, r, x) for (s, r), x in zip(self._cut_blocks(k), states(cut, self.fine))]
        return hit

    def add(self, segments, k=CUT):
        """Simulate the model cut to ``k`` blocks per stack with ``segments``; keep its pieces."""
        with self.lock:
            cut = [k] * len(self.stacks)
            setting = Layout(None, tuple(cut), layout=tuple(segments))
            region = {j: (a, b - 1) for a, b in setting.regions for j in range(a, b)}
            rec = Recorder([(s * k, (s + 1) * k) for s in range(len(cut))], region)
            cfg = self.cfg.replace(accum_steps=min(self.cfg.accum_steps, 3))
            sim = self.simulate(cfg, self.rank, keep=tuple(cut) if len(cut) > 1 else k,
                                setting=setting, recorder=rec)
            index = len(self.simulated)
            self.simulated.append((tuple(cut), tuple(segments)))
            self.assumed = sim.assumed
            where, st = self._cut_blocks(k), states(setting, self.fine)
            for b, (s, r) in enumerate(where):
                self.covered.setdefault((s, r, st[b]), index)
            self._keep(rec, where, st, cfg.accum_steps, setting, sim)

    def _keep(self, rec, where, st, accum, setting, sim):
        for step, (pieces, shared) in enumerate(rec.steps):
            skeleton, optimizer, keys = [], [], []
            for (phase, micro, kind, block), _, sizes, kinds in pieces:
                mc = micro_class(micro, accum) if phase != "optimizer" else 0
                if kind in ("start", "begin") or (phase is None and kind.startswith("after")) \
                        or (phase == "optimizer" and skeleton[-1][0] != "optimizer"):
                    skeleton.append((phase, micro, kind))
                at = (None, None) if block is None else where[block]
                key = (step, phase, mc, kind, *at, None if block is None else st[block])
                keys.append(key)
                if phase == "optimizer":  # in order: a block's runs come back per foreach op
                    optimizer.append((None if block is None else at,
                                      summarize(sizes, kinds, phase)))
                else:
                    self.raw[key] = (phase, sizes, kinds)
            region = {j: (a, b - 1) for a, b in setting.regions for j in range(a, b)}
            for made, size, kind, freed, by_region, handed in shared:
                made_key, freed_key = keys[made[0]], keys[freed[0]]
                name, by = pieces[made[0]][0], pieces[freed[0]][0][3]
                ends = region.get(name[3], ())
                if by_region:  # the region's (freed by its first or its last block)
                    back = len(self.raw[freed_key][1]) - freed[1]  # from the piece's end
                    self.held.setdefault((made_key, made[1], by == ends[1]), {}).setdefault(
                        freed_key[6], (freed_key[:4], back, size, kind))
                    continue
                rule = self._shared(made_key, made[1], size, kind, freed_key, freed[1],
                                    by_maker=name[3] is not None and by == name[3])
                rule["not"].update(passed(name[3], by, freed_key, where, st))
                rule["handed"] = rule.get("handed", False) or handed
            self.skeletons[step] = skeleton
            self.optimizer[step] = optimizer
            k = len(where) // len(self.stacks)  # ZeRO-1's lines: the step's figures per cut
            self.per_cut.setdefault(k, {})[step] = (
                [sum(v[i] for v in rec.bases[step].values()) for i in range(_K)],
                chain([p for _, p in optimizer]))
            base = rec.bases[step]
            self.bases[step] = {None if b is None else where[b]: v for b, v in base.items()}
        self.loads = {None if b is None else where[b]: v
                      for b, v in rec.loads(self.cfg.world_size).items()}
        self.per_cut[len(where) // len(self.stacks)]["loads"] = sim.loads

    def _shared(self, made, offset, size, kind, freed, at, by_maker=False):
        """What the model made outside the blocks, freed by its last holder: by the state of the
        block that held it last (the lowest-numbered holder, the last the backward meets), or
        where nothing held it."""
        rule = self.shared.setdefault((made, offset), {"size": size, "held": {}, "not": set(),
                                                       "unheld": None, "maker": None})
        # what it is (an activation where a block keeps it, else a temporary) goes with who
        # held it: ``kind`` is put on its allocation and its free alike
        # where in the piece: a backward piece's frees from its end (what a region lets go
        # when it is done), a forward piece's from its start
        back = len(self.raw[freed][1]) - at if freed[1] == "backward" else -at
        if by_maker and freed[1] == "backward":  # the block that made it saved it too
            rule["maker"] = (freed[:4], back, kind)
        elif freed[1] == "backward" and freed[3] in ("B", "R", "r"):  # a block let it go
            rule["held"].setdefault((freed[4], freed[6]), {}).setdefault(
                freed[5], (freed[:4], back, kind))
        else:
            rule["unheld"] = (freed, back, kind)
        return rule

    def _free(self, out, rule, made, offset, home, where, st):
        """The free of one shared storage (made by block ``home``, or outside the blocks)."""
        # held by the blocks after the one that made it (whose own region holds only its
        # inputs): the lowest of them lets it go last
        holder = next((b for b, x in enumerate(st) if (home is None or b > home)
                       and (where[b][0], x) in rule["held"]), None)
        if home is not None and rule["maker"] is not None:  # its maker keeps it last
            name, at, kind = rule["maker"]
            place = ((*name, *where[home], st[home]), home)
        elif holder is None:
            if rule["unheld"] is None:
                return
            key, at, kind = rule["unheld"]
            block = None if key[4] is None else where.index(key[4:6])
            if block is not None:  # the stack's first or last: in the state it is here
                key = (*key[:6], st[block])
            place = (key, block)
        else:
            by_role = rule["held"][where[holder][0], st[holder]]
            name, at, kind = by_role.get(where[holder][1]) or next(iter(by_role.values()))
            place = ((*name, *where[holder], st[holder]), holder)
        out.setdefault(place, []).append((-at, -rule["size"], kind))
        out.setdefault((made, home), []).append((offset, None, kind))

    def _piece(self, key, changes=()):
        """The `Piece` at ``key`` with ``changes``: frees put in, [(offset, -bytes, kind)], or
        an allocation's kind set, [(offset, None, kind)]."""
        raw = self.raw.get(key)
        if raw is None:
            return None
        phase, sizes, kinds = raw
        if changes:
            sizes, kinds = list(sizes), list(kinds)
            n = len(sizes)  # a negative offset counts from the piece's end
            changes = [(o if o >= 0 or size is None else max(n + o, 0), size, kind)
                       for o, size, kind in changes]
            # offsets are the piece's own: kinds set first, then frees put in from the end (a
            # free put in at an allocation's offset goes before it, and moves it on)
            for offset, size, kind in changes:
                if size is None:
                    kinds[offset] = kind
            for offset, size, kind in sorted((c for c in changes if c[1] is not None),
                                             key=lambda c: -c[0]):
                sizes.insert(min(offset, len(sizes)), size)
                kinds.insert(min(offset, len(kinds)), kind)
        return summarize(sizes, kinds, phase)

    # ------------------------------------------------------------------ composing
    def compose(self, setting):
        """The `Simulation` of ``setting`` on the whole model, from the library's pieces."""
        with self.lock:
            self.need(setting)
            # a storage made for the blocks that follow (T5's position bias), where no cut has
            # shown whether a block of some state here holds it: the cut of the setting's own
            # first blocks shows who holds it first
            for k in (CUT, CUT + 2):
                head = head_of(setting, self.stacks, k)
                if k > min(self.stacks) or ((k,) * len(self.stacks), head) in self.simulated or \
                        not self._unknown(setting):
                    continue
                self.add(head, k)
            if self.zero and len(self.per_cut) < 2:  # a second size, for the lines
                k = CUT + 2 if CUT in self.per_cut else CUT
                self.add(tuple((s * k + a, s * k + a + 1, False) for s in range(len(self.stacks))
                               for a in range(k)), k)
            where, st = self._where(setting), states(setting, self.fine)
            peaks = [self._step(step, setting, where, st) for step in sorted(self.skeletons)]
            carried = [(s, r, x, self.covered[s, r, x]) for (s, r), x in zip(where, st)]
            comp = Composition(list(self.simulated), carried, [
                "ZeRO-1's optimizer state and step (its partition of the parameters), along "
                f"the line through cuts of {' and '.join(map(str, sorted(self.per_cut)[:2]))} "
                "blocks per stack"] if self.zero else [])
            loads = self._line(lambda figures: figures["loads"]) if self.zero else \
                self._loads(where)
        # a CUDA rank: cuBLAS's workspaces, as `simulate` adds
        target = self.target if self.target is not None else run_target(self.cfg)
        if target is not None:
            peaks = [_plus(p, cublas_workspaces(target)) for p in peaks]
        for p in peaks:
            p.assumed = self.assumed
        return Simulation(self.rank, peaks, loads, how="composed", stream=None,
                          assumed=self.assumed, composition=comp)

    def _unknown(self, setting):
        """Is there a shared storage whose holders in ``setting`` no cut has shown: a block
        after its maker, before any known holder, of a (stack, state) not known to let it be?"""
        where, st = self._where(setting), states(setting, self.fine)
        for (made, _), rule in self.shared.items():
            if rule["maker"] is not None or not rule.get("handed"):
                continue  # its maker keeps it, or no other block was handed it to hold
            homes = [None] if made[4] is None else \
                [b for b, w in enumerate(where) if w == made[4:6] and st[b] == made[6]]
            reach = -1  # blocks up to here seen: a known holder's, or the end
            for home in homes:
                b = 0 if home is None else home + 1
                if b <= reach:
                    continue
                while b < len(where) and (where[b][0], st[b]) not in rule["held"]:
                    if (where[b][0], st[b]) not in rule["not"]:
                        return True
                    b += 1
                reach = b
        return False

    def _line(self, figure):
        """``figure`` (a list of numbers) of the cut, carried along the line through the two
        smallest cuts to the model's blocks (one stack: exact where it is linear)."""
        (k1, a), (k2, b) = sorted(self.per_cut.items())[:2]
        x, y = figure(a), figure(b)
        steps = sum(self.stacks) - k1 * len(self.stacks)
        per = len(self.stacks) * (k2 - k1)
        return [u + (v - u) * steps // per for u, v in zip(x, y)]

    def _loads(self, where):
        total = list(self.loads.get(None, [0] * self.cfg.world_size))
        for w in where:
            total = [a + b for a, b in zip(total, self.loads.get(w, [0] * len(total)))]
        return total

    def _step(self, step, setting, where, st):
        base = list(self.bases[step].get(None, (0,) * _K))
        for w in where:
            base = [a + b for a, b in zip(base, self.bases[step].get(w, (0,) * _K))]
        if self.zero:
            base = self._line(lambda figures: figures[step][0])
        self._regions = setting.regions
        walk, frees = Walk(base), self._frees(step, where, st)
        for phase, micro, tag in self._skeleton(step):
            mc = micro_class(micro, self.cfg.accum_steps) if phase != "optimizer" else 0
            if phase == "optimizer":
                if self.zero:
                    line = self._line(lambda f: [*f[step][1].net, f[step][1].rise,
                                                 *f[step][1].at_rise])
                    walk.add(Piece("optimizer", tuple(line[:_K]), line[_K],
                                   tuple(line[_K + 1:]), 1), "optimizer")
                else:
                    self._optimizer(walk, step, where)
                continue
            for kind, b in self._order(phase, tag, setting, where, st):
                at = (None, None) if b is None else where[b]
                key = (step, phase, mc, kind, *at, None if b is None else st[b])
                walk.add(self._piece(key, frees.get((key, b), ())), phase)
        return walk.peak()

    def _frees(self, step, where, st):
        """{(piece key, block): frees to put in}: each shared storage freed by the lowest block
        whose state holds it, else where nothing held it."""
        out = {}
        for (made, offset), rule in self.shared.items():
            if made[0] != step:
                continue
            # made outside the blocks once, or by each block of that role and state
            homes = [None] if made[4] is None else \
                [b for b, w in enumerate(where) if w == made[4:6] and st[b] == made[6]]
            for home in homes:
                self._free(out, rule, made, offset, home, where, st)
        for a, b in self._regions:  # what a region keeps for its blocks, freed with it
            for j in range(a, b):
                for (key, _, at_last), by_end in self.held.items():
                    end = b - 1 if at_last else a
                    if key[0] == step and key[3] in ("F", "R") and j != end and \
                            key[4:] == (*where[j], st[j]):
                        # where the region's first (or last) block frees it (as seen with one of
                        # that state, else of another: the same free, at the piece's end)
                        name, back, size, kind = by_end.get(st[end]) or \
                            next(iter(by_end.values()))
                        place = ((*name, *where[end], st[end]), end)
                        out.setdefault(place, []).append((-back, -size, kind))
        return out

    def _skeleton(self, step):
        """The cut's phases in order, its micro-steps laid out for the config's count: the
        first, the middle one for each in between, the last; then the optimizer step."""
        accum, cut = self.cfg.accum_steps, min(self.cfg.accum_steps, 3)
        entries = self.skeletons[step]
        opt = next((i for i, (phase, _, _) in enumerate(entries) if phase == "optimizer"),
                   len(entries))
        out = []
        for m in range(accum):
            source = 0 if m == 0 else cut - 1 if m == accum - 1 else 1
            out += [(phase, m, tag) for phase, micro, tag in entries[:opt] if micro == source]
        return out + [(phase, accum - 1, tag) for phase, _, tag in entries[opt:]]

    def _order(self, phase, tag, setting, where, st):
        """The pieces of one phase of one micro-step, in the order the rank runs them."""
        yield tag, None
        if phase == "forward":
            for b in range(len(where)):
                yield "F", b
                yield "G", b
        elif phase == "backward":
            firsts = set(itertools.accumulate([0] + self.stacks[:-1]))
            region = {b - 1: a for a, b in setting.regions}  # region's last block -> its first
            for b in reversed(range(len(where))):
                yield "B", b
                if b in region:  # each block run again, and what follows it to the next
                    for j in range(region[b], b + 1):
                        yield "R", j
                        yield "r", j
                if b in firsts:
                    yield "H", b

    def _optimizer(self, walk, step, where):
        """The cut's optimizer runs, each block's as many times as the model has such blocks."""
        count = {}
        for w in where:
            count[w] = count.get(w, 0) + 1
        runs, i = self.optimizer[step], 0
        while i < len(runs):
            at, piece = runs[i]
            if at is None:
                walk.add(piece, "optimizer")
                i += 1
                continue
            span = []  # a stretch of block runs, in block order
            while i < len(runs) and runs[i][0] is not None:
                span.append(runs[i])
                i += 1
            # each role's run in this stretch; of several blocks of one role (the cut's
            # middle ones) the first follows another role, the later ones follow their like
            runs_of = {}
            for at2, piece2 in span:
                runs_of.setdefault(at2, []).append(piece2)
            for w in in_order(where):
                got = runs_of.get(w, [])
                for n in range(count[w]):
                    if got:
                        walk.add(got[0] if n == 0 else got[-1], "optimizer")
