"""The training engine on real gloo ranks: issue #3's 'What must hold'."""
import statistics

import pytest
import torch

import ddpkit
from ddpkit.runtime.pool import shared_pool
from ddpkit.spec.setting import CheckpointSetting
from ddpkit.predict.estimate import activation_bytes, estimate, param_count
from ddpkit.spec.model import build_model

# pinned to CPU ranks: these tests compare bitwise CPU results, which must mean the same on a GPU box
CPU = dict(backend="gloo", device="cpu")
TINY = dict(model="mlp", n_blocks=4, width=32, world_size=2, micro_batch=4, accum_steps=2,
            optimizer="sgd", precision="fp32", steps=3, seed=0, **CPU)


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference():
    """One rank, the whole global batch at once, no checkpointing."""
    cfg = ddpkit.TrainConfig(**{**TINY, "world_size": 1, "micro_batch": 16, "accum_steps": 1})
    return ddpkit.train(cfg).state_dict


# --- 1. equivalence
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("checkpoint", [None, 2, "full", [True, False, True, False]])
def test_ddp_accumulation_and_checkpointing_match_one_big_batch(pool, reference, checkpoint, reentrant):
    cfg = ddpkit.TrainConfig(**TINY, checkpoint=checkpoint, use_reentrant=reentrant)
    res = ddpkit.train(cfg, pool=pool)
    assert max_diff(res.state_dict, reference) <= 1e-5
    assert max_diff(res.state_dict, build_model(cfg.rank_plan())[0].state_dict()) > 1e-3  # it did train


@pytest.mark.parametrize("switches", [dict(static_graph=True), dict(find_unused_parameters=True),
                                      dict(gradient_as_bucket_view=True)])
def test_ddp_switches_pass_through_and_keep_the_maths(pool, reference, switches):
    cfg = ddpkit.TrainConfig(**TINY, checkpoint=2, **switches)
    res = ddpkit.train(cfg, pool=pool)
    if "find_unused_parameters" in switches:  # every parameter is used: doctor notes it (a
        # cost, nothing wrong: kept in the result, not warned about)
        assert [(f.pitfall, f.severity) for f in res.findings] == [
            ("find_unused_not_needed", "note")]
    assert max_diff(res.state_dict, reference) <= 1e-5


def test_state_dict_is_rank_zero_weights_without_module_prefix(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**TINY), pool=pool)
    assert set(res.state_dict) == set(build_model(res.config.rank_plan())[0].state_dict())
    assert not any(k.startswith("module.") for k in res.state_dict)
    assert all(v.device.type == "cpu" for v in res.state_dict.values())


def test_gpt_trains_and_loss_falls(pool):
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=2, width=32, seq_len=16, world_size=2,
                             micro_batch=8, steps=12, optimizer="adamw", lr=3e-3, checkpoint=2,
                             **CPU)
    losses = ddpkit.train(cfg, pool=pool).per_rank("loss")
    assert losses[-1] < losses[0] * 0.9


# --- 2. no_sync
def test_no_sync_cuts_allreduces_by_the_accumulation_factor(pool):
    cfg = ddpkit.TrainConfig(**{**TINY, "accum_steps": 4})
    synced = ddpkit.train(cfg.replace(no_sync=False), pool=pool)
    skipped = ddpkit.train(cfg.replace(no_sync=True), pool=pool)
    calls = lambda r: [m["allreduce_calls"] for m in r.metrics]
    buckets = calls(skipped)[0]
    assert buckets >= 1 and set(calls(skipped)) == {buckets}
    assert set(calls(synced)) == {4 * buckets}
    assert skipped.metrics[0]["allreduce_bytes"] * 4 == synced.metrics[0]["allreduce_bytes"]
    assert skipped.metrics[0]["allreduce_bytes"] == param_count(cfg) * 4  # every gradient, once
    assert max_diff(synced.state_dict, skipped.state_dict) <= 1e-6


