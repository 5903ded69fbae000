"""The demo model in FP8 (delayed scaling) in every framework that realises it, through the demo's own
runners: the float8 scale of ``block.attn.query``'s input moves off its initial 1 and is identical,
step for step, in torch (ampbridge's own delayed scaling), Keras (quantize("float8")) and Flax
(fp8_ops); the amax history's max is the first batch's amax here. tf.keras 2 refuses [fp8] by name."""

from __future__ import annotations

import importlib.util
import math

import pytest

from ampbridge._testing import require

for _name in ("torch", "keras", "jax", "flax", "optax", "numpy"):
    require(_name)

from ampbridge import Policy, UnsupportedOptionError  # noqa: E402
from ampbridge.cli.demo.runners import FP8_ROW, RUNNERS  # noqa: E402
from ampbridge.core.policy import Fp8Config  # noqa: E402

POLICY = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "kind:embedding"),
                fp8=Fp8Config(match=("kind:linear",), amax_history=16))
STEPS = 5


def test_the_demo_model_in_fp8_has_the_same_scale_trajectory_in_torch_keras_and_flax():
    runs = {fw: RUNNERS[fw](POLICY, STEPS, (2,)) for fw in ("torch", "keras", "jax")}
    keras_scales, flax_scales = runs["keras"].fp8_divisors, runs["jax"].fp8_divisors
    assert len(keras_scales) == len(flax_scales) == STEPS
    assert keras_scales == flax_scales, (FP8_ROW, keras_scales, flax_scales)
    # torch's operands enter in the autocast dtype, as Keras's and Flax's: the same amaxes
    assert runs["torch"].fp8_divisors == keras_scales, (FP8_ROW, runs["torch"].fp8_divisors, keras_scales)
    # the scale moved: the history recorded the amax (a float8 layer called without training=True keeps 1
    # under TensorFlow and torch, and stores 0 under JAX)
    assert keras_scales[0] == 1.0 and 0 < keras_scales[-1] < 1.0
    for run in runs.values():
        assert all(math.isfinite(x) for i, x in enumerate(run.losses) if i != 2)
        assert run.losses[-1] < run.losses[0]


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed")
def test_tf_keras_refuses_fp8_by_name():
    with pytest.raises(UnsupportedOptionError, match=r"\[fp8\] is not realised on tf.keras 2"):
        RUNNERS["tf_keras"](POLICY, STEPS)
