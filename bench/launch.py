"""Time from call to first record: ddpkit cold launch, ddpkit warm pool, plain mp.spawn, torchrun.

    python -m bench.launch [--repeat 5] [--device cuda]

Each method runs the same job (gloo group up, one all-reduce, one record on rank 0), interleaved
round by round so machine noise hits all methods alike. Targets: cold <= 1.2x mp.spawn; warm pool
>= 10x faster than cold. ``--device cuda``: the all-reduce is on the GPUs, over the backend ddpkit
picks (NCCL with 2+ GPUs, gloo on one shared GPU), in every method alike.
"""
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


def ddpkit_cold():
    return _until_first_record(lambda cb: ddpkit.launch(job, world_size=2, device=DEVICE,
                                                        on_metric=cb))


def ddpkit_warm(pool):
    return _until_first_record(lambda cb: pool.launch(job, on_metric=cb))


def plain_spawn():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.time()
    args = (2, free_port(), queue, DEVICE, resolve_devices(2, None, DEVICE)[0])
    pc = mp.start_processes(first_record, args=args, nprocs=2, join=False, start_method="spawn")
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    backend = resolve_devices(2, None, DEVICE)[0]
    times = {"ddpkit cold launch": [], "ddpkit warm pool": [], "plain mp.spawn": [], "torchrun": []}
    with ddpkit.Pool(world_size=2, device=DEVICE) as pool:
        pool.launch(job)  # the pool's ranks are up before timing starts
        for _ in range(args.repeat):
            times["ddpkit cold launch"].append(ddpkit_cold())
            times["ddpkit warm pool"].append(ddpkit_warm(pool))
            times["plain mp.spawn"].append(plain_spawn())
            times["torchrun"].append(torchrun())
    med = {k: summary(v)[0] for k, v in times.items()}
    rows = [(k, summary(v)[1], f"{med[k] / med['plain mp.spawn']:.2f}x") for k, v in times.items()]
    cold_ratio = med["ddpkit cold launch"] / med["plain mp.spawn"]
    speedup = med["ddpkit cold launch"] / med["ddpkit warm pool"]
    flag = "" if DEVICE == "cpu" else f" --device {DEVICE}"
    text = (f"### Launch: call to first record (`python -m bench.launch --repeat {args.repeat}{flag}`)\n\n"
            f"2 ranks, {backend} on {DEVICE}. Machine: {machine()}\n\n"
            + table(["method", "median (spread)", "vs mp.spawn"], rows)
            + f"\n\ncold / mp.spawn = {cold_ratio:.2f} (target <= 1.2): "
              f"{'met' if cold_ratio <= 1.2 else 'MISSED'}; cold / warm = {speedup:.0f}x "
              f"(target >= 10x): {'met' if speedup >= 10 else 'MISSED'}\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
