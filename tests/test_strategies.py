"""Sharding, compression hooks, precision: real 2-rank gloo runs (issue #6)."""
import pytest
import torch

import ddpkit
from ddpkit.engine.strategies import BucketsInOrder
from ddpkit.runtime.pool import shared_pool
from ddpkit.predict.estimate import estimate

# pinned to CPU ranks: these tests compare bitwise CPU results, which must mean the same on a GPU box
CPU = dict(backend="gloo", device="cpu")
BASE = dict(model="mlp", n_blocks=4, width=32, world_size=2, micro_batch=4, accum_steps=2,
            optimizer="adamw", lr=1e-3, steps=3, **CPU)


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


@pytest.fixture(scope="module")
def ddp_weights(pool):
    return ddpkit.train(ddpkit.TrainConfig(**BASE), pool=pool).state_dict


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("checkpoint", [None, 2])
@pytest.mark.parametrize("strategy", ["ddp_zero1", "fsdp"])
def test_sharded_strategies_end_with_the_weights_of_ddp(pool, ddp_weights, strategy, checkpoint):
    res = ddpkit.train(ddpkit.TrainConfig(**BASE, strategy=strategy, checkpoint=checkpoint),
                       pool=pool)
    assert max_diff(res.state_dict, ddp_weights) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "ddp_zero1", "fsdp"])
def test_model_state_bytes_per_rank_match_the_zero_prediction(pool, strategy):
    cfg = ddpkit.TrainConfig(**BASE, strategy=strategy)
    res = ddpkit.train(cfg, pool=pool)
    est = estimate(cfg)
    last = [m for m in res.metrics if m["step"] == cfg.steps - 1]
    for m in last:
        for key, want in (("param_bytes", est.params), ("grad_bytes", est.grads),
                          ("optimizer_bytes", est.optimizer)):
            assert abs(m[key] - want) <= 0.02 * want, (strategy, key, m[key], want)
    full = estimate(ddpkit.TrainConfig(**BASE))
    total = sum(m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] for m in last)
    # summed over ranks: DDP holds 2 copies of everything, ZeRO-1 one optimizer copy, FSDP one of all
    copies = {"ddp": 2 * (full.params + full.grads + full.optimizer),
              "ddp_zero1": 2 * (full.params + full.grads) + full.optimizer,
              "fsdp": full.params + full.grads + full.optimizer}[strategy]
    assert abs(total - copies) <= 0.01 * copies


def test_fsdp_activation_bytes_do_not_count_gathered_parameters(pool):
    cfg = ddpkit.TrainConfig(**BASE, strategy="fsdp", checkpoint=2)
    res = ddpkit.train(cfg, pool=pool)
    assert len(res.metrics) == cfg.world_size * cfg.steps  # every record checked below
    for m in res.metrics:
        assert abs(m["activation_bytes"] - estimate(cfg).activations) <= 0.05 * estimate(cfg).activations


def test_fp16_compression_halves_allreduce_bytes_on_gloo(pool):
    plain = ddpkit.train(ddpkit.TrainConfig(**BASE), pool=pool)
    packed = ddpkit.train(ddpkit.TrainConfig(**BASE, comm_hook="fp16"), pool=pool)
    assert packed.metrics[0]["allreduce_bytes"] * 2 == plain.metrics[0]["allreduce_bytes"]
    assert packed.metrics[0]["allreduce_calls"] == plain.metrics[0]["allreduce_calls"]
    assert 0 < max_diff(packed.state_dict, plain.state_dict) < 1e-2  # fp16 rounding, not garbage


