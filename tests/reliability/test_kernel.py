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
"""


def spawned_ranks(kernel_pid):
    try:
        return [c for c in psutil.Process(kernel_pid).children(recursive=True)
                if "resource_tracker" not in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def test_kernel_interrupt_mid_run_ends_every_rank():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        assert kc.execute_interactive(SETUP, timeout=60)["content"]["status"] == "ok"
        pid = km.provisioner.process.pid
        msg_id = kc.execute("ddpkit.launch(steady, world_size=2)")
        deadline = time.monotonic() + 60
        while len(spawned_ranks(pid)) < 2:
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.1)
        time.sleep(1.5)  # the run is going
        t0 = time.monotonic()
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while spawned_ranks(pid):
            assert time.monotonic() < deadline, spawned_ranks(pid)
            time.sleep(0.1)
        out = []
        reply = kc.execute_interactive("print(ddpkit.launch(quick, world_size=2).returns)",
                                       output_hook=lambda m: out.append(m["content"].get("text", "")),
                                       timeout=60)
        assert reply["content"]["status"] == "ok" and "[0, 1]" in "".join(out)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
