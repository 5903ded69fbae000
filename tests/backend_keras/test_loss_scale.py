"""ampbridge.keras.optimizer: the reference loss-scale algorithm, in fit and custom loops."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge import LossScaleConfig, LossScaleState, trajectory  # noqa: E402

L = keras.layers
BACKEND = keras.backend.backend()
MIXED = ampbridge.preset("mixed_float16")

# settings Keras's own LossScaleOptimizer cannot express
ODD = LossScaleConfig(mode="dynamic", initial_scale=4.0, growth_factor=3.0, backoff_factor=0.25,
                      growth_interval=2, hysteresis=2, min_scale=1.0, max_scale=100.0)
ODD_FOUND_INF = [False] * 4 + [True, True] + [False] * 6 + [True] * 6 + [False] * 3 + [True, False]


def with_loss_scale(cfg, policy=MIXED):
    return policy.replace(loss_scale=cfg)


def small_model(kx, seed=0):
    kx.seed(seed)
    return keras.Sequential([keras.Input((4,)), L.Dense(8, activation="relu", name="a"),
                             L.LayerNormalization(name="norm"), L.Dense(1, name="head")], name="small")


def regression(n, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, 4).astype("float32"), rng.randn(n, 1).astype("float32")


def injected(found_inf, batch):
    """Sample weights making exactly the chosen batches' gradients non-finite."""
    return np.repeat(np.where(found_inf, np.inf, 1.0), batch).astype("float32")


def state_of(opt, values):
    """The LossScaleState held in a list of optimizer variable values (stateless use)."""
    index = {id(v): i for i, v in enumerate(opt.variables)}
    good, scale, hyst, steps, skipped, _, streak = (
        float(np.asarray(keras.ops.convert_to_numpy(values[index[id(v)]]))) for v in opt._state_variables)
    return LossScaleState(scale, int(good), int(hyst), int(steps), int(skipped), int(streak))


def test_fit_parity_with_native_keras(kx):
    """30 fit steps of the toy transformer: ampbridge == hand-written Keras mixed precision, bit for bit."""
    found_inf = [False] * 30
    found_inf[7] = found_inf[19] = True
    x, y = kx.tokens(120)
    w = injected(found_inf, 4)
    # attention dropout (seeded alike) keeps MultiHeadAttention on its explicit einsum path: XLA:CPU
    # cannot compile the fused float16 attention (a Keras/XLA limitation, native models too)
    run = {}

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        kx.seed(0)
        native = kx.transformer(native=True, dropout=0.1)
    finally:
        keras.config.set_dtype_policy(previous)
    native.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0 ** 15,
                                                       dynamic_growth_steps=5),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True), **run)

    kx.seed(0)
    model = kx.transformer(dropout=0.1)
    model.set_weights(native.get_weights())
    policy = MIXED.replace(keep_float32=("kind:norm", "kind:embedding"),
                           loss_scale=LossScaleConfig(initial_scale=2.0 ** 15, growth_interval=5))
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.Adam(1e-3), policy)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), **run)

    fit = dict(batch_size=4, epochs=1, shuffle=False, verbose=0, sample_weight=w)
    h_native = native.fit(x, y, **fit).history["loss"]
    h_amp = model.fit(x, y, **fit).history["loss"]

    kx.assert_bitwise(native.weights, model.weights, "weights")
    kx.assert_bitwise(native.optimizer.inner_optimizer.variables, opt.inner_optimizer.variables, "Adam state")
    assert kx.numpy(native.optimizer.dynamic_scale) == np.float32(opt.state.scale)
    assert h_native == h_amp
    assert opt.state.steps == 30 and opt.state.skipped >= 2
    assert int(kx.numpy(opt.iterations)) == 30 - opt.state.skipped


def test_fit_trajectory_equals_reference(kx):
    model = small_model(kx)
    policy = with_loss_scale(ODD)
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.SGD(0.01), policy)
    model.compile(opt, "mse")
    x, y = regression(2 * len(ODD_FOUND_INF))
    log = kx.StateLog()
    model.fit(x, y, sample_weight=injected(ODD_FOUND_INF, 2), batch_size=2, shuffle=False, verbose=0,
              callbacks=[log])
    assert log.states == trajectory(ODD, ODD_FOUND_INF)
    assert int(kx.numpy(opt.iterations)) == ODD_FOUND_INF.count(False)


