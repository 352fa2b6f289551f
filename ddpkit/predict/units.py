"""Byte units, said once: every figure ddpkit shows divides by these, in the unit that suits its
size (KiB / MiB / GiB) for tables, bars and axes."""
from __future__ import annotations

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


def human_bytes(n, unit="MiB", digits=2):
    """``n`` bytes as ``'1.50 MiB'`` (``unit``: 'KiB', 'MiB' or 'GiB')."""
    scale = {"KiB": KIB, "MiB": MIB, "GiB": GIB}[unit]
    return f"{n / scale:.{digits}f} {unit}"


UNITS = (("B", 1), ("KiB", KIB), ("MiB", MIB), ("GiB", GIB), ("TiB", TIB))


def byte_unit(n):
    """(name, size) of the largest unit in which ``n`` bytes is at least 1 (B below 1 KiB)."""
    n = abs(n or 0)
    name, size = UNITS[0]
    for u, s in UNITS:
        if n >= s:
            name, size = u, s
    return name, size


def fmt_bytes(n, digits=3):
    """``1536`` -> ``'1.5 KiB'``; None -> ``'-'``."""
    if n is None or n != n:  # None or NaN
        return "-"
    name, size = byte_unit(n)
    return f"{n:.0f} B" if size == 1 else f"{n / size:.{digits}g} {name}"
