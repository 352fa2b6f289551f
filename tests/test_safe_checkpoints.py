"""Checkpoints are loaded without running code from them, a resume that does not fit is refused
before any rank starts, and a save that fails on a full disk loses nothing."""
import errno
import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ddpkit
from ddpkit.engine import saving
from procs import rank_children

MLP = dict(model="mlp", n_blocks=2, width=16, world_size=2, micro_batch=4, steps=2)
GPT = dict(model="gpt", n_blocks=2, width=32, seq_len=16, world_size=2, micro_batch=4,
           accum_steps=2, optimizer="adamw", lr=3e-3, warmup_steps=3, dropout=0.1)


class WritesMarker:
    """What a hostile checkpoint holds: unpickling it calls open(marker, "w")."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of a 2-rank MLP run (saved at step 1)."""
    root = tmp_path_factory.mktemp("saved")
    cfg = ddpkit.TrainConfig(**MLP, save_every=2, save_dir=str(root))
    ddpkit.train(cfg, check=False)
    return cfg, root


@pytest.fixture
def copy(saved, tmp_path):
    cfg, root = saved
    shutil.copytree(root, tmp_path / "ckpt")
    return cfg, tmp_path / "ckpt"


def refuse_resume(cfg, save_dir):
    before = len(rank_children())
    with pytest.raises(ValueError) as info:
        ddpkit.train(cfg, resume_from=str(save_dir), check=False)
    assert len(rank_children()) == before, "ranks were started before the refusal"
    return str(info.value)


