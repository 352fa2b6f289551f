"""Small helpers shared by the benchmarks."""
import os
import platform
import statistics

import torch


def machine():
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def summary(values):
    """median and spread (min-max) of a list of seconds, as a short string."""
    med = statistics.median(values)
    return med, f"{med:.3f} s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
