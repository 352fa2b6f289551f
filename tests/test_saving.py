"""Saving and resuming: exact resume for DDP and FSDP, atomic checkpoints, a rank killed mid-run."""
import os
import signal
import time

import pytest
import torch

import ddpkit
from ddpkit.engine import saving

# pinned to CPU ranks: these tests compare bitwise CPU results, which must mean the same on a GPU box
CPU = dict(backend="gloo", device="cpu")
BASE = dict(model="gpt", n_blocks=2, width=32, seq_len=16, world_size=2, micro_batch=4,
            accum_steps=2, optimizer="adamw", lr=3e-3, warmup_steps=3, dropout=0.1, steps=10, **CPU)


def losses(res):
    return [(m["step"], m["loss"]) for m in res.metrics if m["rank"] == 0]


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_is_exact(tmp_path, strategy):
    cfg = ddpkit.TrainConfig(**BASE, strategy=strategy)
    with ddpkit.Pool(world_size=2, **CPU) as pool:
        straight = ddpkit.train(cfg, pool=pool)
        half = cfg.replace(steps=5, save_every=5, save_dir=str(tmp_path))
        first = ddpkit.train(half, pool=pool)
        resumed = ddpkit.train(cfg.replace(save_dir=str(tmp_path)), pool=pool,
                               resume_from=str(tmp_path))
    assert saving.latest(tmp_path).name == "step_000004"
    assert [s for s, _ in losses(resumed)] == list(range(5, 10))
    # dropout masks, warm-up schedule, Adam moments and data position all continue exactly
    assert losses(first) + losses(resumed) == losses(straight)
    assert max_diff(resumed.state_dict, straight.state_dict) == 0.0


def test_checkpoint_files_are_complete_and_atomic(tmp_path):
    cfg = ddpkit.TrainConfig(**{**BASE, "steps": 4, "save_every": 2, "save_dir": str(tmp_path)})
    ddpkit.train(cfg)
    assert (tmp_path / "latest").read_text() == "step_000003"
    for step in ("step_000001", "step_000003"):
        names = sorted(p.name for p in (tmp_path / step).iterdir())
        assert names == ["meta.json", "rng_rank0.pt", "rng_rank1.pt", "state.pt"]
    assert not list(tmp_path.rglob(".tmp-*"))
    state = torch.load(tmp_path / "step_000003" / "state.pt", weights_only=True)  # plain data only
    assert not any(k.startswith("module.") for k in state["model"])  # the unwrapped module


def test_resume_from_an_empty_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"resume_from=.*no complete checkpoint there"):
        ddpkit.train(ddpkit.TrainConfig(**BASE), resume_from=str(tmp_path))


def test_a_rank_killed_mid_run_leaves_the_last_complete_checkpoint(tmp_path):
    cfg = ddpkit.TrainConfig(**{**BASE, "steps": 400, "save_every": 3, "save_dir": str(tmp_path),
                                "dropout": 0.0, "warmup_steps": 0})
    with ddpkit.Pool(world_size=2, **CPU) as pool:
        victim = pool.pids[1]
        handle = ddpkit.train(cfg, pool=pool, block=False)
        deadline = time.monotonic() + 60
        while not any(m.get("step", 0) >= 7 for m in handle.metrics):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ddpkit.RankError) as info:
            handle.wait(timeout=60)
        assert info.value.rank == 1 and "SIGKILL" in str(info.value)
        done = saving.latest(tmp_path)
        step = int(done.name.split("_")[1])
        assert step >= 5 and (step + 1) % 3 == 0
        # every complete checkpoint loads; training continues from the latest one
        resumed = ddpkit.train(cfg.replace(steps=step + 4), pool=pool, resume_from=str(tmp_path))
    assert [s for s, _ in losses(resumed)] == list(range(step + 1, step + 4))
    ref = ddpkit.train(cfg.replace(steps=step + 4, save_every=0, save_dir=None))
    assert max_diff(resumed.state_dict, ref.state_dict) == 0.0
