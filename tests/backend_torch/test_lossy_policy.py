"""``apply`` names a lossy policy (ampbridge.core.risks), and the loss it names is real."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

torch = require("torch")

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402
from ampbridge.errors import LossyPolicyWarning, _warned  # noqa: E402


def test_float16_without_loss_scaling_warns_once_and_really_flushes_small_gradients():
    _warned.clear()
    policy = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="none"))
    with pytest.warns(LossyPolicyWarning, match=r"loss_scale.mode = 'none': float16 runs \(compute_dtype\)"):
        amp = abt.apply(torch.nn.Linear(4, 4), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyPolicyWarning)
        abt.apply(torch.nn.Linear(4, 4), policy)  # said once per process
    # what the warning names: a gradient of 1e-8 is zero in float16 unless the loss is scaled
    tiny = torch.full((3,), 1e-8)
    assert torch.count_nonzero(tiny.half()) == 0
    assert torch.count_nonzero((tiny * 65536).half()) == 3
    assert amp.scaler.config.mode == "none" and float(amp.scaler.get_scale()) == 1.0


def test_a_safe_policy_warns_nothing():
    _warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyPolicyWarning)
        abt.apply(torch.nn.Linear(4, 4), ampbridge.preset("mixed_float16"))
        abt.apply(torch.nn.Linear(4, 4), ampbridge.preset("mixed_bfloat16"))
