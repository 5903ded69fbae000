"""ampbridge.tf_keras.PhaseCallback: a [[phase]] schedule during fit switches each layer's Keras 2
policy (the traced train step computes in the phase's dtypes) and the loss-scale settings; the
conformance suite (tests/parity/test_conformance.py, the schedule case) holds the trajectory."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import require

require("tf_keras")

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402
from ampbridge import UnsupportedOptionError  # noqa: E402

SCHEDULE = ampbridge.loads("""
    compute_dtype = "float16"
    [loss_scale]
    mode = "auto"
    initial_scale = 256.0
    growth_interval = 2
    [[phase]]
    until_step = 3
    compute_dtype = "float32"
    [[phase]]
    until_step = 6
    [[phase]]
    keep_float32 = ["probe"]
    """)


class Probe(tf_keras.layers.Layer):
    """Records the dtype its (autocast) input has each time a step is traced."""

    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self.seen = seen

    def call(self, x):
        self.seen.append(x.dtype.name)
        return x


def functional(seen):
    x = tf_keras.Input((4,))
    h = tf_keras.layers.Dense(8, name="dense")(x)
    return tf_keras.Model(x, tf_keras.layers.Dense(2, name="head")(Probe(seen, name="probe")(h)))


def test_fit_runs_each_phase_in_its_dtypes():
    seen = []
    m = atk.apply(functional(seen), SCHEDULE)  # built: rebuilt with clone_model, layers made for every phase
    assert m.get_layer("dense").compute_dtype == "float32"  # the first phase runs
    assert type(m.get_layer("dense").kernel).__name__ == "AutoCastVariable"  # made for the float16 phases
    m.compile(atk.optimizer(tf_keras.optimizers.SGD(0.01), SCHEDULE), "mse")
    cb = atk.PhaseCallback(SCHEDULE)
    seen.clear()
    rng = np.random.RandomState(0)
    scales = []
    record = tf_keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: scales.append(float(m.optimizer.loss_scale.numpy())))
    m.fit(rng.randn(32, 4), rng.randn(32, 2), batch_size=4, shuffle=False, verbose=0, callbacks=[cb, record])
    assert cb.switches == [(0, 0), (3, 1), (6, 2)]
    traced = [d for i, d in enumerate(seen) if i == 0 or seen[i - 1] != d]
    assert traced == ["float32", "float16", "float32"]  # the probe pinned in the last phase
    assert m.get_layer("dense").compute_dtype == "float16" and m.get_layer("probe").compute_dtype == "float32"
    assert m.get_layer("dense").kernel.dtype.name == "float32"
    # float32 -> float16 changes the scaling mode (none -> dynamic): the float16 phase starts at its initial scale
    assert scales[:3] == [1.0] * 3 and scales[3] == 256.0 and scales[4] == 256.0 and scales[5] == 512.0


def test_what_it_cannot_do_is_said_by_name():
    m = atk.apply(functional([]), SCHEDULE.at(step=0))  # applied without the schedule
    m.compile(atk.optimizer(tf_keras.optimizers.SGD(0.01), SCHEDULE), "mse")
    with pytest.raises(UnsupportedOptionError, match="apply the model with this same schedule"):
        m.fit(np.zeros((4, 4)), np.zeros((4, 2)), verbose=0, callbacks=[atk.PhaseCallback(SCHEDULE)])
    params = ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 2\ncompute_dtype = "float32"\n'
                             '[[phase]]\nparam_dtype = "float16"\n')
    with pytest.raises(UnsupportedOptionError, match=r"\[\[phase\]\] param_dtype float16 / float32 for layer"):
        atk.apply(functional([]), params, warn=False)


def test_a_custom_loop_runs_the_same_schedule():
    """GradientTape + get_scaled_loss / get_unscaled_gradients / apply_gradients, the model not compiled:
    ``enter(step=)`` switches where fit's callback does, and the loop's step is traced again there."""
    seen = []
    m = atk.apply(functional(seen), SCHEDULE)
    opt = atk.optimizer(tf_keras.optimizers.SGD(0.01), SCHEDULE)
    cb = atk.PhaseCallback(SCHEDULE, optimizer=opt)
    cb.set_model(m)
    seen.clear()

    def one_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(m(x, training=True), "float32") - y))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, m.trainable_variables))
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    rng = np.random.RandomState(0)
    scales, retraced = [], []
    for step in range(8):
        if cb.enter(step=step):
            retraced.append(step)
            train_step = tf.function(one_step)
        scales.append(float(opt.loss_scale.numpy()))
        train_step(tf.constant(rng.randn(4, 4), "float32"), tf.constant(rng.randn(4, 2), "float32"))
    assert cb.switches == [(0, 0), (3, 1), (6, 2)] and retraced == [0, 3, 6]
    traced = [d for i, d in enumerate(seen) if i == 0 or seen[i - 1] != d]  # SGD's first step traces twice
    assert traced == ["float32", "float16", "float32"]  # each phase traced in its dtypes
    assert scales[:3] == [1.0] * 3 and scales[3] == 256.0 and scales[4] == 256.0 and scales[5] == 512.0
    with pytest.raises(ValueError, match="changes phase by step; pass step=N"):
        cb.enter(epoch=1)
