"""FP8 recipes without a framework: Transformer Engine recipe arguments, torchao's Float8LinearConfig dict
form, Keras's QuantizedFloat8DTypePolicy config and Accelerate's fp8_config, read and written.

Round trips over every [fp8] table the grid below spans: the table read back equals the one written, or
each key that changed is a loss named ``fp8.<key>``. The real objects (torchao's config, Accelerate's
kwargs classes, Keras's dtype policy) are checked in the backend tests.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from ampbridge import Fp8Config, LossScaleConfig, Policy, PolicyError, UnsupportedOptionError, recipes

GRID = [Fp8Config(match=match, forward=fwd, backward=bwd, scaling=scaling, margin=margin,
                  **({"amax_history": hist, "amax_compute": algo} if scaling == "delayed" else {}))
        for match, fwd, bwd, scaling, margin, hist, algo in itertools.product(
            [("kind:linear",), ("fc1", "fc2")], ["e4m3", "e5m2"], ["e5m2", "e4m3"], ["delayed", "current"], [0, 3],
            [1024, 16], ["max", "most_recent"])]
GRID = list(dict.fromkeys(GRID))  # current scaling repeats the delayed-only values

TARGETS = {
    "transformer-engine": (recipes.to_transformer_engine, recipes.from_transformer_engine),
    "torchao": (recipes.to_torchao, recipes.from_torchao),
    "keras": (recipes.to_keras, lambda r: recipes.from_keras(r["float8"])),
    "accelerate": (recipes.to_accelerate, lambda r: recipes.from_accelerate(
        {"mixed_precision": r["mixed_precision"], "fp8_config": r["fp8_config"]})),
}


def _policy(fp8: Fp8Config) -> Policy:
    return Policy(compute_dtype="bfloat16", loss_scale=LossScaleConfig(mode="none", skip_nonfinite=False), fp8=fp8)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_round_trip_every_change_is_a_named_loss(target):
    write, read = TARGETS[target]
    exact = 0
    for fp8 in GRID:
        out = write(_policy(fp8))
        back = read(out.result)
        assert "fp8" in back.covers
        names = {loss.setting for loss in out.losses + back.losses}
        got = back.result.fp8
        for key in ("match", "forward", "backward", "scaling", "amax_history", "amax_compute", "margin"):
            if getattr(got, key) != getattr(fp8, key):
                # delayed-only keys go with the scaling when a current-only target drops them
                ok = f"fp8.{key}" in names or (key in ("amax_history", "amax_compute") and "fp8.scaling" in names)
                ok = ok or (key == "backward" and "fp8.forward" in names)  # one TE/torchao format pair loss
                assert ok, (target, fp8, key, getattr(got, key), sorted(names))
        exact += not any(x.setting.startswith("fp8") for x in out.losses + back.losses)
    assert exact, f"{target}: no [fp8] table went through exactly"


@pytest.mark.parametrize("fp8", [Fp8Config(("kind:linear",)), Fp8Config(("kind:linear",), forward="e4m3",
                                 backward="e4m3", amax_history=16, amax_compute="most_recent", margin=2)])
def test_transformer_engine_delayed_is_exact(fp8):
    out = recipes.to_transformer_engine(_policy(fp8))
    assert out.exact and out.result["recipe"] == "DelayedScaling"
    assert recipes.from_transformer_engine(json.loads(json.dumps(out.result))).result.fp8 == fp8


def test_transformer_engine_reads_constructor_defaults_and_enum_spellings():
    got = recipes.from_transformer_engine({"recipe": "DelayedScaling"})
    assert got.exact and got.result.fp8 == Fp8Config(("kind:linear",))  # TE 2.18: HYBRID, 1024, "max", margin 0
    got = recipes.from_transformer_engine({"recipe": "Float8CurrentScaling", "fp8_format": "Format.E4M3"})
    assert (got.result.fp8.scaling, got.result.fp8.backward) == ("current", "e4m3")
    assert any("scale 1 for an amax of 0" in n for n in got.notes)


def test_transformer_engine_losses_named():
    got = recipes.from_transformer_engine({"recipe": "DelayedScaling", "reduce_amax": False, "fp8_dpa": True,
                                           "fp8_mha": False})
    assert [x.setting for x in got.losses] == ["reduce_amax", "fp8_dpa"]  # fp8_mha at TE's default: no loss
    cur = recipes.from_transformer_engine({"recipe": "Float8CurrentScaling", "use_power_2_scales": True})
    assert [x.setting for x in cur.losses] == ["use_power_2_scales"]
    out = recipes.to_transformer_engine(_policy(Fp8Config(("kind:linear",), forward="e5m2", scaling="current",
                                                          margin=1)))
    assert {x.setting for x in out.losses} == {"fp8.forward", "fp8.margin"}


@pytest.mark.parametrize("recipe, message", [
    ({"recipe": "MXFP8BlockScaling"}, "recipe: not a Transformer Engine FP8 recipe class"),
    ({"recipe": "DelayedScaling", "amax_history_length": 4}, "did you mean 'amax_history_len'"),
    ({"recipe": "DelayedScaling", "amax_history_len": 0}, "amax_history_len: must be an integer >= 1"),
    ({"recipe": "DelayedScaling", "amax_compute_algo": "mean"}, "accepted: max, most_recent"),
    ({"recipe": "Float8CurrentScaling", "fp8_format": "E5M2"}, "TE refuses E5M2 alone"),
    ({"recipe": "Float8CurrentScaling", "amax_history_len": 4}, "unknown key in TE Float8CurrentScaling"),
])
def test_transformer_engine_bad_input(recipe, message):
    with pytest.raises(PolicyError, match=message):
        recipes.from_transformer_engine(recipe)


def test_torchao_dict_form_and_losses():
    cast = {"scaling_type": "dynamic", "scaling_granularity": "tensorwise"}
    got = recipes.from_torchao({"cast_config_input": {**cast, "target_dtype": "float8_e4m3fn"}, "emulate": True})
    assert got.exact and got.result.fp8 == Fp8Config(("kind:linear",), scaling="current")
    assert any("emulate is not carried" in n for n in got.notes)
    rowwise = {**cast, "scaling_granularity": "axiswise", "target_dtype": "float8_e4m3fn"}
    got = recipes.from_torchao({"cast_config_input": rowwise, "cast_config_weight": {**cast, "target_dtype":
                               "float8_e5m2"}, "gemm_config_output": {"use_fast_accum": False},
                                "round_scales_to_power_of_2": True, "pad_inner_dim": True})
    assert [x.setting for x in got.losses] == ["cast_config_input.scaling_granularity",
                                               "cast_config_weight.target_dtype", "gemm_config_output",
                                               "round_scales_to_power_of_2"]
    with pytest.raises(PolicyError, match="cast_config_input.target_dtype: not a float8 dtype"):
        recipes.from_torchao({"cast_config_input": {**cast, "target_dtype": "float8_e4m3fnuz"}})
    with pytest.raises(PolicyError, match="did you mean 'emulate'"):
        recipes.from_torchao({"emulat": True})


def test_accelerate_fp8_te_and_ao():
    te = recipes.from_accelerate({"mixed_precision": "fp8", "fp8_config": {"backend": "TE", "amax_history_len": 16,
                                                                            "fp8_format": "E4M3", "margin": 1}})
    assert te.exact and te.result.compute_dtype == "bfloat16" and te.result.output_dtype == "float32"
    # TERecipeKwargs's own default is most_recent, not TE's max
    assert te.result.fp8 == Fp8Config(("kind:linear",), backward="e4m3", amax_history=16,
                                      amax_compute="most_recent", margin=1)
    # what `accelerate config` writes does not reach TERecipeKwargs in 1.16.0
    cfg = {"backend": "TE", "amax_history_length": 16, "amax_compute_algorithm": "max", "interval": 2,
           "override_linear_precision": [False, True, False]}
    got = recipes.from_accelerate({"mixed_precision": "fp8", "fp8_config": cfg})
    assert [x.setting for x in got.losses] == ["fp8_config.amax_history_length", "fp8_config.amax_compute_algorithm",
                                               "fp8_config.interval", "fp8_config.override_linear_precision"]
    assert got.result.fp8.amax_history == 1024 and got.result.fp8.amax_compute == "most_recent"
    ao = recipes.from_accelerate({"mixed_precision": "fp8", "distributed_type": "FSDP", "fp8_config": {"backend": "AO"}})
    assert ao.result.fp8.scaling == "current" and ao.result.reduce_dtype == "bfloat16"
    assert [x.setting for x in ao.losses] == ["fp8_config.backend", "fp8_config.enable_fsdp_float8_all_gather"]
    with pytest.raises(PolicyError, match="fp8_config.backend: not an Accelerate FP8 backend.*MS-AMP"):
        recipes.from_accelerate({"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"}})
    with pytest.raises(PolicyError, match="fp8_config.amax_history_lne: unknown key in fp8_config; did you mean"):
        recipes.from_accelerate({"mixed_precision": "fp8", "fp8_config": {"amax_history_lne": 4}})


def test_keras_float8_names_and_configs():
    got = recipes.from_keras("float8_from_mixed_bfloat16")
    assert got.result.compute_dtype == "bfloat16" and got.result.fp8 == Fp8Config(("kind:linear",))
    cfg = {"mode": "float8", "source_name": "mixed_float16", "amax_history_length": 16}
    got = recipes.from_keras(cfg)
    assert got.result.compute_dtype == "float16" and got.result.fp8.amax_history == 16 and "fp8" in got.covers
    out = recipes.to_keras(got.result)
    assert out.result["float8"] == cfg and out.result["dtype_policy"] == "mixed_float16"
    with pytest.raises(PolicyError, match="amax_history_length: must be an integer >= 1"):
        recipes.from_keras({"mode": "float8", "source_name": "float32", "amax_history_length": -1})


@pytest.mark.parametrize("target", ["deepspeed", "lightning", "jmp"])
def test_a_target_without_float8_names_fp8_as_lost(target):
    out = recipes.write(_policy(Fp8Config(("kind:linear",))), target)
    assert "fp8" in {x.setting for x in out.losses}
    assert "fp8" not in {x.setting for x in recipes.write(_policy(Fp8Config()), target).losses}


def test_fsdp_says_fp8_is_outside_it():
    notes = recipes.to_fsdp(_policy(Fp8Config(("kind:linear",)))).notes
    assert any("convert_to_float8_training" in n for n in notes)
    assert not any("fp8" in n for n in recipes.to_fsdp(_policy(Fp8Config())).notes)


def test_nothing_to_write_without_fp8():
    with pytest.raises(UnsupportedOptionError, match=r"\[fp8\] match is empty"):
        recipes.to_transformer_engine(Policy())


def test_detect_and_cli(tmp_path):
    assert recipes.detect({"recipe": "DelayedScaling"}) == "transformer-engine"
    assert recipes.detect({"cast_config_input": {}}) == "torchao"
    assert recipes.detect({"mode": "float8", "source_name": "float32", "amax_history_length": 4}) == "keras"
    f = tmp_path / "te.json"
    f.write_text(json.dumps({"recipe": "DelayedScaling", "amax_history_len": 16, "reduce_amax": False}))
    run = [sys.executable, "-m", "ampbridge", "convert", str(f), "--to", "accelerate"]
    p = subprocess.run(run, capture_output=True, text=True)
    assert p.returncode == 0 and "fp8_config:\n  backend: \"TE\"" in p.stdout and "amax_history_len: 16" in p.stdout
    assert "lost: reduce_amax = False" in p.stderr
    p = subprocess.run(run + ["--strict"], capture_output=True, text=True)
    assert p.returncode == 1 and p.stdout == ""
    f.write_text(json.dumps({"recipe": "DelayedScaling", "margin": -1}))
    p = subprocess.run(run, capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "te.json:1: margin: must be an integer >= 0; received -1" in p.stderr


def test_check_compares_the_fp8_table_an_fp8_recipe_decides():
    policy = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=16))
    te = recipes.from_transformer_engine({"recipe": "DelayedScaling", "amax_compute_algo": "most_recent"})
    found = {(d.field, d.policy_value, d.other_value, d.other_setting) for d in recipes.disagreements(policy, te)}
    assert found == {("fp8.amax_history", 16, 1024, "amax_history_len"),
                     ("fp8.amax_compute", "max", "most_recent", "amax_compute_algo")}
    keras = recipes.from_keras({"mode": "float8", "source_name": "mixed_bfloat16", "amax_history_length": 16})
    assert not [d for d in recipes.disagreements(policy, keras) if "fp8" in d.field]
    assert [d.field for d in recipes.disagreements(policy.replace(fp8=Fp8Config()), keras) if "fp8" in d.field] == [
        "fp8.match", "fp8.amax_history"]
    # a recipe without FP8 settings does not decide [fp8]
    assert not [d for d in recipes.disagreements(policy, recipes.from_lightning("bf16-mixed")) if "fp8" in d.field]


HOSTILE = [
    ("transformer-engine", x) for x in (None, 1, "x", [], {"recipe": ["x"]}, {"recipe": "DelayedScaling",
                                        "fp8_format": ["HYBRID"]}, {"recipe": "DelayedScaling", "fp8_format": {"a": 1}},
                                        {"recipe": "DelayedScaling", "margin": "1"}, {"recipe": "DelayedScaling",
                                        "amax_compute_algo": {}}, {"recipe": "DelayedScaling", "margin": 1e9})
] + [("torchao", x) for x in (None, [], {"cast_config_input": 1}, {"cast_config_input": {"target_dtype": ["x"]}},
                              {"cast_config_input": {"scaling_type": ["x"], "target_dtype": "float8_e4m3fn"}})] + [
    ("accelerate", {"mixed_precision": "fp8", "fp8_config": x}) for x in (
        1, {"backend": ["TE"]}, {"backend": "TE", "fp8_format": ["x"]}, {"backend": "TE", "margin": "x"},
        {"backend": "TE", "override_linear_precision": 5}, {"backend": "TE", "amax_history_len": 0})] + [
    ("keras", x) for x in ({"class_name": "QuantizedFloat8DTypePolicy", "config": 5}, {"mode": "int8"},
                           {"source_name": "nope"}, "float8_from_nope", {"amax_history_length": "x"})]


@pytest.mark.parametrize("fmt, data", HOSTILE)
def test_hostile_input_is_a_policy_error_not_a_crash(fmt, data):
    with pytest.raises((PolicyError, UnsupportedOptionError)):
        recipes.read(data, fmt)
