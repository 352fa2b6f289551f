"""This machine's rates, measured on its ranks (every rank at once, so the cores are as shared
as in a run; `calibrate.calibrate` launches them, fits and caches):

* collectives over the group's transport (gloo on loopback), by size, and the share of a core
  they take from compute beside them (`rank_figures`);
* a reference step's phases, by this thread's CPU time (`reference_phases`);
* and, in the kernel the first time a real-size model needs them (`tables`): matrix products on
  a grid of shapes (m, n, k in 8..1024) in float32 and bfloat16, attention (the CPU flash
  kernel) forward and backward, memory-bound ops by size and each common op's own factor.

Each measurement repeats until it has run a stated time and takes the median, so a core taken
by something else for a moment is not measured.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

import torch

from ..engine import policies, strategies
from ..engine.data import RankBatches, make_dataset
from ..engine.step import train_step, zero_grad
from ..spec.model import build_model

SIZES = (8, 32, 128, 512, 1024)
"""The grid of matrix sizes (m, n and k each) a matrix product is measured at."""
MAX_FLOPS = 2.2e9
"""Grid points above this many FLOPs are not run: their rate is their smaller neighbours'."""
MEMORY_SIZES = (2**10, 2**14, 2**18, 2**22, 2**24)
"""Bytes a memory-bound op moves, for its rate by size."""


CLOCK = time.thread_time
"""The clock compute is measured by: this thread's CPU time, so a machine loaded by other work
gives the ops' own costs (collectives are timed by the wall clock: they wait on peers)."""


def timed(fn, min_s=0.01, rounds=5, clock=None):
    """Median seconds of one call of ``fn`` over ``rounds`` rounds of at least ``min_s``, by
    ``clock`` (`CLOCK` when not given)."""
    clock = clock or CLOCK
    fn()
    out = []
    for _ in range(rounds):
        n, start = 0, clock()
        while True:
            fn()
            n += 1
            elapsed = clock() - start
            if elapsed >= min_s:
                break
        out.append(elapsed / n)
    return statistics.median(out)


def gemm_table(dtype, sizes=SIZES, tick=None):
    """{"sizes", "log_rate"[m][n][k]}: log FLOP/s of a (m, k) @ (k, n) product per grid point;
    points above `MAX_FLOPS` take the rate of the largest measured point below them."""
    dt = getattr(torch, dtype)
    grid = [[[None] * len(sizes) for _ in sizes] for _ in sizes]
    for i, m in enumerate(sizes):
        for j, n in enumerate(sizes):
            for k_, k in enumerate(sizes):
                if 2 * m * n * k > MAX_FLOPS:
                    continue
                a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
                grid[i][j][k_] = math.log(2 * m * n * k / timed(lambda: torch.mm(a, b)))
                if tick:
                    tick()
    for i in range(len(sizes)):  # fill the points not run from their measured neighbours
        for j in range(len(sizes)):
            for k_ in range(len(sizes)):
                if grid[i][j][k_] is None:
                    grid[i][j][k_] = max(grid[a][b][c] for a in range(i + 1)
                                         for b in range(j + 1) for c in range(k_ + 1)
                                         if grid[a][b][c] is not None)
    return {"sizes": list(sizes), "log_rate": grid}


