"""glibc's mmap threshold in a CPU rank: what its resident memory is beside its tensors.

glibc serves a block of at least its mmap threshold (128 KiB at start) with a mapping of its
own, handed back to the system when the block is freed; after such a block is freed it raises
the threshold to that block's size (up to 32 MiB), so later blocks of that size come from the
heap, which keeps freed memory resident and fragments. Measured on ddpkit's CPU ranks at real
sizes (``bench/results.md``: ``bench.peak``, ``bench.malloc``), a rank's resident peak was
1.16-3.26x its tensors' peak that way, and 1.024-1.074x with the threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_=131072``, glibc's own variable; a fixed threshold is never raised).

That speed is worth more than the tighter figure by default: fixed, every large block is mapped
and given back when freed, and the kernel zeroes its pages again at every step, 1.26-1.40x the
CPU time of a step with blocks above 128 KiB (``bench.malloc``; a 256-wide GPT's step 1.40x).
So CPU ranks keep glibc's own threshold, and `fits`/`plan` budget the share measured with it.
`fix_threshold` runs when a CPU rank starts: where ``DDPKIT_MMAP_THRESHOLD`` is a number of
bytes (131072 for the tight figure) it fixes the threshold there (``mallopt``), so that `fits`
and `plan` can budget a small allowance; unset or ``dynamic`` leaves glibc's default alone, and
so does a ``MALLOC_MMAP_THRESHOLD_`` of the user's own (glibc's to apply). The kernel reads the
same (`ddpkit.devices.mmap_threshold`) for the allowance, and checks the variable before a
launch (`devices.mmap_threshold_problem`); both variables are read at a rank's start, so warm
ranks started under other values are replaced (`ddpkit.runtime.start.STARTUP_PREFIXES`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from ..devices import GLIBC_MMAP_ENV, mmap_threshold

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_threshold(environ=None):
    """In a CPU rank at start: fix glibc's mmap threshold as `devices.mmap_threshold` says
    (nothing when glibc already has the user's own, or when it is to stay dynamic, the default,
    or off glibc). Returns the threshold set, or None."""
    environ = os.environ if environ is None else environ
    wanted = mmap_threshold(environ)
    if wanted is None or environ.get(GLIBC_MMAP_ENV, "").strip():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc: nothing to fix
    return wanted if mallopt(_M_MMAP_THRESHOLD, wanted) == 1 else None
