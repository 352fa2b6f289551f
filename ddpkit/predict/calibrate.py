"""`calibrate()`: this machine's `machine.Machine`, measured once and kept.

It launches ranks (the shared pool's, as a run has them) that measure matrix products,
attention, memory-bound ops and collectives every rank at once (`rates.py`); runs the built-in
models' real steps at small sizes with a timeline on every step, and fits the framework's cost
per dispatched op in each phase to them (least squares over their simulated streams: the cost
that is most of a small step); measures how much slower a rank computes when more ranks than
cores share the machine (a reference step on 4 ranks against 2); and keeps the answer per
machine, torch version and threads per rank as JSON in ``~/.cache/ddpkit/calibration/``
(``DDPKIT_CACHE`` moves it). ``refresh=True`` measures again. On a machine with CUDA GPUs it
measures them instead (`calibrate_gpu`): the same figures on the GPU, timed with CUDA events,
the host's cost of issuing each op, a kernel's fixed cost, NCCL's collectives on real ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import torch

from ..config import TrainConfig
from ..devices import cuda_gpus, mmap_threshold
from ..engine.saving import atomic_write_bytes
from ..runtime.launch import launch
from . import hardware, rates, replay
from .machine import Machine
from .optrace import Op
from .player import play
from .simulate import simulate

REFERENCES = (dict(model="gpt", n_blocks=2, width=32, seq_len=16, micro_batch=2, optimizer="adamw"),
              dict(model="mlp", n_blocks=4, width=32, micro_batch=4),
              dict(model="gpt", n_blocks=4, width=128, seq_len=64, micro_batch=4,
                   optimizer="adamw"),
              dict(model="mlp", n_blocks=4, width=256, micro_batch=16, optimizer="adamw",
                   checkpoint=2),
              dict(model="mlp", n_blocks=2, width=512, micro_batch=8))
"""The built-in models' steps the framework's per-op cost is fitted on: two small enough that
the cost is most of the step, two where compute is, one with recompute, one whose all-reduce
is most of it (the share of a core communication takes, `fit_share`)."""


def machine_key(threads):
    """What a calibration holds for: this host, its processor and cores, torch, the threads of
    a rank, and the CPU ranks' glibc mmap threshold (`devices.mmap_threshold`: ranks with it
    fixed at 128 KiB ran 1.26-1.40x slower, bench/results.md, so neither's rates are the
    other's)."""
    import platform

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{platform.node()} | {cpu} | {os.cpu_count()} cores | torch {torch.__version__} | "
            f"{threads} thread(s) a rank | mmap threshold {mmap_threshold() or 'dynamic'}")


