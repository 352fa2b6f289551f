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

import json
import os
import statistics

import numpy as np
import torch

from ..config import TrainConfig
from ..devices import cuda_gpus
from ..engine.loop import train_rank
from ..engine.saving import atomic_write_bytes
from ..runtime.launch import launch
from . import rates
from .machine import Machine
from .optrace import Op
from .simulate import simulate

REFERENCES = (dict(model="gpt", n_blocks=2, width=32, seq_len=16, micro_batch=2, optimizer="adamw"),
              dict(model="mlp", n_blocks=4, width=32, micro_batch=4),
              dict(model="gpt", n_blocks=4, width=128, seq_len=64, micro_batch=4,
                   optimizer="adamw"),
              dict(model="mlp", n_blocks=4, width=256, micro_batch=16, optimizer="adamw",
                   checkpoint=2))
"""The built-in models' steps the framework's per-op cost is fitted on: two small enough that
the cost is most of the step, two where compute is, one with recompute."""
REFERENCE_STEPS = 12


def phase_seconds(records):
    """Median seconds per optimizer step of forward, backward (recompute in it) and the optimizer,
    and the whole step, from rank 0's records with a timeline on every step (steps after the
    first two: DDP rebuilds its buckets at step 1)."""
    per_step = []
    for rec in records:
        if rec["rank"] != 0 or rec["step"] < 2 or "timeline" not in rec:
            continue
        span = {}
        for _, _, micro, kind, name, start, end, _ in rec["timeline"]:
            if kind == "allreduce":
                continue
            key = "backward" if kind == "recompute" else kind
            a, b = span.get((key, micro), (start, end))
            span[(key, micro)] = (min(a, start), max(b, end))
        totals = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for (key, _), (a, b) in span.items():
            totals[key] += b - a
        totals["step"] = rec["step_time_s"]
        per_step.append(totals)
    return {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}


def machine_key(threads):
    """What a calibration holds for: this host, its processor and cores, torch, the threads of
    a rank."""
    import platform

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{platform.node()} | {cpu} | {os.cpu_count()} cores | torch {torch.__version__} | "
            f"{threads} thread(s) a rank")


def cache_path(key):
    import hashlib

    folder = os.environ.get("DDPKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "ddpkit")
    return os.path.join(folder, "calibration",
                        hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def _phase_model(machine, stream):
    """Per phase: (seconds without the framework's per-op cost, ops, views) of a stream."""
    out = {p: [0.0, 0, 0] for p in ("forward", "backward", "optimizer")}
    for op in stream:
        if not isinstance(op, Op) or op.kind == "collective" or op.phase not in out:
            continue
        seconds = machine.op_s(op)
        entry = out[op.phase]  # recompute is part of the backward here, as in the timeline
        entry[0] += seconds
        entry[2 if op.kind == "view" else 1] += 1
    return out


def fit_overheads(machine, measured, streams):
    """The framework's seconds per op and per view, in each phase, that bring the model of the
    reference steps to their measured phases (least squares, never below zero); and the
    step's fixed work (what the step took beyond its phases)."""
    saved = dict(machine.overhead)
    machine.overhead = {}
    models = [_phase_model(machine, s) for s in streams]
    out, fixed = {}, []
    for phase in ("forward", "backward", "optimizer"):
        a = np.array([[m[phase][1], m[phase][2]] for m in models], dtype=float)
        b = np.array([meas[phase] - m[phase][0] for meas, m in zip(measured, models)])
        coef = np.linalg.lstsq(a, b, rcond=None)[0]
        if coef.min() < 0:  # one of the two alone, the better fit
            fits = [(max(0.0, float(np.linalg.lstsq(a[:, [j]], b, rcond=None)[0][0])), j)
                    for j in (0, 1)]
            fits = [(c, j, float(np.sum((a[:, j] * c - b) ** 2))) for c, j in fits]
            c, j, _ = min(fits, key=lambda f: f[2])
            coef = [c, 0.0] if j == 0 else [0.0, c]
        out[phase], out[phase + "_view"] = float(coef[0]), float(coef[1])
    for meas in measured:
        fixed.append(meas["step"] - meas["forward"] - meas["backward"] - meas["optimizer"])
    machine.overhead = {**saved, **out, "other": out["forward"]}
    return machine.overhead, max(0.0, statistics.median(fixed))


def _launch(fn, *args, world_size, on_metric=None, **kw):
    """``fn`` on the shared warm pool of ``world_size`` CPU ranks (gloo), as a run has them."""
    return launch(fn, *args, world_size=world_size, backend="gloo", device="cpu", pool=True,
                  on_metric=on_metric, stall_timeout_s=600, **kw)


def _reference_steps(world_size, tick):
    """Each reference config's measured phases on ``world_size`` ranks, and its config."""
    out = []
    for ref in REFERENCES:
        cfg = TrainConfig(**ref, world_size=world_size, steps=REFERENCE_STEPS, timeline_every=1,
                          backend="gloo", device="cpu")
        res = _launch(train_rank, cfg, world_size=world_size, return_weights=False)
        out.append((cfg, phase_seconds(res.metrics)))
        tick()
    return out


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
    if not refresh and os.path.exists(path):
        with open(path) as fh:
            return Machine.from_json(json.load(fh))
    machine = calibrate_gpu(key, min(len(gpus), 8), progress) if gpus else \
        _calibrate_cpu(key, progress)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, json.dumps(machine.to_json()).encode())
    return machine


def calibrate_gpu(key, world, progress=True):
    """This machine's GPUs, measured on ``world`` NCCL ranks (`rates.gpu_figures`)."""
    bar = _bar(progress)
    try:
        res = launch(rates.gpu_figures, world_size=world,
                     device="cuda", pool=True, stall_timeout_s=900,
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
    from . import hardware

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
        four = _launch(rates.rank_figures, world_size=4, compute=False,
                       on_metric=tick).returns[0]
        machine = Machine(f"this machine ({os.cpu_count()} cores, CPU ranks, gloo)",
                          threads=two["threads"], gemm=two["gemm"], attention=two["attention"],
                          memory=two["memory"], collectives={**two["collectives"],
                                                             **four["collectives"]},
                          comm_cpu_share=two["comm_cpu_share"], key=key)
        refs = _reference_steps(2, tick)
        streams = [simulate(cfg, 0).stream for cfg, _ in refs]
        machine.overhead, machine.step_s = fit_overheads(machine, [m for _, m in refs], streams)
        machine.contention = _contention(refs[2], tick)
    finally:
        if bar is not None:
            bar.close()
    return machine


def _contention(reference, tick):
    """{"4/cores": ...}: how much slower a rank computes with 4 ranks than with 2 on this
    machine (the reference step's forward and backward, measured both ways)."""
    cfg, two = reference
    four = _reference_steps_one(cfg.replace(world_size=4))
    tick()
    cores = os.cpu_count() or 1
    ratio = (four["forward"] + four["backward"]) / (two["forward"] + two["backward"])
    base = max(1.0, 2 / cores)
    return {f"2/{cores}": base, f"4/{cores}": base * ratio}


def _reference_steps_one(cfg):
    res = _launch(train_rank, cfg, world_size=cfg.world_size, return_weights=False)
    return phase_seconds(res.metrics)


def _bar(progress):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=None, desc="calibrating this machine", unit="step", leave=False)
