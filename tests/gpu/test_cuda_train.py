"""CUDA paths of the training engine: NCCL ranks, fp16 + GradScaler, CUDA peak memory.
Skipped, with the reason, where there are not enough GPUs."""
import pytest
import torch

import ddpkit
from ddpkit.estimate import estimate

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL, one process per GPU); this machine has {GPUS}")

TINY = dict(model="gpt", n_blocks=4, width=64, seq_len=32, world_size=2, micro_batch=4,
            accum_steps=2, steps=3)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trains_on_nccl_in_every_precision(precision):
    res = ddpkit.train(ddpkit.TrainConfig(**TINY, precision=precision, checkpoint=2))
    assert res.run.backend == "nccl"
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in res.metrics)


def test_cuda_peak_is_max_memory_allocated_every_step():
    res = ddpkit.train(ddpkit.TrainConfig(**TINY))
    est = estimate(res.config)
    assert all("peak_bytes" in m for m in res.metrics)  # free on CUDA: probed every step
    assert all(m["peak_bytes"] >= est.params + est.grads for m in res.metrics)


def test_activation_bytes_match_the_estimate_on_cuda():
    for setting in (None, 2, "full"):
        res = ddpkit.train(ddpkit.TrainConfig(**TINY, checkpoint=setting, steps=1))
        predicted = estimate(res.config).activations
        assert abs(res.metrics[0]["activation_bytes"] - predicted) <= 0.10 * predicted
