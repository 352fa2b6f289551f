"""`launch`: run a function on N ranks from a notebook kernel, on the ranks ``pool=`` names.

``pool=`` means one thing wherever ddpkit takes it (`launch`, `train`, `sweep`,
`pitfalls.run`): ``"fresh"`` (ranks started for this run alone), ``"shared"`` (the kernel's warm
pool for these ranks, `pool.shared_pool`; fresh ranks while it runs another job) or a `Pool` of
yours. `resolve_pool` reads it (the old spellings None, True and False are refused, naming the
new one: None meant fresh ranks to `launch` and the shared pool to `train`), and `check_pool` is
the one check that a `Pool` fits a run. Bad settings and unpicklable arguments raise before any
process exists (`job`).
"""
from __future__ import annotations

from ..devices import resolve_devices
from .group import HOST, RankGroup, interrupts_held
from .handle import RunHandle
from .job import check_options, finish, make_job
from .pool import Pool, PoolBusy, shared_pool

POOLS = ("shared", "fresh")


def resolve_pool(pool):
    """``pool=`` as one of ``"shared"``, ``"fresh"`` or a `Pool`; anything else is refused,
    naming the new spelling."""
    if isinstance(pool, Pool) or (isinstance(pool, str) and pool in POOLS):
        return pool
    old = {None: "'fresh' to launch() and 'shared' to train()", True: "'shared'",
           False: "'fresh'"}
    said = f" (it meant {old[pool]}: write that)" if isinstance(pool, bool) or pool is None \
        else ""
    raise TypeError(f"pool={pool!r}{said}: pass pool='shared' (the kernel's warm ranks), "
                    f"pool='fresh' (ranks for this run alone) or a ddpkit.Pool")


def check_pool(pool, world_size=None, backend=None, device=None, host=None, named=""):
    """The one check that ``pool`` (a `Pool`) can serve a run of ``world_size`` ranks on
    ``backend``/``device`` (each as given: None is the pool's own) listening on ``host``;
    ``named``: how the run's settings are named in the error (``"TrainConfig."``)."""
    if world_size is not None and world_size != pool.world_size:
        raise ValueError(f"{named}world_size={world_size} but the pool has {pool.world_size} "
                         f"ranks; pass a pool of {world_size} ranks, or pool='shared'")
    if backend is not None or device is not None:
        backend, device = resolve_devices(pool.world_size, backend or pool.backend,
                                          device or pool.device)
        if (backend, device) != (pool.backend, pool.device):
            raise ValueError(f"{named[:-1] or 'the run'} asks for {backend} on {device}, the "
                             f"pool runs {pool.backend} on {pool.device}; pass a matching pool "
                             f"or pool='shared'")
    if host is not None and host != pool.host:
        raise ValueError(f"host={host!r} but the pool listens on {pool.host!r}; pass "
                         f"host={pool.host!r} or make a Pool with host={host!r}")


def launch(fn, *args, world_size=None, backend=None, device=None, block=True, on_metric=None,
           on_output=None, stall_timeout_s=300.0, seed=0, pool="fresh", port=None, host=HOST,
           **kwargs):
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks (default 2); the group is up.

    block=True returns a `RunResult` (``returns`` of every rank, ``metrics`` of every rank);
    block=False returns a `RunHandle` at once. ``on_metric(record)`` and ``on_output(rank, line)``
    are called from ddpkit's drain thread as records and output lines arrive. ``pool``:
    ``"fresh"`` (the default) starts ranks for this run alone; ``"shared"`` runs on the kernel's
    warm pool for these ranks (`ddpkit.shutdown` ends it); a `Pool` on that pool's warm ranks.
    ``stall_timeout_s``: end the run with `RankStalled` when a rank sends nothing (no
    ``ctx.log``) for that long; None turns the watchdog off.
    ``host``: the address the rendezvous store and the ranks' gloo sockets listen on; loopback
    by default, so nothing outside this machine can reach them. Pass another address of this
    machine only when something elsewhere must connect (the store has no authentication).
    The names above are the launcher's; every other keyword goes to ``fn``.
    """
    pool = resolve_pool(pool)
    kw = dict(block=block, on_metric=on_metric, on_output=on_output,
              stall_timeout_s=stall_timeout_s, seed=seed, **kwargs)
    if pool == "shared":
        if port is not None:
            raise ValueError(f"port={port} with pool='shared': the shared pool's ranks have "
                             f"their own port; pass pool='fresh' for a launch on port {port}")
        pool = shared_pool(2 if world_size is None else world_size, backend, device, host)
        return launch_or_fresh(pool, fn, *args, **kw)
    if isinstance(pool, Pool):
        check_pool(pool, world_size, host=host)
        return pool.launch(fn, *args, **kw)
    world_size = 2 if world_size is None else world_size
    check_options(block, on_metric, on_output, port, host)
    backend, device = resolve_devices(world_size, backend, device)
    job = make_job(fn, args, kwargs, seed, stall_timeout_s)
    with interrupts_held() as held:  # an interrupt now ends the run below, not mid-start
        group = RankGroup(world_size, backend, device, persistent=False, port=port,
                          pg_timeout_s=job["pg_timeout_s"],
                          deterministic=job["flags"]["deterministic"], host=host)
        handle = RunHandle(group, job, on_metric=on_metric, on_output=on_output,
                           stall_timeout_s=stall_timeout_s, owns_group=True)
    return finish(handle, block, held)


def launch_or_fresh(pool, fn, *args, **kw):
    """``pool.launch``, or a fresh launch of ranks like the pool's while it is busy with another
    job (a Lab run going on in the background, say)."""
    try:
        return pool.launch(fn, *args, **kw)
    except PoolBusy:
        return launch(fn, *args, world_size=pool.world_size, backend=pool.backend,
                      device=pool.device, host=pool.host, **kw)
