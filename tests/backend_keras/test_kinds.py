"""Keras kinds: the core's inference for a model's own layer classes (keras-hub writes its own
``LlamaLayerNorm``), ``ampbridge.keras.register_kind``, and the [kinds] table beating both."""

from __future__ import annotations

import numpy as np
import pytest

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


class PreNorm(keras.layers.Layer):  # the common ViT wrapper: a LayerNormalization and the block it wraps
    def __init__(self, **kw):
        super().__init__(**kw)
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.fn = keras.layers.Dense(4, name="fn")

    def call(self, x):
        return self.fn(self.norm(x))


class TinyNorm(keras.Model):  # a model whose own class name ends in Norm
    def __init__(self, **kw):
        super().__init__(**kw)
        self.pre = PreNorm(name="pre")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(x + self.pre(x))


def _tiny_norm():
    model = TinyNorm()
    model(np.ones((2, 4), "float32"))
    return model


def test_a_prenorm_wrapper_and_the_root_get_no_inferred_kind():
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    model = _tiny_norm()
    plan = ak.plan(model, policy)
    assert plan[""].kind is None and plan[""].kind_source == "norm by name, not inferred: the model itself"
    assert plan["pre"].kind is None and plan["pre"].kind_source == "norm by name, not inferred: holds linear"
    applied = ak.apply(model, policy)
    pre = applied.pre
    # what runs: the Keras layers' own policies (the wrapper and its Dense compute bfloat16)
    assert (applied.compute_dtype, pre.compute_dtype, pre.norm.compute_dtype, pre.fn.compute_dtype) == \
        ("bfloat16", "bfloat16", "float32", "bfloat16")
    assert "bfloat16" in str(pre.fn(np.ones((2, 4), "float32")).dtype)
    # an explicit [kinds] entry still makes the wrapper a norm: the rule reaches what it holds
    table = policy.replace(kinds={"norm": ["PreNorm"]})
    with pytest.warns(ampbridge.BroadRuleWarning, match=r"kind:norm\) reaches .* \(pre\)"):
        applied = ak.apply(_tiny_norm(), table)  # the wrapper holds most of the model: said once
    assert ak.plan(applied, table)["pre"].kind_text == "norm ([kinds] table)"
    assert applied.pre.fn.compute_dtype == "float32" and applied.head.compute_dtype == "bfloat16"
