"""``ampbridge.jax.apply`` names a lossy policy (ampbridge.core.risks) once."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

require("jax")
nn = require("flax.linen")

import ampbridge.jax as abj  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402
from ampbridge.errors import LossyPolicyWarning, _warned  # noqa: E402


def test_float16_reduce_with_no_loss_scale_warns_once():
    _warned.clear()
    policy = Policy(compute_dtype="bfloat16", reduce_dtype="float16")
    with pytest.warns(LossyPolicyWarning, match=r"reduce_dtype = 'float16': gradients are all-reduced in float16"):
        abj.apply(nn.Dense(3), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyPolicyWarning)
        abj.apply(nn.Dense(3), policy)
        abj.apply(nn.Dense(3), Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="dynamic")))
