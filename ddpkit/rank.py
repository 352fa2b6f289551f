"""What runs inside each rank process: the trampoline, the process group, the `Context`.

A spawned child starts in `rank_main` (a module-level function, so spawn can find it by name).
The user's function arrives as cloudpickle bytes over the rank's pipe, which is why a function
or an ``nn.Module`` class defined in a notebook cell works: it travels by value, not by name.

Everything the rank says goes back over that one pipe as small tuples ``(kind, rank, payload, t)``:
``started``, ``metric``, ``print``, ``return``, ``error``. The kernel never reads a rank's stdout:
file descriptors 1 and 2 are re-pointed at a pipe whose lines are forwarded as ``print`` messages,
so rank output cannot land in whichever notebook cell happens to be running.

The same `Context` is built from the environment under ``torchrun`` (`Context.from_env`), so the
training code is one function whichever launcher started it.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import devices, shipping


def _plain(value):
    """Turn one-element tensors and numpy scalars into Python numbers so records pickle small;
    other tensors become CPU copies (see `_cpu_copy`), inside lists, tuples and dicts too."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _cpu_copy(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _cpu_copy(t):
    """A CPU tensor for the kernel. Records travel through multiprocessing's pickler, for which
    torch.multiprocessing registers CUDA IPC (``multiprocessing/reductions.py``: the kernel would
    map this rank's GPU memory, valid only while the rank lives); a pickled CUDA tensor is rebuilt
    on ``cuda:r`` (``storage.py``: ``torch.save`` keeps its device), so the kernel would use a GPU."""
    if t.device.type == "cpu":
        return t
    out = t.detach().cpu()
    return out.requires_grad_() if t.requires_grad and t.is_leaf else out


class _CpuPickler(cloudpickle.CloudPickler):
    """cloudpickle that sends every plain tensor as its CPU copy, wherever it sits in the value
    (a Parameter pickles its ``.data``, a plain tensor, so it is moved too)."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type != "cpu":
            return _cpu_copy(obj).__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def dumps_for_kernel(value):
    """Pickle a rank's return value with every tensor on CPU."""
    import io

    buf = io.BytesIO()
    _CpuPickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buf.getvalue()


def format_record(record):
    """One record as a log line: ``step=3 loss=0.512 ...``."""
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in record.items())


class _Channel:
    """One rank's pipe to the kernel; thread-safe because output forwarding sends too."""

    def __init__(self, conn, rank):
        self.conn, self.rank = conn, rank
        self._lock = threading.Lock()

    def send(self, kind, payload=None):
        with self._lock:
            try:
                self.conn.send((kind, self.rank, payload, time.time()))
            except (BrokenPipeError, EOFError, OSError):
                pass  # the kernel is gone or stopped us; nothing left to tell

    def poll(self):
        with self._lock:
            return self.conn.poll()

    def recv(self):
        return self.conn.recv()


