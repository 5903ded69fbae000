import dataclasses

import pytest

import ampbridge
from ampbridge import LossScaleConfig, Policy, PolicyError, Rule


def test_defaults_are_the_documented_ones():
    p = Policy()
    assert (p.compute_dtype, p.param_dtype, p.output_dtype, p.reduce_dtype) == ("float32",) * 4
    assert p.matmul_precision == "highest" and p.keep_float32 == () and p.overrides == ()
    ls = p.loss_scale
    assert (ls.mode, ls.initial_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval) == (
        "auto", 65536.0, 2.0, 0.5, 2000)
    assert (ls.hysteresis, ls.consecutive_hysteresis, ls.min_scale, ls.max_scale) == (1, False, None, None)
    assert (ls.on_min_scale, ls.skip_nonfinite) == ("clamp", True)


def test_auto_mode_resolves_by_compute_dtype():
    assert Policy(compute_dtype="float16").resolved_loss_scale.mode == "dynamic"
    assert Policy(compute_dtype="bfloat16").resolved_loss_scale.mode == "none"
    assert Policy(compute_dtype="float32").resolved_loss_scale.mode == "none"
    static = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="static"))
    assert static.resolved_loss_scale.mode == "static"


def test_reduce_dtype_follows_param_dtype_when_absent():
    assert Policy(param_dtype="bfloat16").reduce_dtype == "bfloat16"
    assert Policy(param_dtype="bfloat16", reduce_dtype="fp32").reduce_dtype == "float32"


def test_objects_are_frozen_hashable_and_normalised():
    p = Policy(compute_dtype="bf16", keep_float32=["kind:norm"], overrides=[{"match": "head", "compute_dtype": "f32"}])
    assert p.compute_dtype == "bfloat16"
    assert p.keep_float32 == ("kind:norm",)
    assert p.overrides == (Rule(("head",), compute_dtype="float32"),)
    assert hash(p) == hash(Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",),
                                  overrides=(Rule("head", compute_dtype="float32"),)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = "float16"  # type: ignore[misc]


def test_rules_order_keep_float32_then_overrides():
    p = Policy(keep_float32=("kind:norm",), overrides=(Rule("head", compute_dtype="float32"),))
    labels = [label for label, _ in p.rules]
    assert labels == ["keep_float32[0]", "override[0]"]
    assert p.rules[0][1] == Rule(("kind:norm",), "float32", "float32", "float32")


@pytest.mark.parametrize("kwargs,key,accepted", [
    ({"growth_factor": 0.5}, "loss_scale.growth_factor", "a finite number >= 1"),
    ({"backoff_factor": 1.0}, "loss_scale.backoff_factor", "strictly between 0 and 1"),
    ({"backoff_factor": 0.0}, "loss_scale.backoff_factor", "strictly between 0 and 1"),
    ({"initial_scale": -1.0}, "loss_scale.initial_scale", "a number > 0"),
    ({"initial_scale": float("inf")}, "loss_scale.initial_scale", "a number > 0"),
    ({"min_scale": -2.0}, "loss_scale.min_scale", "a number > 0"),
    ({"max_scale": 1e39}, "loss_scale.max_scale", "float32 max"),
    ({"growth_interval": 0}, "loss_scale.growth_interval", "an integer from 1 to 2147483647"),
    ({"growth_interval": 10.0}, "loss_scale.growth_interval", "an integer from 1 to 2147483647"),
    ({"hysteresis": True}, "loss_scale.hysteresis", "an integer from 1 to 2147483647"),
    ({"mode": "dynamc"}, "loss_scale.mode", "auto | dynamic | static | none"),
    ({"on_min_scale": "stop"}, "loss_scale.on_min_scale", "clamp | warn | error"),
    ({"skip_nonfinite": 1}, "loss_scale.skip_nonfinite", "true | false"),
    ({"min_scale": 4.0, "max_scale": 2.0}, "loss_scale.min_scale", "a value <= max_scale"),
    ({"initial_scale": 1.0, "min_scale": 2.0}, "loss_scale.initial_scale", "a value >= min_scale"),
])
def test_impossible_loss_scale_values(kwargs, key, accepted):
    with pytest.raises(PolicyError) as info:
        LossScaleConfig(**kwargs)
    keys = [p.key for p in info.value.problems]
    assert key in keys
    problem = info.value.problems[keys.index(key)]
    assert accepted in problem.accepted
    assert isinstance(info.value, ValueError)


def test_every_problem_is_reported_not_just_the_first():
    with pytest.raises(PolicyError) as info:
        LossScaleConfig(growth_factor=0.1, backoff_factor=2.0, growth_interval=-1)
    assert {p.key for p in info.value.problems} == {
        "loss_scale.growth_factor", "loss_scale.backoff_factor", "loss_scale.growth_interval"}


def test_bad_rules_and_pins():
    with pytest.raises(PolicyError, match="at least one of compute_dtype"):
        Rule("head")
    with pytest.raises(PolicyError, match="did you mean 'norm'"):
        Policy(keep_float32=("kind:nrom",))
    with pytest.raises(PolicyError, match="must be a list of patterns"):
        Policy(keep_float32="kind:norm")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="'auto' is accepted for compute_dtype only"):
        Policy(param_dtype="auto")


def test_policy_error_carries_the_first_problem():
    with pytest.raises(PolicyError) as info:
        Policy(compute_dtype="fp8")
    e = info.value
    assert e.key == "compute_dtype" and e.value == "fp8"
    assert "float16" in e.accepted and "auto" in e.accepted


def test_replace_revalidates():
    p = ampbridge.preset("mixed_float16")
    assert p.replace(compute_dtype="bfloat16").compute_dtype == "bfloat16"
    with pytest.raises(PolicyError):
        p.replace(matmul_precision="fast")