CONFIGS = {
    "odd": ODD,
    "consecutive": ODD.replace(consecutive_hysteresis=True, hysteresis=3, min_scale=None, max_scale=None),
    "growth_1.1": LossScaleConfig(mode="dynamic", initial_scale=3.0, growth_factor=1.1, backoff_factor=0.3,
                                  growth_interval=1),
    "grow_to_inf": LossScaleConfig(mode="dynamic", initial_scale=3e38, growth_interval=1),
    "static": LossScaleConfig(mode="static", initial_scale=8.0),
    "none": LossScaleConfig(mode="none"),
    "no_skip": ODD.replace(skip_nonfinite=False),
    # DeepSpeed >= 0.17.1's growth timing; optax's apply_if_finite(inner, 2)
    "first_growth_later": ODD.replace(first_growth_interval=3),
    "max_skips_2": ODD.replace(max_consecutive_skips=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_apply_trajectory_equals_reference(kx, name):
    cfg = CONFIGS[name]
    opt = ak.optimizer(keras.optimizers.SGD(0.5), with_loss_scale(cfg))
    var = keras.Variable(np.ones(3, "float32"))
    states, finite_values = [], []
    reference = ampbridge.LossScaler(cfg)
    for found_inf in ODD_FOUND_INF:
        grad = np.full(3, np.inf if found_inf else 0.25, "float32")
        before = kx.numpy(var).copy()
        opt.apply([keras.ops.convert_to_tensor(grad)], [var])
        states.append(opt.state)
        applied = reference.update(found_inf)
        if not applied:
            np.testing.assert_array_equal(kx.numpy(var), before)
        elif found_inf and cfg.max_consecutive_skips is not None:  # applied anyway: the inf update landed
            assert not np.isfinite(kx.numpy(var)).all()
            var.assign(np.ones(3, "float32"))
        finite_values.append(kx.numpy(var).copy())
    assert states == trajectory(cfg, ODD_FOUND_INF)
    if not cfg.skip_nonfinite:
        assert not np.isfinite(finite_values[-1]).all()


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit of stateless_apply")
def test_jitted_stateless_apply_trajectory(kx):
    import jax

    opt = ak.optimizer(keras.optimizers.Adam(0.1), with_loss_scale(ODD))
    var = keras.Variable(np.ones(3, "float32"))
    opt.build([var])
    step = jax.jit(opt.stateless_apply)
    opt_values, weights = [v.value for v in opt.variables], [var.value]
    states = []
    for found_inf in ODD_FOUND_INF:
        grad = jax.numpy.full(3, np.inf if found_inf else 0.25, "float32")
        new_weights, new_values = step(opt_values, [grad], weights)
        if found_inf:  # a skipped step returns the inputs bit for bit
            kx.assert_bitwise(weights, new_weights, "weights")
            kx.assert_bitwise(opt_values[len(opt._variables):], new_values[len(opt._variables):], "Adam state")
        weights, opt_values = new_weights, new_values
        states.append(state_of(opt, opt_values))
    assert states == trajectory(ODD, ODD_FOUND_INF)


def test_scale_loss_custom_loop(kx):
    """The native custom-loop recipe: scale_loss, gradients, apply (the optimizer unscales)."""
    policy = with_loss_scale(LossScaleConfig(mode="static", initial_scale=1024.0))
    opt = ak.optimizer(keras.optimizers.SGD(0.1), policy)
    assert float(kx.numpy(opt.scale_loss(keras.ops.convert_to_tensor(2.0)))) == 2048.0
    none = ak.optimizer(keras.optimizers.SGD(0.1), ampbridge.preset("float32"))
    assert none.loss_scale_config.mode == "none"
    loss = keras.ops.convert_to_tensor(3.0)
    assert none.scale_loss(loss) is loss


def test_skipped_fit_step_is_bit_identical(kx):
    model = small_model(kx)
    policy = with_loss_scale(LossScaleConfig(initial_scale=16.0, growth_interval=1))
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.Adam(1e-2), policy)
    model.compile(opt, "mse")
    x, y = regression(6)
    model.fit(x[:4], y[:4], batch_size=2, shuffle=False, verbose=0)
    weights = [kx.numpy(v).copy() for v in model.weights]
    inner = [kx.numpy(v).copy() for v in opt.inner_optimizer.variables]
    before = opt.state
    model.fit(x[4:], y[4:], sample_weight=np.full(2, np.inf, "float32"), batch_size=2, verbose=0)
    kx.assert_bitwise(weights, model.weights, "weights")
    kx.assert_bitwise(inner, opt.inner_optimizer.variables, "Adam state")
    assert opt.state == LossScaleState(before.scale / 2, 0, 1, before.steps + 1, before.skipped + 1)


MIN_ERROR = LossScaleConfig(mode="dynamic", initial_scale=2.0, min_scale=1.0, on_min_scale="error")


def test_on_min_scale_error_and_warn_in_custom_loop(kx):
    opt = ak.optimizer(keras.optimizers.SGD(0.1), with_loss_scale(MIN_ERROR))
    var = keras.Variable(np.ones(2, "float32"))
    inf = keras.ops.convert_to_tensor(np.full(2, np.inf, "float32"))
    opt.apply([inf], [var])
    assert opt.state.scale == 1.0
    with pytest.raises(ampbridge.LossScaleError, match="min_scale=1.0"):
        opt.apply([inf], [var])
    assert opt.state == LossScaleState(1.0, 0, 1, 1, 1)  # raised before changing anything, like the reference

    warn = ak.optimizer(keras.optimizers.SGD(0.1), with_loss_scale(MIN_ERROR.replace(on_min_scale="warn")))
    with pytest.warns(ampbridge.AmpBridgeWarning, match="min_scale"):
        for _ in range(3):
            warn.apply([inf], [var])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn.apply([inf], [var])  # once only
    assert warn.state == trajectory(MIN_ERROR.replace(on_min_scale="warn"), [True] * 4)[-1]


def test_on_min_scale_error_in_fit(kx):
    x, y = regression(8)
    w = injected([False, True, True, False], 2)
    for callbacks in ([], [ak.LossScaleCallback()]):
        model = small_model(kx)
        policy = with_loss_scale(MIN_ERROR)
        ak.apply(model, policy)
        model.compile(ak.optimizer(keras.optimizers.SGD(0.01), policy), "mse")
        compiled = BACKEND != "torch"
        if compiled and not callbacks:
            with pytest.raises(ampbridge.UnsupportedOptionError, match="LossScaleCallback"):
                model.fit(x, y, sample_weight=w, batch_size=2, shuffle=False, verbose=0)
            continue
        with pytest.raises(ampbridge.LossScaleError):
            model.fit(x, y, sample_weight=w, batch_size=2, shuffle=False, verbose=0, callbacks=callbacks)


def _trained(kx, epochs, found_inf):
    model = small_model(kx)
    policy = MIXED.replace(keep_float32=("kind:norm",), loss_scale=LossScaleConfig(initial_scale=256.0,
                                                                                   growth_interval=2))
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.Adam(1e-2), policy), "mse")
    x, y = regression(2 * len(found_inf))
    fit = dict(sample_weight=injected(found_inf, 2), batch_size=2, shuffle=False, verbose=0)
    if epochs:
        model.fit(x, y, epochs=epochs, **fit)
    return model, policy, (x, y), fit


