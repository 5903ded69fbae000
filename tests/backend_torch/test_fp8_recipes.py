"""FP8 recipes against the real objects: torchao's ``Float8LinearConfig`` and Accelerate's
``AORecipeKwargs`` / ``TERecipeKwargs`` (with the launcher's own environment mapping)."""

import argparse
import dataclasses

import pytest

import ampbridge._testing
from ampbridge import Fp8Config, Policy, recipes

torch = ampbridge._testing.require("torch")
ampbridge._testing.require("torchao.float8", "the torchao FP8 recipes")
accelerate_utils = ampbridge._testing.require("accelerate.utils", "the Accelerate FP8 recipes")
from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType  # noqa: E402

CURRENT = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), scaling="current"))


def build(plain: dict) -> Float8LinearConfig:
    """A real Float8LinearConfig from to_torchao's dict form (what a user writes in code)."""
    def cast(d):
        return CastConfig(ScalingType(d["scaling_type"]), ScalingGranularity(d["scaling_granularity"]),
                          getattr(torch, d["target_dtype"]))
    return Float8LinearConfig(**{k: cast(v) for k, v in plain.items()})


def test_a_real_config_reads_and_writes_back_equal():
    got = recipes.from_torchao(Float8LinearConfig())
    assert got.exact and got.result.fp8 == CURRENT.fp8
    assert build(recipes.to_torchao(got.result).result) == Float8LinearConfig()
    e4m3_grads = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
    got = recipes.from_torchao(e4m3_grads)
    assert got.exact and got.result.fp8.backward == "e4m3"
    assert build(recipes.to_torchao(got.result).result) == e4m3_grads


def test_rowwise_recipe_losses_named():
    got = recipes.from_torchao(Float8LinearConfig.from_recipe_name("rowwise"))
    names = [x.setting for x in got.losses]
    assert "cast_config_input.scaling_granularity" in names and "round_scales_to_power_of_2" in names


def test_the_dict_form_of_a_real_config_reads_like_the_object():
    cfg = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    assert recipes.from_torchao(dataclasses.asdict(cfg)).losses == recipes.from_torchao(cfg).losses
    assert [x.setting for x in recipes.from_torchao(cfg).losses] == ["enable_fsdp_float8_all_gather"]


def test_accelerate_ao_kwargs_default_config():
    kw = accelerate_utils.AORecipeKwargs()  # Accelerate's own default: pad_inner_dim and FSDP all-gather on
    got = recipes.from_torchao(kw.config)
    assert got.result.fp8 == CURRENT.fp8 and [x.setting for x in got.losses] == ["enable_fsdp_float8_all_gather"]


def _te_kwargs(monkeypatch, yaml_fp8_config: dict):
    """TERecipeKwargs as Accelerate 1.16's launcher builds it from a config's fp8_config section."""
    import accelerate.utils.dataclasses as acc_dc
    from accelerate.utils.launch import setup_fp8_env

    monkeypatch.setattr(acc_dc, "is_transformer_engine_available", lambda: True)  # the class checks only that
    args = argparse.Namespace(fp8_backend="TE", fp8_amax_history_len=1024, fp8_amax_compute_algo="most_recent",
                              fp8_margin=0, fp8_format="HYBRID")  # the launcher's argparse defaults
    for key, value in yaml_fp8_config.items():  # launch.py: fp8_config keys become fp8_<key> arguments
        setattr(args, key if key.startswith("fp8") else "fp8_" + key, value)
    env = setup_fp8_env(args, {})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return acc_dc.TERecipeKwargs()


def test_accelerate_te_kwargs_get_what_to_accelerate_writes(monkeypatch):
    policy = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), backward="e4m3", amax_history=16,
                                                            amax_compute="max", margin=2))
    fp8_config = recipes.to_accelerate(policy).result["fp8_config"]
    kw = _te_kwargs(monkeypatch, fp8_config)
    assert (kw.fp8_format, kw.margin, kw.amax_history_len, kw.amax_compute_algo) == ("E4M3", 2, 16, "max")
    te = {"recipe": "DelayedScaling", "fp8_format": kw.fp8_format, "margin": kw.margin,
          "amax_history_len": kw.amax_history_len, "amax_compute_algo": kw.amax_compute_algo}
    assert recipes.from_transformer_engine(te).result.fp8 == policy.fp8


def test_accelerate_config_keys_do_not_reach_te_kwargs(monkeypatch):
    """What `accelerate config` writes (amax_history_length) is exported under a name TERecipeKwargs does not read;
    the reader says so and reads the value Accelerate really uses."""
    cfg = {"backend": "TE", "amax_history_length": 16, "amax_compute_algorithm": "max"}
    kw = _te_kwargs(monkeypatch, cfg)
    got = recipes.from_accelerate({"mixed_precision": "fp8", "fp8_config": cfg})
    assert (kw.amax_history_len, kw.amax_compute_algo) == (1024, "most_recent")
    assert (got.result.fp8.amax_history, got.result.fp8.amax_compute) == (kw.amax_history_len, kw.amax_compute_algo)
    assert {x.setting for x in got.losses} == {"fp8_config.amax_history_length", "fp8_config.amax_compute_algorithm"}
