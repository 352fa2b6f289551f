"""The launcher, on real gloo ranks: everything in issue #2's 'What must hold'."""
import _thread
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import ddpkit
from procs import port_is_free, rank_children


# --- work functions (module level here; notebook-defined ones are tested in a subprocess)
def allreduce_work(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    for i in range(3):
        ctx.log(step=i, loss=scale * i)
    print(f"hello from {ctx.rank}")
    return {"rank": ctx.rank, "sum": t.item() * scale, "device": str(ctx.device),
            "world": ctx.world_size, "main": ctx.is_main, "seed_draw": torch.rand(1).item()}


def wait_for_file(ctx, path):
    ctx.log(step=0, loss=1.0)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx.log(step=1, loss=0.5)
    return ctx.rank


def culprit_work(ctx, culprit):
    if ctx.rank == culprit:
        ctx.log(step=7)
        time.sleep(0.2)
        raise ValueError("boom on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # the peer fails here with a connection error once the culprit is gone
    return "unreachable"


def sleeper_peer(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 gives up")
    time.sleep(120)  # not in a collective: only the launcher can end this rank


def killed_work(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def stall_work(ctx):
    if ctx.rank == 1:
        ctx.log(step=3)
        time.sleep(600)  # silent: never logs again
    for i in range(400):
        ctx.log(step=i)
        time.sleep(0.05)


def collective_hang(ctx):
    ctx.log(step=0)
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def slow_work(ctx):
    for i in range(600):
        ctx.log(step=i)
        time.sleep(0.05)


def pid_work(ctx):
    return os.getpid()


def maybe_fail(ctx, fail):
    dist.barrier()
    if fail and ctx.rank == 1:
        raise RuntimeError("planned failure")
    return ctx.rank


# --- 1. notebook-defined code, unpicklable arguments
NOTEBOOK_CODE = textwrap.dedent("""
    import torch, ddpkit
    import torch.distributed as dist

    class TinyNet(torch.nn.Module):          # defined in "the notebook": __main__, no file
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
        def forward(self, x):
            return self.lin(x)

    offset = 10
    def work(ctx, scale):
        model = torch.nn.parallel.DistributedDataParallel(TinyNet())
        model(torch.ones(3, 4)).sum().backward()
        g = model.module.lin.weight.grad.sum().item()
        return (ctx.rank + offset) * scale, g

    res = ddpkit.launch(work, 2.0, world_size=2)
    print("RETURNS", res.returns)
""")


def test_notebook_defined_function_and_class_run_on_every_rank():
    # `python -c` runs code as a __main__ with no file, as a notebook kernel does; plain
    # mp.spawn fails there with "Can't get attribute 'work' on <module '__main__'>".
    out = subprocess.run([sys.executable, "-c", NOTEBOOK_CODE], text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("RETURNS")][0]
    returns = eval(line[len("RETURNS "):])
    assert [r[0] for r in returns] == [20.0, 22.0]
    assert returns[0][1] == pytest.approx(returns[1][1])  # DDP averaged the same gradient


# a notebook cell: torch imported at its top, the function reads switches of torch.backends
# (torch's ModuleType subclasses in sys.modules) and a module of the user's own of that kind
BACKENDS_CELL = """
import os
import torch
import module_subclass

def read_switches(ctx):
    return (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
            type(torch.backends.cudnn).__name__, type(torch.backends).__name__,
            module_subclass.doubled, module_subclass.pid, os.getpid())
"""


def cell_function(code, name):
    """A function as a notebook cell defines it: its module is in no sys.modules entry, so
    cloudpickle sends it by value, with the modules it reaches."""
    ns = {"__name__": "__cell__"}
    exec(compile(code, "<cell>", "exec"), ns)
    return ns[name]


def test_a_cell_function_reading_torch_backends_runs_on_every_rank():
    import module_subclass

    fn = cell_function(BACKENDS_CELL, "read_switches")
    res = ddpkit.launch(fn, world_size=2, pool="shared")
    kernel = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
              "CudnnModule", "GenericModule", 42)
    for out in res.returns:
        assert tuple(out[:5]) == kernel  # the modules themselves, by name, subclass and all
        assert out[5] == out[6] != os.getpid()  # the module's property ran on the rank
    assert type(module_subclass).__name__ == "_Settings"


def test_a_module_subclass_no_rank_can_import_is_named_before_launch():
    import types

    class Switches(types.ModuleType):
        pass

    switches = Switches("switches")  # made here, in no sys.modules entry

    def work(ctx):
        return switches

    with pytest.raises(TypeError, match=r"the function cannot be sent to the ranks: module "
                                        r"'switches' \(a Switches\).*import it inside the function"):
        ddpkit.launch(work, world_size=2)


def test_unpicklable_argument_is_refused_before_any_process_starts():
    lock = threading.Lock()
    before = len(rank_children())
    with pytest.raises(TypeError, match=r"argument 1 \(lock\) cannot be sent to the ranks"):
        ddpkit.launch(allreduce_work, lock, world_size=2)
    with pytest.raises(TypeError, match=r"keyword argument 'scale' \(generator\)"):
        ddpkit.launch(allreduce_work, scale=(i for i in range(3)))
    with pytest.raises(TypeError, match=r"cannot take these arguments.*unexpected keyword"):
        ddpkit.launch(allreduce_work, 1.0, nope=1)
    assert len(rank_children()) == before


def test_every_rank_returns_and_records_carry_rank():
    res = ddpkit.launch(allreduce_work, 2.0, world_size=2, backend="gloo", device="cpu")
    assert [r["rank"] for r in res.returns] == [0, 1]
    assert all(r["sum"] == 6.0 for r in res.returns)  # (1 + 2) * 2: a real all-reduce happened
    assert [r["main"] for r in res.returns] == [True, False]
    assert {r["device"] for r in res.returns} == {"cpu"} and res.backend == "gloo"
    assert sorted((m["rank"], m["step"]) for m in res.metrics) == [(r, s) for r in (0, 1) for s in range(3)]
    # seeds are carried: same seed -> same draws on every rank and in every run
    again = ddpkit.launch(allreduce_work, 2.0, world_size=2)
    assert res.returns[0]["seed_draw"] == res.returns[1]["seed_draw"] == again.returns[0]["seed_draw"]
    other = ddpkit.launch(allreduce_work, 2.0, world_size=2, seed=1)
    assert other.returns[0]["seed_draw"] != res.returns[0]["seed_draw"]


def test_world_size_one_runs_too():
    res = ddpkit.launch(allreduce_work, 1.0, world_size=1)
    assert res.returns[0]["sum"] == 1.0


# --- 2. live
def test_records_and_prints_arrive_live(tmp_path, capsys):
    seen = []
    flag = tmp_path / "go"
    h = ddpkit.launch(wait_for_file, str(flag), world_size=2, block=False, on_metric=seen.append)
    deadline = time.monotonic() + 60
    while len({m["rank"] for m in h.metrics}) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not h.done, "the run should still be waiting for the flag file"
    assert {m["rank"] for m in seen} == {0, 1} and all(m["step"] == 0 for m in seen)
    flag.touch()
    res = h.wait(timeout=60)
    assert h.done and res.returns == [0, 1]
    assert len(seen) == 4 and res.metrics == seen


def tensor_records(ctx):
    ctx.log(step=0, vec=torch.arange(3.0))
    ctx.log(step=1, vec=torch.arange(3.0) * 2)
    w = torch.arange(12_000_000, dtype=torch.float32).reshape(3000, 4000)  # 48 MB
    # tied weights (one storage twice), a strided view of it, another dtype
    return {"rank": ctx.rank, "w": w, "tied": w, "view": w[1::2, ::3], "half": w[0].bfloat16()}


def test_tensor_records_and_a_return_read_after_their_rank_ended_still_arrive():
    # on_metric holds the kernel on the first record while the rank sends the second, returns
    # and exits: the rest is read from a rank that is gone (a busy kernel, a slow callback).
    # Sent through multiprocessing's pickler, a record's tensor was a shared-memory descriptor
    # fetched from the dead rank, and the run ended in "ProcessDied ... exited with code 0".
    # The return value's bytes follow its message on the pipe (ddpkit/rank/returns.py)
    def slow_first(record):
        if record["step"] == 0:
            time.sleep(1.5)

    res = ddpkit.launch(tensor_records, world_size=1, on_metric=slow_first)
    assert [m["vec"].tolist() for m in res.metrics] == [[0.0, 1.0, 2.0], [0.0, 2.0, 4.0]]
    value = res.returns[0]
    w = torch.arange(12_000_000, dtype=torch.float32).reshape(3000, 4000)
    assert value["rank"] == 0 and torch.equal(value["w"], w)
    assert value["tied"] is value["w"]  # one tensor in, one out: sent once
    assert torch.equal(value["view"], w[1::2, ::3]) and value["view"].stride() == (8000, 3)
    assert value["view"].untyped_storage().data_ptr() == value["w"].untyped_storage().data_ptr()
    assert value["half"].dtype == torch.bfloat16 and torch.equal(value["half"], w[0].bfloat16())


class OpensAFile:
    """Unpickled, it opens a file that is not there: an OSError raised while the kernel loads
    a value, not a pipe's end."""

    def __reduce__(self):
        return (open, ("/nonexistent/ddpkit-return",))


def returns_opens_a_file(ctx):
    return OpensAFile()


def test_a_value_that_fails_to_load_in_the_kernel_says_why_not_that_the_rank_died():
    with pytest.raises(FileNotFoundError, match="ddpkit-return"):
        ddpkit.launch(returns_opens_a_file, world_size=1)
    assert rank_children() == []


def test_rank_prints_show_prefixed_by_rank(capsys):
    res = ddpkit.launch(allreduce_work, 1.0, world_size=2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert (1, "hello from 1") in res.prints


# --- 3. culprit first
@pytest.mark.parametrize("culprit", [0, 1])
def test_rank_error_names_the_culprit_not_the_peer(culprit):
    with pytest.raises(ddpkit.RankError) as info:
        ddpkit.launch(culprit_work, culprit, world_size=2)
    err = info.value
    assert err.rank == culprit and err.exc_type == "ValueError" and err.step == 7
    assert "boom on purpose" in err.traceback and "in culprit_work" in err.traceback
    assert 'raise ValueError("boom on purpose")' in err.traceback  # source lines travel too
    assert f"rank {culprit} failed at step 7: ValueError: boom on purpose" in str(err)


def test_peers_of_a_failed_rank_are_ended_promptly():
    t0 = time.monotonic()
    with pytest.raises(ddpkit.RankError) as info:
        ddpkit.launch(sleeper_peer, world_size=2)
    assert info.value.rank == 1
    # rank 0 would sleep 120 s; the launcher ended it (bound includes ~3 s of spawn)
    assert time.monotonic() - t0 < 20


def test_a_rank_killed_by_a_signal_is_the_culprit():
    with pytest.raises(ddpkit.RankError) as info:
        ddpkit.launch(killed_work, world_size=2)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)


# --- 4. stall watchdog
def test_silent_rank_is_named_by_the_stall_watchdog():
    with pytest.raises(ddpkit.RankStalled) as info:
        ddpkit.launch(stall_work, world_size=2, stall_timeout_s=1.5)
    assert info.value.ranks == [1] and info.value.last_steps == {1: 3}
    assert "rank 1 (last step 3)" in str(info.value)


def test_collective_that_never_completes_ends_with_rank_stalled():
    with pytest.raises(ddpkit.RankStalled) as info:
        ddpkit.launch(collective_hang, world_size=2, stall_timeout_s=1.5)
    assert info.value.ranks == [0, 1] and info.value.last_steps == {0: 0, 1: 0}


# --- 5. nothing left
def test_stop_ends_every_rank_and_frees_the_port():
    env_before = dict(os.environ)
    h = ddpkit.launch(slow_work, world_size=2, block=False)
    deadline = time.monotonic() + 60
    while len(h.metrics) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [c.pid for c in rank_children()]
    h.stop()
    res = h.wait()
    assert res.stopped and h.done and 0 < len(res.metrics) < 1200
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)
    assert port_is_free(res.port)
    assert dict(os.environ) == env_before


def test_keyboard_interrupt_while_blocked_ends_every_rank(kernel_sigint):
    fired = []

    def interrupt_once_going(record):  # the main thread is blocked in the launch by now
        if not fired:
            fired.append(True)
            _thread.interrupt_main()
    with pytest.raises(KeyboardInterrupt):
        ddpkit.launch(slow_work, world_size=2, on_metric=interrupt_once_going)
    assert fired
    # the autouse fixture checks that no rank is left


def test_each_launch_gets_a_fresh_free_port_and_a_used_port_is_refused():
    a = ddpkit.launch(pid_work, world_size=2)
    b = ddpkit.launch(pid_work, world_size=2)
    assert a.port != b.port and port_is_free(a.port) and port_is_free(b.port)
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ValueError, match=rf"port={busy.getsockname()[1]} is already in use.*port=None"):
            ddpkit.launch(pid_work, world_size=2, port=busy.getsockname()[1])


# --- 6. re-run
def test_twenty_launches_in_a_row_leave_nothing_behind():
    me = psutil.Process()
    ddpkit.launch(maybe_fail, False, world_size=2)  # warm-up: imports, resource tracker
    rss0, fds0 = me.memory_info().rss, me.num_fds()
    outcomes = []
    for i in range(20):
        try:
            outcomes.append(ddpkit.launch(maybe_fail, i % 4 == 3, world_size=2).returns)
        except ddpkit.RankError as err:
            outcomes.append(err.rank)
    assert outcomes == [[0, 1] if i % 4 != 3 else 1 for i in range(20)]
    assert rank_children() == []
    assert me.num_fds() <= fds0 + 2
    assert me.memory_info().rss - rss0 < 40 * 2**20  # bytes; no per-run growth


# --- 7. warm pool
def test_pool_reuses_ranks_and_rebuilds_after_a_failure():
    with ddpkit.Pool(world_size=2) as pool:
        first = pool.launch(pid_work).returns
        assert pool.launch(pid_work).returns == first  # same processes: no spawn
        res = pool.launch(allreduce_work, 2.0)
        assert [r["sum"] for r in res.returns] == [6.0, 6.0]
        with pytest.raises(ddpkit.RankError):
            pool.launch(maybe_fail, True)
        rebuilt = pool.launch(pid_work).returns
        assert rebuilt != first and len(rebuilt) == 2
        assert ddpkit.launch(pid_work, pool=pool).returns == rebuilt


def test_pool_refuses_a_second_run_at_once():
    with ddpkit.Pool(world_size=2) as pool:
        h = pool.launch(slow_work, block=False)
        with pytest.raises(RuntimeError, match="already running a job"):
            pool.launch(pid_work)
        h.stop()
        assert pool.launch(pid_work).returns  # usable again after stop


def test_pool_launch_is_much_faster_than_cold():
    # not a timing claim (that lives in bench/launch.py): only that the pool skips spawn at all
    with ddpkit.Pool(world_size=2) as pool:
        pool.launch(pid_work)
        warm = pool.launch(pid_work).wall_s
    cold = ddpkit.launch(pid_work).wall_s
    assert warm < cold


# --- 8. bad input, before spawning
@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(world_size=0), ValueError, r"world_size=0: need at least 1 rank"),
    (dict(world_size="2"), TypeError, r"world_size must be an int"),
    (dict(world_size=1, backend="nccl"), ValueError, r"backend=nccl: this machine has no visible CUDA GPU; pass backend=None, device='cpu'"),
    (dict(backend="mpi"), ValueError, r"backend='mpi' is not one of"),
    (dict(stall_timeout_s=-1), ValueError, r"stall_timeout_s=-1"),
])
def test_bad_settings_are_refused_before_spawning(kwargs, exc, pattern):
    gpus = len(ddpkit.devices.cuda_gpus())
    if kwargs.get("backend") == "nccl" and gpus >= 1:
        kwargs["world_size"] = gpus + 1
        pattern = r"is above the \d+ visible CUDA GPU.*NCCL runs one process per GPU"
    before = len(rank_children())
    with pytest.raises(exc, match=pattern):
        ddpkit.launch(pid_work, **kwargs)
    assert len(rank_children()) == before


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match=r"launch\(\) needs a function.*got int"):
        ddpkit.launch(42)


