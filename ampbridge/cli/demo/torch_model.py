"""The demo model in PyTorch (see ``ampbridge.cli.demo``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .model import CONFIG, Config, weights


class SelfAttention(nn.Module):
    ampbridge_kind = "attention"

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, h, dh).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attn = SelfAttention(c.dim, c.heads)
        self.norm2 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.mlp_in = nn.Linear(c.dim, c.hidden)
        self.mlp_out = nn.Linear(c.hidden, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp_out(F.relu(self.mlp_in(self.norm2(x))))


class DemoModel(nn.Module):
    def __init__(self, c: Config = CONFIG):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.block = Block(c)
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))


def build(seed: int = 0, config: Config = CONFIG) -> DemoModel:
    """The model with the shared initial weights."""
    model = DemoModel(config)
    w = weights(seed, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding):
                module.weight.copy_(torch.from_numpy(w[f"{name}.embedding"]))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(torch.from_numpy(w[f"{name}.scale"]))
                module.bias.copy_(torch.from_numpy(w[f"{name}.bias"]))
            elif isinstance(module, nn.Linear):
                module.weight.copy_(torch.from_numpy(np.ascontiguousarray(w[f"{name}.kernel"].T)))
                module.bias.copy_(torch.from_numpy(w[f"{name}.bias"]))
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.long().reshape(-1))
