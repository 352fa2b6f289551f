"""c10's count of live CPU allocations, and the profiler window that reads it: what the CPU peak
(`memory.PeakProbe`) is measured with.

``FLAGS_caffe2_report_cpu_memory_usage`` (`cpu_accounting`) makes the CPU allocator's reporter
keep every live block's size and a running total, and report each allocation and free to the
profiler. A `window` records those events and nothing else but the user's own ranges
(``record_function``: ``ddpkit:<phase>``, FSDP's ``FSDP::all_gather``...), which say what each
allocation happened inside: the profiler is enabled for ``RecordScope.USER_SCOPE`` only, so
the step's ops are not recorded. Measured on bench.overhead's GPT (a 23 ms step on one CPU
thread), a window cost 8 ms where `torch.profiler.profile` with ``profile_memory=True``, which
records every op, cost 32 ms: the op events made the step slower, the profiler's end slower
(11 ms) and the walk over them slower (15 ms), and added nothing the peak reads (the same
allocations, sizes, totals and phases).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os

import torch

_FLAG = []  # [the c_bool of libc10's flag], once found


def cpu_accounting(on=True):
    """Switch c10's count of every live CPU allocation on or off
    (``FLAGS_caffe2_report_cpu_memory_usage``, a flag of libc10 read on every allocation and
    free: a mutex and a hash map, about 2.5 us an allocation). True when the flag was found."""
    if not _FLAG:
        _FLAG.append(None)
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        for path in sorted(glob.glob(os.path.join(lib_dir, "*c10.*"))):
            try:  # the library torch loaded already: dlopen returns the same handle
                _FLAG[0] = ctypes.c_bool.in_dll(ctypes.CDLL(path),
                                                "FLAGS_caffe2_report_cpu_memory_usage")
                break
            except (OSError, ValueError):
                continue
    if _FLAG[0] is None:
        return False
    _FLAG[0].value = on
    return True


class Window:
    """What a `window` hands back: ``results`` (torch's ``_ProfilerResult``) once it is closed."""
    results = None


@contextlib.contextmanager
def window():
    """A CPU profiler window with the allocator's events and the user's ranges only (as
    ``torch.autograd.profiler.profile`` starts one, given ``RecordScope.USER_SCOPE`` as the one
    scope to record, which its own arguments cannot say)."""
    from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
    from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState,
                                    RecordScope, _ExperimentalConfig)

    # kind, input shapes, memory, stacks, FLOPs, modules: the memory alone
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                            _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE})
    out = Window()
    try:
        yield out
    finally:
        out.results = _disable_profiler()


def allocation_events(win):
    """A closed `window`'s CPU allocator events in time order: (time, size, address, running
    total, phase, inside FSDP's collectives), and the end time of each ``ddpkit:forward``
    range. Each allocation sits under the range it happened in."""
    alloc = torch._C._profiler._EventType.Allocation
    out, forward_ends = [], []
    stack = [(n, None, False) for n in win.results.experimental_event_tree()]
    while stack:
        node, phase, fsdp = stack.pop()
        if node.tag == alloc:  # a leaf: only its extra fields are read
            ef = node.extra_fields
            if ef.device.type == "cpu":
                out.append((node.start_time_ns, ef.alloc_size, ef.ptr, ef.total_allocated, phase,
                            fsdp))
            continue
        name = node.name
        if name.startswith("ddpkit:"):
            phase = name[len("ddpkit:"):]
            if phase == "forward":
                forward_ends.append(node.end_time_ns)
        elif name.startswith(("FSDP::all_gather", "FSDP::post_backward_reduce")):
            fsdp = True
        stack.extend([(c, phase, fsdp) for c in node.children])
    out.sort(key=lambda e: e[0])  # stable: a parent's events before its children's
    return out, sorted(forward_ends)


def cpu_allocated():
    """Bytes the CPU allocator holds now, by c10's count (0 when it has none): read from a
    one-allocation `window` (the first window in a process takes ~1.5 s). Exact while the
    count has been on since those bytes were allocated (see `memory.PeakProbe`)."""
    if not _FLAG or _FLAG[0] is None or not _FLAG[0].value:
        return 0
    with window() as win:
        torch.empty(1, dtype=torch.uint8)
    events, _ = allocation_events(win)
    return events[0][3] - events[0][1] if events else 0