def deterministic_flag(ctx):
    return torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def test_determinism_flags_are_carried_into_ranks(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert ddpkit.launch(deterministic_flag, world_size=1).returns == [(False, None)]
    torch.use_deterministic_algorithms(True)
    try:
        # cuBLAS reads the variable when CUDA starts, so the rank sets it before its device
        assert ddpkit.launch(deterministic_flag, world_size=1).returns == [(True, ":4096:8")]
    finally:
        torch.use_deterministic_algorithms(False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # the kernel's environment is untouched


def precision_seen(ctx):
    def legacy(read):
        try:
            return read()
        except RuntimeError:  # torch refuses once the legacy and the new API were mixed
            return "refused"
    return (legacy(torch.get_float32_matmul_precision),
            legacy(lambda: torch.backends.cuda.matmul.allow_tf32),
            legacy(lambda: torch.backends.cudnn.allow_tf32),
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
            torch.backends.mkldnn.matmul.fp32_precision)


@pytest.fixture
def kernel_precision():
    """The kernel's float32 precision as it was; put back after the test, whatever it set."""
    from ddpkit.rank.entry import _apply_precision, capture_job_state

    before = capture_job_state()
    yield before
    _apply_precision(before)


@pytest.mark.parametrize("setting", [
    lambda: torch.set_float32_matmul_precision("high"),
    lambda: (setattr(torch.backends.cuda.matmul, "allow_tf32", True),
             setattr(torch.backends.cudnn, "allow_tf32", False)),
    lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),  # the new API
], ids=["matmul-precision-high", "cuda-tf32-cudnn-not", "new-api"])
def test_tf32_and_matmul_precision_set_in_the_kernel_reach_every_rank(kernel_precision, setting):
    from ddpkit.rank.entry import _apply_precision

    default = precision_seen(None)
    with ddpkit.Pool(world_size=2) as pool:
        setting()
        wanted = precision_seen(None)
        assert wanted != default
        assert pool.launch(precision_seen).returns == [wanted, wanted]
        _apply_precision(kernel_precision)  # the kernel back to its defaults...
        assert precision_seen(None) == default
        # ...and the warm ranks follow: nothing is left over from the last job
        assert pool.launch(precision_seen).returns == [default, default]


def unterminated_print(ctx):
    print(f"progress {ctx.rank}", end="")  # no newline: the sync marker must not glue onto it
    return ctx.rank


def test_a_partial_last_line_still_arrives_before_the_return():
    res = ddpkit.launch(unterminated_print, world_size=2)
    assert sorted(res.prints) == [(0, "progress 0"), (1, "progress 1")]


def late_rank(ctx):
    if ctx.rank == 1:
        time.sleep(3)
    return ctx.rank


def test_drain_thread_does_not_spin_while_a_rank_finishes_late():
    me = psutil.Process()
    cpu0 = sum(me.cpu_times()[:2])
    ddpkit.launch(late_rank, world_size=2)
    # rank 0 exits at once; waiting 3 s for rank 1 must not burn the kernel's core
    assert sum(me.cpu_times()[:2]) - cpu0 < 1.5


def test_a_late_control_message_does_not_kill_a_pool_rank():
    with ddpkit.Pool(world_size=2) as pool:
        pids = pool.pids
        h = pool.launch(pid_work, block=False)
        h.send_control(checkpoint=2)  # the job never reads controls
        h.wait()
        assert pool.launch(pid_work).returns == pids  # same ranks: none died


def stop_from_callback_work(ctx):
    for i in range(2000):
        ctx.log(step=i)
        time.sleep(0.005)


def test_stop_from_inside_on_metric_ends_the_run():
    holder = {}
    def on_metric(rec):
        if rec["step"] == 5:
            holder["h"].stop()
    holder["h"] = h = ddpkit.launch(stop_from_callback_work, world_size=2, block=False,
                                    on_metric=on_metric)
    res = h.wait(timeout=60)
    assert res.stopped and len(res.metrics) < 400