FOUND = [False, True, False, False, False]


def test_save_load_continue_equals_uninterrupted(kx, tmp_path):
    straight, _, (x, y), fit = _trained(kx, 3, FOUND)

    model, policy, _, _ = _trained(kx, 1, FOUND)
    model.save(tmp_path / "run.keras")
    saved_state = model.optimizer.state
    resumed = ak.load_model(tmp_path / "run.keras")
    assert isinstance(resumed.optimizer, ak.LossScaleOptimizer) and resumed.optimizer.state == saved_state
    assert resumed.optimizer.loss_scale_config == model.optimizer.loss_scale_config
    resumed.fit(x, y, epochs=2, **fit)

    kx.assert_bitwise(straight.weights, resumed.weights, "weights")
    kx.assert_bitwise(straight.optimizer.variables, resumed.optimizer.variables, "optimizer variables")
    assert straight.optimizer.state == resumed.optimizer.state
    assert straight.optimizer.state.skipped == 3


def test_weights_checkpoint_carries_loss_scale_state(kx, tmp_path):
    straight, _, (x, y), fit = _trained(kx, 3, FOUND)
    model, _, _, _ = _trained(kx, 1, FOUND)
    model.save_weights(tmp_path / "ckpt.weights.h5")

    fresh, _, _, _ = _trained(kx, 0, FOUND)
    fresh.optimizer.build(fresh.trainable_variables)  # Keras loads optimizer variables into a built optimizer
    fresh.load_weights(tmp_path / "ckpt.weights.h5")
    assert fresh.optimizer.state == model.optimizer.state and fresh.optimizer.state.steps == 5
    fresh.fit(x, y, epochs=2, **fit)
    kx.assert_bitwise(straight.weights, fresh.weights, "weights")
    assert straight.optimizer.state == fresh.optimizer.state


def test_config_round_trip_and_bad_input():
    opt = ak.optimizer(keras.optimizers.Adam(3e-4), with_loss_scale(ODD))
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, ak.LossScaleOptimizer) and clone.loss_scale_config == ODD
    assert clone.policy == opt.policy and float(clone.inner_optimizer.learning_rate) == pytest.approx(3e-4)
    with pytest.raises(TypeError, match="already scales the loss"):
        ak.optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), MIXED)
    assert ak.optimizer("adam", MIXED).loss_scale_config.mode == "dynamic"
    assert ak.optimizer("adam", ampbridge.preset("mixed_bfloat16")).loss_scale_config.mode == "none"


