"""The step's peak memory: how high it goes, in which phase, and what it is made of.

"Will it fit?" is answered by the highest moment of one optimizer step on one rank: every live
tensor byte at that moment of forward, backward (with any recompute) and the optimizer step,
DDP's gradient buckets included. A `Peak` says it the same way for a measurement (this module,
on a rank) and a prediction (`ddpkit.predict.simulate`, a simulated step under FakeTensorMode):
``bytes``, ``phase`` and ``ledger`` (the bytes of each `KINDS` at that moment, adding up to
``bytes``), and ``by_phase`` (the highest moment of each phase).

**How a rank measures it** (`PeakProbe`):

* CPU: c10's own count of live CPU allocations. ``FLAGS_caffe2_report_cpu_memory_usage`` makes
  the CPU allocator's reporter keep every live block's size and a running total; ddpkit turns
  it on before the model is built, so the total covers every byte the run allocates:
  parameters, DDP's buckets (allocated in DDP's constructor), optimizer state, activations,
  temporaries. A probed step runs inside a CPU profiler window that records the allocator's
  events and the user's ranges, not the ops (`allocations.window`); each allocator event
  there carries that running total, its address and the enclosing ``ddpkit:<phase>`` range
  (`train_step` marks its phases), so the peak is the highest total of the window, with its
  phase. The count costs about 2.5 us an allocation, so it is on only
  until the second probed step (steps 0 and 1); the bytes live when that window opened, a step
  boundary, are kept, and each later probe counts its own window on top of them (`PeakProbe`).
  Without the count the profiler sees no frees of blocks allocated before its window and no
  base at all (what ddpkit read before: DDP's buckets were invisible, and the step where DDP
  rebuilds them read one bucket set high).
* CUDA: ``torch.cuda.max_memory_allocated()``, read and reset at each phase boundary, gives
  each phase's peak; the ledger at the peak phase is then the census of parameters,
  gradients, optimizer state and buckets at that phase's end plus the measured activations,
  the rest being temporaries (the CPU ledger is exact to the block; this one is not).
  ``TrainConfig.memory_snapshot`` records the allocator's history for one step for
  https://pytorch.org/memory_viz.

``peak_bytes`` leaves out what was allocated before the job and the dataset (on a GPU run it
stays in host memory; `data_bytes` says how much it is).

**The ledger** (`ledger.Ledger`, which `summarize` reads): the blocks live at the peak, each
named by what it was seen to be (`ledger.KINDS`), blocks freed on another thread (gloo's)
ended where the allocator's total drops; prediction and measurement classify alike.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .allocations import allocation_events, cpu_accounting, cpu_allocated, window
from .ledger import KINDS, Ledger, ledger_at, unseen_frees  # noqa: F401 (the simulation reads
# Ledger and ledger_at here, beside summarize)

PHASES = ("forward", "backward", "optimizer")
TIE = 1e-3
"""Two phases whose highest moments are within this fraction are tied: the earlier is named."""


@dataclass
class Peak:
    """The highest moment of one step on one rank: ``bytes`` in ``phase``, made of ``ledger``
    (`KINDS` -> bytes, adding up to ``bytes``); ``by_phase``: each phase's highest moment."""
    bytes: int
    phase: str
    ledger: dict
    by_phase: dict = field(default_factory=dict)
    exact_ledger: bool = True
    """False on CUDA without a memory snapshot: the ledger is a census at the phase's end."""
    base: int = 0
    """Bytes live when the step began (a step boundary: parameters, optimizer state, DDP's
    buckets); the step's own rise is ``bytes - base``."""
    assumed: tuple = ()
    """A prediction's: what sized each data-dependent op (the batch's values, the routing
    assumed, an upper bound), one line each (`ddpkit.predict.datadep`); empty for none."""

    def __post_init__(self):
        self.ledger = {k: int(self.ledger.get(k, 0)) for k in KINDS}
        negative = {k: v for k, v in self.ledger.items() if v < 0}
        if negative:  # bytes counted live that the allocator had freed: a ledger's own fault
            raise ValueError(f"a peak's ledger holds no negative bytes: {negative} in {self!r}")

    def table(self):
        """The ledger as a pandas Series in bytes, largest first."""
        import pandas as pd

        return pd.Series(self.ledger, name="bytes").sort_values(ascending=False)

    def __repr__(self):
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.ledger.items() if v)
        said = f"; {self.assumed[0]}{' (and more: .assumed)' if self.assumed[1:] else ''}" \
            if self.assumed else ""
        return f"Peak({_fmt(self.bytes)} in the {self.phase}: {parts}{said})"