def attention_points(dtype, tick=None):
    """{"forward"/"backward": [(flops, FLOP/s)...]}: CPU's causal flash attention at batch x
    heads 8, head dim 64, sequence lengths 32..1024."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    dt = getattr(torch, dtype)
    out = {"forward": [], "backward": []}
    for T in (32, 128, 512, 1024):
        q, k, v = (torch.randn(2, 4, T, 64, dtype=dt, requires_grad=True) for _ in range(3))
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        out["forward"].append((flops, flops / timed(fwd)))
        o = fwd()
        g = torch.randn_like(o)
        both = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), g))
        bflops = sdpa_backward_flop_count(o.shape, q.shape, k.shape, v.shape)
        out["backward"].append((bflops, bflops / max(both - flops / out["forward"][-1][1], 1e-9)))
        if tick:
            tick()
    return out


_MEMORY_OPS = {  # op name -> (make its inputs from n elements, run it, bytes moved per element)
    "add": (lambda n: (torch.randn(n), torch.randn(n)), lambda a, b: torch.add(a, b), 12),
    "mul": (lambda n: (torch.randn(n), torch.randn(n)), lambda a, b: torch.mul(a, b), 12),
    "copy_": (lambda n: (torch.empty(n), torch.randn(n)), lambda a, b: a.copy_(b), 8),
    "gelu": (lambda n: (torch.randn(n),), lambda a: torch.nn.functional.gelu(a), 8),
    "native_layer_norm": (lambda n: (torch.randn(n // 256, 256),),
                          lambda a: torch.nn.functional.layer_norm(a, (256,)), 8),
    "_softmax": (lambda n: (torch.randn(n // 256, 256),), lambda a: torch.softmax(a, -1), 8),
    "sum": (lambda n: (torch.randn(n // 256, 256),), lambda a: a.sum(-1), 4),
    "addcdiv_": (lambda n: (torch.randn(n), torch.randn(n), torch.rand(n) + 1),
                 lambda a, b, c: a.addcdiv_(b, c), 16),
}


def memory_rates(tick=None):
    """{"bytes_per_s": [(bytes, rate)...] (``add``'s, the reference), "ops": {name: factor}}:
    each op's rate over ``add``'s at 1 MiB."""
    ref = []
    for nbytes in MEMORY_SIZES:
        n = max(nbytes // 12, 1)
        a, b = torch.randn(n), torch.randn(n)
        ref.append((12 * n, 12 * n / timed(lambda: torch.add(a, b))))
    at = 2**20
    factors = {}
    a_rate = dict(ref)
    near = min(a_rate, key=lambda x: abs(math.log(x / at)))
    for name, (make, run, per) in _MEMORY_OPS.items():
        n = max(at // per, 256)
        args = make(n)
        rate = per * n / timed(lambda: run(*args))
        factors[name] = rate / a_rate[near]
        if tick:
            tick()
    return {"bytes_per_s": ref, "ops": factors}


# ----------------------------------------------------------------------------- on the ranks
COLLECTIVE_SIZES = tuple(4 ** i for i in range(5, 14))  # 1 KiB .. 64 MiB
"""Payload bytes each collective is timed at."""


def _collective(kind, nbytes, world):
    """A function that runs one collective of ``nbytes`` payload, as the strategies issue it."""
    import torch.distributed as dist

    n = max(nbytes // 4, world)
    if kind == "allreduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t)
    if kind == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, 0)
    shard = max(n // world, 1)
    if kind == "allgather":
        inp, out = torch.ones(shard), torch.empty(shard * world)
        return lambda: dist.all_gather_into_tensor(out, inp)
    inp, out = torch.ones(shard * world), torch.empty(shard)  # reduce_scatter
    return lambda: dist.reduce_scatter_tensor(out, inp)


def collective_points(world, kinds=("allreduce", "allgather", "reduce_scatter", "broadcast"),
                      sizes=COLLECTIVE_SIZES, tick=None):
    """{"kind/world": [(payload bytes, seconds)...]}: each collective's median time on this
    group (every rank runs it; a barrier before each round)."""
    import torch.distributed as dist

    out = {}
    for kind in kinds:
        points = []
        for nbytes in sizes:
            run = _collective(kind, nbytes, world)
            run()
            times = []
            for _ in range(5):
                dist.barrier()
                reps = max(1, min(20, int(2e6 // max(nbytes, 1))))
                start = time.perf_counter()
                for _ in range(reps):
                    run()
                times.append((time.perf_counter() - start) / reps)
            points.append((nbytes, statistics.median(times)))
            if tick:
                tick()
        out[f"{kind}/{world}"] = points
    return out


def comm_cpu_share(world, rounds=40):
    """The share of a collective's time that it takes from compute on this rank: how much
    slower matrix products run while ``rounds`` all-reduces of 4 MiB run on another thread
    (gloo's copies and adds run on the rank's cores) than alone. Every rank runs the same
    number of all-reduces, so none waits for a peer that stopped."""
    import threading

    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    alone = timed(lambda: torch.mm(a, b), min_s=0.05, clock=time.perf_counter)  # the wall's
    t = torch.ones(2**20)
    dist.barrier()
    worker = threading.Thread(target=lambda: [dist.all_reduce(t) for _ in range(rounds)])
    done, start = 0, time.perf_counter()
    worker.start()
    while worker.is_alive():
        torch.mm(a, b)
        done += 1
    beside = (time.perf_counter() - start) / max(done, 1)
    worker.join()
    dist.barrier()
    return max(0.0, min(1.0, 1.0 - alone / beside))


def rank_figures(ctx, tick_every=4):
    """What the ranks measure together: each collective by size on this group, and the share
    of a core they take from compute; rank 0's figures are returned. ``ctx.log`` ticks the
    kernel's progress bar."""
    count = [0]

    def tick():
        count[0] += 1
        if count[0] % tick_every == 0:
            ctx.log(stage="calibrating", done=count[0])
    out = {"threads": torch.get_num_threads(),
           "collectives": collective_points(ctx.world_size, tick=tick),
           "comm_cpu_share": comm_cpu_share(ctx.world_size)}
    return out if ctx.rank == 0 else None


def tables(threads):
    """The rate tables of `machine.Machine` for ops too large to run again here (a real-size
    model's): matrix products, attention and memory-bound ops, with ``threads`` threads (a
    rank's). Measured in the kernel by this thread's CPU time, the first time one is needed."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {"gemm": {d: gemm_table(d) for d in ("float32", "bfloat16")},
                "attention": {d: attention_points(d) for d in ("float32", "bfloat16")},
                "memory": memory_rates()}
    finally:
        torch.set_num_threads(before)


def reference_phases(ctx, plan, steps=12):
    """This thread's CPU seconds in each phase of a step of ``plan`` (a `RankPlan`) on this
    rank (its own model, policy, wrapping and batches, as `engine.loop.train_rank` builds them),
    the median over the steps after the first three; and the whole step's (``step``). Rank 0's;
    None elsewhere."""
    model = build_model(plan)[0]
    policies.install(plan, model)
    wrapped, optimizer, _ = strategies.wrap(plan, model, ctx, count_comm=False)
    data = RankBatches(make_dataset(plan), ctx.rank, ctx.world_size, shuffle=False)
    seconds = {}

    @contextlib.contextmanager
    def phase(name):
        start = time.thread_time()
        yield
        seconds[name] = seconds.get(name, 0.0) + time.thread_time() - start
    out, consumed = [], 0
    for _ in range(steps):
        seconds.clear()
        batches = data.micro_batches(consumed, plan.micro_batch, plan.accum_steps)
        consumed += ctx.world_size * plan.micro_batch * plan.accum_steps
        start = time.thread_time()
        train_step(wrapped, optimizer, batches, accum_steps=plan.accum_steps, no_sync=plan.no_sync,
                   precision=strategies.autocast_precision(plan), loss_fn=plan.loss_fn,
                   phase=phase)
        zero_grad(optimizer)
        out.append({**seconds, "step": time.thread_time() - start})
    if ctx.rank:
        return None
    return {k: statistics.median(o[k] for o in out[3:]) for k in out[0]}
