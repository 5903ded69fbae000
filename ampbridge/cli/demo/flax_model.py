"""The demo model in Flax linen (see ``ampbridge.cli.demo``)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from .model import CONFIG, Config, weights


class SelfAttention(nn.Module):
    dim: int
    heads: int
    ampbridge_kind = "attention"

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        h, dh = self.heads, self.dim // self.heads

        def split(y):
            return y.reshape(b, t, h, dh).transpose(0, 2, 1, 3)

        q = split(nn.Dense(self.dim, name="query")(x))
        k = split(nn.Dense(self.dim, name="key")(x))
        v = split(nn.Dense(self.dim, name="value")(x))
        attn = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh), axis=-1)
        return nn.Dense(self.dim, name="out")((attn @ v).transpose(0, 2, 1, 3).reshape(b, t, self.dim))


class Block(nn.Module):
    c: Config

    @nn.compact
    def __call__(self, x):
        c = self.c
        x = x + SelfAttention(c.dim, c.heads, name="attn")(nn.LayerNorm(c.norm_eps, name="norm1")(x))
        y = nn.LayerNorm(c.norm_eps, name="norm2")(x)
        return x + nn.Dense(c.dim, name="mlp_out")(nn.relu(nn.Dense(c.hidden, name="mlp_in")(y)))


class DemoModel(nn.Module):
    c: Config = CONFIG

    @nn.compact
    def __call__(self, tokens):
        c = self.c
        x = nn.Embed(c.vocab, c.dim, name="embed")(tokens)
        x = Block(c, name="block")(x)
        return nn.Dense(c.vocab, name="head")(nn.LayerNorm(c.norm_eps, name="norm")(x))


def build(seed: int = 0, config: Config = CONFIG):
    """The module and its variables holding the shared initial weights."""
    w = weights(seed, config)
    params: dict = {}
    for key, value in w.items():
        path, leaf = key.rsplit(".", 1)
        node = params
        for part in path.split("."):
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return DemoModel(config), {"params": params}


def loss_fn(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()
