"""The ledger of a step's peak: which kind every byte live at a moment of the step is.

`Ledger` follows the blocks of one step's allocator events (a rank's profiler window, or a
simulated step's storages) and says, at any event, the bytes of each of `KINDS`: parameters at
the step's start, gradients and optimizer state at its end, DDP's buckets (the comm hook's
buffers), activations (what the forward saved for backward), FSDP's buffers (allocated inside
FSDP's all-gather and reduce-scatter); every other block allocated in the step is a temporary,
every other block from before it is "other" (the micro-batch, small buffers). Prediction and
measurement classify with this same class (`ddpkit.engine.memory.summarize`).

**Frees no event shows.** A rank's events are its main thread's; a block can be let go on
another thread, and then only the allocator's running total says so. Gloo does this to FSDP's
collectives: the work object holds the all-gather's output and the reduce-scatter's input, and
drops them on gloo's own thread once the collective is done. Such a block is known by two
things: its address allocated again (a block at that address was freed first), and a drop of
the total between two events by exactly its size (``unseen``). The ledger ends it there, or at
the reuse; without this it stayed live to the end of the window, and the peak's "other" (the
total less the ledger) came out negative: -4,736 B, then -33,656 B on one FSDP rank.
"""
from __future__ import annotations

KINDS = ("parameters", "gradients", "optimizer_state", "ddp_buckets", "fsdp_buffers",
         "activations", "temporaries", "other")
"""What the bytes at the peak are, in the order a ledger lists them."""
# when a block was seen as two things, the first of these names it (a gradient that is a view
# of a DDP bucket with gradient_as_bucket_view=True is a bucket)
_PRIORITY = ("parameters", "optimizer_state", "ddp_buckets", "gradients", "activations")


class Ledger:
    """Bytes by kind at any event of a step (`at`).

    ``events``: allocator events in time order, each ``(size, key, fsdp)`` (size < 0 frees the
    block at ``key``; ``fsdp``: allocated inside FSDP's collectives). ``base``: bytes live
    before the first event (what the job had before the step, less what it leaves out).
    ``census``: kind -> {key: bytes} of blocks live before the step, known by kind.
    ``seen``: (kind, key, index) observations: the block at ``key`` live at event ``index`` is
    of that kind (``len(events)``: after the last event). Keys are allocation addresses (a
    rank) or StorageImpl ids (a simulation). ``unseen``: (index, bytes) drops of the total
    that no event explains (frees on another thread), found by `unseen_frees`.
    """

    def __init__(self, events, base, census, seen, unseen=()):
        census = _pre_step(events, census)
        self.blocks, live, self.pre_freed, self.orphans = [], {}, [], []
        for i, (size, key, fsdp) in enumerate(events):
            if size > 0:
                if key in live:  # allocated again: the block there was freed on another thread
                    self.orphans.append(self.blocks[live[key]])
                    self.blocks[live[key]][1] = i
                live[key] = len(self.blocks)
                self.blocks.append([i, len(events) + 1, size, key, fsdp])  # alive past the end
            else:
                j = live.pop(key, None)
                if j is None:
                    self.pre_freed.append((i, -size, key))  # a block from before the step
                else:
                    self.blocks[j][1] = i
        by_key = {}
        for b in self.blocks:
            by_key.setdefault(b[3], []).append(b)
        self.kind_of = {}
        for kind, key, index in seen:
            for b in by_key.get(key, ()):
                if b[0] <= index < b[1]:
                    old = self.kind_of.get(id(b))
                    if old is None or _PRIORITY.index(kind) < _PRIORITY.index(old):
                        self.kind_of[id(b)] = kind
        # never freed in the window, and nothing the step keeps: freed where no event shows
        self.orphans += [b for b in self.blocks if b[1] > len(events) and id(b) not in self.kind_of]
        self._end_unseen(unseen)
        # before the step: the known kinds, the rest "other"
        self.before, self.pre_kind = dict.fromkeys(KINDS, 0), {}
        for kind in _PRIORITY:
            for key, size in census.get(kind, {}).items():
                if key not in self.pre_kind:
                    self.pre_kind[key] = kind
                    self.before[kind] += size
        self.before["other"] = base - sum(self.before.values())

    def _end_unseen(self, unseen):
        """End each orphan block at the drop of the total by exactly its size, after it was
        allocated and before its address came back (FSDP's buffers first, then the oldest)."""
        for index, freed in unseen:
            fits = [b for b in self.orphans if b[2] == freed and b[0] < index < b[1]]
            if fits:
                b = min(fits, key=lambda b: (not b[4], b[0]))
                b[1] = index
                self.orphans.remove(b)

    def kind(self, b):
        return self.kind_of.get(id(b)) or ("fsdp_buffers" if b[4] else "temporaries")

    def at(self, index):
        out = dict(self.before)
        for i, size, key in self.pre_freed:  # what the step freed of them up to `index`
            if i <= index:
                out[self.pre_kind.get(key, "other")] -= size
        for b in self.blocks:
            if b[0] <= index < b[1]:
                out[self.kind(b)] += b[2]
        return out

    def settle(self, index, total):
        """The ledger at ``index`` when the allocator's ``total`` there is known: what it holds
        beyond the blocks is "other" (blocks of threads the events do not see); blocks it holds
        less than are orphans freed out of sight, ended here largest first, FSDP's first."""
        out = self.at(index)
        short = sum(out.values()) - total
        for b in sorted((b for b in self.orphans if b[0] <= index < b[1]),
                        key=lambda b: (not b[4], -b[2])):
            if short <= 0:
                break
            out[self.kind(b)] -= b[2]
            short -= b[2]
        out["other"] -= short
        return out


def unseen_frees(events, totals, base):
    """(index, bytes) of each drop of the running total at an event that the event itself does
    not explain: blocks freed on a thread whose events the window does not record."""
    out, before = [], base
    for i, (event, total) in enumerate(zip(events, totals)):
        if total - before - event[0] < 0:
            out.append((i, before + event[0] - total))
        before = total
    return out


def ledger_at(events, at, base, census, seen):
    """`Ledger` of the events, at event ``at``."""
    return Ledger(events, base, census, seen).at(at)


def _pre_step(events, census):
    """The census of blocks from before the step: keys allocated in the step are new blocks,
    not these (DDP's rebuilt buckets at step 1 are new; the first ones were there before)."""
    fresh = {key for size, key, _ in events if size > 0}
    out = {}
    for kind, blocks in census.items():
        out[kind] = {k: v for k, v in blocks.items() if k not in fresh or kind == "parameters"}
    return out
