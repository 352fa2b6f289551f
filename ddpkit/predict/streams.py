"""A large model's step stream, carried from the simulations of 3 and 4 blocks to all N.

`scale.py` carries the step's memory from 3 and 4 simulated blocks to N; the step's time needs
its stream of ops (`optrace.py`) at N blocks, since buckets, prefetches and overlaps depend on
the order of everything. With identical middle blocks, the 4-block stream is the 3-block stream
with one block's work added wherever a block's work is: its forward, its backward (with its
recompute, its gradients' ``grad`` marks and what FSDP issues beside it), DDP's copies of its
gradients, its parameters' turn in a per-parameter optimizer loop. So the two streams are
aligned (`difflib`, on each element's kind, name, payload and phase, block numbers left out),
and each stretch the 4-block stream adds is played N - 4 more times where it stands; where the
two differ only in sizes (a foreach optimizer's ops over longer lists), each size is carried
along the line through 3 and 4 blocks. Blocks are numbered again in the order they run (the
forward 0..N-1, the backward N-1..0, a recompute as the block whose backward it is in);
collectives get fresh indices, and each wait is pointed at the latest collective of the same
kind and size issued before it and not yet waited on, so prefetch chains hold.
"""
from __future__ import annotations

import dataclasses
import difflib

from .optrace import Mark, Op


def extend(three, four, n):
    """The stream of an N-block step from the streams of its 3- and 4-block steps."""
    if n <= 4:
        return list(four)
    k = n - 4
    match = difflib.SequenceMatcher(None, [_key(e, True) for e in three],
                                    [_key(e, True) for e in four], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in match.get_opcodes():
        added = four[j1:j2]
        if tag == "equal":
            out += [_along(a, b, k) for a, b in zip(three[i1:i2], added)]
        elif tag == "insert":
            out += added * (k + 1)
        elif tag == "replace" and i2 - i1 == j2 - j1 and all(
                _key(a, False) == _key(b, False) for a, b in zip(three[i1:i2], added)):
            out += [_along(a, b, k) for a, b in zip(three[i1:i2], added)]
        else:  # what the 4-block stream has instead: as it is, and the added part again
            out += added + added[max(0, (i2 - i1)):] * k
    return _rewire(_relabel(out))


def _key(e, sized):
    """What aligns two streams: an op's kind, name, phase and micro-step (and its bytes where
    ``sized``), a mark's kind, phase and micro-step."""
    if isinstance(e, Op):
        return (e.kind, e.name, e.phase, e.micro) + ((e.bytes,) if sized else ())
    return (e.what, e.phase, e.micro)


def _along(a, b, k):
    """``b`` (4 blocks) with its bytes and FLOPs carried k blocks further along the line from
    ``a`` (3 blocks)."""
    if isinstance(b, Mark):
        return dataclasses.replace(b, bytes=b.bytes + k * (b.bytes - a.bytes)) \
            if b.what == "bucket" else b
    return dataclasses.replace(b, bytes=b.bytes + k * (b.bytes - a.bytes),
                               flops=b.flops + k * (b.flops - a.flops))


def _relabel(stream):
    """Blocks numbered in the order they run: forward 0..N-1 (per micro-step), backward
    N-1..0, a recompute as the block whose backward it is in."""
    n = max((sum(1 for e in stream if isinstance(e, Mark) and e.what == "block_forward_start"
                 and e.micro == m) for m in {e.micro for e in stream}), default=0)
    count, current, out = {}, {}, []
    for e in stream:
        if isinstance(e, Mark) and e.what.startswith(("block_", "recompute_")):
            kind = e.what.rsplit("_", 1)[0]
            c = count.get((e.what, e.micro), 0)
            count[(e.what, e.micro)] = c + 1
            if kind == "block_forward":
                block = c
            elif kind == "block_backward":
                block = n - 1 - c
                if e.what.endswith("start"):
                    current[e.micro] = block
            else:
                block = current.get(e.micro, e.block)
            e = dataclasses.replace(e, block=block)
        out.append(e)
    return out


def _rewire(stream):
    """Fresh indices for every collective; each wait on the latest one of the same kind and
    payload issued before it and not yet waited on."""
    out, issued, kinds, count = [], [], {}, 0
    for e in stream:
        if isinstance(e, Op) and e.kind == "collective":
            kinds[e.index] = (e.shape, e.bytes)
            count += 1
            e = dataclasses.replace(e, index=-count)
            issued.append(e)
        elif isinstance(e, Mark) and e.what == "wait":
            want = kinds.get(e.block)
            target = next((x for x in reversed(issued) if (x.shape, x.bytes) == want), None)
            if target is None:
                continue
            issued.remove(target)
            e = dataclasses.replace(e, block=target.index)
        out.append(e)
    return out