def _fmt(n):
    """Bytes in the largest unit that keeps them >= 1 (the engine's own: it imports nothing
    from predict/)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def phase_of(by_phase):
    """The phase of the highest moment: the first (in step order) within `TIE` of the top."""
    top = max(by_phase.values())
    return next(p for p, b in by_phase.items() if b >= top * (1 - TIE))


# ----------------------------------------------------------------------------- the peak
def summarize(events, totals, base, census, seen, measured=False):
    """The `Peak` of a step from its allocator events, measured or simulated alike.

    ``events``: ``(size, key, fsdp, phase)`` in time order; ``totals``: the bytes live after
    each (what the probe leaves out already taken off); ``base``: live before the first;
    ``census`` and ``seen`` as `ledger_at` takes them. The peak is the highest total reached
    inside a phase (between phases only a few scalars are made). None if no phase ran.
    ``measured``: a rank's own step, whose ledger may still count a block gloo freed on its
    own thread unseen (`unseen_kept`)."""
    by_phase, at = {}, None
    for i, (event, total) in enumerate(zip(events, totals)):
        phase = event[3]
        if phase not in PHASES:
            continue
        if total > by_phase.get(phase, -1):
            by_phase[phase] = total
        if at is None or total > totals[at]:
            at = i
    if at is None:
        return None
    compact = [e[:3] for e in events]
    # blocks of threads the events do not see (gloo's) move the total without an event
    ledger = Ledger(compact, base, census, seen, unseen_frees(compact, totals, base))
    ledger = ledger.settle(at, totals[at])
    exact = True
    if measured:
        ledger, exact = unseen_kept(ledger)
    return Peak(totals[at], phase_of(by_phase), ledger,
                {p: by_phase[p] for p in PHASES if p in by_phase}, exact_ledger=exact, base=base)


def unseen_kept(ledger):
    """(ledger, exact) for a rank's measured step. A block gloo frees on its own thread leaves
    no event; where the allocator's total says so it is ended (`ledger.unseen_frees`), but on a
    loaded machine one can still be counted live at the peak, and the peak's total, which is
    right, then leaves another kind negative (seen: other -33,656 B on an FSDP rank). The
    surplus comes off the kinds gloo frees that way (FSDP's buffers, then temporaries, then the
    largest), the total kept, and the ledger is marked inexact: a measurement's doubt must not
    end the user's run (a `Peak` refuses a negative entry)."""
    deficit = -sum(v for v in ledger.values() if v < 0)
    if not deficit:
        return ledger, True
    out = {k: max(v, 0) for k, v in ledger.items()}
    for kind in ("fsdp_buffers", "temporaries", *sorted(out, key=out.get, reverse=True)):
        take = min(out.get(kind, 0), deficit)
        out[kind] = out.get(kind, 0) - take
        deficit -= take
        if not deficit:
            break
    return out, False


