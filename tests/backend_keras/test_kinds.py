"""Keras kinds: the core's inference for a model's own layer classes (keras-hub writes its own
``LlamaLayerNorm``), ``ampbridge.keras.register_kind``, and the [kinds] table beating both."""

from __future__ import annotations

import numpy as np

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge.backends.keras.layers import _REGISTERED  # noqa: E402


class LlamaLayerNorm(keras.layers.Layer):  # as keras-hub writes it: no Keras norm base class
    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        var = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return x * keras.ops.rsqrt(var + 1e-6) * keras.ops.cast(self.scale, x.dtype)


class Mixer(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.proj = keras.layers.Dense(4, name="proj")

    def call(self, x):
        return self.proj(x)


def _model():
    inputs = keras.Input((3, 4))
    x = LlamaLayerNorm(name="norm")(inputs)
    return keras.Model(inputs, Mixer(name="mix")(x))


def test_inferred_registered_and_table_kinds():
    model = _model()
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    plan = ak.plan(model, policy)
    assert plan["norm"].kind_text == "norm (class name)" and plan["norm"].compute_dtype == "float32"
    assert plan["mix"].kind is None and plan["mix.proj"].kind_text == "linear"
    try:
        ak.register_kind(Mixer, "attention")
        plan = ak.plan(model, policy.replace(keep_float32=("kind:attention",)))
        assert plan["mix"].kind_text == "attention (registered)" and plan["mix.proj"].compute_dtype == "float32"
    finally:
        _REGISTERED.unregister(Mixer)
    table = policy.replace(kinds={"none": ["LlamaLayerNorm"], "norm": ["Mixer"]})
    plan = ak.plan(model, table)
    assert plan["norm"].kind is None and plan["norm"].compute_dtype == "bfloat16"
    assert plan["mix"].kind == "norm" and plan["mix.proj"].compute_dtype == "float32"
    applied = ak.apply(_model(), policy)
    out = applied(np.ones((2, 3, 4), "float32"))
    assert applied.get_layer("norm").compute_dtype == "float32" and "float32" in str(out.dtype)
