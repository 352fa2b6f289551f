"""The data of a run, and each rank's share of it.

`make_dataset(cfg)` is a map-style ``Dataset``: the built-in models' synthetic samples, your
``data(cfg)``, or, for a Hugging Face causal LM with ``data=None``, synthetic token sequences
``{"input_ids", "labels"}`` (labels are the inputs: the model shifts them itself).

`RankBatches` splits a rank's share into micro-batches with torch's own ``DistributedSampler``
(seeded, ``drop_last``): rank r takes every world_size-th index of the (shuffled) order, so the
union over ranks of one optimizer step is a contiguous stretch of that order, whatever the world
size and accumulation. Position is counted in samples consumed, so a resumed run (or one whose
accumulation changed mid-run) continues at the same sample; past the end comes the next epoch.
"""
from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset, default_collate

from .spec import describe_spec, model_info, resolve


class TokenDataset(torch.utils.data.Dataset):
    """Synthetic next-token data for a transformers causal LM: {"input_ids", "labels"}."""

    def __init__(self, input_ids):
        self.input_ids = input_ids

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def make_dataset(cfg, n_samples=None):
    from .models import SyntheticData

    if cfg.builtin:
        data = SyntheticData(cfg, n_samples)
        return TensorDataset(data.inputs, data.targets)
    if cfg.data is None:  # TrainConfig allows this only for a causal LM
        info = model_info(cfg.model, cfg.blocks, cfg.seed)
        return TokenDataset(SyntheticData(cfg, n_samples, vocab=info.vocab_size).inputs)
    make = resolve(cfg.data, "data")
    try:
        ds = make(cfg)
    except Exception as exc:
        raise ValueError(f"TrainConfig.data={describe_spec(cfg.data)} raised "
                         f"{type(exc).__name__}: {exc}; it is called as data(cfg) and returns a "
                         f"Dataset") from exc
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise ValueError(f"TrainConfig.data={describe_spec(cfg.data)} returned a "
                         f"{type(ds).__name__}, not a map-style Dataset (with __len__ and "
                         f"__getitem__); return e.g. torch.utils.data.TensorDataset(x, y)")
    return ds


def check_length(cfg, ds):
    """Refuse a dataset that cannot fill one optimizer step on every rank."""
    need = cfg.micro_batch * cfg.accum_steps
    per_rank = len(ds) // cfg.world_size
    if per_rank < need:
        raise ValueError(
            f"TrainConfig.data={describe_spec(cfg.data)} has {len(ds)} samples, fewer than one "
            f"global batch (world_size={cfg.world_size} x micro_batch={cfg.micro_batch} x "
            f"accum_steps={cfg.accum_steps} = {cfg.global_batch}); give more samples or lower "
            f"micro_batch/accum_steps")


def first_batch(cfg, ds, size=None):
    """The first ``size`` samples (default: one micro-batch), collated as the ranks do."""
    return _collate(ds, list(range(min(size or cfg.micro_batch, len(ds)))))


def _collate(ds, idx):
    if isinstance(ds, TensorDataset):  # one gather per tensor, same result as collating rows
        index = torch.as_tensor(idx)
        return tuple(t[index] for t in ds.tensors)
    return default_collate([ds[i] for i in idx])


class RankBatches:
    def __init__(self, ds, rank, world_size, seed=0, shuffle=True):
        self.ds, self.world_size = ds, world_size
        self.sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=True)
        self.per_rank = len(self.sampler)
        self._epoch, self._order = None, None

    def _index(self, position):
        epoch, offset = divmod(position, self.per_rank)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)  # a new shuffle per epoch, as a DataLoader would
            self._epoch, self._order = epoch, list(self.sampler)
        return self._order[offset]

    def micro_batches(self, consumed, micro_batch, accum_steps):
        """This rank's micro-batches for the optimizer step after ``consumed`` samples (all
        ranks together)."""
        start = consumed // self.world_size
        for k in range(accum_steps):
            first = start + k * micro_batch
            yield _collate(self.ds, [self._index(first + j) for j in range(micro_batch)])
