"""FP8 current scaling on Flax linen (ampbridge's own ``CurrentScalingDotGeneral``) against torchao's
own functions in the same process: the scales and float8 bits are ``hp_tensor_to_float8_dynamic``'s,
the saturating cast is ``hp_tensor_and_scale_to_float8``'s at any scale, and a ``Dense`` layer's
output and gradients equal ``Float8Linear``'s (``emulate=True``) up to float32 summation order, its
dequantised operands bit-equal. (Here, not in tests/backend_jax: the JAX floors have no torchao.)"""

import math
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ampbridge._testing import require

torch = require("torch")  # first: torch before jax in one process
require("torchao.float8", "the reference of current scaling")
from torchao.float8 import CastConfig, Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from ampbridge.core.fp8 import amax_of, current_scale  # noqa: E402

from .fp8_torchao import CASES, TORCH_FP8, assert_same_float8, assert_same_scale, torchao_cast  # noqa: E402

jax = require("jax")
require("flax")
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402

from ampbridge.backends.jax.fp8_current import CurrentScalingDotGeneral, qdq, quantize, scale_of  # noqa: E402

EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 30


def ours(x, fmt, margin=0):
    s = scale_of(jnp.asarray(x), fmt, margin)
    return np.asarray(s), np.asarray(quantize(jnp.asarray(x), s, fmt)).view(np.uint8)


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
@example(np.float32([1e38]), "e4m3", 10)  # the margin makes the scale subnormal: XLA's 0
@example(np.float32([0.0]), "e5m2", 3)
def test_the_scale_is_the_reference_and_the_bits_torchaos_over_random_tensors(x, fmt, margin):
    got_scale, got_bits = ours(x, fmt, margin)
    want = current_scale(amax_of(x.ravel().tolist()), fmt, margin)
    assert (math.isnan(want) and np.isnan(got_scale)) or float(got_scale) == want
    if margin == 0:  # torchao's own scale: hp_tensor_to_float8_dynamic end to end
        assert_same_float8(got_bits, torchao_cast(x, fmt)[1], fmt)
    else:  # the margin is ampbridge's: torchao's cast with the reference's scale
        assert_same_float8(got_bits, torchao_cast(x, fmt, want)[1], fmt)


@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=6), elements=values),
       st.floats(2.0 ** -30, 2.0 ** 30, width=32), st.sampled_from(["e4m3", "e5m2"]))
@example(np.float32([1000.0, -1e6, 3.0]), 1.0, "e4m3")  # beyond the format's max: saturated, not NaN/inf
def test_the_cast_saturates_as_torchaos_at_any_scale(x, scale, fmt):
    got = np.asarray(quantize(jnp.asarray(x), jnp.float32(scale), fmt)).view(np.uint8)
    assert_same_float8(got, torchao_cast(x, fmt, scale)[1], fmt)


def torchao_linear(x, w, g, fmt_in, fmt_grad):
    """Float8Linear (emulate=True, float32): output, input gradient, weight gradient."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    casts = {f"cast_config_{k}": CastConfig(target_dtype=TORCH_FP8[f])
             for k, f in (("input", fmt_in), ("weight", fmt_in), ("grad_output", fmt_grad))}
    layer = Float8Linear.from_float(layer, config=Float8LinearConfig(**casts, emulate=True))
    xt = torch.from_numpy(x).requires_grad_(True)
    y = layer(xt)
    y.backward(torch.from_numpy(g))
    return y.detach().numpy(), xt.grad.numpy(), layer.weight.grad.numpy().T


@pytest.mark.parametrize("fmt_in,fmt_grad", [("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e4m3", "e4m3")])
def test_a_dense_layer_is_torchaos_float8_linear(fmt_in, fmt_grad):
    rng = np.random.default_rng(3)
    x = np.float32(rng.normal(size=(16, 32)) * 3)
    w = np.float32(rng.normal(size=(24, 32)) * 0.2)  # torch's (out, in)
    g = np.float32(rng.normal(size=(16, 24)) * 1e-3)
    layer = nn.Dense(24, use_bias=False, dot_general_cls=lambda: CurrentScalingDotGeneral(fmt_in, fmt_grad))
    params = {"params": {"kernel": jnp.asarray(w.T)}}
    y, vjp = jax.vjp(lambda p, x: layer.apply(p, x), params, jnp.asarray(x))
    dp, dx = vjp(jnp.asarray(g))
    want_y, want_dx, want_dw = torchao_linear(x, w, g, fmt_in, fmt_grad)
    # float32 products of the same float8 values: XLA and torch.mm may sum them in another order (on
    # the CPU this was written on, the output and the kernel gradient came out bit-equal and the input
    # gradient, XLA's transposed dot, within 2.4e-5 relative where the sum cancels)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=2e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-6, atol=1e-8)
    np.testing.assert_allclose(np.asarray(dp["params"]["kernel"]), want_dw, rtol=2e-6, atol=1e-8)
    # what is bit-equal: the float32 operands both dots multiply, torchao's dequantised float8
    for v, f in ((x, fmt_in), (w.T, fmt_in), (g, fmt_grad)):
        scale, data = torchao_cast(v, f)
        # the operand of its emulated mm: data.float() / scale
        want = torch.from_numpy(data).view(TORCH_FP8[f]).float() / torch.from_numpy(scale)
        np.testing.assert_array_equal(np.asarray(qdq(jnp.asarray(v), f)), want.numpy())


def test_bfloat16_operands_dequantise_to_float32_as_torchaos():
    """bfloat16 Float8Linear and Dense(dtype=bfloat16), one output feature: the input gradient is one
    float32 product of the dequantised gradient and weight per element, rounded to bfloat16 once."""
    rng = np.random.default_rng(5)
    x, w, g = (rng.normal(size=s) * f for s, f in (((8, 16), 3.0), ((1, 16), 0.2), ((8, 1), 1e-3)))
    bf = lambda a: torch.from_numpy(np.float32(a)).bfloat16()  # noqa: E731
    layer = Float8Linear.from_float(torch.nn.Linear(16, 1, bias=False),
                                    config=Float8LinearConfig(emulate=True))
    with torch.no_grad():
        layer.weight.copy_(bf(w).float())
    layer = layer.bfloat16()
    xt = bf(x).requires_grad_(True)
    layer(xt).backward(bf(g))
    dense = nn.Dense(1, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                     dot_general_cls=CurrentScalingDotGeneral)
    params = {"params": {"kernel": jnp.asarray(bf(w).float().numpy().T, jnp.bfloat16)}}
    xj = jnp.asarray(bf(x).float().numpy(), jnp.bfloat16)
    _, vjp = jax.vjp(lambda p, x: dense.apply(p, x), params, xj)
    _, dx = vjp(jnp.asarray(bf(g).float().numpy(), jnp.bfloat16))
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx.astype(jnp.float32)), xt.grad.float().numpy())
