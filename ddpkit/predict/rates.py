"""This machine's rates, measured on its ranks (every rank at once, so the cores are as shared
as in a run; `calibrate.calibrate` launches them, fits and caches). Each function takes the
rank's ``device``: on CPU ranks the clock is the host's; on a CUDA rank each measurement is
timed with CUDA events around its kernels, queued back to back (torch's CUDA semantics docs:
"Asynchronous execution": a host clock would time the launches, not the kernels), and the GPU's
own figures are added (`gpu_figures`: the host's cost of issuing an op, a kernel's fixed cost):

* collectives over the group's transport (gloo on loopback), by size (`rank_figures`);
* a reference step's phases, by this thread's CPU time, and its wall time (`reference_phases`:
  the share of a core collectives take from compute is fitted to it, `calibrate.fit_share`);
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
from torch.utils._python_dispatch import TorchDispatchMode

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


def timed(fn, min_s=0.01, rounds=5, clock=None, device=None):
    """Median seconds of one call of ``fn`` over ``rounds`` rounds of at least ``min_s``, by
    ``clock`` (`CLOCK` when not given). On a CUDA ``device`` the device's seconds: CUDA events
    around the calls of each round."""
    if device is not None and torch.device(device).type == "cuda":
        return _timed_cuda(fn, min_s, rounds)
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


def _timed_cuda(fn, min_s, rounds):
    """CUDA events around ``n`` calls, ``n`` chosen from a first timed call so a round lasts
    about ``min_s`` (events, not a host clock: the calls are queued without waiting)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, min(1000, int(min_s / max(start.elapsed_time(end) / 1e3, 1e-7))))
    out = []
    for _ in range(rounds):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(out)


def gemm_table(dtype, sizes=SIZES, tick=None, device=None, max_flops=MAX_FLOPS):
    """{"sizes", "log_rate"[m][n][k]}: log FLOP/s of a (m, k) @ (k, n) product per grid point;
    points above ``max_flops`` take the rate of the largest measured point below them."""
    dt = getattr(torch, dtype)
    grid = [[[None] * len(sizes) for _ in sizes] for _ in sizes]
    for i, m in enumerate(sizes):
        for j, n in enumerate(sizes):
            for k_, k in enumerate(sizes):
                if 2 * m * n * k > max_flops:
                    continue
                a = torch.randn(m, k, dtype=dt, device=device)
                b = torch.randn(k, n, dtype=dt, device=device)
                grid[i][j][k_] = math.log(2 * m * n * k / timed(lambda: torch.mm(a, b),
                                                                device=device))
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


