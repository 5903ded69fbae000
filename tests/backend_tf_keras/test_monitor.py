"""ampbridge.tf_keras.Monitor: the shared numerics log from a tf_keras ``fit``, its statistics the
runlog reference's (``layer_stats``) of the gradients Keras 2's LossScaleOptimizer really computes."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import fuzz_settings, require

require("tf_keras")
require("hypothesis")

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402
from ampbridge import LossScaleConfig, UnsupportedOptionError  # noqa: E402
from ampbridge.backends.tf_keras.monitor import _layer_row  # noqa: E402
from ampbridge.diagnostics.runlog import STAT_KEYS, layer_stats, read_log  # noqa: E402

POLICY = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",), loss_scale=LossScaleConfig(
    mode="dynamic", initial_scale=1024.0, growth_interval=4))
BATCH = 4


def model_and_data():
    x = tf_keras.Input((4,))
    h = tf_keras.layers.Dense(8, name="dense")(x)
    h = tf_keras.layers.LayerNormalization(name="norm")(h)
    m = atk.apply(tf_keras.Model(x, tf_keras.layers.Dense(2, name="head")(h)), POLICY)
    m.compile(atk.optimizer(tf_keras.optimizers.SGD(0.1), POLICY), "mse")
    rng = np.random.RandomState(0)
    return m, rng.randn(8 * BATCH, 4).astype("float32"), rng.randn(8 * BATCH, 2).astype("float32")


def native_stats(m, x, y, scale):
    """The reference statistics of step 0: Keras 2's scaled gradients by hand (a tape on the loss
    times the scale, as the LossScaleOptimizer takes them), through ``layer_stats``."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf_keras.losses.mse(y, tf.cast(m(x, training=True), tf.float32))) * scale
    layers = [m.get_layer(name) for name in ("dense", "norm", "head")]
    grads = tape.gradient(loss, [layer.trainable_weights for layer in layers])
    return {layer.name: layer_stats(np.concatenate([g.numpy().ravel() for g in gs]), scale, layer.compute_dtype)
            for layer, gs in zip(layers, grads)}


def test_fit_log_matches_the_native_gradients_the_optimizer_and_report(tmp_path):
    m, x, y = model_and_data()
    w = np.ones(len(x), np.float32)
    w[2 * BATCH:3 * BATCH] = np.inf  # step 2 overflows
    expected0 = native_stats(m, x[:BATCH], y[:BATCH], 1024.0)
    path = tmp_path / "run.jsonl"
    scales = []
    record = tf_keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: scales.append(float(m.optimizer.loss_scale.numpy())))
    with atk.Monitor(path, m, every=3) as monitor:
        m.fit(x, y, sample_weight=w, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[record, monitor])
    log = read_log(path)
    assert log.header["framework"] == "tf_keras" and log.header["layers"] == [
        "dense", "norm", "head", atk.OUTPUT_CAST]  # Plan paths, the output cast apply appended too
    assert [s["step"] for s in log.steps] == [0, 2, 3, 6]  # every 3rd, and the non-finite one
    for name, want in expected0.items():
        got = log.steps[0]["layers"][name]
        np.testing.assert_allclose([got[k] for k in STAT_KEYS], [want[k] for k in STAT_KEYS], rtol=1e-5, err_msg=name)
    bad = log.steps[1]
    assert (bad["found_inf"], bad["skipped"], bad["first_nonfinite"]) == (True, True, {"path": "head", "where": "gradient"})
    assert [s["loss_scale"] for s in log.steps] == [scales[s["step"]] for s in log.steps] == [1024.0, 1024.0, 512.0, 512.0]
    assert np.isfinite(log.steps[2]["loss"]) and log.steps[2]["loss"] > 0
    assert (log.end["steps"], log.end["skipped"], log.end["last_step"]) == (8, 1, 7)
    assert len([line for line in path.read_text().splitlines() if '"kind": "end"' in line]) == 1


BIG = float(np.float32(1e30))
finite32 = st.floats(-BIG, BIG, width=32, allow_subnormal=False)
specials = st.sampled_from([0.0, np.inf, -np.inf, np.nan, 70000.0, 1e-6, 3e-8])


@fuzz_settings(30, 400)
@given(st.lists(st.one_of(finite32, specials), min_size=1, max_size=40), st.integers(0, 16),
       st.sampled_from(["float16", "bfloat16", "float32"]))
@example([70000.0, 1.0, 0.0], 1, "float16")  # beyond float16 scaled, within it unscaled: an overflow
@example([1.8e19, -3.0], 0, "float32")  # squares beyond float32: the rms still finite
@example([1e-6, 3e-8, np.inf], 4, "float16")  # underflow once unscaled, and a non-finite one
def test_layer_row_is_the_runlog_reference(scaled, exponent, dtype):
    scale = float(2 ** exponent)
    g = np.asarray(scaled, np.float32)
    u = g / np.float32(scale)  # what the optimizer applies: exact for a power-of-two scale ...
    if np.any((u == 0) != (g == 0)):  # ... unless it flushes a tiny gradient to zero
        return
    got = _layer_row([tf.constant(u[: len(u) // 2]), tf.constant(u[len(u) // 2:])], tf.constant(scale), dtype).numpy()
    want = layer_stats(g, scale, dtype)
    np.testing.assert_allclose(got, [want[k] for k in STAT_KEYS], rtol=1e-5, equal_nan=True)


def test_what_it_needs_is_said_by_name(tmp_path):
    m, _, _ = model_and_data()
    with pytest.raises(ValueError, match="every must be a positive integer"):
        atk.Monitor(tmp_path / "a.jsonl", m, every=0)
    plain = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="ampbridge.tf_keras.apply"):
        atk.Monitor(tmp_path / "b.jsonl", plain)
    plain = atk.apply(plain, "float32")  # a mixed model's compile wraps a plain optimizer in Keras 2's own
    plain.compile(tf_keras.optimizers.SGD(), "mse")
    with pytest.raises(UnsupportedOptionError, match="ampbridge.tf_keras.optimizer"):
        atk.Monitor(tmp_path / "c.jsonl", plain)


def test_a_custom_loop_logs_as_fit_does(tmp_path):
    m, x, y = model_and_data()
    opt = m.optimizer
    expected0 = native_stats(m, x[:BATCH], y[:BATCH], 1024.0)
    path = tmp_path / "loop.jsonl"
    monitor = atk.Monitor(path, m, every=2)

    @tf.function
    def step(xb, yb, mult):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf_keras.losses.mse(yb, tf.cast(m(xb, training=True), tf.float32))) * mult
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, m.trainable_variables))
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    scales = []
    with monitor:
        for i in range(5):
            scales.append(float(opt.loss_scale.numpy()))
            loss = step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH], np.float32(np.inf if i == 1 else 1.0))
            monitor.record(loss)
    log = read_log(path)
    assert [(s["step"], s["found_inf"], s["loss_scale"]) for s in log.steps] == [
        (0, False, 1024.0), (1, True, 1024.0), (2, False, 512.0), (4, False, 512.0)]
    assert [s["loss_scale"] for s in log.steps] == [scales[s["step"]] for s in log.steps]
    for name, want in expected0.items():
        got = log.steps[0]["layers"][name]
        np.testing.assert_allclose([got[k] for k in STAT_KEYS], [want[k] for k in STAT_KEYS], rtol=1e-5, err_msg=name)
    assert log.steps[1]["first_nonfinite"] == {"path": "head", "where": "gradient"}
    assert (log.end["steps"], log.end["skipped"]) == (5, 1)
