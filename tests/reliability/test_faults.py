"""Faults survived: each one ends with a clear error within a bound, leaves no process or zombie
in the whole process tree, frees the rendezvous port, and the next run works."""
import _thread
import gc
import os
import signal
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import ddpkit
from procs import port_is_free, rank_children


def steady(ctx, steps=2000):
    for i in range(steps):
        dist.all_reduce(torch.ones(1))
        ctx.log(step=i)
        time.sleep(0.005)
    return ctx.rank


def raises_at(ctx, step):
    for i in range(step + 1):
        dist.all_reduce(torch.ones(1))
        ctx.log(step=i)
    if ctx.rank == 1:
        raise RuntimeError(f"planned failure at step {step}")
    dist.all_reduce(torch.ones(1))


def kills_itself(ctx):
    dist.all_reduce(torch.ones(1))
    ctx.log(step=0)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def hangs_in_collective(ctx):
    ctx.log(step=0)
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def quick(ctx):
    dist.all_reduce(torch.ones(1))
    return ctx.rank


def tree():
    """Every live descendant of this process (zombies included), less the resource tracker."""
    return [p for p in rank_children()
            if p.is_running()]


def wait_for(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def after_the_fault(port):
    """What must hold after every fault."""
    wait_for(lambda: tree() == [], timeout=5)  # no rank, no zombie
    if port is not None:
        assert port_is_free(port)
    assert ddpkit.launch(quick, world_size=2).returns == [0, 1]  # the next run works


def test_rank_raises():
    h = ddpkit.launch(raises_at, 3, world_size=2, block=False)
    t0 = time.monotonic()
    with pytest.raises(ddpkit.RankError, match="planned failure at step 3") as info:
        h.wait(timeout=60)
    assert info.value.rank == 1 and time.monotonic() - t0 < 30
    after_the_fault(h.result.port)


def test_rank_killed_with_sigkill():
    h = ddpkit.launch(kills_itself, world_size=2, block=False)
    with pytest.raises(ddpkit.RankError, match="killed by signal SIGKILL") as info:
        h.wait(timeout=60)
    assert info.value.rank == 1
    after_the_fault(h.result.port)


def test_rank_hangs_in_a_collective():
    h = ddpkit.launch(hangs_in_collective, world_size=2, block=False, stall_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(ddpkit.RankStalled):
        h.wait(timeout=60)
    assert time.monotonic() - t0 < 30  # startup + 2 s of silence + teardown
    after_the_fault(h.result.port)


def interrupt_at_the_first_record():
    """on_metric: the kernel's interrupt once the run is going (the main thread is then blocked
    in the launch, whatever the machine's load made of the start-up)."""
    fired = []

    def on_metric(record):
        if not fired:
            fired.append(time.monotonic())
            _thread.interrupt_main()
    return on_metric, fired


def test_interrupt_while_blocked(kernel_sigint):
    on_metric, fired = interrupt_at_the_first_record()
    with pytest.raises(KeyboardInterrupt):
        ddpkit.launch(steady, world_size=2, on_metric=on_metric)
    assert fired and time.monotonic() - fired[0] < 10  # ended well before the run's ~10 s
    after_the_fault(None)


@pytest.mark.parametrize("after_s", [0.01, 0.05, 0.3])
def test_interrupt_while_the_ranks_start(after_s, kernel_sigint):
    """An interrupt while ranks are still being started is held until every rank is known,
    then raised: nothing half-started is left."""
    with pytest.raises(KeyboardInterrupt):
        threading.Timer(after_s, _thread.interrupt_main).start()
        ddpkit.launch(steady, world_size=2)
    after_the_fault(None)


def test_stop_mid_run():
    h = ddpkit.launch(steady, world_size=2, block=False)
    wait_for(lambda: len(h.metrics) >= 10)
    t0 = time.monotonic()
    h.stop()
    assert time.monotonic() - t0 < 5 and h.wait().stopped
    after_the_fault(h.result.port)


def test_pool_rank_dies_between_runs():
    with ddpkit.Pool(world_size=2) as pool:
        assert pool.launch(quick).returns == [0, 1]
        old = pool.pids
        os.kill(old[1], signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(old[1]) or
                 psutil.Process(old[1]).status() == psutil.STATUS_ZOMBIE)
        # the next launch notices the dead rank, rebuilds the pool and runs
        assert pool.launch(quick).returns == [0, 1]
        assert pool.pids != old and not psutil.pid_exists(old[0])
    after_the_fault(None)


def test_two_runs_at_once_never_mix():
    """Two launches at once from one kernel are two separate groups (own ranks, own port):
    each handle sees only its own records. A pool or a lab refuses the second run instead."""
    def tagged(ctx, tag):
        for i in range(20):
            dist.all_reduce(torch.ones(1))
            ctx.log(step=i, tag=tag)
        return tag
    a = ddpkit.launch(tagged, "a", world_size=2, block=False)
    b = ddpkit.launch(tagged, "b", world_size=2, block=False)
    ra, rb = a.wait(timeout=120), b.wait(timeout=120)
    assert ra.returns == ["a", "a"] and rb.returns == ["b", "b"]
    assert {m["tag"] for m in ra.metrics} == {"a"} and {m["tag"] for m in rb.metrics} == {"b"}
    assert ra.port != rb.port
    with ddpkit.Pool(world_size=2) as pool:
        h = pool.launch(steady, block=False)
        with pytest.raises(RuntimeError, match="already running a job"):
            pool.launch(quick)
        h.stop()
    after_the_fault(None)


def test_fifty_runs_in_a_row_do_not_grow():
    me = psutil.Process()
    with ddpkit.Pool(world_size=2) as pool:
        for _ in range(3):  # warm-up
            pool.launch(quick)
        gc.collect()
        fds0, rss0, kids0 = me.num_fds(), me.memory_info().rss, len(tree())
        outcomes = []
        for i in range(50):
            try:
                if i % 10 == 9:
                    pool.launch(raises_at, 0)  # fails; the pool is rebuilt by the next launch
                else:
                    outcomes.append(pool.launch(quick).returns)
            except ddpkit.RankError as err:
                outcomes.append(err.rank)
        assert outcomes == [1 if i % 10 == 9 else [0, 1] for i in range(50)]
        assert len(tree()) == 0  # the 50th run failed: the pool's ranks are gone
        pool.launch(quick)  # and come back
        gc.collect()
        assert len(tree()) == kids0 == 2  # only the pool's two ranks
        assert me.num_fds() <= fds0 + 4, (fds0, me.num_fds())
        assert me.memory_info().rss - rss0 < 64 * 2**20, "resident memory grew by > 64 MiB"
    after_the_fault(None)
