"""Keras float8 settings against Keras's own ``QuantizedFloat8DTypePolicy`` (each Keras backend)."""

import pytest

from ampbridge import Fp8Config, Policy, recipes
from ampbridge._testing import require

keras = require("keras")


@pytest.mark.parametrize("history", [1024, 16])
def test_written_config_builds_the_policy_keras_quantize_makes(history):
    policy = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=history))
    out = recipes.to_keras(policy)
    real = keras.dtype_policies.QuantizedFloat8DTypePolicy(**out.result["float8"])
    assert real.name == "float8_from_mixed_bfloat16" and real.amax_history_length == history
    layer = keras.layers.Dense(4, dtype=out.result["dtype_policy"])
    layer.build((None, 8))
    layer.quantize("float8")  # what model.quantize("float8") does to each Dense
    if history == keras.dtype_policies.QuantizedFloat8DTypePolicy.default_amax_history_length:
        assert layer.dtype_policy.get_config() == real.get_config()
    for form in (real.get_config(), keras.dtype_policies.serialize(real)):
        back = recipes.from_keras(form)
        assert back.result.fp8 == policy.fp8 and back.result.compute_dtype == "bfloat16"
    assert recipes.from_keras(real.name).result.fp8 == Fp8Config(("kind:linear",))


def test_what_keras_cannot_hold_is_lost():
    policy = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_compute="most_recent", margin=1))
    assert {x.setting for x in recipes.to_keras(policy).losses} >= {"fp8.amax_compute", "fp8.margin"}
