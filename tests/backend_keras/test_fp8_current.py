"""FP8 current scaling on Keras (each backend; ampbridge's own ``CurrentScalingCall``: Keras has none):
its scale is ``core.fp8.current_scale`` over random tensors and margins, the cast saturates, the
output gradient is quantized in the ``backward`` format, and a model with ``[fp8] scaling =
"current"`` trains with no new variables. Against torchao and the Flax op:
tests/parity/test_fp8_current_keras.py."""

import math
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ampbridge
from ampbridge import Fp8Config, Policy
from ampbridge._testing import require
from ampbridge.core.fp8 import amax_of, current_scale

keras = require("keras")
import ampbridge.keras as ak  # noqa: E402
from ampbridge.backends.keras.fp8_current import CurrentScalingCall, qdq, quantize, scale_of  # noqa: E402

L, ops = keras.layers, keras.ops
BACKEND = keras.backend.backend()
EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 30
finite = st.floats(-3.4028234663852886e38, 3.4028234663852886e38, width=32)
values = finite | st.sampled_from([0.0, -0.0, 1e-45, 1e-12, 1.5e-12, math.inf, -math.inf, math.nan])
CURRENT = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), scaling="current"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=values),
       st.sampled_from(["e4m3", "e5m2"]), st.integers(0, 64))
@example(np.float32([1e38]), "e4m3", 10)  # the margin makes the scale subnormal
@example(np.float32([0.0]), "e5m2", 3)
@example(np.float32([1e-13, -5e-14]), "e4m3", 0)  # below torchao's 1e-12 floor
def test_the_scale_is_the_reference_over_random_tensors(x, fmt, margin):
    got = ops.convert_to_numpy(scale_of(ops.convert_to_tensor(x), fmt, margin))
    # XLA and TensorFlow compute float32 with subnormals as zero, torch with them
    want = current_scale(amax_of(x.ravel().tolist()), fmt, margin, flush_denormals=BACKEND != "torch")
    assert (math.isnan(want) and np.isnan(got)) or float(got) == want


def test_the_cast_saturates_at_the_formats_max():
    x = ops.convert_to_tensor(np.float32([1000.0, -1e6, 3.0, 500.0]))
    got = ops.convert_to_numpy(ops.cast(quantize(x, np.float32(1.0), "e4m3"), "float32"))
    np.testing.assert_array_equal(got, [448.0, -448.0, 3.0, 448.0])
    got = ops.convert_to_numpy(ops.cast(quantize(x, np.float32(100.0), "e5m2"), "float32"))
    np.testing.assert_array_equal(got, [57344.0, -57344.0, 320.0, 49152.0])


