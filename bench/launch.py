"""Time from call to first record: ddpkit cold launch (spawn, and forkserver), ddpkit warm pool,
plain mp.spawn, torchrun; and a kernel's first and second `ddpkit.train`.

    python -m bench.launch [--repeat 5] [--worlds 2,4,8] [--device cuda]

Each method runs the same job (gloo group up, one all-reduce, one record on rank 0), interleaved
round by round so machine noise hits all methods alike, at each world size. ``forkserver`` (the
default on a CPU build) and ``spawn`` are set with ``DDPKIT_START_METHOD``: the server (one fresh
interpreter that imports torch) starts
with the first launch of a kernel, timed apart in a fresh process ("first launch"); later
launches fork from it. torchrun runs at 2 ranks only (it costs seconds more, every time).
The last table is what a notebook sees: in a fresh process, the first `ddpkit.train` of a tiny
config (the shared pool starts) and the second (it is warm), to the first record.
Targets: cold <= 1.2x mp.spawn; warm pool >= 10x faster than cold; second train >= 10x sooner
than the first. ``--device cuda``: the all-reduce is on the GPUs, over the backend ddpkit picks
(NCCL with 2+ GPUs, gloo on one shared GPU), in every method alike.
"""
import json
import os
import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ddpkit
from bench._common import machine, summary, table
from bench._plain_work import first_record
from ddpkit.devices import resolve_devices
from ddpkit.runtime.start import START_ENV

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cpu"  # set by main()


def job(ctx):
    dist.all_reduce(torch.ones(1, device=ctx.device))
    ctx.log(step=0)


def _until_first_record(run):
    first = []
    t0 = time.monotonic()
    run(lambda rec: first.append(time.monotonic()) if not first else None)
    return first[0] - t0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddpkit_cold(world, method="spawn"):
    os.environ[START_ENV] = method
    try:
        return _until_first_record(lambda cb: ddpkit.launch(job, world_size=world, device=DEVICE,
                                                            on_metric=cb))
    finally:
        del os.environ[START_ENV]


def ddpkit_warm(pool):
    return _until_first_record(lambda cb: pool.launch(job, on_metric=cb))


def plain_spawn(world):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.time()
    args = (world, free_port(), queue, DEVICE, resolve_devices(world, None, DEVICE)[0])
    pc = mp.start_processes(first_record, args=args, nprocs=world, join=False,
                            start_method="spawn")
    stamp = queue.get()
    pc.join()
    return stamp - t0


def torchrun():
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(ROOT / "bench" / "_plain_work.py"),
                          DEVICE, resolve_devices(2, None, DEVICE)[0]],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    stamp = float(next(l.split()[1] for l in out.stdout.splitlines() if l.startswith("FIRST_RECORD")))
    return stamp - t0


# a fresh process standing for a fresh kernel: what its first launches cost
FRESH = """
import json, os, sys, time
import ddpkit
from bench.launch import job, _until_first_record
device, world, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = []
if what == "forkserver":
    os.environ["DDPKIT_START_METHOD"] = "forkserver"
    for _ in range(2):
        out.append(_until_first_record(lambda cb: ddpkit.launch(job, world_size=world,
                                                                device=device, on_metric=cb)))
else:
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=2, width=16, micro_batch=4, steps=2,
                             world_size=world, device=device)
    for _ in range(2):
        out.append(_until_first_record(lambda cb: ddpkit.train(cfg, on_metric=cb)))
print("TIMES", json.dumps(out))
"""


def in_fresh_process(world, what):
    """(first, second) seconds to the first record in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", FRESH, DEVICE, str(world), what], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("TIMES"))[6:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--worlds", default="2,4,8", help="world sizes, comma-separated")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    worlds = [int(w) for w in args.worlds.split(",")]
    backend = resolve_devices(2, None, DEVICE)[0]
    flag = "" if DEVICE == "cpu" else f" --device {DEVICE}"
    text = (f"### Launch: call to first record (`python -m bench.launch --repeat {args.repeat} "
            f"--worlds {args.worlds}{flag}`)\n\n{backend} on {DEVICE}. Machine: {machine()}\n")
    verdicts = []
    for world in worlds:
        names = ["ddpkit cold launch (spawn)", "ddpkit cold launch (forkserver)",
                 "ddpkit warm pool", "plain mp.spawn"] + (["torchrun"] if world == 2 else [])
        times = {k: [] for k in names}
        first_fs = []
        with ddpkit.Pool(world_size=world, device=DEVICE) as pool:
            pool.launch(job)  # the pool's ranks are up before timing starts
            ddpkit_cold(world, "forkserver")  # the forkserver is up: its first start is below
            for _ in range(args.repeat):
                times["ddpkit cold launch (spawn)"].append(ddpkit_cold(world))
                times["ddpkit cold launch (forkserver)"].append(ddpkit_cold(world, "forkserver"))
                times["ddpkit warm pool"].append(ddpkit_warm(pool))
                times["plain mp.spawn"].append(plain_spawn(world))
                if world == 2:
                    times["torchrun"].append(torchrun())
                first_fs.append(in_fresh_process(world, "forkserver")[0])
        times["ddpkit forkserver, a kernel's first launch"] = first_fs
        med = {k: summary(v)[0] for k, v in times.items()}
        rows = [(k, summary(v)[1], f"{med[k] / med['plain mp.spawn']:.2f}x")
                for k, v in times.items()]
        text += f"\n\n{world} ranks:\n\n" + table(["method", "median (spread)", "vs mp.spawn"], rows)
        cold = med["ddpkit cold launch (spawn)"] / med["plain mp.spawn"]
        speedup = med["ddpkit cold launch (spawn)"] / med["ddpkit warm pool"]
        verdicts.append(f"{world} ranks: cold / mp.spawn = {cold:.2f} (target <= 1.2): "
                        f"{'met' if cold <= 1.2 else 'MISSED'}; cold / warm = {speedup:.0f}x "
                        f"(target >= 10x): {'met' if speedup >= 10 else 'MISSED'}; forkserver / "
                        f"spawn = {med['ddpkit cold launch (forkserver)'] / med['ddpkit cold launch (spawn)']:.2f}")
    firsts, seconds = [], []
    for _ in range(args.repeat):
        a, b = in_fresh_process(2, "train")
        firsts.append(a)
        seconds.append(b)
    ratio = summary(firsts)[0] / summary(seconds)[0]
    text += ("\n\nA fresh kernel's `ddpkit.train` of a tiny config, 2 ranks, to its first record:"
             "\n\n" + table(["train", "median (spread)"],
                             [("first (the shared pool starts)", summary(firsts)[1]),
                              ("second (the pool is warm)", summary(seconds)[1])])
             + f"\n\nfirst / second = {ratio:.0f}x (target >= 10x): "
               f"{'met' if ratio >= 10 else 'MISSED'}\n\n" + "\n".join(f"- {v}" for v in verdicts)
             + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