# --- 3. measured against estimated
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_activation_bytes_fall_with_segments_as_estimated(pool, model):
    base = ddpkit.TrainConfig(model=model, n_blocks=4, width=32, seq_len=16, world_size=2,
                              micro_batch=2, steps=1, **CPU)
    measured = {}
    for setting in (None, 2, 4, "full"):
        res = ddpkit.train(base.replace(checkpoint=setting), pool=pool)
        acts = {m["activation_bytes"] for m in res.metrics}
        assert len(acts) == 1  # the same on every rank and step
        measured[setting] = acts.pop()
        predicted = activation_bytes(base, base.checkpoint.with_value(setting))
        assert abs(measured[setting] - predicted) <= 0.10 * predicted, (setting, measured, predicted)
    assert measured[None] > measured[2] > measured[4] > measured["full"]
    # the structure: s=2 keeps 1 boundary + 2 blocks; None keeps 4 blocks -> the step is 2 blocks
    est = estimate(base)
    assert measured[None] - measured[2] == pytest.approx(2 * est.activation_per_block - est.boundary, rel=0.1)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "zero1"])
def test_params_grads_optimizer_bytes_match_the_estimate_exactly(pool, optimizer):
    cfg = ddpkit.TrainConfig(**{**TINY, "optimizer": optimizer, "lr": 1e-3, "steps": 1})
    res = ddpkit.train(cfg, pool=pool)
    est = estimate(cfg)
    for m in res.metrics:
        assert m["param_bytes"] == est.params and m["grad_bytes"] == est.grads
        if optimizer != "zero1":
            assert m["optimizer_bytes"] == est.optimizer
    if optimizer == "zero1":
        shards = [m["optimizer_bytes"] for m in res.metrics]
        full = 2 * est.params  # AdamW: exp_avg + exp_avg_sq
        assert sum(shards) == full  # every parameter's state lives on exactly one rank
        assert all(abs(s - full / 2) <= 0.25 * full / 2 for s in shards)  # about 1/world_size each


def test_the_peak_is_probed_at_steps_0_and_1_then_every_peak_every(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**{**TINY, "steps": 6, "peak_every": 2}), pool=pool)
    est = estimate(res.config)
    assert [m["step"] for m in res.metrics if "peak_bytes" in m and m["rank"] == 0] == [0, 1, 3, 5]
    for m in res.metrics:
        if "peak_bytes" not in m:
            continue
        assert m["peak_bytes"] >= est.params + m["activation_bytes"]
        assert sum(m["peak_ledger"].values()) == m["peak_bytes"]
        assert m["peak_ledger"]["parameters"] == est.params


def test_sampled_probes_carry_what_every_step_would_measure(pool):
    # activation and model-state bytes are measured at the first step and every peak_every
    # steps (the probe has a cost); each record between carries the same numbers
    cfg = ddpkit.TrainConfig(**{**TINY, "steps": 7, "optimizer": "adamw", "checkpoint": 2})
    keys = ("activation_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")
    every = ddpkit.train(cfg.replace(peak_every=1), pool=pool).metrics
    sampled = ddpkit.train(cfg.replace(peak_every=3), pool=pool).metrics
    assert [[m[k] for k in keys] for m in sampled] == [[m[k] for k in keys] for m in every]
    assert all(m["optimizer_bytes"] > 0 and m["activation_bytes"] > 0 for m in sampled)


def test_bf16_autocast_runs_on_cpu(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**{**TINY, "precision": "bf16"}), pool=pool)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in res.metrics)


def test_sweep_gives_one_row_per_combination(pool):
    import pandas as pd
    from ddpkit.runs.sweep import SWEEP_COLUMNS

    table = ddpkit.sweep(ddpkit.TrainConfig(**{**TINY, "steps": 3}), pool=pool,
                         checkpoint=[None, 2], accum_steps=[1, 2], progress=False)
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns) == ["checkpoint", "accum_steps", *SWEEP_COLUMNS]
    assert list(zip(table.checkpoint, table.accum_steps)) == [("none", 1), ("none", 2), ("2", 1),
                                                              ("2", 2)]  # str(setting)
    assert (table.activation_bytes == table.predicted_activation_bytes).all()
    assert table.recompute_flops_ratio[0] == 1.0 and table.recompute_flops_ratio[2] > 1.0
    for row in table.itertuples():  # rank 0's steps after the first, as the columns say
        steady = [m["step_time_s"] for m in row.result.metrics if m["rank"] == 0][1:]
        q = statistics.quantiles(steady, n=4, method="inclusive")
        assert row.step_time_ms == pytest.approx(1000 * statistics.median(steady))
        assert row.step_time_iqr_ms == pytest.approx(1000 * (q[2] - q[0]))
    # each row keeps its run: the TrainResult of exactly that setting
    assert [r.config.accum_steps for r in table.result] == [1, 2, 1, 2]
    assert table.final_loss[3] == table.result[3].summary()["final_loss"]


