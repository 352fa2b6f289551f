"""Save and resume a run so that the resumed run is the run that was never stopped.

Layout of ``save_dir``::

    step_000006/state.pt         DDP: rank 0's unwrapped model, optimizer, scheduler (torch.save)
    step_000006/dcp/             FSDP: torch.distributed.checkpoint, each rank writes its shards
    step_000006/rng_rank{r}.pt   every rank's RNG states (dropout masks continue where they were)
    step_000006/meta.json        step, samples consumed (the sampler position), the config
    latest                       name of the newest *complete* checkpoint, written last

Every file is written to a temp file, fsynced and renamed. ``latest`` moves only after every rank
has written its part and met at a barrier, so a crash mid-save (a rank killed) leaves the previous
checkpoint as the latest and a half-written folder that nothing points at. A write that fails (a
full disk) removes its temp file and ends the run with an error naming the rank, file and cause.

Loading runs no code from the folder: a checkpoint may come from a shared drive or a workshop
handout. Every ``.pt`` holds only tensors, plain containers, numbers and strings (RNG states
included), so it is read with ``torch.load(weights_only=True)``; DCP's pickled metadata and
non-tensor items, which torch itself reads with ``pickle.load`` / ``weights_only=False``, are
checked first (`check_resume` in the kernel before any rank starts, again in each rank).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"
_TEMP_PREFIX = ".tmp-"


def atomic_write_bytes(path, data: bytes):
    """Temp file beside ``path``, fsync, rename (then fsync the folder): a reader sees the old
    file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX, suffix=path.name)
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


@contextlib.contextmanager
def _writing(ctx, path):
    """A failed write (a full disk: ENOSPC) says which rank, which file and why; the run's
    error then reads ``rank 1 failed ...: OSError: [Errno 28] rank 1 could not write ...``."""
    try:
        yield
    except OSError as exc:
        text = f"rank {ctx.rank} could not write checkpoint file {path}: {exc.strerror or exc}"
        raise (OSError(exc.errno, text) if exc.errno else OSError(text)) from exc


def remove_temp_files(save_dir):
    """Temp files of writers that were killed mid-write (SIGKILL runs no cleanup): ddpkit's own
    ``.tmp-*`` and DCP's ``*.metadata.tmp``. Nothing reads them; they only take space."""
    root = Path(save_dir)
    if root.is_dir():
        for p in [*root.rglob(_TEMP_PREFIX + "*"), *root.rglob("*.metadata.tmp")]:
            p.unlink(missing_ok=True)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# RNG states as tensors and lists, so that torch.load(weights_only=True) reads them back
def _saved_rng_states():
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": [version, torch.tensor(internal, dtype=torch.int64), gauss]}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng_states(state):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]  # a tuple in checkpoints from before the tensor
    random.setstate((version, tuple(internal.tolist() if torch.is_tensor(internal) else internal),
                     gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(ctx, plan, step, consumed, model, optimizer, scheduler, save_dir, fsdp=False):
    """Collective: every rank calls it after optimizer step ``step``."""
    root = Path(save_dir)
    folder = root / f"step_{step:06d}"
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        remove_temp_files(root)  # no rank writes now: every rank is before the barrier below
    _barrier()
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
        except (OSError, CheckpointException) as exc:  # DCP's own is a BaseException
            raise OSError(f"rank {ctx.rank} could not write checkpoint folder "
                          f"{folder / 'dcp'}: {exc}") from exc
        if ctx.is_main:
            with _writing(ctx, folder / "state.pt"):
                atomic_torch_save({"scheduler": scheduler.state_dict()}, folder / "state.pt")
    else:
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather shards
            optimizer.consolidate_state_dict(to=0)
        if ctx.is_main:
            with _writing(ctx, folder / "state.pt"):
                atomic_torch_save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                                   "scheduler": scheduler.state_dict()}, folder / "state.pt")
    rng = folder / f"rng_rank{ctx.rank}.pt"
    with _writing(ctx, rng):
        atomic_torch_save(_saved_rng_states(), rng)
    _barrier()  # every part is on disk before the checkpoint is declared complete
    if ctx.is_main:
        meta = {"step": step, "consumed": consumed, "world_size": ctx.world_size,
                "strategy": plan.strategy, "resume": resume_fields(plan),
                "config": plan.to_dict()}
        with _writing(ctx, folder / "meta.json"):
            atomic_write_bytes(folder / "meta.json", json.dumps(meta, default=str).encode())
        with _writing(ctx, root / LATEST):
            atomic_write_bytes(root / LATEST, folder.name.encode())
    _barrier()


