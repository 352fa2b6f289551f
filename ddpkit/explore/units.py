"""Byte units, said once: every figure ddpkit shows in MiB or GiB divides by these."""
from __future__ import annotations

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


def human_bytes(n, unit="MiB", digits=2):
    """``n`` bytes as ``'1.50 MiB'`` (``unit``: 'KiB', 'MiB' or 'GiB')."""
    scale = {"KiB": KIB, "MiB": MIB, "GiB": GIB}[unit]
    return f"{n / scale:.{digits}f} {unit}"