def attention_points(dtype, tick=None, device=None, lengths=(32, 128, 512, 1024), heads=(2, 4),
                     head_dim=64):
    """{"forward"/"backward": [(flops, FLOP/s)...]}: causal SDPA (the CPU flash kernel, or the
    kernel CUDA picks) at ``heads`` = (batch, heads), sequence lengths ``lengths``. On CUDA the
    FLOPs are those the kernel does (half of torch's count: a causal kernel skips the masked
    half; `Machine.device_s` halves a causal op's count the same way)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    dt = getattr(torch, dtype)
    share = 0.5 if device is not None and torch.device(device).type == "cuda" else 1.0
    out = {"forward": [], "backward": []}
    for T in lengths:
        q, k, v = (torch.randn(*heads, T, head_dim, dtype=dt, device=device, requires_grad=True)
                   for _ in range(3))
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        flops = share * sdpa_flop_count(q.shape, k.shape, v.shape)
        out["forward"].append((flops, flops / timed(fwd, device=device)))
        o = fwd()
        g = torch.randn_like(o)
        both = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), g), device=device)
        bflops = share * sdpa_backward_flop_count(o.shape, q.shape, k.shape, v.shape)
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


def memory_rates(tick=None, device=None, sizes=MEMORY_SIZES):
    """{"bytes_per_s": [(bytes, rate)...] (``add``'s, the reference), "ops": {name: factor}}:
    each op's rate over ``add``'s at 1 MiB (at the largest size on a GPU, where 1 MiB is a
    kernel's fixed cost more than its bandwidth)."""
    ref = []
    for nbytes in sizes:
        n = max(nbytes // 12, 1)
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        ref.append((12 * n, 12 * n / timed(lambda: torch.add(a, b), device=device)))
    at = 2**20 if device is None or torch.device(device).type == "cpu" else sizes[-1]
    factors = {}
    a_rate = dict(ref)
    near = min(a_rate, key=lambda x: abs(math.log(x / at)))
    for name, (make, run, per) in _MEMORY_OPS.items():
        n = max(at // per, 256)
        args = [t.to(device) for t in make(n)]
        rate = per * n / timed(lambda: run(*args), device=device)
        factors[name] = rate / a_rate[near]
        if tick:
            tick()
    return {"bytes_per_s": ref, "ops": factors}


# ----------------------------------------------------------------------------- on the ranks
COLLECTIVE_SIZES = tuple(4 ** i for i in range(5, 14))  # 1 KiB .. 64 MiB
"""Payload bytes each collective is timed at."""


def _collective(kind, nbytes, world, device=None):
    """A function that runs one collective of ``nbytes`` payload, as the strategies issue it."""
    import torch.distributed as dist

    n = max(nbytes // 4, world)
    ones = lambda m: torch.ones(m, device=device)  # noqa: E731
    if kind == "allreduce":
        t = ones(n)
        return lambda: dist.all_reduce(t)
    if kind == "broadcast":
        t = ones(n)
        return lambda: dist.broadcast(t, 0)
    shard = max(n // world, 1)
    # torch 2.13 names them *_single (the old names warn, FutureWarning); 2.11 has only the old
    if kind == "allgather":
        inp, out = ones(shard), torch.empty(shard * world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    inp, out = ones(shard * world), torch.empty(shard, device=device)  # reduce_scatter
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(out, inp)


def collective_points(world, kinds=("allreduce", "allgather", "reduce_scatter", "broadcast"),
                      sizes=COLLECTIVE_SIZES, tick=None, device=None):
    """{"kind/world": [(payload bytes, seconds)...]}: each collective's median time on this
    group (every rank runs it; a barrier before each round; on CUDA, events around it)."""
    import torch.distributed as dist

    cuda = device is not None and torch.device(device).type == "cuda"
    out = {}
    for kind in kinds:
        points = []
        for nbytes in sizes:
            run = _collective(kind, nbytes, world, device)
            run()
            reps = max(1, min(20, int(2e6 // max(nbytes, 1))))
            if not cuda and reps > 1:
                reps = _agreed_reps(run, reps, device)
            times = []
            for _ in range(5):
                dist.barrier()
                times.append(_events(run, reps) if cuda else _clocked(run, reps))
            points.append((nbytes, statistics.median(times)))
            if tick:
                tick()
        out[f"{kind}/{world}"] = points
    return out


ROUND_S = 0.02
"""A round of a collective's calls on CPU ranks lasts about this long at least: the calls of a
slow one (more ranks than cores: a few ms each, scheduling more than the wire) are not
repeated 20 times a round."""


def _agreed_reps(run, reps, device=None):
    """At most ``reps`` calls a round, fewer where rank 0 sees a call take long enough that
    fewer last `ROUND_S` (its count, broadcast: every rank must run as many collectives)."""
    import torch.distributed as dist

    start = time.perf_counter()
    run()
    one = time.perf_counter() - start
    n = torch.tensor([max(1, min(reps, math.ceil(ROUND_S / max(one, 1e-9))))], device=device)
    dist.broadcast(n, 0)
    return int(n.item())


def _clocked(run, reps):
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - start) / reps


def _events(run, reps):
    """Seconds a call of ``run`` takes on the current CUDA stream: events around ``reps``
    calls (the same count on every rank: each call is a collective)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def rank_figures(ctx, tick_every=4):
    """What the ranks measure together: each collective by size on this group; rank 0's
    figures are returned. ``ctx.log`` ticks the
    kernel's progress bar."""
    count = [0]

    def tick():
        count[0] += 1
        if count[0] % tick_every == 0:
            ctx.log(stage="calibrating", done=count[0])
    out = {"threads": torch.get_num_threads(),
           "collectives": collective_points(ctx.world_size, tick=tick)}
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


class OpClock(TorchDispatchMode):
    """Each op's own seconds inside a real step (this thread's CPU time around the op alone),
    summed by (phase, op name): what an op costs in a rank, caches as the step leaves them and
    its output newly allocated, beside what it costs run alone (`replay`)."""

    def __init__(self):
        super().__init__()
        self.phase, self.seconds = "", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        key = f"{self.phase}/{func._overloadpacket.__name__}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.thread_time() - start
        return out


def reference_phases(ctx, plan, steps=12, clocked=4):
    """A step of ``plan`` (a `RankPlan`) on this rank, as `engine.loop.train_rank` builds it
    (its model, policy, wrapping and batches): this thread's CPU seconds in each phase and the
    whole step (``step``), and the step's wall seconds (``wall``: with its communication), the
    median over ``steps`` steps after the first three; and ``ops``:
    each (phase, op)'s own seconds per step (`OpClock`), over ``clocked`` more steps. Rank 0's;
    None elsewhere."""
    model = build_model(plan)[0]
    policies.install(plan, model)
    wrapped, optimizer, _ = strategies.wrap(plan, model, ctx, count_comm=False)
    data = RankBatches(make_dataset(plan), ctx.rank, ctx.world_size, shuffle=False)
    seconds, clock, consumed = {}, OpClock(), [0]

    @contextlib.contextmanager
    def phase(name):
        start, clock.phase = time.thread_time(), name
        yield
        seconds[name] = seconds.get(name, 0.0) + time.thread_time() - start
        clock.phase = ""

    def one_step():
        seconds.clear()
        batches = data.micro_batches(consumed[0], plan.micro_batch, plan.accum_steps)
        consumed[0] += ctx.world_size * plan.micro_batch * plan.accum_steps
        start, wall = time.thread_time(), time.perf_counter()
        train_step(wrapped, optimizer, batches, accum_steps=plan.accum_steps, no_sync=plan.no_sync,
                   precision=strategies.autocast_precision(plan), loss_fn=plan.loss_fn,
                   phase=phase)
        zero_grad(optimizer)
        return {**seconds, "step": time.thread_time() - start, "wall": time.perf_counter() - wall}
    out = [one_step() for _ in range(steps)]
    with clock:
        for _ in range(clocked):
            one_step()
    if ctx.rank:
        return None
    result = {k: statistics.median(o[k] for o in out[3:]) for k in out[0]}
    result["ops"] = {k: v / clocked for k, v in clock.seconds.items()}
    return result


# ----------------------------------------------------------------------------- a CUDA rank
GPU_SIZES = (64, 256, 1024, 4096, 8192)
"""A GPU's matrix products: m, n and k each (every point runs: 1.1 TFLOP at most)."""
GPU_MEMORY_SIZES = (2**16, 2**20, 2**24, 2**27)
GPU_LENGTHS = (512, 1024, 2048, 4096, 8192)


def host_costs(device, n=200):
    """Seconds the host spends issuing one op on ``device``, by phase (`Machine.overhead`): a
    forward op recorded by autograd (a tiny tensor: the launch, not the kernel, is what is
    timed), a view, one op of autograd's backward, one foreach op over 16 tensors."""
    x = torch.ones(8, device=device, requires_grad=True)

    def host(fn):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        torch.cuda.synchronize(device)
        return seconds / n

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y
    forward = statistics.median(host(chain) for _ in range(5))
    view = statistics.median(host(lambda: [x.view(2, 4) for _ in range(n)]) for _ in range(5))
    out = chain().sum()
    backward = statistics.median(host(lambda: out.backward(retain_graph=True)) for _ in range(5))
    tensors = [torch.ones(8, device=device) for _ in range(16)]
    foreach = statistics.median(host(lambda: [torch._foreach_mul_(tensors, 1.0)
                                             for _ in range(n)]) for _ in range(5))
    return dict(forward=forward, forward_view=view, backward=backward, backward_view=view,
                optimizer=foreach, optimizer_view=view, other=forward, other_view=view)


def kernel_cost(device, n=100):
    """A kernel's fixed cost on the device: a tiny kernel's time, replayed ``n`` at a time from
    a CUDA graph (no launch from the host between them)."""
    y = torch.ones(8, device=device)
    stream = torch.cuda.Stream(device)  # warmed up off the default stream (torch's CUDA
    stream.wait_stream(torch.cuda.current_stream(device))  # graphs docs), then captured
    with torch.cuda.stream(stream):
        y.mul_(1.0)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            y.mul_(1.0)
    return timed(graph.replay, device=device) / n


def gpu_figures(ctx, tick_every=4):
    """Everything a CUDA rank measures on its GPU (``ctx.device``), every rank at once; rank
    0's figures are returned, with the GPU's name and compute capability."""
    count, device = [0], ctx.device

    def tick():
        count[0] += 1
        if count[0] % tick_every == 0:
            ctx.log(stage="calibrating", done=count[0])
    out = {"threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(device),
           "capability": list(torch.cuda.get_device_capability(device))}
    out["gemm"] = {d: gemm_table(d, GPU_SIZES, tick, device, max_flops=float("inf"))
                   for d in ("float32", "bfloat16")}
    out["attention"] = {"bfloat16": attention_points("bfloat16", tick, device, GPU_LENGTHS,
                                                     (4, 16), 128)}
    out["memory"] = memory_rates(tick, device, GPU_MEMORY_SIZES)
    out["overhead"] = host_costs(device)
    out["kernel_s"] = kernel_cost(device)
    if ctx.world_size > 1:
        out["collectives"] = collective_points(ctx.world_size, tick=tick, device=device,
                                               sizes=tuple(4 ** i for i in range(5, 15)))
    return out if ctx.rank == 0 else None
