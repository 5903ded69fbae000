"""A pinned layer called from another layer's own code: the Plan says its output meets a stream of
another dtype (the same row as torch's and Flax's, which promote), ``apply`` warns on TensorFlow
(which refuses a raw float16 + float32), and an [[override]] with ``output_dtype`` returns it to
the stream on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
POLICY = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))


class Residual(L.Layer):
    """keras-hub's TransformerEncoder in miniature: a norm, then a raw ``x + residual``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(4, name="dense")
        self.norm = L.LayerNormalization(name="norm")

    def call(self, x):
        residual = x
        return self.norm(self.dense(x)) + residual  # TensorFlow: no float16 + float32


def _model():
    inputs = keras.Input((4,))
    x = Residual(name="block")(inputs)
    x = L.LayerNormalization(name="final_norm")(x)  # called by the graph: keeps its float32 output
    return keras.Model(inputs, L.Dense(2, name="head")(x))


def _dtype(t):
    return keras.backend.standardize_dtype(t.dtype)


def test_pinned_layer_called_from_code_is_flagged_and_keeps_its_dtype():
    if keras.backend.backend() == "tensorflow":
        with pytest.warns(ampbridge.errors.AmpBridgeWarning, match="TensorFlow does not promote"):
            model = ak.apply(_model(), POLICY)
    else:
        model = ak.apply(_model(), POLICY)
    plan = ak.plan(model, POLICY)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype) == ("float32", "float32")  # as torch and Flax
    assert "called from block's own code, which computes in float16" in row.note
    assert 'output_dtype = "float16"' in row.note
    assert "called from" not in (plan["final_norm"].note or "")  # called by the graph: Keras casts
    block = model.get_layer("block")
    half = keras.ops.ones((2, 4), "float16")
    assert _dtype(block.norm(half)) == "float32"
    if keras.backend.backend() != "tensorflow":  # JAX and torch promote inside the block, as torch and Flax do
        assert _dtype(block(half)) == plan["block"].output_dtype == "float16"  # the block's own row
        assert _dtype(model(np.ones((2, 4), "float32"))) == "float32"


def test_an_override_output_dtype_returns_it_to_the_stream_on_every_backend():
    policy = POLICY.replace(overrides=({"match": ("block.norm",), "compute_dtype": "float32",
                                        "output_dtype": "float16"},))
    model = ak.apply(_model(), policy)  # no warning: the policy asked
    row = ak.plan(model, policy)["block.norm"]
    assert (row.compute_dtype, row.output_dtype, row.rule) == ("float32", "float16", "override[0]")
    assert "called from" not in (row.note or "")
    half = keras.ops.ones((2, 4), "float16")
    assert _dtype(model.get_layer("block").norm(half)) == "float16"
    assert _dtype(model.get_layer("block")(half)) == "float16"
    assert _dtype(model(np.ones((2, 4), "float32"))) == "float32"  # TensorFlow included