def test_sweep_progress_shows_only_the_current_settings_loss(pool, capfd):
    """The bar's loss belongs to the setting its description names: none shown when a setting
    starts (not the previous setting's last loss), then that setting's own."""
    import re

    table = ddpkit.sweep(ddpkit.TrainConfig(**{**TINY, "steps": 3}), pool=pool, seed=[0, 1])
    frames = [f.strip() for f in capfd.readouterr().err.replace("\n", "\r").split("\r")]
    own = {f"seed={sd}": {f"{v:.4f}" for v in res.per_rank("loss", 0)}
           for sd, res in zip(table.seed, table.result)}
    assert own["seed=0"].isdisjoint(own["seed=1"])  # each setting's losses tell it apart
    shown = {}
    for f in frames:
        m = re.match(r"(seed=\d): .*?(?:loss=([\d.]+))?\]$", f)
        if m:
            shown.setdefault(m[1], []).append(m[2])
    assert list(shown) == ["seed=0", "seed=1"], frames
    for label, losses in shown.items():
        assert losses[0] is None, (label, losses)  # the frame drawn as the setting starts
        assert {v for v in losses if v} <= own[label], (label, losses, own)
    assert any(shown["seed=1"])  # its own loss did show


def test_tradeoff_marks_the_pareto_frontier():
    import pandas as pd
    from ddpkit.runs.demo import pareto

    # cost, memory: (1.0, 10) (1.1, 6) (1.2, 8: beaten by 1.1) (1.3, 3)
    assert pareto([1.0, 1.1, 1.2, 1.3], [10, 6, 8, 3]) == [0, 1, 3]
    df = pd.DataFrame({"checkpoint": ["none", 2, 3, "full"], "final_loss": [0.1] * 4,
                       "step_time_ms": [5.0, 6.0, 7.0, 6.5], "step_time_iqr_ms": [0.5] * 4,
                       "activation_bytes": [10 * 2**20, 6 * 2**20, 8 * 2**20, 3 * 2**20],
                       "peak_bytes": [2**30] * 4, "recompute_flops_ratio": [1.0, 1.1, 1.2, 1.3]})
    fig = ddpkit.tradeoff(df)
    front = [t for t in fig.data if t.name == "Pareto frontier"]
    assert [list(t.x) for t in front] == [[1.0, 1.1, 1.3], [5.0, 6.0, 6.5]]
    assert list(front[0].text) == ["checkpoint=none", "checkpoint=2", "checkpoint=full"]
    assert "MiB" in fig.layout.yaxis.title.text  # the unit fits the size


# --- 4. bad config, at construction
@pytest.mark.parametrize("changes, pattern", [
    (dict(checkpoint=5), r"TrainConfig.checkpoint=5: segments must be between 1 and n_blocks=4; pass checkpoint<=4"),
    (dict(checkpoint=0), r"checkpoint=0: segments must be between 1"),
    (dict(accum_steps=0), r"TrainConfig.accum_steps=0: needs at least 1 .*pass accum_steps=1 or more"),
    (dict(micro_batch=0), r"TrainConfig.micro_batch=0: needs at least 1 .*pass micro_batch=1 or more"),
    (dict(model="resnet"), r"TrainConfig.model='resnet': unknown model; pass one of \('mlp', 'gpt'\)"),
    (dict(precision="fp8"), r"TrainConfig.precision='fp8': unknown precision; pass one of"),
    (dict(optimizer="lion"), r"TrainConfig.optimizer='lion': unknown optimizer"),
    (dict(checkpoint=[True, False]), r"selective list needs exactly n_blocks=4 booleans"),
    (dict(checkpoint=True), r"checkpoint=True: ambiguous"),
    (dict(model="gpt", width=30, n_heads=4), r"TrainConfig.n_heads=4: must divide width=30"),
    (dict(world_size=0), r"TrainConfig.world_size=0: needs at least 1"),
])
def test_bad_config_names_the_field_and_the_fix(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        ddpkit.TrainConfig(**{**TINY, **changes})


def test_fp16_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"precision='fp16' needs CUDA.*pass precision='bf16' or 'fp32'"):
        ddpkit.TrainConfig(**{**TINY, "precision": "fp16"})


