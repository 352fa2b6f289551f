"""Built-in models and their synthetic data.

Both models are a stem, ``model.blocks`` (identical blocks in an ``nn.Sequential``, called as a
whole, so a checkpointed segment of several blocks is one region as in checkpoint_sequential)
and a head. ``forward(inputs, targets)`` returns the mean loss: a tuple batch ``(x, y)`` trains
them with ``loss=None``. A policy (policies.py) never changes the state_dict keys.

Data are synthetic and deterministic: sample i of the run is the same whatever the world size,
so runs with different world sizes and accumulation can be compared weight for weight.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGET_FREQ = 1.5  # the mlp data: y = sin(TARGET_FREQ * x . p), p a fixed random unit-ish vector


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, width, ratio, dropout=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ratio * width)
        self.fc2 = nn.Linear(ratio * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class _Blocks(nn.Module):
    """Common shape: stem -> blocks -> head."""

    def forward(self, inputs, targets):
        return self.loss(self.blocks(self.stem(inputs)), targets)


class MLPModel(_Blocks):
    """Regression of a fixed nonlinear target; input and hidden width D."""

    def __init__(self, n_blocks=4, width=64, mlp_ratio=4, dropout=0.0):
        super().__init__()
        self.stem_fc = nn.Linear(width, width)  # so the first block's input requires grad
        self.blocks = nn.Sequential(*(MLPBlock(width, mlp_ratio, dropout) for _ in range(n_blocks)))
        self.ln_f = nn.LayerNorm(width)
        self.out = nn.Linear(width, 1)

    def stem(self, x):
        return self.stem_fc(x)

    def loss(self, h, y):
        return F.mse_loss(self.out(self.ln_f(h)).squeeze(-1), y)


class Attention(nn.Module):
    def __init__(self, width, n_heads, dropout=0.0):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class GPTBlock(nn.Module):
    def __init__(self, width, n_heads, ratio, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, n_heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, ratio * width), nn.GELU(),
                                 nn.Linear(ratio * width, width), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTModel(_Blocks):
    """A small causal transformer over synthetic tokens (next-token prediction)."""

    def __init__(self, n_blocks=4, width=64, mlp_ratio=4, seq_len=32, vocab=64, n_heads=4,
                 dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*(GPTBlock(width, n_heads, mlp_ratio, dropout)
                                      for _ in range(n_blocks)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def stem(self, idx):
        return self.tok(idx) + self.pos.weight[: idx.shape[1]]

    def loss(self, h, targets):
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_builtin(cfg):
    """The built-in model a config names (seed first: `spec.build_model` does)."""
    if cfg.model == "mlp":
        return MLPModel(cfg.n_blocks, cfg.width, cfg.mlp_ratio, cfg.dropout)
    return GPTModel(cfg.n_blocks, cfg.width, cfg.mlp_ratio, cfg.seq_len, cfg.vocab, cfg.n_heads,
                    cfg.dropout)


class SyntheticData:
    """The samples of a run, made from the seed in blocks of 1,024: sample i is the same
    whatever the run's length, so a run resumed at step k sees exactly the data it would have."""

    BLOCK = 1024

    def __init__(self, cfg, n_samples=None, vocab=None):
        self.cfg = cfg
        self._rank_batches = {}
        self.tokens = cfg.model != "mlp"  # token sequences (gpt, or a transformers causal LM)
        self.vocab = vocab or cfg.vocab
        n = n_samples or cfg.steps * cfg.global_batch
        g = torch.Generator().manual_seed(10_000 + cfg.seed)
        if not self.tokens:
            self._proj = torch.randn(cfg.width, generator=g) / math.sqrt(cfg.width)
        else:
            # a fixed random "grammar": each token strongly predicts the next, so loss can fall
            self._next = torch.randint(self.vocab, (self.vocab,), generator=g)
        blocks = [self._block(b) for b in range(-(-n // self.BLOCK))]
        # clone: own storages of exactly n samples (a view would keep whole blocks alive)
        self.inputs = torch.cat([x for x, _ in blocks])[:n].clone()
        self.targets = torch.cat([y for _, y in blocks])[:n].clone()

    def _block(self, b):
        cfg, size = self.cfg, self.BLOCK
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + b)
        if not self.tokens:
            x = torch.randn(size, cfg.width, generator=g)
            # a smooth target the MLP learns visibly over a few hundred SGD steps (sin(3z) was
            # too sharp: the loss sat at its variance, 0.5, for 300 steps)
            return x, torch.sin(TARGET_FREQ * x @ self._proj)
        start = torch.randint(self.vocab, (size,), generator=g)
        noise = torch.rand(size, cfg.seq_len + 1, generator=g) < 0.1
        rand = torch.randint(self.vocab, (size, cfg.seq_len + 1), generator=g)
        seq = torch.empty(size, cfg.seq_len + 1, dtype=torch.long)
        seq[:, 0] = start
        for t in range(1, cfg.seq_len + 1):
            seq[:, t] = torch.where(noise[:, t], rand[:, t], self._next[seq[:, t - 1]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def micro_batches(self, start, rank, world_size, micro_batch, accum_steps):
        """Rank ``rank``'s micro-batches ``(x, y)`` for the optimizer step whose global batch
        starts at sample ``start``: DistributedSampler's order without shuffling, so rank r takes
        every world_size-th sample of [start, start + G), starting at r (`data.RankBatches`)."""
        from torch.utils.data import TensorDataset

        from .data import RankBatches

        # one sampler per (rank, world size), kept: callers ask once per step, and building it
        # lists the whole epoch's order
        key = (rank, world_size)
        if key not in self._rank_batches:
            self._rank_batches[key] = RankBatches(TensorDataset(self.inputs, self.targets), rank,
                                                  world_size, shuffle=False)
        return self._rank_batches[key].micro_batches(start, micro_batch, accum_steps)


def build_model(cfg):
    """The model a config names (built-in or your own), seeded from cfg.seed."""
    from .spec import build_model as build

    return build(cfg)[0]