def cache_path(key):
    import hashlib

    folder = os.environ.get("DDPKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "ddpkit")
    return os.path.join(folder, "calibration",
                        hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


VIEW_WEIGHT = 0.5
"""A view op's dispatch cost in units of another op's (it runs no kernel)."""
PHASES = ("forward", "backward", "optimizer")


def fit_costs(machine, refs):
    """From the reference steps (``refs``: (their simulated stream, what a rank measured:
    phases and each op's own seconds, `rates.reference_phases`)): each op's cost in a rank over
    its cost run alone (``factor``: by phase and op name, and by phase and kind for the ops the
    references do not run), and beyond it per byte moved (``per_byte``: by phase and kind); each phase's cost per dispatched op (``overhead``: what the phase
    took beyond its ops' own seconds); and the step's fixed work (beyond its phases)."""
    alone, inside, kinds, per_op, fixed = {}, {}, {}, {p: [] for p in PHASES}, []
    moved = {}  # bytes by key
    for stream, measured in refs:
        ops = [e for e in stream if isinstance(e, Op) and e.kind != "collective"
               and e.phase in PHASES]
        for op in ops:
            t = machine.replayed.get(replay.key(op.recipe)) if op.recipe is not None else None
            if t:
                key = f"{op.phase}/{op.name}"
                alone[key] = alone.get(key, 0.0) + t
                moved[key] = moved.get(key, 0) + op.bytes
                kinds[key] = "memory" if op.kind == "memory" else "compute"
        for key, t in measured["ops"].items():
            inside[key] = inside.get(key, 0.0) + t
        for phase in PHASES:
            own = sum(t for k, t in measured["ops"].items() if k.startswith(phase + "/"))
            n = sum(VIEW_WEIGHT if op.kind == "view" else 1.0 for op in ops if op.phase == phase)
            per_op[phase].append(max(0.0, measured[phase] - own) / max(n, 1.0))
        fixed.append(measured["step"] - sum(measured[p] for p in PHASES))
    factor = {k: inside[k] / alone[k] for k in alone if inside.get(k)}
    measured = list(factor)
    for phase in PHASES:  # the ops no reference runs: their kind's, in their phase
        for kind in ("memory", "compute"):
            keys = [k for k in measured if k.startswith(phase + "/") and kinds[k] == kind]
            if keys:
                factor[f"{phase}/{kind}"] = (sum(inside[k] for k in keys)
                                             / sum(alone[k] for k in keys))
    per_byte = {}
    for phase in PHASES:  # in a step, an op costs its cost alone and a cost per byte it moves
        for kind in ("memory", "compute"):
            keys = [k for k in measured if k.startswith(phase + "/") and kinds[k] == kind]
            if keys and sum(moved[k] for k in keys):
                extra = sum(inside[k] - alone[k] for k in keys)
                per_byte[f"{phase}/{kind}"] = max(0.0, extra / sum(moved[k] for k in keys))
    overhead = {}
    for phase in PHASES:
        overhead[phase] = statistics.median(per_op[phase])
        overhead[phase + "_view"] = VIEW_WEIGHT * overhead[phase]
    overhead["other"], overhead["other_view"] = overhead["forward"], overhead["forward_view"]
    return overhead, factor, per_byte, max(0.0, statistics.median(fixed))


SHARES = [i / 20 for i in range(21)]


def fit_share(machine, refs, ranks):
    """The share of a core a collective takes from compute (`Machine.comm_cpu_share`) that
    predicts the reference steps' wall seconds best (their relative errors' squares, summed):
    on CPU ranks gloo's copies and sums run on the cores the ranks compute on."""
    def error(share):
        machine.comm_cpu_share = share
        return sum((play(stream, machine, ranks=ranks)[0] / measured["wall"] - 1) ** 2
                   for stream, measured in refs)
    return min(SHARES, key=error)


def _launch(fn, *args, world_size, on_metric=None, **kw):
    """``fn`` on the shared warm pool of ``world_size`` CPU ranks (gloo), as a run has them."""
    return launch(fn, *args, world_size=world_size, backend="gloo", device="cpu", pool="shared",
                  on_metric=on_metric, stall_timeout_s=600, **kw)


def _reference_steps(world_size, tick):
    """Each reference config and its phases' CPU seconds on rank 0 of ``world_size`` ranks."""
    out = []
    for ref in REFERENCES:
        cfg = TrainConfig(**ref, world_size=world_size, backend="gloo", device="cpu")
        out.append((cfg, _launch(rates.reference_phases, cfg.rank_plan(),
                                 world_size=world_size).returns[0]))
        tick()
    return out


_LOADED = {}  # cache path -> the Machine this process holds (its replays grow as it predicts)


def cached():
    """This machine's `Machine` for CPU ranks if it has been calibrated (the cache), else None:
    never measures (what the Lab's read-out and `train` use, which must not wait a minute)."""
    path = cache_path(machine_key(max(1, (os.cpu_count() or 1) // 2)))
    if path in _LOADED or os.path.exists(path):
        return calibrate(progress=False, device="cpu")
    return None


def calibrate(refresh=False, progress=True, device=None):
    """This machine's `Machine`: from the cache when it has one for this machine, torch and
    threads per rank, else measured now and kept. ``device="cuda"`` (the default where CUDA
    GPUs are visible): its GPUs' ranks (`calibrate_gpu`: NCCL, one rank per GPU, up to 8);
    ``"cpu"`` (the default elsewhere): CPU ranks over gloo (about 30-60 s on 2 cores).
    ``refresh=True`` measures again."""
    gpus = cuda_gpus()
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"calibrate(device={device!r}): pass 'cpu', 'cuda' or None (the GPUs "
                         f"where there are some)")
    if device == "cuda" and not gpus:
        raise ValueError("calibrate(device='cuda'): this machine has no visible CUDA GPU; pass "
                         "device='cpu', or step_time(device='H100') for a named GPU")
    gpus = gpus if device != "cpu" else []
    threads = max(1, (os.cpu_count() or 1) // 2)  # what the launcher gives each of 2+ ranks
    key = machine_key(threads) + (f" | {len(gpus)} GPU(s) {gpus}" if gpus else "")
    path = cache_path(key)
    if not refresh and path in _LOADED:
        return _LOADED[path]
    if not refresh and os.path.exists(path):
        with open(path) as fh:
            _LOADED[path] = Machine.from_json(json.load(fh))
        return _LOADED[path]
    machine = calibrate_gpu(key, min(len(gpus), 8), progress) if gpus else \
        _calibrate_cpu(key, progress)
    remember(machine)
    _LOADED[path] = machine
    return machine


def calibrate_gpu(key, world, progress=True):
    """This machine's GPUs, measured on ``world`` NCCL ranks (`rates.gpu_figures`)."""
    bar = _bar(progress)
    try:
        res = launch(rates.gpu_figures, world_size=world,
                     device="cuda", pool="shared", stall_timeout_s=900,
                     on_metric=lambda r: bar.update(1) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    return gpu_machine(res.returns[0], world, key)


def gpu_machine(fig, world, key=""):
    """A `Machine` of kind ``"cuda"`` from a CUDA rank's figures (`rates.gpu_figures`): its
    matrix products, attention, memory-bound ops, host costs and kernel cost as measured; its
    collectives as measured on ``world`` ranks, or, on one GPU, the catalogue's link for the
    card (`hardware`) where it knows it; its peak (for MFU) where the catalogue knows it."""
    device = hardware.device_for(fig["gpu"])
    collectives = dict(fig.get("collectives") or {})
    notes = [f"{fig['gpu']}: measured on this machine ({world} GPU(s))"]
    if not collectives and device is not None:
        inside = hardware.LINKS[device.nvlink]
        collectives = {"link": [inside.bus, inside.latency], "node": device.node}
        notes.append(f"collectives: one GPU here, so the catalogue's {device.nvlink}")
    peak = {} if device is None else {"bfloat16": device.bf16, "float16": device.bf16,
                                      "float32": device.fp32}
    return Machine(f"this machine's {fig['gpu']}", kind="cuda", threads=fig["threads"],
                   gemm=fig["gemm"], attention=fig["attention"], memory=fig["memory"],
                   overhead=fig["overhead"], kernel_s=fig["kernel_s"], collectives=collectives,
                   peak_flops=peak, key=key, notes=notes)


def _calibrate_cpu(key, progress):
    bar = _bar(progress)

    def tick(record=None):
        if bar is not None and (record is None or record.get("rank") == 0):
            bar.update(1)
    try:
        two = _launch(rates.rank_figures, world_size=2, on_metric=tick).returns[0]
        four = _launch(rates.rank_figures, world_size=4, on_metric=tick).returns[0]
        machine = Machine(f"this machine ({os.cpu_count()} cores, CPU ranks, gloo)",
                          threads=two["threads"], collectives={**two["collectives"],
                                                               **four["collectives"]},
                          key=key)
        refs = [(simulate(cfg, 0).stream, measured) for cfg, measured in
                _reference_steps(2, tick)]
        for stream, _ in refs:
            replay.learn(machine, stream)
        machine.overhead, machine.factor, machine.per_byte, machine.step_s = fit_costs(machine,
                                                                                     refs)
        machine.comm_cpu_share = fit_share(machine, refs, ranks=2)
    finally:
        if bar is not None:
            bar.close()
    return machine


def remember(machine):
    """Keep ``machine`` in its cache file (written whole, atomically)."""
    path = cache_path(machine.key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with replay.LEARNING:  # not while another thread adds to its figures
        data = json.dumps(machine.to_json()).encode()
    atomic_write_bytes(path, data)


def _bar(progress):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=None, desc="calibrating this machine", unit="step", leave=False)