def test_train_refuses_a_pool_of_another_size(pool):
    with pytest.raises(ValueError, match=r"world_size=1 but the pool has 2 ranks"):
        ddpkit.train(ddpkit.TrainConfig(**{**TINY, "world_size": 1}), pool=pool)


def test_estimate_stays_the_function_after_its_module_is_imported():
    import importlib
    module = importlib.import_module("ddpkit.predict.estimate")
    assert ddpkit.estimate is module.estimate  # the function, not its module
    assert isinstance(ddpkit.estimate(ddpkit.TrainConfig(**TINY)), ddpkit.Estimate)
    assert ddpkit.train.__module__ == "ddpkit.runs.train" and callable(ddpkit.train)


def test_train_runs_doctor_first_and_keeps_its_findings(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**TINY), pool=pool)
    assert res.findings == []  # the built-in models are clean
    cfg = ddpkit.TrainConfig(**{**TINY, "checkpoint": 2, "use_reentrant": True, "dropout": 0.1,
                                "preserve_rng_state": False})
    with pytest.warns(UserWarning, match=r"ddpkit.doctor: \[dropout_rng\]"):
        res = ddpkit.train(cfg, pool=pool)
    assert "dropout_rng" in {f.pitfall for f in res.findings}


def test_doctor_leaves_the_kernel_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(1)
    torch.manual_seed(1234)
    from ddpkit.runs.train import check_config
    check_config(ddpkit.TrainConfig(**TINY))
    assert torch.rand(1) == expected


def test_sweep_over_world_sizes_uses_a_pool_per_size():
    table = ddpkit.sweep(ddpkit.TrainConfig(**{**TINY, "steps": 1}), world_size=[1, 2])
    assert list(table.world_size) == [1, 2]
    assert [r.run.world_size for r in table.result] == [1, 2]


def test_the_recompute_ratio_follows_torchs_early_stop_switch():
    """The traced FLOPs are memoised per setting, yet torch's early-stop switch (a global) changes
    what a recompute runs: with it off, non-reentrant checkpointing recomputes all, as reentrant
    does (notebook 02 shows it)."""
    from ddpkit.runs.sweep import recompute_flops_ratio

    full = ddpkit.TrainConfig(model="mlp", n_blocks=3, width=32, micro_batch=4,
                              checkpoint="full", backend="gloo", device="cpu")
    early = recompute_flops_ratio(full)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        all_of_it = recompute_flops_ratio(full)
    assert all_of_it > early and recompute_flops_ratio(full) == early
    assert abs(all_of_it - recompute_flops_ratio(full.replace(use_reentrant=True))) < 1e-9


def _counting_left_on(ctx):
    """In a rank: does a collective pass through ddpkit's Python, or an allocation into c10's
    count? (What a run's probes switch on for the process.)"""
    import sys

    import torch.distributed as dist
    from ddpkit.engine.allocations import cpu_allocated

    calls = []
    sys.setprofile(lambda frame, event, arg: event == "call" and calls.append(
        frame.f_code.co_filename))
    try:
        dist.all_reduce(torch.ones(4))
    finally:
        sys.setprofile(None)
    return any(f.endswith("collectives.py") for f in calls), cpu_allocated() > 0


def test_a_warm_ranks_next_job_runs_without_the_probes_counting(pool):
    # one step: the peak probe's allocation count is switched off only after its second window
    ddpkit.train(ddpkit.TrainConfig(**{**TINY, "steps": 1}), pool=pool)
    assert pool.launch(_counting_left_on).returns == [(False, False)] * 2