@pytest.mark.parametrize("changes, pattern", [
    (dict(comm_hook="bf16"), r"comm_hook='bf16': bf16_compress_hook needs CUDA and NCCL.*comm_hook='fp16' or None"),
    (dict(strategy="zero3"), r"TrainConfig.strategy='zero3': unknown strategy; pass one of"),
    (dict(strategy="fsdp", optimizer="zero1"), r"optimizer='zero1'.*strategy='ddp_zero1'"),
    (dict(strategy="fsdp", comm_hook="fp16"), r"DDP communication hooks do not apply to FSDP"),
    (dict(save_every=2), r"TrainConfig.save_dir=None: save_every=2 needs a folder"),
])
def test_bad_strategy_settings_name_the_field(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        ddpkit.TrainConfig(**{**BASE, **changes})


def test_what_bf16_autocast_does_to_saved_bytes(pool):
    def acts(micro_batch, precision):
        cfg = ddpkit.TrainConfig(**{**BASE, "steps": 1, "micro_batch": micro_batch,
                                    "precision": precision})
        return ddpkit.train(cfg, pool=pool).metrics[0]["activation_bytes"]
    # autocast saves bf16 copies of the weights for backward (2 bytes per parameter) besides
    # activations of about half the size: a big micro-batch saves less, a tiny one more
    weight_copies = estimate(ddpkit.TrainConfig(**BASE)).params // 2
    assert acts(64, "bf16") < acts(64, "fp32")
    assert acts(4, "bf16") > acts(4, "fp32")
    assert acts(4, "bf16") > weight_copies


def fsdp_mesh_groups(ctx):
    """The group under FSDP's mesh as ddpkit builds it and as ``init_device_mesh`` would, on
    CPU ranks of a machine where CUDA is available (what torch.cuda answers on a GPU box)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddpkit.engine.strategies import fsdp_mesh

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        ours = fsdp_mesh("cpu").get_group()
        theirs = init_device_mesh("cpu", (ctx.world_size,)).get_group()
    finally:
        torch.cuda.is_available = real
    return (ours is dist.group.WORLD, timeout(ours)), (theirs is dist.group.WORLD, timeout(theirs))


def test_fsdp_mesh_is_the_jobs_group_with_the_jobs_timeout_on_a_gpu_box(pool):
    # stall_timeout_s=100 gives the job's collectives a 200 s timeout (launch._collective_timeout)
    res = pool.launch(fsdp_mesh_groups, stall_timeout_s=100)
    for ours, theirs in res.returns:
        assert ours == (True, 200.0)
        # what init_device_mesh did there: a group of its own with torch's 30-minute default
        assert theirs == (False, 1800.0)


def train_without_weights(ctx, plan):
    """What the CLI runs under torchrun: the weights are neither gathered nor copied."""
    from ddpkit.engine import loop, strategies

    def refused(*args, **kwargs):
        raise AssertionError("full_state_dict ran, though nobody receives the weights")

    original, strategies.full_state_dict = strategies.full_state_dict, refused
    try:
        return loop.train_rank(ctx, plan, return_weights=False)
    finally:
        strategies.full_state_dict = original  # a pool's rank lives on


def test_under_torchrun_an_fsdp_run_gathers_no_weights_nobody_receives(pool):
    cfg = ddpkit.TrainConfig(**BASE, strategy="fsdp")
    res = ddpkit.launch(train_without_weights, cfg.rank_plan(), pool=pool)
    assert res.returns == [None, None] and len(res.metrics) == 2 * cfg.steps


def hsdp_mesh_and_group_count(ctx, shard_size):
    """One HSDP job's mesh: the process groups this rank holds before it and after."""
    import torch.distributed as dist

    from ddpkit.engine.strategies import hsdp_mesh

    before = len(dist.distributed_c10d._world.pg_map)
    hsdp_mesh(ctx.device.type, shard_size)
    return before, len(dist.distributed_c10d._world.pg_map)


def test_hsdp_jobs_in_a_warm_pool_reuse_their_process_groups(pool):
    # each job used to make a shard and a replicate group per rank and never destroy them
    # (with NCCL, a communicator each): a pool's process groups grew with every HSDP job
    runs = [pool.launch(hsdp_mesh_and_group_count, 2).returns for _ in range(3)]
    first = runs[0][0]
    assert first[1] - first[0] in (0, 2), runs  # made now (shard, replicate), or by a job before
    assert all(after == first[1] for run in runs for _, after in run), runs


class _Bucket:
    """What `BucketsInOrder` reads of DDP's GradBucket: its index and its buffer."""

    def __init__(self, index):
        self._index, self._buffer = index, torch.full((2,), float(index))

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer


def test_powersgd_buckets_take_turns_and_an_error_reaches_every_later_bucket():
    # gloo matches collectives by the order each rank issues them; PowerSGD issues its P and Q
    # all-reduces from callbacks: a bucket's hook may start only once the one before it is done
    started, futures = [], {}

    def hook(state, bucket):
        started.append(bucket.index())
        futures[bucket.index()] = torch.futures.Future()
        return futures[bucket.index()]

    ordered = BucketsInOrder(hook)
    out = [ordered(None, _Bucket(i)) for i in range(3)]
    assert started == [0]  # buckets 1 and 2 wait
    futures[0].set_result(torch.zeros(2))
    assert started == [0, 1] and not out[1].done()
    futures[1].set_result(torch.ones(2))
    assert started == [0, 1, 2] and out[1].wait().tolist() == [1.0, 1.0]
    futures[2].set_exception(RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="reset by peer"):
        out[2].wait()
    # the next backward starts again at bucket 0, and a failure there fails the rest, unrun
    started.clear()
    out = [ordered(None, _Bucket(i)) for i in range(2)]
    futures[0].set_exception(RuntimeError("gloo timeout"))
    with pytest.raises(RuntimeError, match="gloo timeout"):
        out[1].wait()
    assert started == [0]
