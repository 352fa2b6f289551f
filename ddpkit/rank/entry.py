"""How a rank process starts, serves its jobs and ends: one path for ddpkit's ranks and torchrun's.

A rank ddpkit started (spawned, or forked from the forkserver: `ddpkit.runtime.start`) begins in
`rank_main` (a module-level function, so either method finds it by name).
The user's function arrives as cloudpickle bytes over the rank's pipe, which is why a function
or an ``nn.Module`` class defined in a notebook cell works: it travels by value, not by name.
A process torchrun started enters through `torchrun_main` instead. Both live through `_live`:
start up (device, process group), work, then the same teardown whatever happened.
"""
from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
import traceback

import torch

from .. import devices, shipping
from . import heap
from .context import Context
from .fresh import Baseline, release_memory
from .output import Channel, OutputForwarder
from .returns import dumps_for_kernel
from .process_group import destroy_group, init_group, set_collective_timeout, start_group


# torch 2.13 keeps float32 precision per (backend, op) (the fp32_precision API), besides the
# legacy matmul precision and cuDNN TF32 flags it still answers for; a rank reproduces all three
_FP32_KNOBS = [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"),
               ("cuda", "rnn"), ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
               ("mkldnn", "rnn")]


def _legacy(read):
    """A legacy precision getter's answer, or None where torch refuses to answer (it raises
    when the legacy and the new API were mixed: a rank then refuses too)."""
    try:
        return read()
    except RuntimeError:
        return None


def capture_job_state():
    """The kernel's determinism flags and float32 precision (TF32), as carried into ranks."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        # torch.set_float32_matmul_precision / backends.cuda.matmul.allow_tf32 (one legacy
        # setting), backends.cudnn.allow_tf32, and the per-backend table both write into
        "matmul_precision": _legacy(torch.get_float32_matmul_precision),
        "cudnn_allow_tf32": _legacy(lambda: torch.backends.cudnn.allow_tf32),
        "fp32_precision": {k: torch._C._get_fp32_precision_getter(*k) for k in _FP32_KNOBS},
    }


def _apply_precision(flags):
    """The kernel's float32 precision, exactly: the legacy settings first (each also writes some
    of the table, and keeps a flag of its own that a later job must not inherit), then the
    table over them. Checked against every sequence of the legacy and new calls."""
    torch.set_float32_matmul_precision(flags["matmul_precision"] or "highest")
    allow = flags["cudnn_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = True if allow is None else allow
    for (backend, op), value in flags["fp32_precision"].items():
        torch._C._set_fp32_precision_setter(backend, op, value)


def apply_job_state(seed, flags):
    """Seed every RNG and copy the kernel's determinism and precision flags, before each job."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    wanted = (flags["deterministic"], flags["warn_only"])
    if wanted != (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled()):
        # only when it changes: the call itself costs ~1 s the first time (it imports a lot)
        torch.use_deterministic_algorithms(wanted[0], warn_only=wanted[1])
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    _apply_precision(flags)


def _place(rank, spec):
    """This rank's device. With shared GPUs, ranks take them round-robin."""
    if spec["device_type"] != "cuda":
        return torch.device("cpu")
    seen = torch.cuda.device_count()
    if not torch.cuda.is_available() or seen < spec["gpus"]:
        raise RuntimeError(
            f"the kernel saw {spec['gpus']} CUDA GPU(s), this rank sees {seen}: CUDA_VISIBLE_DEVICES "
            f"changed after the kernel first asked. Restart the kernel, or pass device='cpu'")
    device = torch.device("cuda", devices.rank_gpu(rank, spec["gpus"]))
    torch.cuda.set_device(device)
    return device


