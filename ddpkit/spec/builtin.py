"""The built-in teaching models, mlp and gpt (their synthetic data: `engine.data`).

Both models are a stem, ``model.blocks`` (identical blocks in an ``nn.Sequential``, called as a
whole, so a checkpointed segment of several blocks is one region as in checkpoint_sequential)
and a head. ``forward(inputs, targets)`` returns the mean loss: a tuple batch ``(x, y)`` trains
them with ``loss=None``. A policy (policies.py) never changes the state_dict keys.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


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


def build_builtin(model, n_blocks=4, width=64, mlp_ratio=4, seq_len=32, vocab=64, n_heads=4,
                  dropout=0.0):
    """The built-in model named ``model`` ('mlp' or 'gpt') at these sizes (seed first:
    `model.build_model` does)."""
    if model == "mlp":
        return MLPModel(n_blocks, width, mlp_ratio, dropout)
    return GPTModel(n_blocks, width, mlp_ratio, seq_len, vocab, n_heads, dropout)