def latest(save_dir):
    """The newest complete checkpoint folder in ``save_dir``, or None."""
    pointer = Path(save_dir) / LATEST
    if not pointer.exists():
        return None
    return Path(save_dir) / pointer.read_text().strip()


# ----------------------------------------------------------------------------- loading safely
def _refuse(path, why):
    raise ValueError(f"checkpoint file {path} {why}. ddpkit loads checkpoints without running code "
                   f"from them (torch.load weights_only=True), so a folder from elsewhere cannot "
                   f"act on this machine; resume only from a folder a ddpkit run wrote") from None


def _why(exc):
    """The one line of torch's weights_only error that names the offending global."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:")[1].split(". Please use")[0].strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def safe_load(path, map_location="cpu", mmap=False, data=None):
    """torch.load(weights_only=True): tensors, plain containers, numbers and strings only.
    ``data``: the bytes to read (``path`` then only names them in an error)."""
    try:
        return torch.load(data if data is not None else path, map_location=map_location,
                          weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # what weights_only raises for a disallowed global
        _refuse(path, f"holds something other than tensors and plain data ({_why(exc)})")
    except (RuntimeError, EOFError, ValueError) as exc:  # truncated, not a torch.save file
        _refuse(path, f"is not a readable torch.save file ({_why(exc)})")


# What DCP's ``.metadata`` pickle may name: its own record types, paths, sizes, dtypes, layouts.
# torch reads that file with a bare pickle.load, so it is unpickled here first with only these
# (the "restricting globals" recipe of Python's pickle docs); anything else is refused.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _DCP_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _dcp_metadata(path):
    try:
        with open(path, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except Exception as exc:
        _refuse(path, f"is not plain DCP metadata ({type(exc).__name__}: {exc})")


def check_dcp(folder):
    """Every pickle DCP would read in ``folder``: the metadata and each non-tensor item (tensor
    items torch itself reads with weights_only=True)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    folder = Path(folder)
    for extra in folder.glob("__*.metadata"):
        _dcp_metadata(extra)  # per-rank metadata files, where a writer made them
    md = _dcp_metadata(folder / ".metadata")
    if not isinstance(md, Metadata):
        _refuse(folder / ".metadata", f"holds a {type(md).__name__}, not DCP metadata")
    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        file = (folder / info.relative_path).resolve()
        if folder.resolve() not in file.parents:
            _refuse(folder / ".metadata", f"points item {index.fqn!r} outside its folder")
        with open(file, "rb") as fh:
            fh.seek(info.offset)
            blob = fh.read(info.length)
        safe_load(f"{file} (item {index.fqn!r})", data=io.BytesIO(blob))


