"""``ampbridge.tf_keras.tune`` (issue 41) under TF_USE_LEGACY_KERAS=1: a model with one layer whose
outputs leave float16's range is non-finite on every forward under ``mixed_float16``; tune pins that
layer and what its float32 output needs next, the tuned policy trains 30 finite steps with a falling
loss, and the user's model (its weights, their dtypes, its layers' dtype policies) is untouched."""

from __future__ import annotations

import math

from ampbridge._testing import require, tune_batches

tf_keras = require("tf_keras")
np = require("numpy")

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402


class Scale(tf_keras.layers.Layer):
    """Multiplies by 1e6: every output element is beyond float16's 65504."""

    def call(self, x):
        return x * 1e6


def _model():
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(8, name="first"), Scale(name="scale"),
                                 tf_keras.layers.Dense(8, name="shrink"), tf_keras.layers.Activation("tanh", name="tanh"),
                                 tf_keras.layers.Dense(1, name="head")])
    kernel, bias = model.get_layer("shrink").get_weights()
    model.get_layer("shrink").set_weights([kernel * 1e-6, bias * 0])  # back to O(1): float32 trains fine
    return model


_data = tune_batches


def _fit(model, policy, data, steps):
    model = atk.apply(tf_keras.models.clone_model(model), policy, warn=False)
    model.set_weights(_model().get_weights())
    model.compile(optimizer=atk.optimizer(tf_keras.optimizers.Adam(1e-2), policy), loss="mse")
    return [float(model.train_on_batch(*data[i % len(data)])) for i in range(steps)]


def test_tune_pins_the_overflowing_layer_then_what_its_output_needs_next():
    model, data = _model(), _data()
    before = [w.copy() for w in model.get_weights()]
    dtypes = [(v.name, v.dtype) for v in model.weights]
    policies = [layer.dtype_policy.name for layer in model.layers]
    # under mixed_float16 every forward is non-finite
    out = atk.apply(tf_keras.models.clone_model(model), "mixed_float16", warn=False)
    assert not np.isfinite(np.asarray(out(data[0][0]), np.float32)).any()

    result = atk.tune(model, "mixed_float16", data, "mse", steps=6)

    assert result.added == ("scale", "shrink")
    assert result.finite and result.policy.compute_dtype == "float16" and result.framework == "tf_keras"
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=("scale", "shrink"))
    assert result.evidence["scale"].nonfinite == "output" and not result.evidence["first"].pinned
    assert result.chosen.gap_before is None and result.chosen.gap_after is not None

    # the user's model is as it was
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert [(v.name, v.dtype) for v in model.weights] == dtypes
    assert [layer.dtype_policy.name for layer in model.layers] == policies

    losses = _fit(model, result.policy, data, 30)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4


def test_tune_refuses_what_is_not_a_tf_keras_model():
    import pytest

    with pytest.raises(TypeError, match="tune takes a tf_keras model"):
        atk.tune(object(), "mixed_float16", _data(), "mse")


def test_tune_pins_the_layer_a_finite_run_diverges_at():
    """Finite but far off under mixed_bfloat16: a first Dense removes a 1000 offset from its inputs,
    which bfloat16 holds only to the nearest 4; tune pins it for the loss gap, which falls under 5%."""
    offset = 1000.0
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(4, name="center"),
                                 tf_keras.layers.Dense(8, activation="tanh", name="hidden"),
                                 tf_keras.layers.Dense(1, name="head")])
    model.get_layer("center").set_weights([np.eye(4, dtype="float32"), np.full(4, -offset, "float32")])
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 1)).astype("float32")
    data = []
    for _ in range(4):
        s = rng.standard_normal((16, 4)).astype("float32")
        data.append((s + offset, (np.asarray(model(s + offset)) + 0.3 * np.tanh(s @ w)).astype("float32")))
    result = atk.tune(model, "mixed_bfloat16", data, "mse", steps=8)
    c = result.chosen
    assert c.finite and c.skipped == 0 and c.gap_before > 0.3
    assert result.added == ("center",) and result.evidence["center"].diverged
    assert c.gap_after < 0.05 and c.close
