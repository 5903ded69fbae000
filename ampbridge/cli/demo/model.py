"""The conformance/demo model: one small transformer-ish network in torch, Keras and Flax.

The three definitions share layer names (``embed``, ``block.norm1``, ``block.attn.query`` ...,
``head``), layout and initial weights (drawn once from a numpy seed), so the same policy gives
the same Plan in each framework and float32 training agrees to rounding. The attention block is
written out (query/key/value/out projections) rather than taken from each framework's own
multi-head attention layer, whose internals differ; it declares ``ampbridge_kind = "attention"``.

Example:
    >>> sorted(weights())[:3]
    ['block.attn.key.bias', 'block.attn.key.kernel', 'block.attn.out.bias']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 32
    heads: int = 2
    hidden: int = 64
    seq: int = 8
    batch: int = 16
    lr: float = 0.1
    norm_eps: float = 1e-5


CONFIG = Config()

#: every layer of the model, in forward order: (path, kind, class)
LAYERS = (
    ("embed", "embedding"),
    ("block", None),
    ("block.norm1", "norm"),
    ("block.attn", "attention"),
    ("block.attn.query", "linear"),
    ("block.attn.key", "linear"),
    ("block.attn.value", "linear"),
    ("block.attn.out", "linear"),
    ("block.norm2", "norm"),
    ("block.mlp_in", "linear"),
    ("block.mlp_out", "linear"),
    ("norm", "norm"),
    ("head", "linear"),
)


def weights(seed: int = 0, config: Config = CONFIG) -> dict[str, np.ndarray]:
    """Initial weights by ``path.name``; dense kernels are (in, out) as Keras and Flax store them."""
    rng = np.random.default_rng(seed)
    c = config

    def dense(d_in: int, d_out: int) -> tuple[np.ndarray, np.ndarray]:
        bound = 1.0 / np.sqrt(d_in)
        return (rng.uniform(-bound, bound, (d_in, d_out)).astype(np.float32),
                rng.uniform(-bound, bound, (d_out,)).astype(np.float32))

    w: dict[str, np.ndarray] = {"embed.embedding": rng.normal(0, 1, (c.vocab, c.dim)).astype(np.float32)}
    for name in ("block.norm1", "block.norm2", "norm"):
        w[f"{name}.scale"] = (1 + 0.1 * rng.normal(size=c.dim)).astype(np.float32)
        w[f"{name}.bias"] = (0.1 * rng.normal(size=c.dim)).astype(np.float32)
    for name, d_in, d_out in (("block.attn.query", c.dim, c.dim), ("block.attn.key", c.dim, c.dim),
                              ("block.attn.value", c.dim, c.dim), ("block.attn.out", c.dim, c.dim),
                              ("block.mlp_in", c.dim, c.hidden), ("block.mlp_out", c.hidden, c.dim),
                              ("head", c.dim, c.vocab)):
        w[f"{name}.kernel"], w[f"{name}.bias"] = dense(d_in, d_out)
    return w


def batches(steps: int, seed: int = 1, config: Config = CONFIG) -> list[tuple[np.ndarray, np.ndarray]]:
    """A learnable token task: predict ``(x + 1) % vocab`` at every position."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, config.vocab, (config.batch, config.seq)).astype(np.int32)
        out.append((x, ((x + 1) % config.vocab).astype(np.int32)))
    return out


def load_keras_weights(model, w: dict[str, np.ndarray], children, layers) -> None:
    """The shared weights ``w`` into a built Keras model (Keras 3 or tf.keras 2: the same layer classes,
    names and variable names); ``children(layer)`` lists a layer's direct sublayers, ``layers`` is the
    framework's ``layers`` module."""

    def walk(layer, prefix=""):
        for sub in children(layer):
            path = f"{prefix}{sub.name}"
            yield path, sub
            yield from walk(sub, path + ".")

    for path, layer in walk(model):
        if isinstance(layer, layers.Embedding):
            layer.embeddings.assign(w[f"{path}.embedding"])
        elif isinstance(layer, layers.LayerNormalization):
            layer.gamma.assign(w[f"{path}.scale"])
            layer.beta.assign(w[f"{path}.bias"])
        elif isinstance(layer, layers.Dense):
            layer.kernel.assign(w[f"{path}.kernel"])
            layer.bias.assign(w[f"{path}.bias"])