# ----------------------------------------------------------------------------- code in a checkpoint
@pytest.mark.parametrize("name", ["state.pt", "rng_rank1.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused(copy, tmp_path, name):
    cfg, save_dir = copy
    path = save_dir / "step_000001" / name
    marker = tmp_path / "marker"
    state = torch.load(path, weights_only=True)
    state["extra"] = WritesMarker(marker)
    torch.save(state, path)
    message = refuse_resume(cfg, save_dir)
    assert f"checkpoint file {path} holds something other than tensors and plain data" in message
    assert "Unsupported global: GLOBAL io.open" in message and "resume only from" in message
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the file is live: an unchecked load runs its code
    assert marker.exists()


def test_dcp_metadata_that_would_run_code_is_refused(copy, tmp_path):
    cfg, save_dir = copy
    marker = tmp_path / "marker"
    (save_dir / "step_000001" / "dcp").mkdir()
    with open(save_dir / "step_000001" / "dcp" / ".metadata", "wb") as fh:
        pickle.dump(WritesMarker(marker), fh)  # torch's DCP reads this with a bare pickle.load
    message = refuse_resume(cfg, save_dir)
    assert f"checkpoint file {save_dir / 'step_000001' / 'dcp' / '.metadata'} is not plain DCP " \
           f"metadata (UnpicklingError: global io.open is not allowed)" in message
    assert not marker.exists()


def _dcp_with_code(folder, marker):
    """A DCP folder whose non-tensor item runs code when torch's DCP loads it."""
    dcp.save({"w": torch.ones(3), "extra": WritesMarker(marker)}, checkpoint_id=str(folder))


def test_a_dcp_item_that_would_run_code_is_refused_in_the_kernel(copy, tmp_path):
    cfg, save_dir = copy
    marker = tmp_path / "marker"
    _dcp_with_code(save_dir / "step_000001" / "dcp", marker)
    message = refuse_resume(cfg, save_dir)
    assert "(item 'extra') holds something other than tensors and plain data" in message
    assert not marker.exists()


def test_ranks_load_dcp_through_the_same_check(tmp_path):
    """The ranks' own DCP load (what `saving.load` uses) refuses it too; torch's default runs it."""
    folder, marker = tmp_path / "dcp", tmp_path / "marker"
    _dcp_with_code(folder, marker)
    with pytest.raises(ValueError, match=r"\(item 'extra'\) holds something other than tensors"):
        saving.dcp_load({"w": torch.zeros(3), "extra": None}, folder)
    assert not marker.exists()
    dcp.load({"w": torch.zeros(3), "extra": None}, checkpoint_id=str(folder))
    assert marker.exists()  # torch's DCP loads non-tensor items with weights_only=False


def test_saved_files_hold_only_plain_data(saved):
    _, root = saved
    for path in sorted((root / "step_000001").glob("*.pt")):
        torch.load(path, weights_only=True)  # raises on anything but tensors and plain data
    rng = torch.load(root / "step_000001" / "rng_rank0.pt", weights_only=True)
    assert set(rng) >= {"torch", "python", "numpy"}


# ----------------------------------------------------------------------------- config mismatch
@pytest.mark.parametrize("change, named", [
    (dict(n_blocks=3), "TrainConfig.n_blocks=3 but the checkpoint has n_blocks=2"),
    (dict(model="gpt"), "TrainConfig.model='gpt' but the checkpoint has model='mlp'"),
    (dict(width=32), "TrainConfig.width=32 but the checkpoint has width=16"),
    (dict(world_size=1), "TrainConfig.world_size=1 but the checkpoint has world_size=2"),
    (dict(optimizer="adamw"), "TrainConfig.optimizer='adamw' but the checkpoint has optimizer='sgd'"),
    (dict(strategy="fsdp"), "TrainConfig.strategy='fsdp' but the checkpoint has strategy='ddp'"),
])
def test_a_resume_that_does_not_fit_names_the_field(saved, change, named):
    cfg, root = saved
    message = refuse_resume(cfg.replace(**change), root)
    assert named in message and "does not fit this config" in message
    fix = ", ".join(f"{k}={v!r}" for k, v in saving.resume_fields(cfg.rank_plan()).items() if k in change)
    assert f"resume with {fix}" in message


def test_a_resume_names_every_differing_field(saved):
    cfg, root = saved
    message = refuse_resume(cfg.replace(n_blocks=4, width=8), root)
    assert "n_blocks=4 but the checkpoint has n_blocks=2" in message
    assert "width=8 but the checkpoint has width=16" in message
    assert "resume with n_blocks=2, width=16" in message


# ----------------------------------------------------------------------------- full disk
class FullDisk(io.FileIO):
    """A file on a disk that fills up: half the bytes land, then ENOSPC."""

    def write(self, data):
        super().write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def train_on_a_disk_that_fills(ctx, plan, bad_rank, bad_folder):
    """train_rank, with every checkpoint write of ``bad_rank`` into ``bad_folder`` failing."""
    from ddpkit.engine.loop import train_rank

    real = os.fdopen

    def fdopen(fd, *args, **kwargs):
        if ctx.rank == bad_rank and bad_folder in os.readlink(f"/proc/self/fd/{fd}"):
            return FullDisk(fd, "wb")
        return real(fd, *args, **kwargs)

    os.fdopen = fdopen  # this rank process only; it ends with the run
    return train_rank(ctx, plan)


def test_a_full_disk_mid_save_loses_nothing(tmp_path):
    cfg = ddpkit.TrainConfig(**GPT, steps=9, save_every=3, save_dir=str(tmp_path))  # saves 2, 5, 8
    bad = tmp_path / "step_000005"
    with pytest.raises(ddpkit.RankError) as info:
        ddpkit.launch(train_on_a_disk_that_fills, cfg.rank_plan(), 1, str(bad), world_size=2)
    err = info.value
    assert err.rank == 1 and err.exc_type == "OSError"
    assert (f"rank 1 could not write checkpoint file {bad / 'rng_rank1.pt'}: "
            f"No space left on device") in err.message
    assert saving.latest(tmp_path).name == "step_000002"  # the previous complete checkpoint
    assert not (bad / "meta.json").exists()
    assert not list(tmp_path.rglob(".tmp-*"))  # the half-written temp file was removed
    (bad / ".tmp-abcstate.pt").write_bytes(b"half")  # what a writer killed by SIGKILL leaves
    resumed = ddpkit.train(cfg, resume_from=str(tmp_path), check=False)
    assert not list(tmp_path.rglob(".tmp-*"))  # swept by the next save
    straight = ddpkit.train(cfg.replace(save_every=0, save_dir=None), check=False)
    rank0 = lambda res: [(m["step"], m["loss"]) for m in res.metrics if m["rank"] == 0]  # noqa: E731
    assert rank0(resumed) == [p for p in rank0(straight) if p[0] >= 3]
    assert all(torch.equal(resumed.state_dict[k], straight.state_dict[k]) for k in straight.state_dict)
