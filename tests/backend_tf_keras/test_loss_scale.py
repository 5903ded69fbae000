"""``ampbridge.tf_keras.optimizer``: Keras 2's own ``LossScaleOptimizer`` where it runs the policy's
settings, the reference state in that same class otherwise; both trace the core's reference
trajectory (scale, skipped steps) over random finite/non-finite sequences, eager and in
``tf.function``, and the expressibility rule is checked against Keras 2's class itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ampbridge._testing import fuzz_settings, require

tf_keras = require("tf_keras")
require("hypothesis")

import tensorflow as tf  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402
from ampbridge import LossScaleConfig, UnsupportedOptionError  # noqa: E402
from ampbridge.backends.tf_keras.loss_scale import ReferenceState  # noqa: E402


def drive(opt, found_infs, compiled=False):
    """Scale and whether the weight moved, after each step of one variable's SGD."""
    var = tf.Variable([1.0, 2.0])

    def step(bad):
        grad = opt.get_scaled_loss(tf.where(bad, tf.constant([math.inf, 1.0]), tf.constant([0.5, 0.25])))
        opt.apply_gradients(zip(opt.get_unscaled_gradients([grad]), [var]))

    run = tf.function(step) if compiled else step
    out = []
    for bad in found_infs:
        before = var.numpy()
        run(tf.constant(bad))
        out.append((float(opt.loss_scale.numpy()), not np.array_equal(before, var.numpy())))
    return out


def reference(cfg, found_infs):
    return [(s.scale, ampbridge.core.loss_scale.applies(cfg, bad, 0)) for s, bad in
            zip(ampbridge.trajectory(cfg, found_infs), found_infs)]


def policy_with(cfg):
    return ampbridge.preset("mixed_float16").replace(loss_scale=cfg)


configs = st.one_of(
    st.builds(lambda init, interval, floor: LossScaleConfig(mode="dynamic", initial_scale=2.0 ** init,
                                                            growth_interval=interval,
                                                            min_scale=None if floor is None else min(floor, 2.0 ** init)),
              st.integers(0, 6), st.integers(1, 4), st.sampled_from([None, 1.0, 0.25, 4.0])),
    st.builds(lambda init, interval, growth, backoff, hyst, cons, ceiling, skip: LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** init, growth_interval=interval, growth_factor=growth,
        backoff_factor=backoff, hysteresis=hyst, consecutive_hysteresis=cons,
        max_scale=None if ceiling is None else max(ceiling, 2.0 ** init),
        skip_nonfinite=skip),
        st.integers(0, 10), st.integers(1, 4), st.sampled_from([2.0, 1.5, 3.0]), st.sampled_from([0.5, 0.25, 0.75]),
        st.integers(1, 3), st.booleans(), st.sampled_from([None, 64.0, 2.0 ** 10]), st.booleans()),
    st.builds(lambda mode, init, skip: LossScaleConfig(mode=mode, initial_scale=init, skip_nonfinite=skip),
              st.sampled_from(["static", "none"]), st.sampled_from([1.0, 128.0]), st.booleans()),
)
sequences = st.lists(st.booleans(), min_size=1, max_size=14)


@fuzz_settings(25, 400)
@given(configs, sequences)
def test_optimizer_traces_the_reference(cfg, found_infs):
    opt = atk.optimizer(tf_keras.optimizers.SGD(1.0), policy_with(cfg))
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(opt._loss_scale, ReferenceState) != atk.keras2_expressible(cfg)
    assert drive(opt, found_infs) == reference(cfg, found_infs)


@fuzz_settings(25, 400)
@given(configs, sequences)
def test_keras2_expressible_means_keras2s_own_class_runs_it(cfg, found_infs):
    # Keras 2's own optimizer, as a user would write it for this config: where ampbridge says it is
    # expressible, it must trace the reference exactly
    if cfg.mode != "dynamic":
        return
    native = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(1.0), initial_scale=cfg.initial_scale, dynamic_growth_steps=cfg.growth_interval)
    agrees = drive(native, found_infs) == reference(cfg, found_infs)
    assert agrees or not atk.keras2_expressible(cfg)


