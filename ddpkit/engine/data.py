"""The data of a run, and each rank's share of it.

`make_dataset(plan)` is a map-style ``Dataset``: the built-in models' synthetic samples, your
``data(cfg)``, or, for a Hugging Face causal LM with ``data=None``, synthetic token sequences
``{"input_ids", "labels"}`` (labels are the inputs: the model shifts them itself).

`RankBatches` splits a rank's share into micro-batches with torch's own ``DistributedSampler``
(seeded, ``drop_last``): rank r takes every world_size-th index of the (shuffled) order, so the
union over ranks of one optimizer step is a contiguous stretch of that order, whatever the world
size and accumulation. Position is counted in samples consumed, so a resumed run (or one whose
accumulation changed mid-run) continues at the same sample; past the end comes the next epoch.

`SyntheticData`: the built-in models' samples, synthetic and deterministic: sample i of the run
is the same whatever the world size, so runs with different world sizes and accumulation can be
compared weight for weight.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DistributedSampler, TensorDataset, default_collate

from ..spec.model import describe_spec, model_info, resolve

TARGET_FREQ = 1.5  # the mlp data: y = sin(TARGET_FREQ * x . p), p a fixed random unit-ish vector


class TokenDataset(torch.utils.data.Dataset):
    """Synthetic next-token data for a transformers causal LM: {"input_ids", "labels"}."""

    def __init__(self, input_ids):
        self.input_ids = input_ids

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def make_dataset(plan, n_samples=None):
    """The run's dataset (``n_samples``: of the built-in data, how many; all a run takes by
    default)."""
    if plan.builtin:
        data = SyntheticData(plan, n_samples)
        return TensorDataset(data.inputs, data.targets)
    if plan.data is None:  # TrainConfig allows this only for a causal LM
        info = model_info(plan.model, plan.blocks, plan.seed)
        return TokenDataset(SyntheticData(plan, n_samples, vocab=info.vocab_size).inputs)
    make = resolve(plan.data, "data")
    try:
        ds = make(plan.config)  # your function takes the TrainConfig, as written
    except Exception as exc:
        raise ValueError(f"TrainConfig.data={describe_spec(plan.data)} raised "
                         f"{type(exc).__name__}: {exc}; it is called as data(cfg) and returns a "
                         f"Dataset") from exc
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise ValueError(f"TrainConfig.data={describe_spec(plan.data)} returned a "
                         f"{type(ds).__name__}, not a map-style Dataset (with __len__ and "
                         f"__getitem__); return e.g. torch.utils.data.TensorDataset(x, y)")
    return ds


def check_length(plan, ds):
    """Refuse a dataset that cannot fill one optimizer step on every rank."""
    need = plan.micro_batch * plan.accum_steps
    per_rank = len(ds) // plan.world_size
    if per_rank < need:
        raise ValueError(
            f"TrainConfig.data={describe_spec(plan.data)} has {len(ds)} samples, fewer than one "
            f"global batch (world_size={plan.world_size} x micro_batch={plan.micro_batch} x "
            f"accum_steps={plan.accum_steps} = {plan.global_batch}); give more samples or lower "
            f"micro_batch/accum_steps")


def first_batch(plan, ds, size=None):
    """The first ``size`` samples (default: one micro-batch), collated as the ranks do."""
    return _collate(ds, list(range(min(size or plan.micro_batch, len(ds)))))


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


class SyntheticData:
    """The samples of a run, made from the seed in blocks of 1,024: sample i is the same
    whatever the run's length, so a run resumed at step k sees exactly the data it would have."""

    BLOCK = 1024

    def __init__(self, plan, n_samples=None, vocab=None):
        self.plan = plan
        self._rank_batches = {}
        self.tokens = plan.model != "mlp"  # token sequences (gpt, or a transformers causal LM)
        self.vocab = vocab or plan.vocab
        n = n_samples or plan.steps * plan.global_batch
        g = torch.Generator().manual_seed(10_000 + plan.seed)
        if not self.tokens:
            self._proj = torch.randn(plan.width, generator=g) / math.sqrt(plan.width)
        else:
            # a fixed random "grammar": each token strongly predicts the next, so loss can fall
            self._next = torch.randint(self.vocab, (self.vocab,), generator=g)
        blocks = [self._block(b) for b in range(-(-n // self.BLOCK))]
        # clone: own storages of exactly n samples (a view would keep whole blocks alive)
        self.inputs = torch.cat([x for x, _ in blocks])[:n].clone()
        self.targets = torch.cat([y for _, y in blocks])[:n].clone()

    def _block(self, b):
        plan, size = self.plan, self.BLOCK
        g = torch.Generator().manual_seed(plan.seed * 1_000_003 + b)
        if not self.tokens:
            x = torch.randn(size, plan.width, generator=g)
            # a smooth target the MLP learns visibly over a few hundred SGD steps (sin(3z) was
            # too sharp: the loss sat at its variance, 0.5, for 300 steps)
            return x, torch.sin(TARGET_FREQ * x @ self._proj)
        start = torch.randint(self.vocab, (size,), generator=g)
        noise = torch.rand(size, plan.seq_len + 1, generator=g) < 0.1
        rand = torch.randint(self.vocab, (size, plan.seq_len + 1), generator=g)
        seq = torch.empty(size, plan.seq_len + 1, dtype=torch.long)
        seq[:, 0] = start
        for t in range(1, plan.seq_len + 1):
            seq[:, t] = torch.where(noise[:, t], rand[:, t], self._next[seq[:, t - 1]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def micro_batches(self, start, rank, world_size, micro_batch, accum_steps):
        """Rank ``rank``'s micro-batches ``(x, y)`` for the optimizer step whose global batch
        starts at sample ``start``: DistributedSampler's order without shuffling, so rank r takes
        every world_size-th sample of [start, start + G), starting at r (`data.RankBatches`)."""
        # one sampler per (rank, world size), kept: callers ask once per step, and building it
        # lists the whole epoch's order
        key = (rank, world_size)
        if key not in self._rank_batches:
            self._rank_batches[key] = RankBatches(TensorDataset(self.inputs, self.targets), rank,
                                                  world_size, shuffle=False)
        return self._rank_batches[key].micro_batches(start, micro_batch, accum_steps)
