"""The demo model in tf.keras 2 (the ``tf_keras`` package; see ``ampbridge.cli.demo``): the Keras 3
definition's layers, names and weights, in Keras 2's API and TensorFlow ops."""

from __future__ import annotations

import math

import tensorflow as tf
import tf_keras
from tf_keras import layers

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

    def call(self, x):
        b, t = tf.shape(x)[0], tf.shape(x)[1]
        h, dh = self.heads, self.dim // self.heads

        def split(y):
            return tf.transpose(tf.reshape(y, (b, t, h, dh)), (0, 2, 1, 3))

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = tf.matmul(q, k, transpose_b=True) / tf.cast(math.sqrt(dh), q.dtype)
        attn = tf.nn.softmax(scores, axis=-1)
        return self.out(tf.reshape(tf.transpose(tf.matmul(attn, v), (0, 2, 1, 3)), (b, t, self.dim)))


class Block(layers.Layer):
    def __init__(self, c: Config, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = layers.LayerNormalization(epsilon=c.norm_eps, name="norm1")
        self.attn = SelfAttention(c.dim, c.heads, name="attn")
        self.norm2 = layers.LayerNormalization(epsilon=c.norm_eps, name="norm2")
        self.mlp_in = layers.Dense(c.hidden, name="mlp_in")
        self.mlp_out = layers.Dense(c.dim, name="mlp_out")

    def call(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp_out(tf.nn.relu(self.mlp_in(self.norm2(x))))


class DemoModel(tf_keras.Model):
    def __init__(self, c: Config = CONFIG, **kwargs):
        super().__init__(**kwargs)
        self.config_ = c
        self.embed = layers.Embedding(c.vocab, c.dim, name="embed")
        self.block = Block(c, name="block")
        self.norm = layers.LayerNormalization(epsilon=c.norm_eps, name="norm")
        self.head = layers.Dense(c.vocab, name="head")

    def call(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens))))


def build(seed: int = 0, config: Config = CONFIG, *, policy=None) -> DemoModel:
    """The model with the shared initial weights; with ``policy``, applied before it is built (Keras 2
    fixes a layer's dtype when its variables are made)."""
    model = DemoModel(config, name="demo")
    if policy is not None:
        import ampbridge.tf_keras

        model = ampbridge.tf_keras.apply(model, policy, warn=False)
    model(tf.zeros((config.batch, config.seq), dtype="int32"))
    load_keras_weights(model, weights(seed, config),
                       lambda layer: layer._flatten_layers(include_self=False, recursive=False), layers)
    return model
