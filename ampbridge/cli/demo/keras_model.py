"""The demo model in Keras 3 (see ``ampbridge.cli.demo``); works on every Keras backend."""

from __future__ import annotations

import math

import keras
from keras import layers, ops

from .model import CONFIG, Config, load_keras_weights, weights


class SelfAttention(layers.Layer):
    ampbridge_kind = "attention"

    def __init__(self, dim: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads = dim, heads
        self.query = layers.Dense(dim, name="query")
        self.key = layers.Dense(dim, name="key")
        self.value = layers.Dense(dim, name="value")
        self.out = layers.Dense(dim, name="out")

    def build(self, input_shape):
        for sub in (self.query, self.key, self.value, self.out):
            sub.build(input_shape)

    def call(self, x, training=None):
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        h, dh = self.heads, self.dim // self.heads

        def split(y):
            return ops.transpose(ops.reshape(y, (b, t, h, dh)), (0, 2, 1, 3))

        q, k, v = (split(self.query(x, training=training)), split(self.key(x, training=training)),
                   split(self.value(x, training=training)))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / math.sqrt(dh)
        attn = ops.softmax(scores, axis=-1)
        return self.out(ops.reshape(ops.transpose(ops.matmul(attn, v), (0, 2, 1, 3)), (b, t, self.dim)),
                        training=training)


class Block(layers.Layer):
    def __init__(self, c: Config, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = layers.LayerNormalization(epsilon=c.norm_eps, name="norm1")
        self.attn = SelfAttention(c.dim, c.heads, name="attn")
        self.norm2 = layers.LayerNormalization(epsilon=c.norm_eps, name="norm2")
        self.mlp_in = layers.Dense(c.hidden, name="mlp_in")
        self.mlp_out = layers.Dense(c.dim, name="mlp_out")

    def build(self, input_shape):
        self.norm1.build(input_shape)
        self.attn.build(input_shape)
        self.norm2.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build(tuple(input_shape[:-1]) + (self.mlp_in.units,))

    def call(self, x, training=None):
        x = x + self.attn(self.norm1(x), training=training)
        return x + self.mlp_out(ops.relu(self.mlp_in(self.norm2(x), training=training)), training=training)


class DemoModel(keras.Model):
    def __init__(self, c: Config = CONFIG, **kwargs):
        super().__init__(**kwargs)
        self.config_ = c
        self.embed = layers.Embedding(c.vocab, c.dim, name="embed")
        self.block = Block(c, name="block")
        self.norm = layers.LayerNormalization(epsilon=c.norm_eps, name="norm")
        self.head = layers.Dense(c.vocab, name="head")

    def call(self, tokens, training=None):
        # `training` passed down by hand: Keras's float8 Dense updates its scales only when called with
        # training=True, and Keras's call context does not always carry it there (never under JAX)
        return self.head(self.norm(self.block(self.embed(tokens), training=training)), training=training)


def build(seed: int = 0, config: Config = CONFIG) -> DemoModel:
    """The model, built, with the shared initial weights."""
    model = DemoModel(config, name="demo")
    model(ops.zeros((config.batch, config.seq), dtype="int32"))
    load_keras_weights(model, weights(seed, config), lambda layer: layer._layers, layers)
    return model


def loss_fn(targets, logits):
    return keras.losses.sparse_categorical_crossentropy(targets, ops.cast(logits, "float32"), from_logits=True)
