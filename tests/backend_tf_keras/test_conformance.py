"""The conformance policies (tests/parity/test_conformance.py) on the tf_keras demo model: the loss
scale each step used and the steps skipped are the core reference's, and they are what the Keras 3
run of the same model records; float32 losses follow Keras 3's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ampbridge._testing import require

require("tf_keras")
require("keras")

import ampbridge  # noqa: E402
from ampbridge import LossScaleConfig, UnsupportedOptionError  # noqa: E402
from ampbridge.core.loss_scale import applies, initial_state, next_state  # noqa: E402

STEPS = 12
PINS = ("kind:norm", "kind:embedding")
POLICIES = {
    "float16": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=4)), (3, 7, 8)),
    "keras2_own": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=2.0, growth_interval=3, min_scale=1.0)), (1, 2, 3, 9)),
    "static": (ampbridge.preset("mixed_float16").replace(
        keep_float32=PINS, loss_scale=LossScaleConfig(mode="static", initial_scale=256.0)), (5, 6)),
    "hysteresis": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=256.0,
        max_scale=4096.0)), (4, 9, 10, 11)),
    "bfloat16": (ampbridge.preset("mixed_bfloat16").replace(keep_float32=PINS), (5,)),
    "float32": (ampbridge.preset("float32"), (6,)),
}


def reference(policy, inject):
    cfg = policy.resolved_loss_scale
    state, scales, skipped = initial_state(cfg), [], []
    for step in range(STEPS):
        bad = step in inject
        scales.append(state.scale)
        skipped.append(not applies(cfg, bad, state.nonfinite_streak))
        state = next_state(cfg, state, bad)
    return scales, skipped


@pytest.mark.parametrize("name", list(POLICIES))
def test_scaler_trajectory_is_the_reference_and_keras3s(name):
    from ampbridge.cli.demo.runners import run_keras
    from ampbridge.cli.demo.runners import run_tf_keras

    policy, inject = POLICIES[name]
    got = run_tf_keras(policy, STEPS, inject)
    assert (got.scales, got.skipped) == reference(policy, inject)
    assert any(not s for s in got.skipped) and all(math.isnan(got.losses[i]) for i in inject)
    if name in ("float32", "float16"):  # Keras 3 on the same weights and batches
        k3 = run_keras(policy, STEPS, inject, jit_compile=False)
        assert (k3.scales, k3.skipped) == (got.scales, got.skipped)
        finite = [i for i in range(STEPS) if i not in inject]
        tol = 1e-5 if name == "float32" else 2e-2
        np.testing.assert_allclose([got.losses[i] for i in finite], [k3.losses[i] for i in finite], rtol=tol)


def test_first_growth_interval_is_refused_by_name():
    from ampbridge.cli.demo.runners import run_tf_keras

    policy = ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=64.0, growth_interval=4, first_growth_interval=5))
    with pytest.raises(UnsupportedOptionError, match="first_growth_interval"):
        run_tf_keras(policy, 2)
