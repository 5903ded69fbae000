"""FP8 current scaling on Flax linen (ampbridge's own ``CurrentScalingDotGeneral``: Flax has none):
its scale is ``core.fp8.current_scale`` over random tensors and margins, and ``[fp8] scaling =
"current"`` trains bit-identical to the same model written by hand with the op as
``dot_general_cls``. Against torchao's own functions: tests/parity/test_fp8_current_torchao.py."""

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

jax = require("jax")
require("flax")
optax = require("optax")
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402

import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.fp8_current import CurrentScalingDotGeneral, scale_of  # noqa: E402

from .test_fp8 import batches, train  # noqa: E402

EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 30
finite = st.floats(-3.4028234663852886e38, 3.4028234663852886e38, width=32)
values = finite | st.sampled_from([0.0, -0.0, 1e-45, 1e-12, 1.5e-12, math.inf, -math.inf, math.nan])


@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=values),
       st.sampled_from(["e4m3", "e5m2"]), st.integers(0, 64))
@example(np.float32([1e38]), "e4m3", 10)  # the margin makes the scale subnormal: XLA's 0
@example(np.float32([0.0]), "e5m2", 3)
def test_the_scale_is_the_reference_over_random_tensors(x, fmt, margin):
    got = np.asarray(scale_of(jnp.asarray(x), fmt, margin))
    want = current_scale(amax_of(x.ravel().tolist()), fmt, margin)
    assert (math.isnan(want) and np.isnan(got)) or float(got) == want


class Net(nn.Module):
    op: object = None  # the hand-written model's dot_general_cls
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(48, dtype=self.dtype, dot_general_cls=self.op, name="fc1")(x))
        x = nn.relu(nn.Dense(32, dtype=self.dtype, dot_general_cls=self.op, name="fc2")(x))
        return nn.Dense(16, dtype=self.dtype, dot_general_cls=self.op, name="head")(x)


@pytest.mark.parametrize("fp8", [
    Fp8Config(("kind:linear",), scaling="current"),
    Fp8Config(("kind:linear",), forward="e5m2", backward="e4m3", scaling="current", margin=3),
], ids=["e4m3-e5m2", "e5m2-e4m3-margin3"])
def test_current_scaling_trains_bit_identical_to_the_op_written_by_hand(fp8):
    x = jnp.zeros((16, 32))
    hand = Net(op=lambda: CurrentScalingDotGeneral(fp8.forward, fp8.backward, fp8.margin), dtype=jnp.bfloat16)
    params = jax.jit(hand.init)(jax.random.key(0), x)
    assert set(params) == {"params"}  # stateless: no fp8 collection to checkpoint
    amp = abj.apply(Net(), Policy(compute_dtype="bfloat16", fp8=fp8))
    assert jax.tree.structure(jax.eval_shape(amp.init, jax.random.key(0), x)) == jax.tree.structure(params)
    want_params, want = train(hand.apply, params, batches(4))
    got_params, got = train(amp.apply, params, batches(4))
    assert got == want and all(math.isfinite(v) for v in got)
    for a, b, p in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(np.asarray(a), np.asarray(p))  # it trains
    assert amp.plan(x)["fc2"].fp8_by == "ampbridge current scaling (emulated)"


def test_margin_and_formats_reach_the_op():
    x = jnp.float32(np.random.default_rng(2).normal(size=(16, 32)))
    params = jax.jit(Net().init)(jax.random.key(0), x)
    outs = {"off": np.asarray(jax.jit(Net().apply)(params, x))}
    for key, fp8 in {"default": Fp8Config(("fc1",), scaling="current"),
                     "margin": Fp8Config(("fc1",), scaling="current", margin=4),
                     "e5m2": Fp8Config(("fc1",), scaling="current", forward="e5m2")}.items():
        amp = abj.apply(Net(), Policy(fp8=fp8))
        outs[key] = np.asarray(jax.jit(amp.apply)(params, x))
    assert not np.array_equal(outs["default"], outs["off"])  # float8 rounding is in the output
    assert not np.array_equal(outs["default"], outs["e5m2"])
    assert not np.array_equal(outs["default"], outs["margin"])


def test_a_matched_module_without_dot_general_cls_is_still_refused():
    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(4, (3,), name="conv")(x)

    with pytest.raises(ampbridge.UnsupportedOptionError, match="Flax's fp8_ops replace"):
        abj.apply(Conv(), Policy(fp8=Fp8Config(("conv",), scaling="current"))).init(
            jax.random.key(0), jnp.zeros((1, 8, 2)))
