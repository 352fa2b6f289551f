"""GPUs by name and memory budgets in bytes: what `fits`, `largest_micro_batch` and `plan` compare
the step's peak with.

A card's usable bytes are its memory less the CUDA context (about 0.5 GiB on recent drivers)
and a 5% reserve for the caching allocator's rounding and fragmentation: stated here, not
hidden in the figures. Cards go by the names people write: 'H100', 'h100', 'H100-80GB',
'NVIDIA H100 80GB'.
"""
from __future__ import annotations

import re

from .units import GIB, KIB, MIB, TIB

CUDA_CONTEXT = 512 * MIB
ALLOCATOR_RESERVE = 0.05
GPUS = {
    "T4": 16 * GIB,
    "V100-16GB": 16 * GIB,
    "V100-32GB": 32 * GIB,
    "A10G": 24 * GIB,
    "L4": 24 * GIB,
    "L40S": 48 * GIB,
    "A100-40GB": 40 * GIB,
    "A100-80GB": 80 * GIB,
    "H100-80GB": 80 * GIB,
    "H200-141GB": 141 * GIB,
}
"""The cards `fits` knows, by memory. Other spellings are accepted (`gpu_name`)."""


def _norm(text):
    return re.sub(r"[\s_\-]", "", text.upper().replace("NVIDIA", ""))


def _spellings():
    models = [key.split("-")[0] for key in GPUS]
    out = {}
    for key, model in zip(GPUS, models):
        gb = GPUS[key] // GIB
        for unit in ("GB", "G", "GIB"):
            out[_norm(f"{model}{gb}{unit}")] = key
        if models.count(model) == 1:
            out[_norm(model)] = key
    return out


def gpu_name(name):
    """The `GPUS` key for a card as people write it: 'H100', 'h100', 'H100-80GB', 'NVIDIA H100
    80GB', 'a100_40gb'. 'A100' alone is refused: it came with 40 and 80 GB."""
    key = _spellings().get(_norm(name))
    if key is not None:
        return key
    sizes = [k for k in GPUS if _norm(k.split("-")[0]) == _norm(name)]
    hint = f" (it came with {' and '.join(k.split('-')[1] for k in sizes)}: name one)" \
        if sizes else ""
    raise ValueError(f"gpu={name!r} is not a card ddpkit knows{hint}; pass one of "
                     f"{', '.join(GPUS)} (ddpkit.predict.gpus.GPUS) or a byte count such as "
                     f"16 * 2**30")


def usable_bytes(gpu):
    """Bytes a training step can use on a named GPU (or a byte count given as is)."""
    if isinstance(gpu, str) and not re.fullmatch(r"\s*[\d.]+\s*([KMGT]i?B|B)?\s*", gpu, re.I):
        return int((GPUS[gpu_name(gpu)] - CUDA_CONTEXT) * (1 - ALLOCATOR_RESERVE))
    return parse_bytes(gpu, "gpu")


def parse_bytes(value, name="memory_budget"):
    """An int of bytes, or a string like '12GiB', '512 MiB', '1.5GB' (GB = 10**9)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass bytes (an int) or a string like '12GiB'")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", value, re.I)
        if m:
            unit = (m.group(2) or "B").upper()
            scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": TIB}[unit]
            return int(float(m.group(1)) * scale)
    raise ValueError(f"{name}={value!r}: pass bytes (an int > 0) or a string like '12GiB' or "
                     f"'512MiB'")


def budget_bytes(memory_budget):
    """A budget in bytes: a card's usable bytes for a GPU name, else bytes or a size string."""
    try:
        return usable_bytes(memory_budget) if isinstance(memory_budget, str) else \
            parse_bytes(memory_budget)
    except ValueError:
        return parse_bytes(memory_budget)  # its message names memory_budget