class Context:
    """What the user's function receives as its first argument.

    ``rank``, ``world_size``, ``local_rank``, ``device``, ``backend``, ``is_main`` (rank 0),
    ``seed``; ``log(**fields)`` streams one record to the kernel; ``barrier()``;
    ``sync_controls()`` returns the settings the kernel changed mid-run, the same on every rank.
    """

    def __init__(self, rank, world_size, local_rank, device, backend, seed=0, channel=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.backend, self.seed = device, backend, seed
        self.is_main = rank == 0
        self._channel = channel
        self.last_step = None
        self._next_sync, self._last_sync = 0, None
        self.records = []  # kept here only when there is no kernel to send them to (torchrun)
        self.on_record = None  # under torchrun: called with each record instead of printing it

    @classmethod
    def from_env(cls, seed=0, backend=None, device=None):
        """A Context for a process started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK set);
        ``backend`` and ``device`` as in `ddpkit.launch`."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        # the choice a spawned run of this machine's ranks gets, so every rank agrees on it
        backend, kind = devices.resolve_devices(here, backend, device)
        if kind == "cuda":
            place = torch.device("cuda", devices.rank_gpu(local, len(devices.cuda_gpus())))
        else:
            place = torch.device("cpu")
        return cls(rank, world, local, place, backend, seed)

    def log(self, **fields):
        """Send one record (a flat dict of numbers/strings) to the kernel, now."""
        record = {k: _plain(v) for k, v in fields.items()}
        if "step" in record:
            self.last_step = record["step"]
        if self._channel is not None:
            self._channel.send("metric", record)
            return
        self.records.append({"rank": self.rank, **record})
        if self.on_record is not None:  # the CLI's progress bar
            self.on_record(self.records[-1])
        elif self.is_main:  # under torchrun there is no kernel: print rank 0's records
            print(format_record(record), flush=True)

    def barrier(self):
        if dist.is_initialized():
            dist.barrier()

    def sync_controls(self, step, latency_s=0.1):
        """Settings the kernel sent while running, the same on every rank, at the same step.

        Collective: every rank calls it at every step with the same ``step`` (the train loop
        does), but it only talks on the steps it scheduled: rank 0 reads its pipe and
        broadcasts ``[has settings, next step to talk]``, spacing the talks about ``latency_s``
        apart (a change lands within ~0.1 s), so a fast step does not pay a collective each time.
        """
        if step < self._next_sync:
            return {}
        fresh = {}
        if self.is_main and self._channel is not None:
            while self._channel.poll():
                msg = self._channel.recv()
                if msg[0] == "control":
                    fresh.update(msg[1])
        now = time.monotonic()
        if self._last_sync is not None and step > self._last_sync[0]:
            per_step = (now - self._last_sync[1]) / (step - self._last_sync[0])
            gap = max(1, min(1000, int(latency_s / max(per_step, 1e-6))))
        else:
            gap = 1
        self._last_sync = (step, now)
        header = [1 if fresh else 0, step + gap]
        if dist.is_initialized() and self.world_size > 1:
            flag = torch.tensor(header, device=self._flag_device())
            dist.broadcast(flag, src=0)
            header = flag.tolist()
            if header[0]:
                box = [fresh]
                dist.broadcast_object_list(box, src=0, device=self._flag_device())
                fresh = box[0]
        self._next_sync = header[1]
        return fresh

    def _flag_device(self):
        # every group ddpkit starts has gloo for CPU tensors (devices.group_backend): a CPU flag
        # needs no device-to-host copy to read
        return torch.device("cpu")


def apply_job_state(seed, flags):
    """Seed every RNG and copy the kernel's determinism flags, before each job."""
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


def capture_job_state():
    """The kernel's determinism flags, as carried into ranks."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def _interface_of(host):
    """The name of this machine's network interface that holds ``host``'s address, or None
    (a wildcard such as 0.0.0.0 is on no interface)."""
    import socket

    import psutil

    wanted = {info[4][0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addrs):  # "fe80::1%eth0": drop the scope
            return name
    return None


def listen_on(host):
    """Make this rank's own sockets listen on ``host``'s interface only.

    Left alone, gloo binds the address this machine's *hostname* resolves to (torch's
    ``ProcessGroupGloo::createDefaultDevice``; loopback only as a fallback), which on most servers
    is a LAN address. ``GLOO_SOCKET_IFNAME`` is what torch reads instead when it creates the gloo
    device (``ProcessGroupGloo::Options::create_default``), and ``NCCL_SOCKET_IFNAME`` does the same
    for NCCL's bootstrap. Set in this rank process only, before the group exists; a value the user
    exported for other jobs does not open a ddpkit run to the network (``host=`` is the switch).
    """
    name = _interface_of(host)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name


def init_group(rank, world_size, backend, host, port, timeout_s, device=None):
    """Join the kernel's TCPStore and bring the process group up, listening on ``host`` only."""
    listen_on(host)
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    start_group(backend, device, store=store, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s))


def start_group(backend, device, **kwargs):
    """``init_process_group`` for a rank on ``device``, spawned or under torchrun.

    NCCL ranks pass ``device_id``: barriers then know their GPU (without it, every
    ``dist.barrier()`` warns "using the device under current context", distributed_c10d.py
    ``barrier``), and NCCL connects during start-up (``eager_connect_single_device``), so an NCCL
    hang shows as a start-up stall rather than in the first collective.
    """
    bound = device if backend == "nccl" else None
    dist.init_process_group(devices.group_backend(backend), device_id=bound, **kwargs)


def set_collective_timeout(seconds):
    """Change the group's collective timeout (gloo's, and NCCL's watchdog) for the next job."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


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


def _release_memory(device):
    """Between a pool's jobs: free the last job's reference cycles and cached CUDA blocks, so the
    next job's peak_bytes is its own."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def destroy_group():
    if dist.is_initialized():
        dist.destroy_process_group()


