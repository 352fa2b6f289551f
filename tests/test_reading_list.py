"""The reading list on real gloo ranks (issue #24): ZeRO's Table 1 and communication volume
for ddp / ddp_zero1 / zero2 / fsdp at 2 and 4 ranks, HSDP, PowerSGD; every collective counted."""
import pytest

import ddpkit
from ddpkit.spec.names import FSDP_STRATEGIES
from ddpkit.predict import zero
from ddpkit.predict.units import byte_unit

CPU = dict(backend="gloo", device="cpu")
BASE = dict(model="mlp", n_blocks=4, width=64, micro_batch=4, optimizer="adamw", lr=1e-3,
            steps=3, **CPU)


def cfg_of(world_size, strategy, **kw):
    return ddpkit.TrainConfig(**{**BASE, **kw}, world_size=world_size, strategy=strategy)


@pytest.fixture(scope="module")
def runs():
    """Every strategy at 2 and 4 ranks, run once (warm pools)."""
    out = {}
    for ws, strategies in ((2, ("ddp", "ddp_zero1", "zero2", "fsdp")),
                           (4, ("ddp", "ddp_zero1", "zero2", "fsdp", "hsdp"))):
        with ddpkit.Pool(world_size=ws, **CPU) as pool:
            for s in strategies:
                kw = {"shard_size": 2} if s == "hsdp" else {}
                out[ws, s] = ddpkit.train(cfg_of(ws, s, **kw), pool=pool)
    return out


def last_records(res):
    return [m for m in res.metrics if m["step"] == res.config.steps - 1]


def rank0(res):
    return next(m for m in last_records(res) if m["rank"] == 0)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("ws", [2, 4])
def test_model_state_bytes_per_rank_are_table_1(runs, ws):
    psi = sum(zero.param_counts(runs[ws, "ddp"].config))
    for (w, strategy), res in runs.items():
        if w != ws:
            continue
        rule = zero.model_states(res.config)
        recs = last_records(res)
        for key in ("param_bytes", "grad_bytes"):
            # exact: FSDP2 chunks each tensor along dim 0, so rank shards differ by a few rows,
            # and together they are exactly the copies the rule counts
            total = sum(m[key] for m in recs)
            assert total == rule[key] * ws, (strategy, key, total, rule[key] * ws)
        opt = [m["optimizer_bytes"] for m in recs]
        if strategy == "ddp_zero1":
            # torch's ZeroRedundancyOptimizer hands out whole parameters greedily: uneven, and
            # together one copy of the state
            assert sum(opt) == 8 * psi
        else:
            assert sum(opt) == rule["optimizer_bytes"] * ws, (strategy, opt)
    hsdp = runs.get((ws, "hsdp"))
    if hsdp is not None:  # 16 Psi / shard_size per rank, fp32
        for m in last_records(hsdp):
            total = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
            assert abs(total - 16 * psi / 2) <= 0.002 * 16 * psi / 2


@pytest.mark.parametrize("ws", [2, 4])
def test_communication_volume_per_rank_per_step_follows_the_paper(runs, ws):
    ddp = [m["comm_bytes"] for m in last_records(runs[ws, "ddp"])]
    assert ddp == [round(2 * (ws - 1) / ws * 4 * sum(zero.param_counts(runs[ws, "ddp"].config)))] * ws
    for (w, strategy), res in runs.items():
        if w != ws:
            continue
        rule = zero.comm_volume(res.config)
        for m in res.metrics:
            assert m["comm_bytes"] == sum(m["comm_by_op"].values())
        for m in last_records(res):
            assert set(m["comm_by_op"]) == set(rule), (strategy, m["comm_by_op"])
            for op, want in rule.items():
                assert abs(m["comm_by_op"][op] - want) <= 0.01 * want, (strategy, op)
    zero2 = [m["comm_bytes"] for m in last_records(runs[ws, "zero2"])]
    assert all(abs(z - d) <= 0.01 * d for z, d in zip(zero2, ddp))
    fsdp = rank0(runs[ws, "fsdp"])["comm_bytes"]
    inside, root = zero.param_counts(runs[ws, "fsdp"].config)
    # 1.5x DDP's for the blocks (resharded after forward), 1x for the root's parameters
    assert abs(fsdp - ddp[0] * (1.5 * inside + root) / (inside + root)) <= 0.01 * fsdp
    assert fsdp > 1.4 * ddp[0]


