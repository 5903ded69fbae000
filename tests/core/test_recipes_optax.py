"""optax apply_if_finite arguments in and out (framework-free; optax's own behaviour is held to
ampbridge's in tests/backend_jax/test_optax_ported.py)."""

import pytest

from ampbridge import LossScaleConfig, PolicyError, preset, recipes


def test_max_consecutive_errors_is_max_consecutive_skips_both_ways():
    c = recipes.from_optax({"max_consecutive_errors": 4, "notfinite_count": 1})
    assert c.exact and c.result == LossScaleConfig(mode="none", skip_nonfinite=True, max_consecutive_skips=4)
    assert c.state.nonfinite_streak == 1
    back = recipes.to_optax(c.result)
    assert back.exact and back.result == {"max_consecutive_errors": 4}


def test_always_skipping_is_the_largest_int32_limit_and_a_loss_scale_is_a_loss():
    out = recipes.to_optax(preset("mixed_float16"))
    assert out.result == {"max_consecutive_errors": 2**31 - 1}
    assert [loss.setting for loss in out.losses] == ["loss_scale.mode"]
    assert recipes.to_optax(LossScaleConfig(mode="none", skip_nonfinite=False)).result is None


@pytest.mark.parametrize("kwargs,key", [({}, "max_consecutive_errors"), ({"max_consecutive_errors": -1},
                                        "max_consecutive_errors"), ({"max_consecutive_errors": 2, "max_errors": 1},
                                        "max_errors"), ({"max_consecutive_errors": 2**31}, "max_consecutive_errors")])
def test_bad_arguments_are_one_line_each(kwargs, key):
    with pytest.raises(PolicyError) as e:
        recipes.from_optax(kwargs)
    assert key in str(e.value) and all("\n" not in str(p) for p in e.value.problems)
