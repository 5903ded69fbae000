"""tf.keras 2 recipes (framework-free): Keras 2 policy names and LossScaleOptimizer settings in and out.
tests/backend_tf_keras/test_recipes_native.py runs what to_tf_keras writes in Keras 2 itself."""

import pytest

import ampbridge
from ampbridge import LossScaleConfig, recipes


def test_reads_keras2s_names_and_its_optimizer_settings():
    p = recipes.from_tf_keras("mixed_float16").result
    assert (p.compute_dtype, p.param_dtype) == ("float16", "float32")
    assert (p.loss_scale.mode, p.loss_scale.initial_scale, p.loss_scale.growth_interval, p.loss_scale.min_scale) == (
        "dynamic", 32768.0, 2000, 1.0)
    p = recipes.from_tf_keras("mixed_float16", loss_scale_optimizer={
        "inner_optimizer": {"class_name": "SGD"}, "dynamic": True, "initial_scale": 256.0,
        "dynamic_growth_steps": 10}).result
    assert (p.loss_scale.initial_scale, p.loss_scale.growth_interval) == (256.0, 10)
    static = recipes.from_tf_keras_loss_scale_optimizer({"dynamic": False, "initial_scale": 128.0,
                                                         "dynamic_growth_steps": None}).result
    assert (static.mode, static.initial_scale, static.skip_nonfinite) == ("static", 128.0, False)
    assert recipes.from_tf_keras("mixed_bfloat16").result.loss_scale.mode == "none"


@pytest.mark.parametrize("bad, named", [
    ({"dynamic": False}, "initial_scale"),
    ({"dynamic": False, "initial_scale": 2.0, "dynamic_growth_steps": 5}, "dynamic_growth_steps"),
    ({"initial_scale": 2.0, "multiplier": 3}, "multiplier"),
    ({"dynamic": "yes"}, "dynamic"),
])
def test_bad_optimizer_configs_name_the_key(bad, named):
    with pytest.raises(ampbridge.PolicyError, match=named):
        recipes.from_tf_keras_loss_scale_optimizer(bad)


def test_writes_keras2s_arguments_and_names_what_it_cannot_hold():
    exact = ampbridge.preset("mixed_float16").replace(output_dtype="float16", loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=8, min_scale=1.0))
    c = recipes.to_tf_keras(exact)
    assert c.result == {"dtype_policy": "mixed_float16",
                        "loss_scale_optimizer": {"dynamic": True, "initial_scale": 1024.0, "dynamic_growth_steps": 8}}
    assert c.exact
    assert recipes.from_tf_keras("mixed_float16", loss_scale_optimizer=c.result["loss_scale_optimizer"]).result == exact
    lossy = exact.replace(loss_scale=LossScaleConfig(mode="dynamic", growth_factor=3.0, hysteresis=2, max_scale=2.0**20))
    assert {l.setting for l in recipes.to_tf_keras(lossy).losses} == {
        "loss_scale.growth_factor", "loss_scale.hysteresis", "loss_scale.min_scale", "loss_scale.max_scale"}
    static = recipes.to_tf_keras(exact.replace(loss_scale=LossScaleConfig(mode="static", initial_scale=64.0)))
    assert static.result["loss_scale_optimizer"] == {"dynamic": False, "initial_scale": 64.0, "dynamic_growth_steps": None}
    assert [l.setting for l in static.losses] == ["loss_scale.skip_nonfinite"]