def test_hsdp_splits_its_communication_by_group(runs):
    rule = zero.comm_volume(runs[4, "hsdp"].config)
    for m in last_records(runs[4, "hsdp"]):
        by = m["comm_by_op"]
        # within the shard group (2 ranks) a reduce-scatter and the all-gathers; across the
        # replica group an all-reduce of each rank's half of the gradients
        assert abs(by["allreduce"] - rule["allreduce"]) <= 0.01 * rule["allreduce"]
        assert abs(by["allreduce"] - by["reduce_scatter"]) <= 0.01 * by["reduce_scatter"]


@pytest.mark.parametrize("ws, strategy", [(2, "zero2"), (4, "zero2"), (4, "hsdp")])
def test_zero2_and_hsdp_end_with_the_weights_of_ddp(runs, ws, strategy):
    assert max_diff(runs[ws, strategy].state_dict, runs[ws, "ddp"].state_dict) <= 1e-5


@pytest.mark.parametrize("ws, strategy", [(2, "zero2"), (4, "hsdp")])
def test_simulated_peak_is_the_measured_one(runs, ws, strategy):
    # both run on FSDP2: on gloo its reduce-scatter completes asynchronously and may hold its
    # buffers past the simulated moment (the fake group returns at once), so the measured peak
    # may sit above (+3.8% seen in CI; locally a backward peak above the simulation's optimizer
    # peak), never more than 3% below; tests/test_peak.py allows the same
    assert strategy in FSDP_STRATEGIES
    res = runs[ws, strategy]
    est = ddpkit.estimate(res.config)
    probed = [m for m in res.metrics if m["step"] in (0, 1)]
    assert len(probed) == 2 * ws and all("peak_bytes" in m for m in probed)  # both steps probed
    for m in probed:
        want = est.peak(step=m["step"], rank=m["rank"]).bytes
        assert -0.03 * want <= m["peak_bytes"] - want <= 0.10 * want, (m["rank"], m["step"])


def test_powersgd_rank_1_sends_a_tenth_of_ddps_bytes():
    # width 128: more than DDP's first bucket (1 MiB after step 1), so two buckets a step, whose
    # PowerSGD all-reduces gloo must see in the same order on both ranks (issue #41)
    with ddpkit.Pool(world_size=2, **CPU) as pool:
        ddp = ddpkit.train(cfg_of(2, "ddp", steps=20, width=128), pool=pool)
        psgd = ddpkit.train(cfg_of(2, "ddp", steps=20, width=128, comm_hook="powersgd",
                                   powersgd_rank=1), pool=pool)
    d = {m["step"]: m for m in ddp.metrics if m["rank"] == 0}
    p = {m["step"]: m for m in psgd.metrics if m["rank"] == 0}
    for step in (0, 1):  # before start_powerSGD_iter=2: the same uncompressed all-reduce
        assert p[step]["comm_bytes"] == d[step]["comm_bytes"]
    for step in range(2, 20):
        assert p[step]["allreduce_calls"] >= 2  # buckets
        assert p[step]["comm_bytes"] <= 0.10 * d[step]["comm_bytes"]
        # P and Q are all-reduced in callbacks on gloo's thread: counted all the same
        assert p[step]["comm_calls"] >= 3 * p[step]["allreduce_calls"]
        assert p[step]["allreduce_bytes"] == p[step]["comm_by_op"]["allreduce"] * 1  # n=2: 2(n-1)/n = 1
    # the loss curve beside DDP's, on the same batches: error feedback keeps it close
    late = range(10, 20)
    assert sum(p[s]["loss"] for s in late) <= 1.2 * sum(d[s]["loss"] for s in late)


@pytest.mark.parametrize("kw, match", [
    (dict(strategy="hsdp", world_size=4), "shard_size=None: strategy='hsdp' needs"),
    (dict(strategy="hsdp", world_size=4, shard_size=3), "must divide world_size=4"),
    (dict(strategy="fsdp", shard_size=2), "only strategy='hsdp'"),
    (dict(powersgd_rank=2), r"powersgd_rank=2: is PowerSGD's setting"),
    (dict(powersgd_start_iter=5), "powersgd_start_iter=5: is PowerSGD's"),
    (dict(comm_hook="powersgd", powersgd_rank=0), "must be an int >= 1"),
    (dict(comm_hook="powersgd", powersgd_start_iter=1), "iteration 2 at the earliest"),
    (dict(comm_hook="powersgd", link_gbps=1.0), "PowerSGD's vary"),
    (dict(strategy="zero2", comm_hook="powersgd"), "do not apply to FSDP2"),
    (dict(strategy="hsdp", world_size=4, shard_size=2, optimizer="zero1"), "shards it already"),
    (dict(strategy="zero2", bucket_cap_mb=1), "FSDP has neither"),
])
def test_bad_settings_name_the_setting_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        ddpkit.TrainConfig(**{**BASE, **kw})
    assert "pass " in str(e.value)


