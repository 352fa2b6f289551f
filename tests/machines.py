"""A machine of stated round rates, for the tests of the step-time prediction: what they check
is how a step is played (what overlaps, what waits, what recompute adds), not how fast the
machine running the tests is. `bench/step_time.py` sets predictions beside measured runs."""
import math

from ddpkit.predict.machine import Machine

SIZES = [8, 1024]


def synthetic(comm_share=0.0, key=""):
    """1 GFLOP/s for every matrix product, 1 GB/s for every memory-bound op, 1 us per op
    dispatched, 100 us + 1 ms per MB for each collective."""
    flat = [[[math.log(1e9)] * 2 for _ in range(2)] for _ in range(2)]
    coll = {f"{k}/{n}": [(1, 1e-4), (2**30, 1e-4 + 2**30 / 1e9)]
            for k in ("allreduce", "allgather", "reduce_scatter", "broadcast") for n in (2, 4)}
    return Machine("rates for tests", gemm={"float32": {"sizes": SIZES, "log_rate": flat}},
                   attention={"float32": {"forward": [(1, 1e9)], "backward": [(1, 1e9)]}},
                   memory={"bytes_per_s": [(1, 1e9)], "ops": {}},
                   overhead=dict(forward=1e-6, backward=1e-6, optimizer=1e-6, other=1e-6),
                   collectives=coll, comm_cpu_share=comm_share, key=key)


def install(monkeypatch, tmp_path):
    """This machine calibrated, for the test: the synthetic machine kept in a temporary cache
    (``DDPKIT_CACHE``), as `ddpkit.calibrate` would keep a measured one."""
    import os

    from ddpkit.predict import calibrate

    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "_LOADED", {})
    key = calibrate.machine_key(max(1, (os.cpu_count() or 1) // 2))
    machine = synthetic(key=key)
    calibrate.remember(machine)
    return machine