# ----------------------------------------------------------------------------- the probe
def storages(tensors, by="address"):
    """{key: bytes} of the tensors' storages (a DTensor's local shard); the key is the data
    address (``by="address"``, a rank) or the StorageImpl (``by="impl"``, a fake tensor, whose
    address is 0)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            if st.nbytes():
                out[st.data_ptr() if by == "address" else st._cdata] = st.nbytes()
    return out


def optimizer_tensors(optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: the local one
    return [v for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


class PeakProbe:
    """``with probe.step(model, optimizer, ...):`` around one optimizer step, with
    ``phase=probe.phase`` given to `train_step`; then ``probe.peak`` is that step's `Peak`.

    Make it before the model is built: on CPU it turns c10's allocation count on then, and
    ``excluded`` (what the job had already) is read; ``leave_out(nbytes)`` adds more to leave
    out (the dataset).

    On CPU the count costs ~2.5 us an allocation (6% of a small GPT step, more for tinier
    ones), so it stays on only until the end of the second probed window (steps 0 and 1: every
    byte counted from before the model was built). The bytes live when that window opened,
    a step boundary (parameters, optimizer state, DDP's buckets, what else lasts), are kept as
    the ``boundary``; each later probe switches the count on for its own window only and adds
    what the window allocates and frees to that boundary (between steps nothing else lasts, so
    nothing from before the window is freed inside it)."""

    EXACT_WINDOWS = 2

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.complete = self.cuda or cpu_accounting(True)
        self.excluded = torch.cuda.memory_allocated() if self.cuda else cpu_allocated()
        self.data_bytes = 0
        self.peak = None
        self.boundary = None  # CPU: bytes live at a step boundary, once the exact windows are done
        self._exact = self.EXACT_WINDOWS
        self._by_phase, self.reserved_peak = {}, 0

    def leave_out(self, nbytes):
        """Leave ``nbytes`` (allocated since the probe was made) out of every reading."""
        self.excluded += nbytes
        self.data_bytes += nbytes

    def allocated(self):
        return torch.cuda.memory_allocated() if self.cuda else cpu_allocated()

    @contextlib.contextmanager
    def leaving_out(self):
        """Leave out what this thread allocates inside the block, net of what it frees (the
        dataset). On CPU that is read from the allocator's events of this thread, not from two
        readings of the total: another thread may free a block meanwhile (gloo lets go of the
        buffer of DDP's start-up broadcast a few ms after the constructor returns, on rank 0),
        and a difference would take it off the dataset, leaving every reading of the run that
        much high."""
        if self.cuda:
            before = self.allocated()
            yield
            self.leave_out(self.allocated() - before)
            return
        with window() as prof:
            yield
        self.leave_out(sum(e[1] for e in allocation_events(prof)[0]))

    @contextlib.contextmanager
    def phase(self, name):
        """One phase of the step (`train_step` calls it for each forward, backward, optimizer)."""
        if not self.cuda:
            with torch.profiler.record_function(f"ddpkit:{name}"):
                yield
            return
        yield
        self._by_phase[name] = max(self._by_phase.get(name, 0),
                                   torch.cuda.max_memory_allocated() - self.excluded)
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def step(self, model, optimizer, buckets=None, activations=None):
        """``buckets()``: {address: bytes} of DDP's bucket buffers (the comm counter's);
        ``activations``: the `ActivationProbe` of this step, if it ran (its saved addresses)."""
        params = storages(model.parameters())
        grads = storages(p.grad for p in model.parameters())
        states = storages(optimizer_tensors(optimizer))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._by_phase, self.reserved_peak = {}, 0  # (the process probe's, by phase too)
            yield self
            self.peak = self._cuda_peak(model, optimizer, buckets, activations)
            return
        armed = self._exact == 0  # the count on for this window only
        if armed:
            cpu_accounting(True)
        try:
            with window() as prof:
                yield self
        finally:
            if armed or self._exact == 1:
                cpu_accounting(False)
        events, forward_ends = allocation_events(prof)
        census = {"parameters": params, "gradients": grads, "optimizer_state": states}
        if not events:
            self.peak = None
            return
        if armed:  # the boundary, plus what this window allocated and freed
            base, totals, running, live = self.boundary, [], self.boundary, {}
            for e in events:  # an address allocated again was freed on another thread first
                running += e[1] - (live.get(e[2], 0) if e[1] > 0 else 0)
                live[e[2]] = max(e[1], 0)
                totals.append(running)
        else:  # c10's count of every byte since before the model was built
            base = events[0][3] - events[0][1] - self.excluded
            totals = [e[3] - self.excluded for e in events]
            self._exact -= 1
            if self._exact == 0:
                self.boundary = base
        self.peak = self._cpu_peak(events, forward_ends, census, model, optimizer, buckets,
                                   activations, base, totals)

    def _cpu_peak(self, events, forward_ends, census, model, optimizer, buckets, activations,
                  base, totals):
        end = len(events)
        seen = [("parameters", key, 0) for key in census["parameters"]]
        seen += [(kind, key, end) for kind, tensors in (
            ("gradients", [p.grad for p in model.parameters()]),
            ("optimizer_state", optimizer_tensors(optimizer))) for key in storages(tensors)]
        census["ddp_buckets"] = buckets() if buckets else {}
        seen += [("ddp_buckets", key, end) for key in census["ddp_buckets"]]
        if activations is not None:
            times = [e[0] for e in events]
            for keys, t_end in zip(activations.saved_addresses, forward_ends):
                index = _index_at(times, t_end)
                seen += [("activations", key, index) for key in keys]
        return summarize([(e[1], e[2], e[5], e[4]) for e in events], totals, base, census, seen,
                         measured=True)

    def _cuda_peak(self, model, optimizer, buckets, activations):
        by_phase = {p: self._by_phase[p] for p in PHASES if p in self._by_phase}
        phase = phase_of(by_phase)
        grads = storages(p.grad for p in model.parameters()) if phase != "forward" else {}
        bucket_map = buckets() if buckets else {}
        ledger = {"parameters": sum(storages(model.parameters()).values()),
                  "optimizer_state": sum(storages(optimizer_tensors(optimizer)).values()),
                  "ddp_buckets": sum(bucket_map.values()),
                  "gradients": sum(v for k, v in grads.items() if k not in bucket_map),
                  "activations": activations.max_bytes if activations and phase != "optimizer"
                  else 0}
        ledger["temporaries"] = max(by_phase[phase] - sum(ledger.values()), 0)
        return Peak(by_phase[phase], phase, ledger, by_phase, exact_ledger=False)


@contextlib.contextmanager
def cuda_history(path, stacks="python"):
    """The CUDA caching allocator's history of what runs inside (every allocation and free,
    with its Python stack), written to ``path``: a pickle that https://pytorch.org/memory_viz
    draws (``TrainConfig.memory_snapshot``). ``stacks="all"`` adds the C++ frames, torch's own
    default, which can make the recorded step and the dump slow (C++ frames are unwound at each
    allocation and symbolised at the dump)."""
    torch.cuda.memory._record_memory_history(stacks=stacks, max_entries=1_000_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


def _index_at(times, t):
    """Index of the last event at or before time ``t``."""
    import bisect

    return max(bisect.bisect_right(times, t) - 1, 0)