def _custom_step(model, opt, loss_fn, x, y, poison):
    """One step of each backend's hand-written loop: scale_loss, gradients, apply."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) * poison
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
    elif BACKEND == "torch":
        import torch

        model.zero_grad()
        loss = loss_fn(y, model(x, training=True)) * poison
        opt.scale_loss(loss).backward()
        with torch.no_grad():
            opt.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
    else:
        import jax

        def scaled_loss(trainable, non_trainable, opt_values, poison):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            with keras.StatelessScope(state_mapping=list(zip(opt.variables, opt_values))):
                return opt.scale_loss(loss_fn(y, y_pred) * poison), non_trainable

        if not hasattr(opt, "_test_steps"):  # compiled once, as a real loop would
            opt._test_steps = (jax.jit(jax.grad(scaled_loss, has_aux=True)), jax.jit(opt.stateless_apply))
        grad_fn, apply_fn = opt._test_steps
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        opt_values = [v.value for v in opt.variables]
        grads, _ = grad_fn(trainable, non_trainable, opt_values, poison)
        trainable, opt_values = apply_fn(opt_values, grads, trainable)
        for v, value in zip(model.trainable_variables, trainable):
            v.assign(value)
        for v, value in zip(opt.variables, opt_values):
            v.assign(value)


def test_custom_training_loop(kx):
    model = small_model(kx)
    policy = with_loss_scale(ODD)
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.SGD(0.05), policy)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    x, y = regression(8)
    start = float(kx.numpy(loss_fn(y, model(x))))
    states = []
    for found_inf in ODD_FOUND_INF:
        _custom_step(model, opt, loss_fn, x, y, np.float32(np.inf if found_inf else 1.0))
        states.append(opt.state)
    assert states == trajectory(ODD, ODD_FOUND_INF)
    assert all(np.isfinite(kx.numpy(v)).all() for v in model.weights)
    assert float(kx.numpy(loss_fn(y, model(x)))) < start


def _sgd_steps(opt, scales_seen):
    """Two SGD(0.01) steps of one float32 (3,) leaf through ``opt`` (on JAX its jitted
    ``stateless_apply``, as ``fit`` runs it); per step the leaf's bits and the scale after it."""
    v = keras.Variable(np.float32([0.5, -0.25, 0.875]), name="leaf")
    opt.build([v])
    grads = [np.float32([12.0, -40.0, 28.0]), np.float32([-36.0, 20.0, 4.0])]
    out = []
    if BACKEND == "jax":
        import jax

        step, values, weights = jax.jit(opt.stateless_apply), [x.value for x in opt.variables], [v.value]
    for g in grads:
        if BACKEND == "jax":
            weights, values = step(values, [keras.ops.convert_to_tensor(g)], weights)
            at = next(i for i, x in enumerate(opt.variables) if x is opt.dynamic_scale)
            leaf, scale = weights[0], values[at]
        else:
            opt.apply([keras.ops.convert_to_tensor(g)], [v])
            leaf, scale = v.value, opt.dynamic_scale.value
        out.append((np.asarray(keras.ops.convert_to_numpy(leaf)).view("u4").tolist(),
                    float(np.asarray(keras.ops.convert_to_numpy(scale)))))
    scales_seen.extend(s for _, s in out)
    return out, grads


def test_unscaling_divides_like_native_for_any_scale():
    """One gradient, scale 3 (not a power of two), growing every step: ampbridge's step equals Keras's
    own LossScaleOptimizer bit for bit, and both equal v - lr * (g / scale) (found by the fuzzer on JAX,
    where XLA's CPU simplifier had made ampbridge's division a reciprocal multiply; docs/fuzzing.md)."""
    policy = MIXED.replace(loss_scale=LossScaleConfig(mode="dynamic", initial_scale=3.0, growth_interval=1))
    scales = []
    ours, grads = _sgd_steps(ak.optimizer(keras.optimizers.SGD(0.01), policy), scales)
    native, _ = _sgd_steps(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=3.0,
                                                               dynamic_growth_steps=1), [])
    assert ours == native
    v, scale = np.float32([0.5, -0.25, 0.875]), np.float32(3.0)
    for (bits, _), g in zip(ours, grads):
        v = v - np.float32(0.01) * (g / scale)
        scale = scale * np.float32(2.0)
        assert bits == v.view("u4").tolist()
    assert scales == [6.0, 12.0]
