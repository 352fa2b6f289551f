"""The vocabulary of a composed step: where a block stands in its stack (`role`), what its
checkpoint setting makes of it (`states`), the cut simulations' layouts (`Layout`, the
`candidates` to choose from, a setting's own first blocks: `head_of`), and which configs are
composed at all (`composable`, `proven`). `compose.py` lays pieces out by these.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..engine.strategies import is_fsdp
from ..spec.setting import CheckpointSetting

CUT = 4
"""Blocks per stack the library's simulations keep: the first, the second, a middle, the last
(and two more, or four, where a longer region must lie among the middle ones)."""


@dataclasses.dataclass(frozen=True)
class Layout(CheckpointSetting):
    """A checkpoint setting of explicit segments: ``layout`` [(start, stop, checkpointed)]
    (a cut simulation's, which may hold regions no config value makes)."""
    layout: tuple = ()

    @property
    def segments(self):
        return list(self.layout) if self.layout else super().segments


def layout_text(segments):
    return ",".join(("C" if on else "P") * (b - a) if on and b - a == 1 else
                    (f"[{'C' * (b - a)}]" if on else "P" * (b - a)) for a, b, on in segments)


def role(i, n):
    """A block's role in its stack of ``n``: 'first', 'second', 'last' or 'mid'."""
    return "first" if i == 0 else "last" if i == n - 1 else "second" if i == 1 else "mid"


def states(setting, fine=False):
    """Each block's checkpoint state: 'P' (plain); 'C1' (a region of its own); in a longer
    region 'Cf' (the first), 'Cm' (a middle one), 'Cl' (the last), and '>' after the one the
    last block's backward prefetches (the second to last: 'Cf>' in a region of two, or 'Cm>').
    ``fine`` (FSDP, whose recompute gathers blocks its backward would prefetch): a region's
    blocks also say its length (2, 3, 4 or more) and the first and last what is next to the
    region ('-': nothing, else the neighbour's state)."""
    out, segs = [], setting.segments
    for n, (a, b, on) in enumerate(segs):
        for j in range(a, b):
            if not on or b - a == 1:
                out.append("P" if not on else "C1")
                continue
            x = "Cf" if j == a else "Cl" if j == b - 1 else "Cm"
            x += ">" if j == b - 2 else ""
            if fine:
                x += f"{min(b - a, 4)}"
                if j == a:
                    x += "|" + _outside_state(segs, n - 1, last=True)
                if j == b - 1:
                    x += "|" + _outside_state(segs, n + 1, last=False)
            out.append(x)
    return out


def _outside_state(segs, n, last):
    """The state of the block next to a region: of segment ``n``'s last (or first) block."""
    if not 0 <= n < len(segs):
        return "-"
    a, b, on = segs[n]
    return "P" if not on else "C1" if b - a == 1 else "Cl" if last else "Cf"


def micro_class(m, count):
    return 0 if m == 0 else "last" if m == count - 1 else "mid"


def segment_like(k, stacks=1):
    """Cut layouts as int settings make them, with room around: ``p`` plain blocks, regions of
    ``L`` blocks back to back, plain to the end."""
    out = []
    for p in range(3):
        for size in range(2, 6):
            for count in range(1, (k - p) // size + 1):
                one = [(i, i + 1, False) for i in range(p)]
                one += [(p + r * size, p + (r + 1) * size, True) for r in range(count)]
                one += [(i, i + 1, False) for i in range(p + count * size, k)]
                out.append(tuple((a + s * k, b + s * k, on) for s in range(stacks)
                                 for a, b, on in one))
    return out


def candidates(k, stacks=1):
    """Cut layouts to choose from: every way to lay checkpointed regions and plain blocks on
    ``k`` blocks, the same in each of ``stacks`` stacks."""
    out = []
    for splits in itertools.product((False, True), repeat=k - 1):
        bounds = [0] + [i + 1 for i, s in enumerate(splits) if s] + [k]
        parts = list(zip(bounds, bounds[1:]))
        for ons in itertools.product((False, True), repeat=len(parts)):
            if any(not on and b - a > 1 for (a, b), on in zip(parts, ons)):
                continue  # a plain stretch is plain blocks one by one
            out.append(tuple((a + s * k, b + s * k, on) for s in range(stacks)
                             for (a, b), on in zip(parts, ons)))
    return out


def head_of(setting, stacks, k):
    """The cut layout of ``setting``'s first ``k`` blocks of each of ``stacks`` (a region cut at
    the k-th block)."""
    out, first = [], 0
    for s, n in enumerate(stacks):
        out += [(a - first + s * k, min(b, first + k) - first + s * k, on)
                for a, b, on in setting.segments if first <= a < first + k]
        first += n
    return tuple(out)


def passed(maker, by, freed, where, st):
    """The (stack, state)s a shared storage's free shows hold it not: the blocks after its
    maker (``maker``: a block of the cut, or None: made outside the blocks) and before the one
    that let it go in its backward (``by``, the lowest holder: the backward meets it last), or
    every block after its maker where none let it go."""
    start = 0 if maker is None else maker + 1
    held = freed[1] == "backward" and freed[3] in ("B", "R", "r") and by is not None
    if held and by == maker:
        return set()
    stop = by if held else len(where)
    return {(where[b][0], st[b]) for b in range(start, stop)}


def composable(cfg, above):
    """Is ``cfg``'s step composed (`Library`) rather than simulated whole: a model of more than
    ``above`` parameters, every stack longer than the largest cut, no DDP comm hook (whose
    buffers follow the buckets, not the blocks)?"""
    stacks = cfg.checkpoint.stacks
    return cfg.info.n_params > above and min(stacks) > CUT + 4 and cfg.comm_hook is None and \
        proven(cfg)


def proven(cfg):
    """Is the composition of ``cfg``'s setting held to the whole simulation, to the byte
    (tests/test_compose.py, --breadth for the matrix)? On one stack: any checkpoint setting
    (none, segments, every block, a selective list) with DDP or ZeRO-1 (its optimizer step
    along a line: to 64 bytes) in fp32 and bf16, with FSDP in fp32, and FSDP in bf16 with a
    setting alike on every block; accumulation. On several stacks (T5's encoder and decoder):
    DDP, any setting. Not yet: FSDP in bf16 with segments or a list (exact from one library's
    first cut, off once cuts of other layouts mix in: 8-10 KiB on 9 blocks), FSDP on several
    stacks (T5 at 9 + 9 blocks: its all-gather buffers 0.5-5 KiB off), ZeRO-1 on several (130
    bytes along its line); ZeRO-2, HSDP and fp16 untested: those are simulated whole."""
    setting = cfg.checkpoint
    if cfg.strategy not in ("ddp", "ddp_zero1", "fsdp") or cfg.precision not in ("fp32", "bf16"):
        return False
    fsdp, zero = is_fsdp(cfg.strategy), cfg.strategy == "ddp_zero1" or cfg.optimizer == "zero1"
    if setting.several:
        return not (fsdp or zero)
    alike = setting.value is None or setting.value == "full" or all(setting.mask) or \
        not any(setting.mask)
    return not fsdp or cfg.precision == "fp32" or alike
