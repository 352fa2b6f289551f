"""The timeline on NCCL (issue #20): every row a CUDA event read after the step. Skipped, with
the reason, without 2 GPUs; the config check runs everywhere."""
import pytest

import ddpkit
from ddpkit import devices
from ddpkit.runs.timeline import rebuilt_buckets

GPUS = len(devices.cuda_gpus())
CFG = dict(model="mlp", n_blocks=4, width=256, micro_batch=4, world_size=2, steps=4,
           timeline_every=1, bucket_cap_mb=1)


def test_the_simulated_link_is_refused_on_nccl(monkeypatch):
    monkeypatch.setattr(devices, "cuda_gpus", lambda: [(9, 0)] * 2)
    with pytest.raises(ValueError, match=r"link_gbps=1: the simulated link holds back gloo's "
                                         r"all-reduce futures.*backend='gloo'"):
        ddpkit.TrainConfig(**CFG, link_gbps=1)


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL); this machine has {GPUS}")
def test_nccl_timeline_rows_are_device_times_inside_each_step():
    res = ddpkit.train(ddpkit.TrainConfig(**CFG))
    tl = res.timeline
    windows = {(m["rank"], m["step"]): m["timeline_window"] for m in res.metrics}
    for row in tl.itertuples():
        lo, hi = windows[(row.rank, row.step)]
        assert lo <= row.start_s <= row.end_s <= hi, row
    want = rebuilt_buckets(res.ddp_stats)
    for (rank, step), g in tl[tl.step >= 1].groupby(["rank", "step"]):
        assert list(g[g.kind == "allreduce"].sort_values("bucket")["bytes"]) == want
    assert not res.overlap().comm_s.isna().any()