def _watch_parent(kernel, parent):
    """A rank whose kernel died (kill -9, crash) exits on its own within a second. ``parent``:
    the kernel itself for a spawned rank, the forkserver for a forked one (the server exits when
    the kernel does, and the rank is handed to another parent)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent or (parent != kernel and not _alive(kernel)):
            os._exit(3)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _hard_exit_after(seconds, code):
    """Teardown that hangs (a dead peer) must not keep the process alive."""
    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def _error_payload(exc, ctx, phase):
    tb = exc.__traceback__
    here = os.path.dirname(__file__)
    while tb is not None and tb.tb_next is not None and \
            os.path.dirname(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next  # start at the user's code, not at this trampoline
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "step": ctx.last_step if ctx is not None else None,
        "phase": phase,
    }


def start_job(ctx, seed, flags=None):
    """What every job starts from, spawned or under torchrun: the context's per-job state
    cleared, every RNG seeded with ``seed``, the kernel's determinism ``flags`` (this process's
    own when None) in force."""
    ctx.new_job()
    apply_job_state(seed, capture_job_state() if flags is None else flags)
    ctx.seed = seed


def _live(start, work, failed, finish):
    """One rank's life, spawned or under torchrun: ``start()`` brings the device and the process
    group up and returns the `Context`; ``work(ctx)`` returns the exit code; ``failed(exc, ctx)``
    reports an exception and returns the exit code. Whatever happened, the group is destroyed
    (under a hard-exit timer: a teardown waiting on a dead peer must not keep the process alive),
    ``finish()`` flushes the output, and the process ends with ``os._exit``: gloo's teardown can
    abort the interpreter at exit (TORCH_NOTES: SIGABRT in 2-3 of 20 runs), which must not spoil
    a result already reported (nor make torchrun call a good rank failed)."""
    ctx, code = None, 1
    try:
        ctx = start()
        code = work(ctx)
    except BaseException as exc:
        code = failed(exc, ctx)
    finally:
        _hard_exit_after(5, code)
        try:
            destroy_group()
        except Exception:
            pass
        finish()
        os._exit(code)


def rank_main(rank, world_size, conn, spec):
    """Entry point of every rank ddpkit starts. ``spec`` is a plain dict built by the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides when ranks stop
    if spec.get("environ") is not None:
        # forked from a forkserver, which holds the kernel's environment of the moment it
        # started: the kernel's of now, as a spawned rank has it (multiprocessing's own
        # preparation gives a forked rank the kernel's sys.path and working folder of now)
        os.environ.clear()
        os.environ.update(spec["environ"])
    inherited = dict(os.environ)
    parent = spec["ppid"] if spec.get("start_method", "spawn") == "spawn" else os.getppid()
    threading.Thread(target=_watch_parent, args=(spec["ppid"], parent), daemon=True).start()
    channel = Channel(conn, rank)
    output = OutputForwarder(channel)

    def start():
        torch.set_num_threads(spec["threads"])
        cublas = devices.cublas_workspace_config(spec["deterministic"])  # before CUDA starts
        if cublas is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
        device = _place(rank, spec)
        if device.type == "cpu":
            heap.fix_threshold()  # resident memory near the tensors' (rank/heap.py)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR=spec["host"], MASTER_PORT=str(spec["port"]))
        init_group(rank, world_size, spec["backend"], spec["host"], spec["port"],
                   spec["pg_timeout_s"], device)
        return Context(rank, world_size, rank, device, spec["backend"], channel=channel)

    def serve(ctx):
        """One job (a launch), or a pool's jobs until it closes; the exit code."""
        baseline = Baseline(inherited)  # what a pool's rank returns to after each job
        if spec["persistent"]:
            # what exists now (torch, the group) lives as long as the rank: left out of the
            # collection between jobs, which then takes microseconds instead of ~75 ms
            gc.collect()
            gc.freeze()
        timeout_s = spec["pg_timeout_s"]
        while True:
            msg = conn.recv()
            if msg[0] == "control":
                continue  # a setting sent too late for the job it was meant for
            if msg[0] != "job":
                return 0  # "close": the pool is shutting down
            if msg[1]["pg_timeout_s"] != timeout_s:
                timeout_s = msg[1]["pg_timeout_s"]
                set_collective_timeout(timeout_s)
            if not _run_job(ctx, channel, output, msg[1], baseline):
                return 1
            if not spec["persistent"]:
                return 0
            baseline.restore()
            release_memory(ctx.device)

    def failed(exc, ctx):
        if isinstance(exc, EOFError):
            return 0  # the kernel closed the pipe: every job so far went well
        channel.send("error", _error_payload(exc, ctx, "init"))
        return 1

    _live(start, serve, failed, output.finish)


def _run_job(ctx, channel, output, job, baseline):
    """Run one job; True when it returned normally."""
    try:
        baseline.enter(job)
        fn, args, kwargs = shipping.loads(job["payload"])
        start_job(ctx, job["seed"], job["flags"])
        channel.send("started")
        value = fn(ctx, *args, **kwargs)
        try:
            blob, buffers = dumps_for_kernel(value)
        except Exception as exc:
            raise TypeError(f"rank {ctx.rank} returned a {type(value).__name__} that cannot be "
                            f"pickled ({exc}); return plain data (numbers, dicts, CPU tensors)") from exc
        output.sync()
        channel.send("return", (blob, [len(b) for b in buffers]), buffers)
        return True
    except BaseException as exc:
        output.sync()
        channel.send("error", _error_payload(exc, ctx, "run"))
        return False


def torchrun_context(seed=0, backend=None, device=None):
    """This process's `Context` as torchrun started it (RANK, WORLD_SIZE, LOCAL_RANK set), its
    GPU made current: anything that asks CUDA afterwards (a config's checks) must not pick GPU 0."""
    ctx = Context.from_env(seed=seed, backend=backend, device=device)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    return ctx


def torchrun_main(ctx, work):
    """Entry point of a rank torchrun started: the group from torchrun's environment
    (MASTER_ADDR/PORT), ``work(ctx)`` once it is up, then a spawned rank's teardown."""
    def start():
        if ctx.device.type == "cpu":
            heap.fix_threshold()
        start_group(ctx.backend, ctx.device)
        return ctx

    def run(ctx):
        work(ctx)
        return 0

    def failed(exc, ctx):
        traceback.print_exc()  # no kernel to send it to: torchrun's log shows it
        return 1

    _live(start, run, failed, _flush_output)


def _flush_output():
    sys.stdout.flush()
    sys.stderr.flush()
