"""The process side of a step's peak: how high the rank's own memory went, beside the tensors.

``peak_bytes`` (`memory.PeakProbe`) counts tensor bytes, exactly. The operating system sees more:
on CPU, glibc's heap keeps freed blocks for reuse (after a large block is freed glibc raises its
mmap threshold, and later large blocks come from the heap, which it does not give back); on CUDA,
the caching allocator keeps whole segments (``max_memory_reserved`` vs ``max_memory_allocated``).
`ProcessProbe` reads that side on the probed steps, as ``process_peak_bytes``:

* CPU: the resident high-water mark over the step. ``5`` written to ``/proc/self/clear_refs`` at
  the step's start resets ``VmHWM`` (``/proc/self/status``) to the resident memory of then; it is
  read when the step's work ends (before the peak probe reads its profiler's events), less the
  pages that map files (`anonymous_high_water`: libraries' code is not the job's memory);
* CUDA: ``torch.cuda.max_memory_reserved`` over the step (the peak probe resets the allocator's
  peaks at the step's start and keeps the highest reserved between its phase resets).

Both leave out what ``peak_bytes`` leaves out: what the process held when the probe was made,
before the model was built (on CPU its anonymous resident memory: the interpreter, torch's
state; on CUDA what was reserved), and, on CPU, the dataset. ``process_peak_bytes - peak_bytes``
is then the allocator's share (and what lives outside tensors: gloo's buffers, Python objects).

The probe hands the heap's free pages back to the system first (`release_freed`: glibc's
``malloc_trim``), as a pool's CUDA ranks empty their cache after each job: what an earlier job on
a warm rank freed would otherwise be resident already, and this job's reading would start above
its own (a second run on a warm pool read less than its tensors before).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

import torch

_CLEAR_REFS = "/proc/self/clear_refs"


def status_bytes(key):
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def anonymous_high_water():
    """The high-water mark of the process's own memory (not of the files it maps): ``VmHWM``
    less the file-backed and shared pages resident now. Code pages of torch's libraries come in
    as ops first run (61 MB over a small model's first steps here); they are not the job's
    memory. File pages are not given back while the step runs, so this is the anonymous
    high-water mark (to within what the system reclaims under pressure)."""
    return status_bytes("VmHWM") - status_bytes("RssFile") - (status_bytes("RssShmem") or 0)


def _reset_high_water():
    """The resident high-water mark starts again from the resident memory of now."""
    with open(_CLEAR_REFS, "w") as fh:
        fh.write("5")


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed():
    """glibc's ``malloc_trim(0)``: the free pages of every heap go back to the system. True when
    it ran (glibc only; elsewhere nothing happens)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


class ProcessProbe:
    """``with probe.step(peak_probe):`` around a probed step (inside the peak probe's own
    context, so that its reading ends before the peak probe reads its events); then ``bytes``
    is the step's ``process_peak_bytes`` (None where the system does not say). Make it before
    the model is built, beside the `memory.PeakProbe`."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.start = torch.cuda.memory_reserved()
        else:
            release_freed()  # what an earlier job freed, still resident, is not this job's
            self.start = status_bytes("RssAnon")
            try:
                _reset_high_water()
            except OSError:  # not Linux, or /proc is read-only here: no reading
                self.start = None
        self.bytes = None

    @contextlib.contextmanager
    def step(self, peak):
        """``peak``: the step's `memory.PeakProbe` (its ``data_bytes``; on CUDA its reserved
        high-water mark over the step's phases)."""
        self.bytes = None
        if self.start is None:
            yield self
            return
        if not self.cuda:
            _reset_high_water()
        yield self
        if self.cuda:  # the highest of the phases the peak probe reset, and of the last one
            self.bytes = max(peak.reserved_peak, torch.cuda.max_memory_reserved()) - self.start
        else:
            self.bytes = anonymous_high_water() - self.start - peak.data_bytes
