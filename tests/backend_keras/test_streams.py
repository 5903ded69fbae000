"""A pinned layer called from another layer's own code emits what it computes (float32), and where
that output meets its caller's float16 stream (``x + residual``) the two promote to float32 on
every Keras backend, as torch and jnp promote: TensorFlow refuses a raw float16 + float32, so
``apply`` turns on its numpy-style promotion while the caller runs. The Plan row says so, in the
same words as torch's and Flax's rows; an [[override]] with ``output_dtype`` returns the output to
the stream instead. Run as a script, this module prints one backend's 2-step trajectory (JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

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
        stream = self.norm(self.dense(x)) + residual  # TensorFlow alone: no float16 + float32
        object.__setattr__(self, "stream_dtype", keras.backend.standardize_dtype(stream.dtype))
        return stream


def _model():
    inputs = keras.Input((4,))
    x = Residual(name="block")(inputs)
    x = L.LayerNormalization(name="final_norm")(x)  # called by the graph: keeps its float32 output
    return keras.Model(inputs, L.Dense(2, name="head")(x))


def _dtype(t):
    return keras.backend.standardize_dtype(t.dtype)


def _promotion_mode():
    from tensorflow.python.framework.ops import get_dtype_conversion_mode

    return get_dtype_conversion_mode().name


def test_pinned_layer_called_from_code_promotes_the_stream_on_every_backend():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampbridge.errors.AmpBridgeWarning)  # no warning any more
        model = ak.apply(_model(), POLICY)
    plan = ak.plan(model, POLICY)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype) == ("float32", "float32")  # as torch and Flax
    assert row.note.startswith(ampbridge.core.plan.stream_note("float16", "block", "float32"))
    assert "promotes it to float32 on every backend" in row.note and 'output_dtype = "float16"' in row.note
    assert "called from" not in (plan["final_norm"].note or "")  # called by the graph: Keras casts
    block = model.get_layer("block")
    half = keras.ops.ones((2, 4), "float16")
    assert _dtype(block.norm(half)) == "float32"
    # the stream inside the block is float32 on TensorFlow too, and the block returns it uncast, as the
    # hand-pinned model does (native Keras casts nothing at a layer's output); its row says so
    assert _dtype(block(half)) == "float32"
    assert plan["block"].output_dtype == "float16" and "float32 where it reaches the output" in plan["block"].note
    traced = ak.trace(_model(), POLICY, np.ones((2, 4), "float32"))  # what ran: the stream, uncast
    assert traced["block"].output_dtype == "float32"
    assert block.stream_dtype == "float32"
    assert _dtype(model(np.ones((2, 4), "float32"))) == "float32"
    if keras.backend.backend() == "tensorflow":
        assert _promotion_mode() == "OFF"  # only while the block runs
        with pytest.raises(Exception, match="half|float16|float32"):  # what the block's code meets alone
            keras.ops.ones((2, 4), "float16") + keras.ops.ones((2, 4), "float32")


def test_promotion_is_only_where_the_plan_has_such_a_row():
    model = ak.apply(_model(), POLICY)
    wrapper = model.get_layer("block").__dict__.get("_ampbridge_call")
    assert getattr(wrapper, "promote", False) == (keras.backend.backend() == "tensorflow")
    ak.apply(model, ampbridge.preset("mixed_float16"))  # no pin: no stream row, promotion off again
    wrapper = model.get_layer("block").__dict__.get("_ampbridge_call")
    assert not getattr(wrapper, "promote", False)
    for _, layer in ak.walk(ak.apply(_model(), ampbridge.preset("mixed_float16"))):
        assert not getattr(layer.__dict__.get("_ampbridge_call"), "promote", False)


def _train() -> dict:
    """Two fit steps from fixed weights and data (the same on every backend); losses and weights."""
    model = ak.apply(_model(), POLICY)
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(size=w.shape).astype(keras.backend.standardize_dtype(w.dtype)) * 0.5
                       for w in model.weights])
    model.compile(optimizer=ak.optimizer(keras.optimizers.SGD(0.05), POLICY), loss="mse")
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    losses = []
    for _ in range(2):
        losses.append(float(model.train_on_batch(x, y)))
    block = model.get_layer("block")
    return {"losses": losses, "weights": [np.asarray(keras.ops.convert_to_numpy(w)).tolist() for w in model.weights],
            "dtypes": [block.stream_dtype, _dtype(block.norm(keras.ops.ones((2, 4), "float16"))),
                       _dtype(block(keras.ops.ones((2, 4), "float16")))],
            "steps": int(model.optimizer.state.steps)}


#: each backend's run checks itself against one other, so CI's three runs cover every pair
_OTHER = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}


@pytest.mark.slow
def test_trains_the_same_on_every_backend():
    ours = _train()
    assert ours["dtypes"] == ["float32", "float32", "float32"] and ours["steps"] == 2  # the block returns its stream
    assert all(np.isfinite(np.asarray(w)).all() for w in ours["weights"])
    other = _OTHER[keras.backend.backend()]
    env = {**os.environ, "KERAS_BACKEND": other}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["dtypes"] == ours["dtypes"] and theirs["steps"] == 2
    # float16 compute: backends round the same maths in different orders (measured on CPU: losses
    # within 7e-5 relative, weights within 1.3e-5), not bit for bit
    np.testing.assert_allclose(theirs["losses"], ours["losses"], rtol=5e-4, err_msg=f"losses vs {other}")
    for a, b in zip(theirs["weights"], ours["weights"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-4, atol=1e-4, err_msg=f"weights vs {other}")


def test_an_override_output_dtype_returns_it_to_the_stream_on_every_backend():
    policy = POLICY.replace(overrides=({"match": ("block.norm",), "compute_dtype": "float32",
                                        "output_dtype": "float16"},))
    model = ak.apply(_model(), policy)
    row = ak.plan(model, policy)["block.norm"]
    assert (row.compute_dtype, row.output_dtype, row.rule) == ("float32", "float16", "override[0]")
    assert "called from" not in (row.note or "")
    assert not getattr(model.get_layer("block").__dict__.get("_ampbridge_call"), "promote", False)
    half = keras.ops.ones((2, 4), "float16")
    assert _dtype(model.get_layer("block").norm(half)) == "float16"
    assert _dtype(model.get_layer("block")(half)) == "float16"
    assert model.get_layer("block").stream_dtype == "float16"
    assert _dtype(model(np.ones((2, 4), "float32"))) == "float32"  # TensorFlow included


if __name__ == "__main__":
    print(json.dumps(_train()))
