"""``ampbridge.keras.tune`` (issue 41), on every Keras backend: a model with one layer whose outputs
leave float16's range is non-finite on every forward under ``mixed_float16``; tune pins that layer
and what its float32 output needs next, the tuned policy trains 30 finite steps with a falling
loss, and the user's model (its weights, their dtypes, its layers' dtype policies) is untouched."""

from __future__ import annotations

import math

from ampbridge._testing import require, tune_batches

keras = require("keras")
np = require("numpy")

import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402


class Scale(keras.layers.Layer):
    """Multiplies by 1e6: every output element is beyond float16's 65504."""

    def call(self, x):
        return x * 1e6


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="first"), Scale(name="scale"),
                              keras.layers.Dense(8, name="shrink"), keras.layers.Activation("tanh", name="tanh"),
                              keras.layers.Dense(1, name="head")])
    kernel, bias = model.get_layer("shrink").get_weights()
    model.get_layer("shrink").set_weights([kernel * 1e-6, bias * 0])  # back to O(1): float32 trains fine
    return model


_data = tune_batches


def _fit(model, policy, data, steps):
    model = ak.apply(keras.models.clone_model(model), policy, warn=False)
    model.compile(optimizer=ak.optimizer(keras.optimizers.Adam(1e-2), policy), loss="mse")
    model.set_weights(_model().get_weights())
    x = np.concatenate([data[i % len(data)][0] for i in range(steps)])
    y = np.concatenate([data[i % len(data)][1] for i in range(steps)])
    losses = []
    for i in range(steps):
        losses.append(float(model.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])))
    return losses


def test_tune_pins_the_overflowing_layer_then_what_its_output_needs_next():
    model, data = _model(), _data()
    before = [w.copy() for w in model.get_weights()]
    dtypes = [(v.path, v.dtype) for v in model.weights]
    policies = [layer.dtype_policy.name for layer in model.layers]
    # under mixed_float16 every forward is non-finite
    out = ak.apply(keras.models.clone_model(model), "mixed_float16", warn=False)
    assert not np.isfinite(keras.ops.convert_to_numpy(out(data[0][0]))).any()

    result = ak.tune(model, "mixed_float16", data, "mse", steps=6)

    assert result.added == ("scale", "shrink")
    assert result.finite and result.policy.compute_dtype == "float16"
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=("scale", "shrink"))
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    assert result.evidence["scale"].nonfinite == "output" and not result.evidence["first"].pinned

    # the user's model is as it was
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert [(v.path, v.dtype) for v in model.weights] == dtypes
    assert [layer.dtype_policy.name for layer in model.layers] == policies

    losses = _fit(model, result.policy, data, 30)
    assert all(math.isfinite(x) for x in losses[8:])  # the first few: the loss scale backing off
    # falling: by over half on Keras 3.15, by about a quarter on the floor release 3.12
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[8:12]) / 4


OFFSET = 1000.0  # bfloat16 holds 1000 + s to the nearest 4: the signal s (std 1) is lost


def _offset_model():
    """A first Dense that removes a large offset from its inputs (kernel I, bias -1000), then an MLP."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="center"),
                              keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.Dense(1, name="head")])
    model.get_layer("center").set_weights([np.eye(4, dtype="float32"), np.full(4, -OFFSET, "float32")])
    return model


def _offset_data(n=4):
    """Inputs 1000 + s; targets the model's own float32 outputs on 1000 + s, plus a term to learn."""
    rng = np.random.default_rng(1)
    w, teacher = rng.standard_normal((4, 1)).astype("float32"), _offset_model()
    out = []
    for _ in range(n):
        s = rng.standard_normal((16, 4)).astype("float32")
        y = keras.ops.convert_to_numpy(teacher(s + OFFSET)) + 0.3 * np.tanh(s @ w)
        out.append((s + OFFSET, y.astype("float32")))
    return out


def test_tune_pins_the_layer_a_finite_run_diverges_at():
    """Finite but far off under mixed_bfloat16 (the offset layer's input loses its signal); tune
    pins that layer for the loss gap and the gap falls under the tolerance; tries=0 would not."""
    model, data = _offset_model(), _offset_data()
    before = [w.copy() for w in model.get_weights()]
    result = ak.tune(model, "mixed_bfloat16", data, "mse", steps=8)
    c = result.chosen
    assert c.finite and c.skipped == 0 and c.gap_before > 0.3
    assert result.added == ("center",) and result.evidence["center"].diverged
    assert c.gap_after < 0.05 < c.gap_before and c.close
    assert result.policy == ampbridge.preset("mixed_bfloat16").replace(keep_float32=("center",))
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