def test_comm_volume_refuses_what_its_rule_does_not_cover():
    with pytest.raises(ValueError, match="accum_steps=1 and comm_hook=None"):
        zero.comm_volume(cfg_of(2, "ddp", accum_steps=2))


def test_comm_figure_stacks_each_collective_beside_the_rule(runs):
    results = [runs[4, s] for s in ("ddp", "zero2", "fsdp", "hsdp")]
    fig = ddpkit.comm_figure(results)
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert set(bars) == {"allreduce", "allgather", "reduce_scatter"}
    rule = next(t for t in fig.data if t.type == "scatter")
    unit, size = byte_unit(max(rank0(r)["comm_bytes"] for r in results))
    assert fig.layout.yaxis.title.text == unit
    for i, res in enumerate(results):  # each stack adds up to rank 0's bytes sent
        sent = sum(b[i] for b in bars.values())
        assert sent == pytest.approx(rank0(res)["comm_bytes"] / size, rel=1e-9)
        assert rule.y[i] == pytest.approx(sent, rel=0.01)


@pytest.mark.parametrize("width, rank, kw", [
    # widths 64, 128, 256 and ranks 2-4 (rank 1 at width 128 above), beside accumulation,
    # checkpointing and the timeline; from width 128 DDP has two buckets a step from step 1 on
    # (its first holds 1 MiB once rebuilt), whose collectives gloo must see in order
    (64, 2, dict(accum_steps=2, checkpoint=2, timeline_every=1)),
    (128, 4, dict(accum_steps=2, checkpoint="full", timeline_every=1)),
    (256, 3, dict(checkpoint="full", timeline_every=1)),
])
def test_powersgd_trains_at_every_width_and_rank(width, rank, kw):
    cfg = cfg_of(2, "ddp", width=width, comm_hook="powersgd", powersgd_rank=rank, steps=4, **kw)
    res = ddpkit.train(cfg)
    assert sorted({m["step"] for m in res.metrics}) == [0, 1, 2, 3]
    buckets = 1 if width == 64 else 2
    for m in res.metrics:
        assert m["loss"] == m["loss"] and m["loss"] < 10  # finite, not diverged
        # no_sync: one synced micro-step a step, so PowerSGD's iteration count is the step's;
        # from iteration 2 each bucket all-reduces its vectors, then P, then Q
        assert m["allreduce_calls"] >= (buckets if m["step"] >= 1 else 1)
        assert m["comm_calls"] >= m["allreduce_calls"] * (3 if m["step"] >= 2 else 1)
    rows = res.timeline[res.timeline.kind == "allreduce"]
    assert len(rows) and (res.overlap().comm_s > 0).all()


def test_hsdp_saves_its_shards_and_resumes_exactly(tmp_path):
    cfg = cfg_of(4, "hsdp", width=32, shard_size=2)
    with ddpkit.Pool(world_size=4, **CPU) as pool:
        straight = ddpkit.train(cfg.replace(steps=4), pool=pool)
        ddpkit.train(cfg.replace(steps=2, save_every=2, save_dir=str(tmp_path)), pool=pool)
        resumed = ddpkit.train(cfg.replace(steps=4), resume_from=str(tmp_path), pool=pool)
    assert max_diff(resumed.state_dict, straight.state_dict) == 0.0


def test_sweep_has_the_communication_columns_and_figure():
    table = ddpkit.sweep(cfg_of(2, "ddp", steps=3), progress=False, strategy=["ddp", "zero2"])
    assert list(table.strategy) == ["ddp", "zero2"]
    ddp, zero2 = table.comm_by_op
    assert set(ddp) == {"allreduce"} and set(zero2) == {"allgather", "reduce_scatter"}
    assert abs(table.comm_bytes[1] - table.comm_bytes[0]) <= 0.01 * table.comm_bytes[0]
    fig = ddpkit.comm_figure(table)
    assert [t.name for t in fig.data if t.type == "bar"] == ["allgather", "allreduce",
                                                             "reduce_scatter"]
    assert list(fig.data[0].x) == ["strategy=ddp", "strategy=zero2"]