def test_expressible_boundary_is_keras2s_floor_of_one():
    # Keras 2 halves down to 1 and no further: without a floor the reference keeps halving
    bad = [True] * 4
    for floor, same in ((1.0, True), (None, False)):
        cfg = LossScaleConfig(mode="dynamic", initial_scale=4.0, growth_interval=3, min_scale=floor)
        native = tf_keras.mixed_precision.LossScaleOptimizer(
            tf_keras.optimizers.SGD(1.0), initial_scale=4.0, dynamic_growth_steps=3)
        assert (drive(native, bad) == reference(cfg, bad)) is same
        assert atk.keras2_expressible(cfg) is same


@pytest.mark.parametrize("cfg", [
    LossScaleConfig(mode="dynamic", initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=32.0),
    LossScaleConfig(mode="dynamic", initial_scale=8.0, growth_interval=2, min_scale=1.0),
])
def test_compiled_steps_trace_the_reference(cfg):
    found_infs = [False, True, True, False, False, True, False, False, False]
    opt = atk.optimizer(tf_keras.optimizers.SGD(1.0), policy_with(cfg))
    assert drive(opt, found_infs, compiled=True) == reference(cfg, found_infs)


def test_fit_with_the_reference_state_and_checkpoint_round_trip(tmp_path):
    cfg = LossScaleConfig(mode="dynamic", initial_scale=64.0, growth_interval=2, hysteresis=2)
    x = tf_keras.Input((3,))
    model = tf_keras.Model(x, tf_keras.layers.Dense(1, name="head")(x))
    model = atk.apply(model, policy_with(cfg))
    opt = atk.optimizer(tf_keras.optimizers.SGD(0.01), policy_with(cfg))
    model.compile(opt, "mse")
    xs, ys = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    for weight in (1.0, np.inf, np.inf, 1.0):
        model.fit(xs, ys, sample_weight=np.full(4, weight, "float32"), batch_size=4, verbose=0)
    want = ampbridge.trajectory(cfg, [False, True, True, False])[-1]
    assert atk.state_of(opt) == {"scale": want.scale, "good_steps": want.good_steps,
                                 "hysteresis_left": want.hysteresis_left, "steps": 4, "skipped": 2}
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = atk.optimizer(tf_keras.optimizers.SGD(0.01), policy_with(cfg))
    fresh.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
    assert atk.state_of(fresh) == atk.state_of(opt)


@pytest.mark.parametrize("change, named", [
    ({"on_min_scale": "warn", "min_scale": 1.0}, "on_min_scale"),
    ({"max_consecutive_skips": 2}, "max_consecutive_skips"),
    ({"first_growth_interval": 5, "growth_interval": 4}, "first_growth_interval"),
])
def test_settings_neither_realises_are_refused_by_name(change, named):
    cfg = LossScaleConfig(mode="dynamic", **change)
    with pytest.raises(UnsupportedOptionError, match=named):
        atk.optimizer(tf_keras.optimizers.SGD(0.1), policy_with(cfg))


@fuzz_settings(20, 300)
@given(configs, sequences)
def test_what_to_tf_keras_writes_runs_the_policy_in_keras2(cfg, found_infs):
    # the recipe's LossScaleOptimizer arguments, given to Keras 2's own class: exact where it says so
    from ampbridge import recipes

    conversion = recipes.to_tf_keras(policy_with(cfg).replace(output_dtype="float16"))
    args = conversion.result["loss_scale_optimizer"]
    if args is None or any(l.setting.startswith("loss_scale") for l in conversion.losses):
        return
    native = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(1.0), **args)
    assert drive(native, found_infs) == reference(cfg, found_infs)
