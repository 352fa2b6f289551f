"""Save and resume a run so that the resumed run is the run that was never stopped.

Layout of ``save_dir``::

    step_000006/state.pt         DDP: rank 0's unwrapped model, optimizer, scheduler (torch.save)
    step_000006/dcp/             FSDP: torch.distributed.checkpoint, each rank writes its shards
    step_000006/rng_rank{r}.pt   every rank's RNG states (dropout masks continue where they were)
    step_000006/meta.json        step, samples consumed (the sampler position), the config
    latest                       name of the newest *complete* checkpoint, written last

Every file is written to a temp file, fsynced and renamed. ``latest`` moves only after every rank
has written its part and met at a barrier, so a crash mid-save (a rank killed) leaves the previous
checkpoint as the latest and a half-written folder that nothing points at.
"""
from __future__ import annotations

import io
import json
import os
import random
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"


def atomic_write_bytes(path, data: bytes):
    """Temp file beside ``path``, fsync, rename (then fsync the folder): a reader sees the old
    file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the file is for the user to read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_torch_save(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rng_state():
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(ctx, cfg, step, consumed, model, optimizer, scheduler, save_dir, fsdp=False):
    """Collective: every rank calls it after optimizer step ``step``."""
    root = Path(save_dir)
    folder = root / f"step_{step:06d}"
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
        if ctx.is_main:
            atomic_torch_save({"scheduler": scheduler.state_dict()}, folder / "state.pt")
    else:
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather shards
            optimizer.consolidate_state_dict(to=0)
        if ctx.is_main:
            atomic_torch_save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                               "scheduler": scheduler.state_dict()}, folder / "state.pt")
    atomic_torch_save(_rng_state(), folder / f"rng_rank{ctx.rank}.pt")
    _barrier()  # every part is on disk before the checkpoint is declared complete
    if ctx.is_main:
        meta = {"step": step, "consumed": consumed, "world_size": ctx.world_size,
                "strategy": cfg.strategy, "config": cfg.to_dict()}
        atomic_write_bytes(folder / "meta.json", json.dumps(meta, default=str).encode())
        atomic_write_bytes(root / LATEST, folder.name.encode())
    _barrier()


def latest(save_dir):
    """The newest complete checkpoint folder in ``save_dir``, or None."""
    pointer = Path(save_dir) / LATEST
    if not pointer.exists():
        return None
    return Path(save_dir) / pointer.read_text().strip()


def load(ctx, path, model, optimizer, scheduler, fsdp=False):
    """Restore a checkpoint into this rank's objects; returns its meta dict."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != ctx.world_size:
        raise ValueError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run "
                         f"has {ctx.world_size}; resume with world_size={meta['world_size']}")
    state = torch.load(path / "state.pt", map_location=ctx.device, weights_only=False)
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        box = {"model": model_sd, "optim": optim_sd}
        dcp.load(box, checkpoint_id=str(path / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=box["model"],
                       optim_state_dict=box["optim"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    rng = path / f"rng_rank{ctx.rank}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return meta
