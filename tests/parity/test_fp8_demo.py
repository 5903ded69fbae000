"""The demo model in FP8 (delayed scaling) in every framework that realises it, through the demo's own
runners: the float8 scale of ``block.attn.query``'s input moves off its initial 1 and is identical,
step for step, across the frameworks (the amax history's max is the data's first amax here)."""

from __future__ import annotations

import math

from ampbridge._testing import require

for _name in ("keras", "jax", "flax", "optax", "numpy"):
    require(_name)

from ampbridge import Policy  # noqa: E402
from ampbridge.cli.demo.runners import FP8_ROW, RUNNERS  # noqa: E402
from ampbridge.core.policy import Fp8Config  # noqa: E402

POLICY = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "kind:embedding"),
                fp8=Fp8Config(match=("kind:linear",), amax_history=16))
STEPS = 5


def test_the_demo_model_in_fp8_has_the_same_scale_trajectory_in_keras_and_flax():
    runs = {fw: RUNNERS[fw](POLICY, STEPS, (2,)) for fw in ("keras", "jax")}
    keras_scales, flax_scales = runs["keras"].fp8_divisors, runs["jax"].fp8_divisors
    assert len(keras_scales) == len(flax_scales) == STEPS
    assert keras_scales == flax_scales, (FP8_ROW, keras_scales, flax_scales)
    # the scale moved: the history recorded the amax (a float8 layer called without training=True keeps 1
    # under TensorFlow and torch, and stores 0 under JAX)
    assert keras_scales[0] == 1.0 and 0 < keras_scales[-1] < 1.0
    for run in runs.values():
        assert all(math.isfinite(x) for i, x in enumerate(run.losses) if i != 2)
        assert run.losses[-1] < run.losses[0]
