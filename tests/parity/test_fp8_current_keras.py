"""FP8 current scaling on Keras (ampbridge's own ``CurrentScalingCall``, on the KERAS_BACKEND this
process runs) against torchao's own functions and the Flax op in the same process: the scales and
float8 bits are ``hp_tensor_to_float8_dynamic``'s, the saturating cast is
``hp_tensor_and_scale_to_float8``'s at any scale, and a ``Dense`` layer's dequantised operands are
bit-equal to torchao's and to Flax's ``CurrentScalingDotGeneral``, its output and gradients equal
theirs up to float32 summation order. (Here: the Keras floors have no torchao.)"""

import math
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ampbridge._testing import require

torch = require("torch")  # first: torch before jax/tensorflow in one process
require("torchao.float8", "the reference of current scaling")

from ampbridge.core.fp8 import amax_of, current_scale  # noqa: E402

from .fp8_torchao import CASES, ML_DTYPES, TORCH_FP8, assert_same_float8, assert_same_scale, torchao_cast  # noqa: E402

keras = require("keras")
from ampbridge.backends.keras.fp8_current import CurrentScalingCall, qdq, quantize, scale_of  # noqa: E402

ops = keras.ops
BACKEND = keras.backend.backend()
EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 30


def ours(x, fmt, margin=0, scale=None):
    t = ops.convert_to_tensor(np.array(x, np.float32))
    s = scale_of(t, fmt, margin) if scale is None else np.float32(scale)
    f8 = ops.convert_to_numpy(ops.cast(quantize(t, s, fmt), "float32")).astype(getattr(__import__("ml_dtypes"),
                                                                                     ML_DTYPES[fmt]))
    return np.asarray(ops.convert_to_numpy(s), np.float32), f8.view(np.uint8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("x", [x for _, x in CASES], ids=[name for name, _ in CASES])
def test_scale_and_float8_bits_are_torchaos(x, fmt):
    want_scale, want_bits = torchao_cast(x, fmt)
    got_scale, got_bits = ours(x, fmt)
    assert_same_scale(got_scale, want_scale)
    assert_same_float8(got_bits, want_bits, fmt)


finite = st.floats(-3.4028234663852886e38, 3.4028234663852886e38, width=32)
values = finite | st.sampled_from([0.0, -0.0, 1e-45, math.inf, -math.inf, math.nan])


@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=values),
       st.sampled_from(["e4m3", "e5m2"]), st.integers(0, 64))
@example(np.float32([0.0]), "e5m2", 3)
def test_the_scale_is_the_reference_and_the_bits_torchaos_over_random_tensors(x, fmt, margin):
    got_scale, got_bits = ours(x, fmt, margin)
    want = current_scale(amax_of(x.ravel().tolist()), fmt, margin, flush_denormals=BACKEND != "torch")
    assert (math.isnan(want) and np.isnan(got_scale)) or float(got_scale) == want
    if margin == 0:  # torchao's own scale: hp_tensor_to_float8_dynamic end to end
        assert_same_float8(got_bits, torchao_cast(x, fmt)[1], fmt)
    elif want == want:  # the margin is ampbridge's: torchao's cast with the reference's scale
        assert_same_float8(got_bits, torchao_cast(x, fmt, want)[1], fmt)


@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=6), elements=values),
       st.floats(2.0 ** -30, 2.0 ** 30, width=32), st.sampled_from(["e4m3", "e5m2"]))
@example(np.float32([1000.0, -1e6, 3.0]), 1.0, "e4m3")  # beyond the format's max: saturated, not NaN/inf
def test_the_cast_saturates_as_torchaos_at_any_scale(x, scale, fmt):
    assert_same_float8(ours(x, fmt, scale=scale)[1], torchao_cast(x, fmt, scale)[1], fmt)


def keras_dense(x, w, g, fmt_in, fmt_grad):
    """A float32 Dense with CurrentScalingCall: output, input gradient (kernel gradient by the backend)."""
    layer = keras.layers.Dense(w.shape[1], use_bias=False)
    layer.build((None, w.shape[0]))
    layer.kernel.assign(w)
    layer.call = CurrentScalingCall(layer, fmt_in, fmt_grad)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
        dx, dw = tape.gradient(y, [xt, layer.kernel.value], output_gradients=tf.constant(g))
        return y.numpy(), dx.numpy(), dw.numpy()
    if BACKEND == "jax":
        import jax

        y, vjp = jax.vjp(lambda k, x: layer.stateless_call([k], [], x)[0], layer.kernel.value, x)
        dw, dx = vjp(jax.numpy.asarray(g))
        return np.asarray(y), np.asarray(dx), np.asarray(dw)
    xt = torch.tensor(x, requires_grad=True)
    y = layer(xt)
    y.backward(torch.tensor(g))
    return y.detach().numpy(), xt.grad.numpy(), layer.kernel.value.grad.numpy()


def flax_dense(x, w, g, fmt_in, fmt_grad):
    jax = require("jax")
    nn = require("flax.linen")
    from ampbridge.backends.jax.fp8_current import CurrentScalingDotGeneral

    layer = nn.Dense(w.shape[1], use_bias=False, dot_general_cls=lambda: CurrentScalingDotGeneral(fmt_in, fmt_grad))
    y, vjp = jax.vjp(lambda p, x: layer.apply(p, x), {"params": {"kernel": jax.numpy.asarray(w)}}, x)
    dp, dx = vjp(jax.numpy.asarray(g))
    return np.asarray(y), np.asarray(dx), np.asarray(dp["params"]["kernel"])


@pytest.mark.parametrize("fmt_in,fmt_grad", [("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_a_dense_layer_is_the_flax_ops_and_torchaos(fmt_in, fmt_grad):
    rng = np.random.default_rng(3)
    x = np.float32(rng.normal(size=(16, 32)) * 3)
    w = np.float32(rng.normal(size=(32, 24)) * 0.2)  # Keras's and Flax's (in, out)
    g = np.float32(rng.normal(size=(16, 24)) * 1e-3)
    got = keras_dense(x, w, g, fmt_in, fmt_grad)
    want = flax_dense(x, w, g, fmt_in, fmt_grad)
    # float32 products of the same float8 values, summed in each framework's order: on the JAX backend
    # the same XLA dots (bit-equal); on the CPU this was written on, TensorFlow and torch gave the
    # output and the kernel gradient bit-equal too, the input gradient within 1e-3 relative where its
    # sum cancels (XLA's transposed dot sums in another order)
    for a, b, name in zip(got, want, ("output", "input gradient", "kernel gradient")):
        if BACKEND == "jax":
            np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8 if name != "output" else 1e-5, err_msg=name)
    # bit-equal: the float32 operands the matmuls multiply, torchao's dequantised float8 (data.float() / scale)
    for v, f in ((x, fmt_in), (w, fmt_in), (g, fmt_grad)):
        scale, data = torchao_cast(v, f)
        want_v = (torch.from_numpy(data).view(TORCH_FP8[f]).float() / torch.from_numpy(scale)).numpy()
        np.testing.assert_array_equal(ops.convert_to_numpy(qdq(ops.convert_to_tensor(v), f)), want_v)