def _dcp_reader_and_planner(folder):
    """DCP's reader and planner, checking before torch's own unpickling."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            for f in Path(self.path).glob("*.metadata"):
                _dcp_metadata(f)
            return super().read_metadata(*args, **kwargs)

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            # what weights_only accepts calls only allowlisted constructors in torch's own load
            safe_load(f"{folder} (item {read_item.dest_index.fqn!r})",
                      data=io.BytesIO(value.getvalue()))
            super().load_bytes(read_item, value)

    return Reader(str(folder)), Planner()


def dcp_load(state_dict, folder):
    """``dcp.load`` with the checks above; a refusal comes out as itself, not wrapped in DCP's
    CheckpointException (a BaseException listing every rank's traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _dcp_reader_and_planner(folder)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, ValueError)]
        if refused:
            raise refused[0] from exc
        raise


# ----------------------------------------------------------------------------- resume checks
# Fields a resume must share with the checkpoint: they shape the saved tensors (model), the
# optimizer state's layout (optimizer, strategy), or the files themselves (one RNG file per rank,
# DCP shards per rank), so a resume with another value cannot continue the run exactly.
_SAME_MODEL = ("model", "n_blocks", "width", "mlp_ratio")
_SAME_GPT = ("seq_len", "vocab", "n_heads")
_SAME_RUN = ("world_size", "strategy", "optimizer")


def _plain(value):
    if callable(value):  # a model given as a function/class: compare by name, not by address
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
    if isinstance(value, tuple):  # several stacks' paths: a list, as meta.json reads back
        return list(value)
    return value


def resume_fields(plan):
    if not plan.builtin:  # your model: its factory, where its blocks are and its size
        fields = {name: _plain(getattr(plan, name)) for name in ("model", "blocks", "n_blocks")}
        fields["n_params"] = plan.n_params
        return {**fields, **{name: getattr(plan, name) for name in _SAME_RUN}}
    names = _SAME_MODEL + (_SAME_GPT if plan.model == "gpt" else ()) + _SAME_RUN
    return {name: _plain(getattr(plan, name)) for name in names}


def _complete_folder(resume_from):
    folder = latest(resume_from) or Path(resume_from)
    if not (folder / "meta.json").is_file():
        raise ValueError(f"resume_from={str(resume_from)!r}: no complete checkpoint there (no "
                         f"'latest' file nor meta.json); pass a save_dir a run wrote into")
    return folder


def check_resume(plan, resume_from):
    """In the kernel, before any rank starts: the folder a resume would load, checked.

    Refuses (ValueError) a folder with no complete checkpoint, a config that does not fit it
    (naming each differing field), and any file that would run code when loaded. Returns the
    checkpoint folder itself, so the ranks load what was checked even if ``latest`` moves.
    """
    folder = _complete_folder(resume_from)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        saved = meta.get("resume") or {k: meta["config"][k] for k in resume_fields(plan)}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint file {folder / 'meta.json'} is not a ddpkit checkpoint's "
                         f"metadata ({type(exc).__name__}: {exc}); pass a save_dir a ddpkit run "
                         f"wrote into") from None
    now = resume_fields(plan)
    differ = [k for k in now if k in saved and saved[k] != now[k]]
    if differ:
        said = ", ".join(f"TrainConfig.{k}={now[k]!r} but the checkpoint has {k}={saved[k]!r}"
                         for k in differ)
        fix = ", ".join(f"{k}={saved[k]!r}" for k in differ)
        raise ValueError(f"resume_from={str(resume_from)!r} ({folder.name}) does not fit this "
                         f"config: {said}; resume with {fix}, or start a new run in another "
                         f"save_dir")
    if not (folder / "state.pt").is_file():
        raise ValueError(f"checkpoint {folder} has no state.pt: it is not a complete ddpkit "
                         f"checkpoint; pass a save_dir a ddpkit run wrote into")
    for pt in sorted(folder.glob("*.pt")):
        safe_load(pt, mmap=True)  # mmap: the check reads the pickle, not every tensor's bytes
    if (folder / "dcp").is_dir():
        check_dcp(folder / "dcp")
    return folder


def load(ctx, path, model, optimizer, scheduler, fsdp=False):
    """Restore a checkpoint into this rank's objects; returns its meta dict."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != ctx.world_size:
        raise ValueError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run "
                         f"has {ctx.world_size}; resume with world_size={meta['world_size']}")
    state = safe_load(path / "state.pt", map_location=ctx.device)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        box = {"model": model_sd, "optim": optim_sd}
        dcp_load(box, path / "dcp")
        set_state_dict(model, optimizer, model_state_dict=box["model"],
                       optim_state_dict=box["optim"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    rng = path / f"rng_rank{ctx.rank}.pt"
    if rng.exists():
        _restore_rng_states(safe_load(rng))
    return meta
