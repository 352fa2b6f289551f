"""glibc's mmap threshold in a CPU rank: what its resident memory is beside its tensors.

glibc serves a block of at least its mmap threshold (128 KiB at start) with a mapping of its
own, handed back to the system when the block is freed; after such a block is freed it raises
the threshold to that block's size (up to 32 MiB), so later blocks of that size come from the
heap, which keeps freed memory resident and fragments. Measured on ddpkit's CPU ranks at real
sizes (``bench/results.md``: ``bench.peak``, ``bench.malloc``), a rank's resident peak was
1.16-3.26x its tensors' peak that way, and 1.024-1.074x with the threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_=131072``, glibc's own variable; a fixed threshold is never raised).

`fix_threshold` runs when a CPU rank starts: it fixes the threshold (``mallopt``) at
``DDPKIT_MMAP_THRESHOLD`` bytes, 131072 when that is unset, so that ``fits`` and ``plan`` can
budget a small, measured allowance for the allocator; ``DDPKIT_MMAP_THRESHOLD=dynamic`` leaves
glibc's default alone. A ``MALLOC_MMAP_THRESHOLD_`` of the user's own is glibc's to apply, and
left alone too. The kernel reads the same (`ddpkit.devices.mmap_threshold`) for the allowance,
and checks the variable before a launch (`devices.mmap_threshold_problem`); both variables are
read at a rank's start, so warm ranks started under other values are replaced
(`ddpkit.runtime.start.STARTUP_PREFIXES`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from ..devices import GLIBC_MMAP_ENV, mmap_threshold

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_threshold(environ=None):
    """In a CPU rank at start: fix glibc's mmap threshold as `devices.mmap_threshold` says
    (nothing when glibc already has the user's own, or when it is to stay dynamic, or off
    glibc). Returns the threshold set, or None."""
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
