"""A real Jupyter kernel interrupted mid-run: the cell ends, the ranks are gone, the kernel is
not stuck, and the next run in the same kernel works."""
import time

import psutil
from jupyter_client.manager import start_new_kernel

SETUP = """
import time, ddpkit, torch, torch.distributed as dist
def steady(ctx):
    for i in range(100000):
        dist.all_reduce(torch.ones(1)); ctx.log(step=i); time.sleep(0.005)
def quick(ctx):
    return ctx.rank
def going(record):  # the drain thread's: both ranks are past a few all-reduces
    if record.get("step") == 3 and record.get("rank") == 0:
        print("GOING", flush=True)
"""


def spawned_ranks(kernel_pid):
    """The kernel's ranks: its children but multiprocessing's resource tracker and forkserver
    (which outlive a run; a forked rank is the server's child, and counts)."""
    try:
        return [c for c in psutil.Process(kernel_pid).children(recursive=True)
                if "resource_tracker" not in " ".join(c.cmdline())
                and not ("forkserver" in " ".join(c.cmdline()) and c.ppid() == kernel_pid)]
    except psutil.NoSuchProcess:
        return []


def test_kernel_interrupt_mid_run_ends_every_rank():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        assert kc.execute_interactive(SETUP, timeout=60)["content"]["status"] == "ok"
        pid = km.provisioner.process.pid
        # stop_on_error=False: the interrupt's error must not make ipykernel abort the request
        # sent next (it aborts those that reach it before its "stop aborting" message does).
        msg_id = kc.execute("ddpkit.launch(steady, world_size=2, on_metric=going)",
                            stop_on_error=False)
        wait_for_output(kc, "GOING", timeout=60)  # both ranks are stepping through all-reduces
        assert len(spawned_ranks(pid)) == 2
        km.interrupt_kernel()
        while True:  # the interrupt is answered (a kernel stuck in the launch never answers)
            reply = kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        wait_for_idle(kc, msg_id, timeout=30)
        deadline = time.monotonic() + 5
        while spawned_ranks(pid):
            assert time.monotonic() < deadline, spawned_ranks(pid)
            time.sleep(0.1)
        out = []
        reply = kc.execute_interactive("print(ddpkit.launch(quick, world_size=2).returns)",
                                       output_hook=lambda m: out.append(m["content"].get("text", "")),
                                       timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert "[0, 1]" in "".join(out)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def wait_for_output(kc, text, timeout):
    """Read the kernel's iopub until a stream message carries ``text``."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["msg_type"] == "stream" and text in msg["content"]["text"]:
            return


def wait_for_idle(kc, msg_id, timeout):
    """Read the kernel's iopub until it reports idle after the request ``msg_id``."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id):
            return


def test_a_kernel_restart_leaves_no_warm_rank_behind():
    """`ddpkit.train` leaves the kernel's shared pool warm; restarting the kernel (JupyterLab's
    Restart: the old kernel is killed) must not leave those ranks running."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        out = []
        code = ("import ddpkit\nfrom ddpkit.runtime.pool import shared_pids\n"
                "ddpkit.train(ddpkit.TrainConfig(model='mlp', n_blocks=2, width=16, "
                "micro_batch=4, steps=2, world_size=2, backend='gloo', device='cpu'))\n"
                "print('PIDS', *sorted(shared_pids()))")
        reply = kc.execute_interactive(code, timeout=120,
                                       output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        pids = [int(p) for p in "".join(out).split("PIDS")[1].split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        km.restart_kernel(now=True)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                  for p in pids):
            assert time.monotonic() < deadline, "a warm rank outlived its kernel's restart"
            time.sleep(0.1)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
