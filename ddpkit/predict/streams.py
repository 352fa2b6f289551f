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
kind and size issued before it and not yet waited on, so prefetch chains hold. A CUDA rank's
events (`cudastreams`) likewise: each record gets a fresh id, and each wait points at the latest
record of an event with the same role (recorded on the same stream after the same op: FSDP2's
"all-gather done", "copy-out done", "reduce-scatter done"), which is the event FSDP2 waits on.
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
        else:
            out += _replaced(three[i1:i2], added, k)
    return _rewire_events(_rewire(_relabel(out)))


def _replaced(three, four, k):
    """A stretch the two streams differ in, aligned again by kind and name (sizes left out):
    what both have is carried along the line (a foreach optimizer's ops over longer lists),
    what only the 4-block stream has is played N - 3 times (one more block's scalar reads
    among them), anything else is taken as the 4-block stream has it."""
    match = difflib.SequenceMatcher(None, [_key(e, False) for e in three],
                                    [_key(e, False) for e in four], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in match.get_opcodes():
        if tag == "equal":
            out += [_along(a, b, k) for a, b in zip(three[i1:i2], four[j1:j2])]
        elif tag == "insert":
            out += four[j1:j2] * (k + 1)
        elif tag == "replace":
            out += four[j1:j2] + four[j1 + (i2 - i1):j2] * k
    return out


def _key(e, sized):
    """What aligns two streams: an op's kind, name, phase and micro-step (and its bytes where
    ``sized``), a mark's kind, phase and micro-step."""
    if isinstance(e, Op):
        return (e.kind, e.name, e.phase, e.micro, e.stream) + ((e.bytes,) if sized else ())
    return (e.what, e.phase, e.micro, e.stream)


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


def _rewire_events(stream):
    """Fresh ids for every event record; each ``wait_event`` on the latest record, before it,
    of an event with the same role (the stream it is recorded on, the op before it there)."""
    out, last, role, latest, fresh = [], {}, {}, {}, 0
    for e in stream:
        if isinstance(e, Op):
            last[e.stream] = e.name
        elif e.what == "record":
            fresh += 1
            role.setdefault(e.block, (e.stream, last.get(e.stream)))
            latest[role[e.block]] = fresh
            e = dataclasses.replace(e, block=fresh)
        elif e.what == "wait_event":
            if e.block not in role:
                continue  # recorded before the step: nothing to wait for
            e = dataclasses.replace(e, block=latest[role[e.block]])
        out.append(e)
    return out
