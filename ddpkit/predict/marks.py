"""What a simulated step's marks (`optrace.Mark`) mean for its time: where DDP starts each
bucket's all-reduce (from the ``grad`` marks, as DDP lays its buckets out from step 1 on), and
the timeline's rows (from the block marks, as the rank's probe names them). Read by both
players: `player.play` (a CPU rank) and `gpuplay.play_cuda` (a CUDA rank).
"""
from __future__ import annotations

from .optrace import Mark


def ddp_buckets(stream, caps):
    """Where DDP starts each bucket's all-reduce, as positions in ``stream``: {index: (bucket,
    bytes)}. From step 1 on DDP's buckets follow the order the gradients became ready (the
    ``grad`` marks), the first of at most ``caps[0]`` bytes, the others ``caps[1]`` (a bucket
    closes once it reaches its cap: torch's ``compute_bucket_assignment_by_size``), and a
    bucket starts when its last gradient is ready. Only micro-steps that sync (those in which
    the simulation's own DDP handed a bucket over) start any."""
    synced = {e.micro for e in stream if isinstance(e, Mark) and e.what == "bucket"}
    out, state = {}, {}
    for i, e in enumerate(stream):
        if not (isinstance(e, Mark) and e.what == "grad" and e.micro in synced):
            continue
        index, size = state.get(e.micro, (0, 0))
        size += e.bytes
        if size >= caps[min(index, len(caps) - 1)]:
            out[i] = (index, size)
            index, size = index + 1, 0
        state[e.micro] = (index, size)
    for micro, (index, size) in state.items():  # each micro-step's last, partly full bucket
        if size:
            end = max(i for i, e in enumerate(stream) if isinstance(e, Mark) and
                      e.what == "grad" and e.micro == micro)
            out[end] = (index, size)
    return out


def lanes(rank):
    """The timeline's rows a player writes, and the function that adds one (``rank``'s, step
    0: a player plays one step)."""
    rows = []

    def row(kind, name, start, end, micro, nbytes=0):
        rows.append((rank, 0, micro, kind, name, start, end, nbytes))
    return rows, row


def timeline_row(e, t, opened, row):
    """Turn marks into the timeline's rows as the rank's probe names them: a block's forward,
    backward and recompute; the forward's stem and head, the backward's head and stem."""
    what, i, micro = e.what, e.block, e.micro
    if what.endswith("_start") and what != "recompute_start" or what == "recompute_start":
        if what == "block_forward_start" and ("stem", micro) not in opened:
            row("forward", "stem", opened.get(("fwd0", micro), 0.0), t, micro)
            opened[("stem", micro)] = True
        if what == "block_backward_start" and ("bhead", micro) not in opened:
            row("backward", "head", opened.get(("fwd_end", micro), t), t, micro)
            opened[("bhead", micro)] = True
        opened[(what[:-6], i, micro)] = t
        return
    if what.endswith("_end") and i >= 0:
        base = what[:-4]
        start = opened.pop((base + "", i, micro), None)
        if start is None:
            return
        kind = {"block_forward": "forward", "block_backward": "backward",
                "recompute": "recompute"}[base]
        row(kind, f"block {i}", start, t, micro)
        opened[("last_" + kind, micro)] = t
        return
    if what == "forward_end":
        row("forward", "head", opened.get(("last_forward", micro), t), t, micro)
        opened[("fwd_end", micro)] = t
        opened[("fwd0", micro + 1)] = t
    elif what == "backward_end":
        row("backward", "stem", opened.get(("last_backward", micro), t), t, micro)
        opened[("fwd0", micro + 1)] = t
    elif what == "optimizer_end":
        row("optimizer", "optimizer step", opened.get(("fwd0", micro + 1), t), t, micro)
