"""CUDA paths of the training engine: NCCL ranks, fp16 + GradScaler, CUDA peak memory, shared GPUs.
Skipped, with the reason, where there are not enough GPUs. `test_every_config_here_builds_on_cpu`
runs everywhere: it builds each config these tests train, with the GPUs substituted."""
import pytest
import torch

import ddpkit
from ddpkit import devices
from ddpkit.predict.estimate import estimate

GPUS = len(devices.cuda_gpus())
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL, one process per GPU); this machine has {GPUS}")
needs_one = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU, this machine has none")

TINY = dict(model="gpt", n_blocks=4, width=64, seq_len=32, world_size=2, micro_batch=4,
            accum_steps=2, steps=3)


def configs(gpus):
    """Every config the tests below train, by name, for a machine with ``gpus`` GPUs."""
    out = {f"nccl_{p}": {**TINY, "precision": p, "checkpoint": 2} for p in ("fp32", "bf16", "fp16")}
    out.update({f"activations_{s}": {**TINY, "checkpoint": s, "steps": 1} for s in (None, 2, "full")})
    out["peak"] = dict(TINY)
    out["shared"] = {**TINY, "world_size": gpus + 1, "device": "cuda", "precision": "fp16"}
    out["shared_fsdp"] = {**out["shared"], "strategy": "fsdp", "optimizer": "adamw"}
    return out


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_config_here_builds_on_cpu(monkeypatch, gpus):
    monkeypatch.setattr(devices, "cuda_gpus", lambda: [(9, 0)] * gpus)
    for name, kw in configs(gpus).items():
        cfg = ddpkit.TrainConfig(**kw)
        want = ("gloo", "cuda") if cfg.world_size > gpus else ("nccl", "cuda")
        assert devices.resolve_devices(cfg.world_size, cfg.backend, cfg.device) == want, name


CFG = configs(GPUS)


@needs_two
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trains_on_nccl_in_every_precision(precision):
    if precision == "bf16" and min(devices.cuda_gpus()[:2]) < devices.BF16_CAPABILITY:
        pytest.skip(f"bf16 needs compute capability 8.0; this GPU has {devices.cuda_gpus()[0]}")
    res = ddpkit.train(ddpkit.TrainConfig(**CFG[f"nccl_{precision}"]))
    assert res.run.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in res.metrics)


@needs_two
def test_cuda_peak_is_max_memory_allocated_every_step_and_the_predicted_one(tmp_path):
    res = ddpkit.train(ddpkit.TrainConfig(**CFG["peak"], memory_snapshot=str(tmp_path)))
    est = estimate(res.config)
    assert all("peak_bytes" in m for m in res.metrics)  # free on CUDA: probed every step
    for m in res.metrics:
        assert sum(m["peak_ledger"].values()) == m["peak_bytes"]
        want = est.peak(step=min(m["step"], 1), rank=m["rank"])
        # the CUDA prediction is read from torch's sources (kernels, cuBLAS workspaces): this
        # is where it meets max_memory_allocated
        assert abs(m["peak_bytes"] - want.bytes) <= 0.03 * m["peak_bytes"], (m, want)
        assert m["peak_phase"] == want.phase
    # memory_snapshot: the allocator's history of step 1, one file per rank, for memory_viz
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-step1.pickle",
                                                          "rank1-step1.pickle"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())


@needs_one
@pytest.mark.parametrize("setting", [None, 2, "full"])
def test_activation_bytes_equal_the_estimate_on_cuda(setting):
    # fp32 attention runs CUDA's efficient kernel here, which keeps a philox seed and offset
    # and a log-sum-exp rounded up to 32 tokens: the estimate counts them (predict/attention.py)
    res = ddpkit.train(ddpkit.TrainConfig(**CFG[f"activations_{setting}"]))
    assert res.run.device == "cuda"  # NCCL with 2+ GPUs, shared over gloo with one
    assert {m["activation_bytes"] for m in res.metrics} == {estimate(res.config).activations}


@needs_one
def test_more_ranks_than_gpus_train_over_gloo_on_the_shared_gpus(capsys):
    res = ddpkit.train(ddpkit.TrainConfig(**CFG["shared"]))
    assert (res.run.backend, res.run.device) == ("gloo", "cuda")
    assert "share" in capsys.readouterr().out
    assert {m["rank"] for m in res.metrics} == set(range(GPUS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in res.metrics)
    assert all(v.device.type == "cpu" for v in res.state_dict.values())


@needs_one
def test_fsdp_runs_on_shared_gpus_over_gloo():
    # FSDP2 needs all-gather and reduce-scatter of CUDA tensors from gloo: only a GPU can tell
    res = ddpkit.train(ddpkit.TrainConfig(**CFG["shared_fsdp"]))
    assert res.run.backend == "gloo"
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in res.metrics)