class _OutputForwarder:
    """Point fds 1 and 2 at a pipe and forward its lines as ``print`` messages.

    ``sync()`` waits until every line written so far has been sent, so a rank's prints always
    reach the kernel before its ``return`` message does.
    """

    _MARK = b"\x00ddpkit-sync\n"
    # kineto prints these on every profiler window (the CPU peak probe opens one per step);
    # they say nothing about the user's run, so they are not forwarded
    _NOISE = (b"ActivityProfilerHandler.cpp", b"was allocated before the profiling started")

    def __init__(self, channel):
        self.channel = channel
        self._synced = threading.Event()
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        self._thread = threading.Thread(target=self._pump, args=(read_fd,),
                                        name="ddpkit-output", daemon=True)
        self._thread.start()

    def _pump(self, read_fd):
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                if raw.endswith(self._MARK):  # after a partial line (print(..., end=""))
                    head = raw[:-len(self._MARK)]
                    if head:
                        self.channel.send("print", head.decode("utf-8", "replace"))
                    self._synced.set()
                elif not any(n in raw for n in self._NOISE):
                    self.channel.send("print", raw.decode("utf-8", "replace").rstrip("\n"))

    def sync(self, timeout=2.0):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._synced.clear()
        os.write(1, self._MARK)
        self._synced.wait(timeout)

    def finish(self):
        """Close our ends so the pump sees EOF after the last line, then wait for it."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.close(1)
        os.close(2)
        self._thread.join(timeout=2)


def _watch_parent(ppid):
    """A rank whose kernel died (kill -9, crash) exits on its own within a second."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(3)


def _hard_exit_after(seconds, code):
    """Teardown that hangs (a dead peer) must not keep the process alive."""
    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def _error_payload(exc, ctx, phase):
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # start at the user's code, not at this trampoline
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "step": ctx.last_step if ctx is not None else None,
        "phase": phase,
    }


def rank_main(rank, world_size, conn, spec):
    """Entry point of every spawned rank. ``spec`` is a plain dict built by the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides when ranks stop
    threading.Thread(target=_watch_parent, args=(spec["ppid"],), daemon=True).start()
    channel = _Channel(conn, rank)
    output = _OutputForwarder(channel)
    torch.set_num_threads(spec["threads"])
    ctx, code = None, 0
    try:
        if spec["deterministic"]:
            # cuBLAS is deterministic only with this set before CUDA initialises (torch's
            # testing/_internal/common_utils.py notes it); a user's own value is kept
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = _place(rank, spec)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR=spec["host"], MASTER_PORT=str(spec["port"]))
        init_group(rank, world_size, spec["backend"], spec["host"], spec["port"],
                   spec["pg_timeout_s"], device)
        timeout_s = spec["pg_timeout_s"]
        ctx = Context(rank, world_size, rank, device, spec["backend"], channel=channel)
        if spec["persistent"]:
            # what exists now (torch, the group) lives as long as the rank: left out of the
            # collection between jobs, which then takes microseconds instead of ~75 ms
            import gc
            gc.collect()
            gc.freeze()
        channel.send("ready")
        while True:
            msg = conn.recv()
            if msg[0] == "control":
                continue  # a setting sent too late for the job it was meant for
            if msg[0] != "job":
                break  # "close": the pool is shutting down
            if msg[1]["pg_timeout_s"] != timeout_s:
                timeout_s = msg[1]["pg_timeout_s"]
                set_collective_timeout(timeout_s)
            ok = _run_job(ctx, channel, output, msg[1])
            code = 0 if ok else 1
            if not ok or not spec["persistent"]:
                break
            _release_memory(device)
    except BaseException as exc:  # init failed, or the kernel closed the pipe
        if not isinstance(exc, EOFError):
            channel.send("error", _error_payload(exc, ctx, "init"))
            code = 1
    finally:
        _hard_exit_after(5, code)
        try:
            destroy_group()
        except Exception:
            pass
        output.finish()
        # os._exit, not a normal exit: gloo's teardown can abort the interpreter at exit
        # (TORCH_NOTES: SIGABRT in 2-3 of 20 runs), which must not spoil a reported result.
        os._exit(code)


def _run_job(ctx, channel, output, job):
    """Run one job; True when it returned normally."""
    ctx.last_step = None
    ctx._next_sync, ctx._last_sync = 0, None
    try:
        fn, args, kwargs = shipping.loads(job["payload"])
        apply_job_state(job["seed"], job["flags"])
        ctx.seed = job["seed"]
        channel.send("started")
        value = fn(ctx, *args, **kwargs)
        try:
            blob = dumps_for_kernel(value)
        except Exception as exc:
            raise TypeError(f"rank {ctx.rank} returned a {type(value).__name__} that cannot be "
                            f"pickled ({exc}); return plain data (numbers, dicts, CPU tensors)") from exc
        output.sync()
        channel.send("return", blob)
        return True
    except BaseException as exc:
        output.sync()
        channel.send("error", _error_payload(exc, ctx, "run"))
        return False