def input_gradient(layer, x, g):
    """d(sum(layer(x) * g)) / dx on this Keras backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, x, output_gradients=tf.constant(g)).numpy()
    if BACKEND == "jax":
        import jax

        _, vjp = jax.vjp(layer, jax.numpy.asarray(x))
        return np.asarray(vjp(jax.numpy.asarray(g))[0])
    import torch

    xt = torch.tensor(x, requires_grad=True)
    layer(xt).backward(torch.tensor(g))
    return xt.grad.numpy()


@pytest.mark.parametrize("forward,backward", [("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_the_output_gradient_is_quantized_in_the_backward_format(forward, backward):
    """One output unit: each input-gradient element is one float32 product qdq(g)[i] * qdq(w)[j]."""
    rng = np.random.default_rng(4)
    x, w, g = (np.float32(rng.normal(size=s) * f) for s, f in (((8, 16), 3.0), ((16, 1), 0.2), ((8, 1), 1e-3)))
    layer = L.Dense(1, use_bias=False)
    layer.build((None, 16))
    layer.kernel.assign(w)
    layer.call = CurrentScalingCall(layer, forward, backward)
    got = input_gradient(layer, x, g)
    q = lambda v, f: ops.convert_to_numpy(qdq(ops.convert_to_tensor(v), f))  # noqa: E731
    np.testing.assert_array_equal(got, q(g, backward) * q(w, forward).T)
    assert not np.array_equal(got, q(g, forward) * q(w, forward).T)  # the format shows in the bits
    y = ops.convert_to_numpy(layer(x))
    np.testing.assert_allclose(y, q(x, forward) @ q(w, forward), rtol=1e-6, atol=1e-6)


def net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), L.Dense(48, name="fc1"), L.LayerNormalization(name="norm"),
                             L.EinsumDense("ab,bc->ac", 32, bias_axes="c", activation="relu", name="fc2"),
                             L.Dense(16, name="head")])


def mse(y, p):
    return ops.mean(ops.square(ops.cast(p, "float32") - y))


def train(model, n=4):
    rng = np.random.default_rng(1)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=mse)
    return [float(model.train_on_batch(np.float32(rng.normal(size=(16, 32)) * 3),
                                       np.float32(rng.normal(size=(16, 16))))) for _ in range(n)]


def test_current_scaling_trains_with_no_new_variables_and_equals_the_call_set_by_hand(tmp_path):
    model = ak.apply(net(), CURRENT)
    start = [ops.convert_to_numpy(v) for v in model.weights]
    names = lambda m: [v.path.split("/", 1)[1] for v in m.weights]  # noqa: E731
    assert names(model) == names(net())  # stateless: nothing to checkpoint
    plan = ak.plan(model, CURRENT)
    assert plan["fc2"].fp8_by == "ampbridge current scaling (emulated)" and not plan["norm"].fp8
    assert all(isinstance(model.get_layer(n).__dict__.get("call"), CurrentScalingCall) for n in ("fc1", "fc2", "head"))
    hand = net()
    hand = ak.apply(hand, Policy(compute_dtype="bfloat16"))
    for name in ("fc1", "fc2", "head"):
        hand.get_layer(name).call = CurrentScalingCall(hand.get_layer(name), "e4m3", "e5m2")
    got, want = train(model), train(hand)
    assert got == want and all(math.isfinite(v) for v in got)
    for a, b, s in zip(model.weights, hand.weights, start):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
        assert not np.array_equal(ops.convert_to_numpy(a), s)  # it trains
    model.save(tmp_path / "m.keras")  # saving sees Keras's own Dense: reload, apply again
    again = ak.apply(keras.saving.load_model(tmp_path / "m.keras", compile=False), CURRENT)
    x = np.float32(np.random.default_rng(2).normal(size=(4, 32)))
    np.testing.assert_array_equal(ops.convert_to_numpy(again(x)), ops.convert_to_numpy(model(x)))


def test_settings_reach_the_call_and_a_policy_without_fp8_takes_it_away():
    model = net()
    x = np.float32(np.random.default_rng(2).normal(size=(16, 32)))
    outs = {"off": ops.convert_to_numpy(model(x))}
    for key, fp8 in {"default": Fp8Config(("fc1",), scaling="current"),
                     "margin": Fp8Config(("fc1",), scaling="current", margin=8),
                     "e5m2": Fp8Config(("fc1",), scaling="current", forward="e5m2")}.items():
        outs[key] = ops.convert_to_numpy(ak.apply(model, Policy(fp8=fp8))(x))
    assert not np.array_equal(outs["default"], outs["off"])  # float8 rounding is in the output
    assert not np.array_equal(outs["default"], outs["e5m2"])
    assert not np.array_equal(outs["default"], outs["margin"])
    np.testing.assert_array_equal(ops.convert_to_numpy(ak.apply(model, Policy())(x)), outs["off"])
    assert "call" not in model.get_layer("fc1").__dict__


def test_what_current_scaling_cannot_carry_is_refused_by_name():
    class MyDense(L.Dense):
        def call(self, inputs):
            return super().call(inputs) * 2

    model = keras.Sequential([keras.Input((4,)), MyDense(3, name="mine"), L.Dense(2, name="head")])
    with pytest.raises(ampbridge.UnsupportedOptionError, match="'mine' .*current scaling replaces the call of Keras"):
        ak.apply(model, Policy(fp8=Fp8Config(("mine",), scaling="current")))
    with pytest.raises(ampbridge.UnsupportedOptionError, match="'norm' .*current scaling replaces the call of Keras"):
        ak.apply(net(), Policy(fp8=Fp8Config(("norm",), scaling="current")))
    model = net()
    model.get_layer("head").quantize("float8")
    with pytest.raises(ampbridge.UnsupportedOptionError, match="'head', which is float8-quantized"):
        ak.apply(model, Policy(fp8=Fp8Config(("head",), scaling="current")))
    model = net()
    model.get_layer("head").quantize("int8")  # it would run Keras's quantized_call, never this call
    with pytest.raises(ampbridge.UnsupportedOptionError, match="'head', which is int8-quantized"):
        ak.apply(model, Policy(fp8=Fp8Config(("head",), scaling="current")))


def test_a_phase_turns_current_scaling_on_mid_training():
    policy = ampbridge.loads("""
[[phase]]
until_step = 2
[[phase]]
[phase.fp8]
match = ["kind:linear"]
scaling = "current"
""")
    rng = np.random.default_rng(1)
    x, y = np.float32(rng.normal(size=(64, 32)) * 3), np.float32(rng.normal(size=(64, 16)))
    model = ak.apply(net(), policy)
    assert "call" not in model.get_layer("fc1").__dict__
    model.compile(optimizer=ak.optimizer(keras.optimizers.SGD(0.05), policy), loss=mse)
    phases = ak.PhaseCallback(policy)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[phases])
    assert phases.switches == [(0, 0), (2, 1)]
    assert isinstance(model.get_layer("fc1").__dict__.get("call"), CurrentScalingCall)
    hand = net()  # the same by hand: two plain steps, then the call set on the float8 layers
    hand.compile(optimizer=keras.optimizers.SGD(0.05), loss=mse)
    for i in range(4):
        if i == 2:
            for name in ("fc1", "fc2", "head"):
                hand.get_layer(name).call = CurrentScalingCall(hand.get_layer(name))
            hand.train_function = None
        hand.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    for a, b in zip(model.weights, hand.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
