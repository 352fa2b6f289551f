"""GPUs by name and memory budgets in bytes: what `fits`, `largest_micro_batch` and `plan` compare
the step's peak with.

A card's usable bytes are its memory less the CUDA context (about 0.5 GiB on recent drivers)
and a 5% reserve for the caching allocator's rounding and fragmentation: stated here, not
hidden in the figures. Cards go by the names people write: 'H100', 'h100', 'H100-80GB',
'NVIDIA H100 80GB'.

**The allocator's allowance** (`allocator_allowance`): the predicted peak counts tensor bytes; a
process holds more. A budget in bytes is memory of the device the ranks run on, so the
allowance of that device's allocator is added to the peak before it is compared (a card's name
has it inside its usable bytes already: the 5% reserve). On CPU, glibc: measured, with where
the figure came from (`CPU_ALLOWANCE`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..devices import MMAP_TIGHT, mmap_threshold, resolve_devices
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
CAPABILITY = {"T4": (7, 5), "V100-16GB": (7, 0), "V100-32GB": (7, 0), "A10G": (8, 6),
              "L4": (8, 9), "L40S": (8, 9), "A100-40GB": (8, 0), "A100-80GB": (8, 0),
              "H100-80GB": (9, 0), "H200-141GB": (9, 0)}
"""Each card's compute capability (NVIDIA's CUDA GPUs table): what torch's kernel choices read."""
NAMED_CUDNN, NAMED_CUDA = 91000, "12.8"
"""The software a named card's ranks are assumed to run (*assumption*: torch's CUDA 12.8
wheels, whose cuDNN is 9.1-9.15; with a cuDNN above 9.15 sm90's SDPA would take cuDNN's kernel
first)."""


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
    if is_card(gpu):
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


CPU_MEASURED = {"dynamic": 3.26, "fixed": 1.074}
"""A CPU rank's ``process_peak_bytes / peak_bytes`` at real sizes, the highest measured: the rank's
resident high-water mark over a step (its own memory, less what it held before the model was
built) over its tensors' peak of the same step, step 2, both ranks, over ``bench.peak``'s 21 rows
(GPT-2 small and a 100M Llama; DDP, ZeRO-1, FSDP; checkpointing; bf16): ``bench/results.md``,
section ``bench.peak``, run both ways (2026-12-07). "dynamic": glibc's own, what ddpkit's CPU
ranks keep unless told otherwise (`ddpkit.rank.heap`): after a large block is freed the
threshold rises, later large blocks come from the heap, which keeps them resident and
fragments: 1.16-3.26x, FSDP the highest. "fixed": the threshold fixed at 128 KiB or less
(``DDPKIT_MMAP_THRESHOLD=131072``): 1.024-1.074x, FSDP and bf16 the highest, at 1.26-1.40x
the CPU time (``bench.malloc``). At teaching sizes (a few MiB) a rank holds several MiB
besides its tensors (gloo, Python, the profiler's window): a fraction of the peak does not
describe that, and is not meant to."""
CPU_ALLOWANCE = {k: math.ceil(round((v - 1) * 20, 6)) / 20 for k, v in CPU_MEASURED.items()}
"""The allowance budgeted for it: the measured share rounded up to 5%."""


@dataclass(frozen=True)
class Allowance:
    """The allocator's share a budget leaves beside the predicted peak: ``fraction`` of the
    peak, and ``why`` (what it stands for and where the figure came from)."""
    fraction: float
    why: str

    def of(self, peak):
        """The allowance's bytes for a peak of ``peak`` bytes."""
        return math.ceil(peak * self.fraction)

    def room(self, budget):
        """The highest peak whose bytes plus its allowance stay within ``budget``."""
        peak = int(budget / (1 + self.fraction))
        while peak + 1 + self.of(peak + 1) <= budget:
            peak += 1
        while peak > 0 and peak + self.of(peak) > budget:
            peak -= 1
        return peak

    def __str__(self):
        return f"+{100 * self.fraction:.0f}% for {self.why}" if self.fraction else self.why


def card_target(gpu):
    """The `attention.CudaTarget` a named card's ranks run on (its capability, `NAMED_CUDNN`,
    `NAMED_CUDA`), or None for a budget in bytes. `fits`, `largest_micro_batch` and `plan`
    simulate a card's rank as the CUDA rank it is (CUDA's caching allocator's rounding, cuBLAS's
    workspaces, the card's attention kernel, no gloo buffers), whatever device the config runs
    on here."""
    if not is_card(gpu):
        return None
    from .attention import CudaTarget  # it imports torch: parsing a budget here needs none

    return CudaTarget(CAPABILITY[gpu_name(gpu)], cudnn=NAMED_CUDNN, cuda=NAMED_CUDA)


def is_card(gpu):
    """Is ``gpu`` a card's name (not a byte count or a size string)?"""
    return isinstance(gpu, str) and not re.fullmatch(r"\s*[\d.]+\s*([KMGT]i?B|B)?\s*", gpu, re.I)


def allocator_allowance(cfg, gpu=None, allowance=None):
    """The `Allowance` for ``cfg``'s step peak against ``gpu`` (a card's name or a budget in
    bytes). ``allowance``: a fraction of your own (0: tensors only), else the measured one of
    the device ``cfg``'s ranks run on."""
    if allowance is not None:
        if isinstance(allowance, bool) or not isinstance(allowance, (int, float)) \
                or not allowance >= 0:
            raise ValueError(f"allowance={allowance!r}: pass a fraction of the peak >= 0 (0: "
                             f"tensors only), or None for the allocator's measured share")
        return Allowance(float(allowance), "your allowance" if allowance else
                         "no allowance for the allocator (allowance=0)")
    if is_card(gpu) or _device(cfg) == "cuda":
        reserve = f"{100 * ALLOCATOR_RESERVE:.0f}%"
        if is_card(gpu):
            return Allowance(0.0, f"the caching allocator's {reserve} reserve, taken off the "
                                  f"card (stated, not measured)")
        return Allowance(ALLOCATOR_RESERVE / (1 - ALLOCATOR_RESERVE),
                         f"the CUDA caching allocator (a {reserve} reserve: stated, not measured)")
    fixed = _fixed_threshold()
    kind = "fixed" if fixed else "dynamic"
    where = "bench.peak, bench/results.md"
    return Allowance(CPU_ALLOWANCE[kind], (
        f"glibc's heap, its mmap threshold fixed at {fixed} B: a rank's resident peak measured "
        f"at up to {CPU_MEASURED['fixed']:.2f}x its tensors' ({where})"
        if fixed else
        f"glibc's heap, its mmap threshold dynamic (glibc's default, which CPU ranks keep): a "
        f"rank's resident peak measured at up to {CPU_MEASURED['dynamic']:.2f}x its tensors' "
        f"({where}; DDPKIT_MMAP_THRESHOLD={MMAP_TIGHT} fixes it: {CPU_MEASURED['fixed']:.2f}x, at "
        f"1.26-1.40x the CPU time)"))


def _device(cfg):
    try:
        return resolve_devices(cfg.world_size, cfg.backend, cfg.device)[1]
    except ValueError:
        return cfg.device or "cpu"


def _fixed_threshold():
    """The threshold CPU ranks started now fix glibc's at, when it is 128 KiB or less (the
    measured case; `ddpkit.devices.mmap_threshold`), else None."""
    fixed = mmap_threshold()
    return fixed if fixed is not None and fixed <= MMAP_TIGHT else None
