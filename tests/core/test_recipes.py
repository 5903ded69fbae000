"""Recipes as the tools' own docs write them, read into policies spelled out in full."""

import json
from pathlib import Path

import pytest

from ampbridge import LossScaleConfig, LossScaleState, Policy, PolicyError, UnsupportedOptionError
from ampbridge import recipes
from ampbridge.core.loss_scale import f32
from ampbridge.recipes.lightning import _LIGHTNING_ALIASES

HERE = Path(__file__).parent / "recipes"

#: DeepSpeed fp16 under ZeRO: its documented defaults, scale x2 / /2, raise at the minimum
DS_FP16 = LossScaleConfig(mode="dynamic", initial_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=1000, hysteresis=2, consecutive_hysteresis=False, min_scale=1.0,
                          max_scale=None, on_min_scale="error", skip_nonfinite=True)
NO_SCALING = LossScaleConfig(mode="none", skip_nonfinite=False)
SKIPS = LossScaleConfig(mode="none", skip_nonfinite=True)  # bf16 in DeepSpeed 0.19.8: no scaling, NaN steps skipped
TORCH_SCALER = LossScaleConfig(mode="dynamic", initial_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=2000, skip_nonfinite=True)


def settings(conversion):
    return [loss.setting for loss in conversion.losses]


# --- DeepSpeed ---------------------------------------------------------------------------------------

def test_hf_zero2_config_with_auto_filled_by_the_trainer():
    c = recipes.load(HERE / "ds_zero2_hf_auto.json", auto="fp16", release="modulo")
    assert c.source_format == "deepspeed"
    assert c.result == Policy(compute_dtype="float16", param_dtype="float32", output_dtype="float16",
                              reduce_dtype="float16", loss_scale=DS_FP16)
    assert c.exact
    assert any("fp16.enabled = 'auto' read as true" in n for n in c.notes)


def test_hf_zero2_config_bf16_from_the_trainer():
    c = recipes.load(HERE / "ds_zero2_hf_auto.json", auto="bf16")
    assert c.result == Policy(compute_dtype="bfloat16", param_dtype="float32", output_dtype="bfloat16",
                              reduce_dtype="bfloat16", loss_scale=SKIPS)  # check_grad_overflow: true from 0.19.3
    assert c.exact  # the fp16 keys do nothing when bf16 runs: noted, not lost
    assert any("have no effect: fp16 is not enabled" in n for n in c.notes)
    older = recipes.load(HERE / "ds_zero2_hf_auto.json", auto="bf16", version="0.19.2")
    assert older.result.loss_scale == NO_SCALING and older.exact  # ZeRO 2, check_grad_overflow absent: false


def test_bf16_and_fp32_skipping_by_release_and_zero_stage():
    """DeepSpeed 0.19.8: bf16 skips a NaN step at every stage unless check_grad_overflow is false, which
    only ZeRO 1-2 honour; float32 skips under ZeRO 1-3. 0.19.2 skips only where its optimizers check."""
    def skip(mode, stage, check=None, version=None):
        cfg = {"zero_optimization": {"stage": stage}}
        if mode == "bf16":
            cfg["bf16"] = {"enabled": True, **({} if check is None else {"check_grad_overflow": check})}
        return recipes.from_deepspeed(cfg, version=version).result.loss_scale.skip_nonfinite

    assert [skip("bf16", z) for z in range(4)] == [True] * 4
    assert [skip("bf16", z, check=False) for z in range(4)] == [True, False, False, True]
    assert [skip("fp32", z) for z in range(4)] == [False, True, True, True]
    assert [skip("bf16", z, version="0.19.2") for z in range(4)] == [True, False, False, False]
    assert [skip("bf16", z, check=True, version="0.19.2") for z in range(4)] == [True, True, True, False]
    assert [skip("fp32", z, version="0.19.2") for z in range(4)] == [False] * 4
    unchecked = recipes.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, version="0.19.5")
    assert settings(unchecked) == ["zero_optimization.stage"] and "0.19.4-0.19.7" in unchecked.losses[0].reason
    # the writer says check_grad_overflow explicitly, and which stages cannot honour the policy
    import ampbridge

    no_skip = ampbridge.preset("mixed_bfloat16").replace(output_dtype="bfloat16", reduce_dtype="bfloat16",
                                                         loss_scale=LossScaleConfig(skip_nonfinite=False))
    out = recipes.to_deepspeed(no_skip)
    assert out.result["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert settings(out) == ["loss_scale.skip_nonfinite"] and "no ZeRO, ZeRO 3" in out.losses[0].reason
    assert recipes.to_deepspeed(no_skip, stage=2).exact


def test_auto_without_a_trainer_is_a_loss_not_a_guess():
    c = recipes.load(HERE / "ds_zero2_hf_auto.json")
    assert c.result.compute_dtype == "float32"
    assert settings(c) == ["fp16.enabled", "bf16.enabled"]
    assert "auto='fp16'" in c.losses[0].reason


def test_ds_fp16_dynamic_as_deepspeed_documents_it():
    modulo = recipes.load(HERE / "ds_fp16_dynamic.json", release="modulo")
    assert modulo.result == Policy(compute_dtype="float16", output_dtype="float16", reduce_dtype="float16",
                                   loss_scale=DS_FP16)
    assert modulo.exact
    current = recipes.load(HERE / "ds_fp16_dynamic.json")  # default: today's release
    # 0.17.1 and later grow first after window + 1 finite steps: an exact setting (issue 38), not a loss
    assert current.result == modulo.result.replace(loss_scale=DS_FP16.replace(first_growth_interval=1001))
    assert current.exact
    assert sum("e440506" in n for n in current.notes) == 1  # the long explanation once, as a note
    assert recipes.load(HERE / "ds_fp16_dynamic.json", version="0.17.0").result == modulo.result
    late = recipes.load(HERE / "ds_fp16_dynamic.json", version="0.17.1")
    assert late.exact and late.result == current.result


def test_ds_static_scale():
    c = recipes.load(HERE / "ds_fp16_static.json")
    assert c.result.loss_scale == LossScaleConfig(mode="static", initial_scale=128.0, skip_nonfinite=True)
    assert (c.result.compute_dtype, c.result.output_dtype, c.result.reduce_dtype) == ("float16",) * 3
    assert c.exact  # no growth, so no release difference


def test_ds_bf16_zero3_with_fp32_communication():
    c = recipes.load(HERE / "ds_bf16_zero3.json")
    assert c.result == Policy(compute_dtype="bfloat16", param_dtype="float32", output_dtype="bfloat16",
                              reduce_dtype="float32", loss_scale=SKIPS)
    assert c.exact


def test_ds_bf16_options_ampbridge_cannot_express_are_losses():
    c = recipes.from_deepspeed({"bf16": {"enabled": True, "immediate_grad_update": True,
                                         "check_grad_overflow": True, "bf16_optimizer_states": True}})
    assert settings(c) == ["bf16.immediate_grad_update", "bf16.bf16_optimizer_states"]
    assert c.result.loss_scale.skip_nonfinite is True


def test_ds_torch_autocast():
    c = recipes.load(HERE / "ds_torch_autocast.json")
    assert c.result == Policy(compute_dtype="bfloat16", output_dtype="bfloat16", loss_scale=NO_SCALING)
    assert settings(c) == ["torch_autocast.lower_precision_safe_modules"]
    exact = recipes.from_deepspeed({"torch_autocast": {"enabled": True, "dtype": "fp16",
                                                       "lower_precision_safe_modules": []}})
    assert exact.result.loss_scale == TORCH_SCALER and exact.exact


def test_ds_apex_o2_keeps_batchnorm_in_float32():
    c = recipes.load(HERE / "ds_apex_o2.json")
    assert c.result == Policy(compute_dtype="float16", param_dtype="float32", output_dtype="float16",
                              keep_float32=("type:BatchNorm1d", "type:BatchNorm2d", "type:BatchNorm3d",
                                            "type:SyncBatchNorm"),
                              loss_scale=LossScaleConfig(mode="dynamic", initial_scale=65536.0, growth_interval=2000,
                                                         max_scale=2.0**24, skip_nonfinite=True))
    o3 = recipes.from_deepspeed({"amp": {"enabled": True, "opt_level": "O3"}}).result
    assert (o3.param_dtype, o3.loss_scale.mode, o3.loss_scale.skip_nonfinite) == ("float16", "none", False)


def test_ds_stage_0_uses_fp16_optimizer_semantics():
    c = recipes.from_deepspeed({"fp16": {"enabled": True, "hysteresis": 4}}, release="modulo")
    assert c.result.loss_scale.on_min_scale == "clamp"
    assert c.result.loss_scale.hysteresis == 1  # FP16_Optimizer has none, in every release
    # its growth test is stable_interval in every release: window + 1 before the first growth, exactly
    assert settings(c) == [] and c.result.loss_scale.first_growth_interval == 1001


def test_ds_bad_and_unknown_keys_name_the_key(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale_windw": 100, "hysteresis": 0,
                                        "initial_scale_power": "auto"}}, indent=2))
    with pytest.raises(PolicyError) as e:
        recipes.load(bad)
    text = str(e.value)
    assert f"{bad}:4: fp16.loss_scale_windw: unknown key in DeepSpeed's fp16 section; did you mean 'loss_scale_window'?" in text
    assert f"{bad}:5: fp16.hysteresis: must be an integer >= 1; received 0" in text
    assert "fp16.initial_scale_power: 'auto' is not filled in for this key" in text
    with pytest.raises(PolicyError, match="fp_16: not a DeepSpeed key.*did you mean 'fp16'"):
        recipes.from_deepspeed({"fp_16": {"enabled": True}})
    with pytest.raises(PolicyError, match="fp16 and bf16 are both enabled"):
        recipes.from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(PolicyError, match="communication_data_type: not a DeepSpeed communication data type"):
        recipes.from_deepspeed({"communication_data_type": "fp8"})
    with pytest.raises(PolicyError, match=r"initial_scale is below min_scale \(ampbridge loss_scale.initial_scale\)"):
        recipes.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}})
    with pytest.raises(ValueError, match="release='v2'"):
        recipes.from_deepspeed({}, release="v2")


def test_ds_export_of_its_own_defaults_is_exact_for_the_modulo_release():
    policy = recipes.load(HERE / "ds_fp16_dynamic.json", release="modulo").result
    out = recipes.to_deepspeed(policy, release="modulo", stage=1)  # the file's ZeRO stage
    assert out.result == {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                   "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
                                   "min_loss_scale": 1}, "zero_optimization": {"stage": 1}}
    assert out.exact
    # no stage: written without zero_optimization, which runs at stage 0, where hysteresis is ignored
    assert settings(recipes.to_deepspeed(policy, release="modulo")) == ["loss_scale.hysteresis"]
    # the modulo release's timing written for 0.19.8 (which grows first after window + 1): a loss
    assert settings(recipes.to_deepspeed(policy, stage=1)) == ["loss_scale.first_growth_interval"]
    current = recipes.load(HERE / "ds_fp16_dynamic.json").result
    assert recipes.to_deepspeed(current, stage=1).exact and recipes.to_deepspeed(current, stage=1).result == out.result
    assert settings(recipes.to_deepspeed(current, release="modulo", stage=1)) == ["loss_scale.first_growth_interval"]


def test_ds_export_names_what_deepspeed_cannot_hold():
    import ampbridge

    p = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",), matmul_precision="high",
                                                  loss_scale=LossScaleConfig(mode="dynamic", growth_factor=4.0,
                                                                             max_scale=2.0**20, initial_scale=1000.0))
    out = recipes.to_deepspeed(p, release="modulo")
    assert settings(out) == ["matmul_precision", "keep_float32", "loss_scale.initial_scale", "loss_scale.min_scale",
                             "loss_scale.growth_factor", "loss_scale.max_scale", "output_dtype"]
    assert out.result["fp16"]["initial_scale_power"] == 10  # the nearest power of two, reported
    with pytest.raises(UnsupportedOptionError, match="compute_dtype='auto'"):
        recipes.to_deepspeed(Policy(compute_dtype="auto"))
    with pytest.raises(UnsupportedOptionError, match="apex amp, which computes in float16 only"):
        recipes.to_deepspeed(ampbridge.preset("mixed_bfloat16"), via="amp")


# --- Accelerate --------------------------------------------------------------------------------------

def test_accelerate_fp16_as_accelerate_config_writes_it():
    c = recipes.load(HERE / "accelerate_fp16.yaml")
    assert c.source_format == "accelerate"
    assert c.result == Policy(compute_dtype="float16", param_dtype="float32", output_dtype="float32",
                              reduce_dtype="float32", loss_scale=TORCH_SCALER)
    assert c.exact
    custom = recipes.load(HERE / "accelerate_fp16.yaml",
                          grad_scaler_kwargs={"init_scale": 1024.0, "growth_interval": 100})
    assert custom.result.loss_scale == TORCH_SCALER.replace(initial_scale=1024.0, growth_interval=100)


def test_accelerate_fsdp_reduces_in_the_mixed_dtype():
    c = recipes.load(HERE / "accelerate_fsdp_bf16.yaml")
    assert c.result == Policy(compute_dtype="bfloat16", param_dtype="float32", output_dtype="float32",
                              reduce_dtype="bfloat16", loss_scale=NO_SCALING)


def test_accelerate_unquoted_no_is_yaml_false_and_means_no():
    c = recipes.load(HERE / "accelerate_no_unquoted.yaml")
    assert c.result == Policy(loss_scale=NO_SCALING)
    assert any("YAML 1.1's false" in n for n in c.notes)


def test_accelerate_deepspeed_reads_the_deepspeed_file_with_auto_filled():
    c = recipes.load(HERE / "accelerate_deepspeed.yaml")
    assert c.source_format == "accelerate"
    assert c.result == Policy(compute_dtype="bfloat16", output_dtype="bfloat16", reduce_dtype="bfloat16",
                              loss_scale=SKIPS)
    assert any("ds_zero2_hf_auto.json" in n for n in c.notes)
    plugin_only = recipes.from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "fp16",
                                           "deepspeed_config": {"zero_stage": 2}})
    assert plugin_only.result.loss_scale == DS_FP16.replace(first_growth_interval=1001)  # DeepSpeed 0.19.8


def test_accelerate_fp8_and_bad_input():
    with pytest.raises(UnsupportedOptionError, match="mixed_precision='fp8' under distributed_type DEEPSPEED"):
        recipes.from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "fp8"})
    with pytest.raises(PolicyError, match="mixed_precision: not an Accelerate mixed_precision; received 'bf61'"):
        recipes.from_accelerate({"mixed_precision": "bf61"})
    with pytest.raises(PolicyError, match="mixed_precison: unknown key in an Accelerate config; did you mean 'mixed_precision'"):
        recipes.from_accelerate({"mixed_precison": "bf16"})
    with pytest.raises(PolicyError, match="growth_factor: torch requires growth_factor > 1"):
        recipes.from_accelerate({"mixed_precision": "fp16"}, grad_scaler_kwargs={"growth_factor": 1.0})
    with pytest.raises(PolicyError, match="grad_scaler_kwargs.init_sclae: unknown key in GradScalerKwargs"):
        recipes.from_accelerate({"mixed_precision": "fp16"}, grad_scaler_kwargs={"init_sclae": 1.0})


def test_accelerate_export():
    import ampbridge

    assert recipes.to_accelerate(ampbridge.preset("mixed_float16")).result == \
        {"mixed_precision": "fp16", "grad_scaler_kwargs": None}
    out = recipes.to_accelerate(ampbridge.preset("mixed_float16").replace(
        loss_scale=LossScaleConfig(mode="dynamic", growth_interval=500, hysteresis=2)))
    assert out.result["grad_scaler_kwargs"] == {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                                "growth_interval": 500, "enabled": True}
    assert settings(out) == ["loss_scale.hysteresis"]


# --- Lightning -------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,compute,param,scaling", [
    ("16-mixed", "float16", "float32", TORCH_SCALER), (16, "float16", "float32", TORCH_SCALER),
    ("16", "float16", "float32", TORCH_SCALER), ("bf16-mixed", "bfloat16", "float32", NO_SCALING),
    ("bf16", "bfloat16", "float32", NO_SCALING), ("32-true", "float32", "float32", NO_SCALING),
    (32, "float32", "float32", NO_SCALING), ("32", "float32", "float32", NO_SCALING),
    ("bf16-true", "bfloat16", "bfloat16", NO_SCALING), ("16-true", "float16", "float16", NO_SCALING),
])
def test_lightning_precisions(precision, compute, param, scaling):
    c = recipes.from_lightning(precision, api="fabric")
    assert c.result == Policy(compute_dtype=compute, param_dtype=param, output_dtype="float32", reduce_dtype=param,
                              loss_scale=scaling)
    assert c.exact
    mixed = str(_LIGHTNING_ALIASES.get(precision, precision)).endswith("-mixed")
    trainer = recipes.from_lightning(precision, api="trainer")  # the Trainer does not convert outputs
    assert trainer.result == c.result.replace(output_dtype=compute)
    assert [loss.setting for loss in trainer.losses] == (["output_dtype"] if mixed else [])
    unsaid = recipes.from_lightning(precision)  # read as Fabric; a mixed precision says the Trainer differs
    assert unsaid.result == c.result and [loss.setting for loss in unsaid.losses] == (["output_dtype"] if mixed else [])
    back = recipes.to_lightning(c.result)
    assert back.exact and back.result["precision"] == _LIGHTNING_ALIASES.get(precision, precision)


@pytest.mark.parametrize("precision", ["64-true", 64, "64", "transformer-engine", "transformer-engine-float16"])
def test_lightning_precisions_ampbridge_cannot_hold(precision):
    with pytest.raises(UnsupportedOptionError, match="cannot be read"):
        recipes.from_lightning(precision)


def test_lightning_bad_precision():
    with pytest.raises(PolicyError, match="precision: not a Lightning precision; received '16-mxed'.*did you mean '16-mixed'"):
        recipes.from_lightning("16-mxed")
    with pytest.raises(PolicyError, match="not a Lightning precision"):
        recipes.from_lightning(True)


# --- Keras, jmp --------------------------------------------------------------------------------------

def test_keras_policies():
    c = recipes.from_keras("mixed_float16")
    assert c.result == Policy(compute_dtype="float16", output_dtype="float16",
                              loss_scale=LossScaleConfig(mode="dynamic", initial_scale=2.0**15, growth_interval=2000))
    assert recipes.from_keras("mixed_bfloat16").result == Policy(compute_dtype="bfloat16", output_dtype="bfloat16",
                                                                  loss_scale=NO_SCALING)
    assert recipes.from_keras("bfloat16").result == Policy(compute_dtype="bfloat16", param_dtype="bfloat16",
                                                            output_dtype="bfloat16", loss_scale=NO_SCALING)
    lso = json.loads((HERE / "keras_loss_scale_optimizer.json").read_text())
    with_lso = recipes.from_keras("mixed_float16", loss_scale_optimizer=lso).result
    assert with_lso.loss_scale == LossScaleConfig(mode="dynamic", initial_scale=32768.0, growth_interval=1000)
    assert recipes.load(HERE / "keras_loss_scale_optimizer.json").result == with_lso.loss_scale
    with pytest.raises(UnsupportedOptionError, match="quantized"):
        recipes.from_keras("int8_from_mixed_bfloat16")
    with pytest.raises(PolicyError, match="not a Keras dtype policy name.*did you mean 'mixed_float16'"):
        recipes.from_keras("mixed_foat16")


def test_keras_export_fixes_factors_and_has_no_output_dtype():
    import ampbridge

    out = recipes.to_keras(ampbridge.preset("mixed_float16").replace(
        output_dtype="float16", loss_scale=LossScaleConfig(mode="dynamic", backoff_factor=0.25, initial_scale=2.0**15)))
    assert out.result == {"dtype_policy": "mixed_float16",
                          "loss_scale_optimizer": {"initial_scale": 32768.0, "dynamic_growth_steps": 2000},
                          "loss_scale_factor": None}
    assert settings(out) == ["loss_scale.backoff_factor"]
    static = recipes.to_keras(Policy(compute_dtype="float16", param_dtype="float16", output_dtype="float16",
                                     loss_scale=LossScaleConfig(mode="static", initial_scale=512.0,
                                                                skip_nonfinite=False)))
    assert static.result["loss_scale_factor"] == 512.0 and static.exact
    back = recipes.from_keras("float16", loss_scale_factor=512.0).result
    assert back.loss_scale == LossScaleConfig(mode="static", initial_scale=512.0, skip_nonfinite=False)


@pytest.mark.parametrize("text,expected", [
    ("params=float32,compute=bfloat16,output=float32", ("float32", "bfloat16", "float32")),
    ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
    ("c=f16", ("float32", "float16", "float16")),
    ("p=f16,c=bf16", ("float16", "bfloat16", "bfloat16")),
    ("half", ("float16", "float16", "float16")),
    ("full", ("float32", "float32", "float32")),
    ("bf16", ("bfloat16", "bfloat16", "bfloat16")),
    ("p=full,c=half", ("float32", "float16", "float16")),
])
def test_jmp_policy_strings(text, expected):
    p = recipes.from_jmp(text).result
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected
    assert recipes.from_jmp(recipes.to_jmp(p).result).result == p


def test_jmp_half_on_tpu_and_errors():
    assert recipes.from_jmp("c=half", half="bfloat16").result.compute_dtype == "bfloat16"
    with pytest.raises(PolicyError, match=r"malformed item 'p=f16=x' in jmp policy 'p=f16=x'"):
        recipes.from_jmp("p=f16=x")
    with pytest.raises(PolicyError, match=r"malformed item 'c' in jmp policy 'p=f32,c'"):
        recipes.from_jmp("p=f32,c")
    with pytest.raises(PolicyError, match=r"unknown key ' c' in item ' c=bf16'.*jmp does not strip spaces"):
        recipes.from_jmp("p=f32, c=bf16")
    with pytest.raises(PolicyError, match=r"unknown key 'compte'.*did you mean 'compute'"):
        recipes.from_jmp("compte=bf16")
    with pytest.raises(PolicyError, match=r"unknown dtype 'fp8' in item 'c=fp8'"):
        recipes.from_jmp("c=fp8")
    with pytest.raises(PolicyError, match="compute is given twice"):
        recipes.from_jmp("c=f16,compute=bf16")
    with pytest.raises(UnsupportedOptionError, match="float64"):
        recipes.from_jmp("f64")


# --- GradScaler, Flax --------------------------------------------------------------------------------

def test_grad_scaler_state_dict_and_arguments():
    c = recipes.load(HERE / "grad_scaler_state.json")
    assert c.source_format == "grad-scaler"
    assert c.result == TORCH_SCALER.replace(initial_scale=8192.0)
    assert c.state == LossScaleState(scale=8192.0, good_steps=1234, hysteresis_left=1)
    assert recipes.from_grad_scaler({"init_scale": 2.0**10, "growth_interval": 50}).result == \
        TORCH_SCALER.replace(initial_scale=1024.0, growth_interval=50)
    assert recipes.from_grad_scaler({"enabled": False}).result == NO_SCALING
    assert recipes.from_grad_scaler(state_dict={}).result == NO_SCALING
    with pytest.raises(PolicyError, match="missing _growth_tracker"):
        recipes.from_grad_scaler(state_dict={"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                             "growth_interval": 10})


def test_grad_scaler_export_writes_float32_factors():
    out = recipes.to_grad_scaler(LossScaleConfig(mode="dynamic", growth_factor=1.1, backoff_factor=0.9))
    assert out.result["growth_factor"] == f32(1.1) and out.result["backoff_factor"] == f32(0.9)
    assert out.exact and any("float32 value" in n for n in out.notes)
    lossy = recipes.to_grad_scaler(LossScaleConfig(mode="dynamic", hysteresis=2, min_scale=1.0, max_scale=2.0**24))
    assert settings(lossy) == ["loss_scale.hysteresis", "loss_scale.min_scale", "loss_scale.max_scale"]


def test_flax_growth_interval_is_one_longer():
    c = recipes.load(HERE / "flax_dynamic_scale.json")
    assert c.source_format == "flax"
    assert c.result == LossScaleConfig(mode="dynamic", initial_scale=32768.0, growth_interval=2001,
                                       min_scale=float.fromhex("0x1p-126"))
    assert c.state == LossScaleState(scale=32768.0, good_steps=17, hysteresis_left=1)
    assert any("float32 max" in n for n in c.notes)
    assert recipes.from_flax({"minimum_scale": None}).result.min_scale is None
    assert recipes.to_flax(c.result).result == {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                                                "scale": 32768.0, "minimum_scale": float.fromhex("0x1p-126")}
    with pytest.raises(PolicyError, match="fin_stepz: unknown key"):
        recipes.from_flax({"fin_stepz": 1})


def flax_dynamic_scale(growth_factor, backoff_factor, growth_interval, scale, minimum_scale, fin_steps, finite_seq):
    """flax/training/dynamic_scale.py DynamicScale.value_and_grad's update, transcribed on float32 values."""
    out = []
    for finite in finite_seq:
        grow = fin_steps == growth_interval
        fin_scale = min(f32(scale * f32(growth_factor)), 3.4028234663852886e38) if grow and finite else scale
        inf_scale = f32(scale * f32(backoff_factor))
        if minimum_scale is not None:
            inf_scale = max(inf_scale, f32(minimum_scale))
        scale = fin_scale if finite else inf_scale
        fin_steps = 0 if (grow or not finite) else fin_steps + 1
        out.append((scale, fin_steps))
    return out


def test_flax_conversion_follows_flax_trajectory():
    import random

    from ampbridge import trajectory

    rng = random.Random(3)
    seq = [rng.random() > 0.08 for _ in range(3000)]
    kwargs = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7, "scale": 1024.0,
              "minimum_scale": 1.0, "fin_steps": 0}
    cfg = recipes.from_flax(kwargs).result
    got = [(s.scale, s.good_steps) for s in trajectory(cfg, [not f for f in seq])]
    assert got == flax_dynamic_scale(**kwargs, finite_seq=seq)


# --- detection, bare names, FSDP --------------------------------------------------------------------------

@pytest.mark.parametrize("name,fmt", [
    ("ds_zero2_hf_auto.json", "deepspeed"), ("ds_bf16_zero3.json", "deepspeed"), ("accelerate_fp16.yaml", "accelerate"),
    ("keras_loss_scale_optimizer.json", "keras"), ("grad_scaler_state.json", "grad-scaler"),
    ("flax_dynamic_scale.json", "flax"), ("lightning_precision.txt", "lightning"), ("jmp_policy.txt", "jmp"),
    ("amp_bf16.toml", "ampbridge"),
])
def test_detected_from_content(name, fmt):
    assert recipes.load(HERE / name).source_format == fmt


def test_ambiguous_input_asks_which():
    with pytest.raises(PolicyError, match="'bf16' means different things in lightning, jmp"):
        recipes.loads("bf16")
    assert recipes.loads("bf16", "jmp").result.param_dtype == "bfloat16"
    assert recipes.loads("float32").source_format == "keras"  # Keras and jmp agree
    with pytest.raises(PolicyError, match="grad-scaler or flax.*growth_interval N is Flax's N - 1"):
        recipes.detect({"growth_interval": 100, "scale": 1.0})
    with pytest.raises(PolicyError, match="cannot tell which tool's settings"):
        recipes.detect({"colour": "blue"})


def test_fsdp_settings_and_pinned_modules():
    import ampbridge

    policy = ampbridge.preset("mixed_bfloat16").replace(
        keep_float32=("kind:norm",), overrides=(ampbridge.Rule(("decoder.*.attn",), compute_dtype="float32"),))
    layers = [ampbridge.Layer("", None, "Model"), ampbridge.Layer("decoder", None, "Decoder"),
              ampbridge.Layer("decoder.0", None, "Block"), ampbridge.Layer("decoder.0.attn", "attention", "Attn", 10),
              ampbridge.Layer("decoder.0.attn.norm", "norm", "LayerNorm", 2),
              ampbridge.Layer("decoder.0.mlp", "linear", "Linear", 10), ampbridge.Layer("norm", "norm", "LayerNorm", 2)]
    plan = ampbridge.build_plan(layers, policy)
    c = recipes.to_fsdp(policy, plan)
    root, (pin, attn) = c.result["root"], c.result["pinned"]
    assert root["fsdp2"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": "float32",
                             "cast_forward_inputs": True}
    assert root["fsdp1"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "buffer_dtype": "bfloat16",
                             "keep_low_precision_grads": False, "cast_forward_inputs": False,
                             "cast_root_forward_inputs": True, "module_classes_to_ignore": ()}
    assert (pin["label"], pin["patterns"], pin["paths"]) == ("keep_float32[0]", ("kind:norm",), ("norm",))
    # a rule that leaves out output_dtype delivers its compute dtype
    assert (attn["label"], attn["paths"], attn["fsdp2"]["param_dtype"], attn["fsdp2"]["output_dtype"]) == \
        ("override[0]", ("decoder.0.attn",), "float32", "float32")
    # decoder.0.attn.norm is float32 inside a float32 unit: it needs no wrap of its own
    assert "decoder.0.attn.norm" not in pin["paths"]
    assert c.exact
    assert recipes.to_fsdp(policy).result["pinned"][0]["paths"] is None  # without a plan: patterns only


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(recipes, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 20


def test_recipes_import_no_framework():
    import subprocess
    import sys

    code = ("import sys, ampbridge; r = ampbridge.recipes; r.load(%r); r.to_fsdp(ampbridge.preset('mixed_bfloat16')); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax', 'optax', 'deepspeed', "
            "'accelerate', 'lightning', 'numpy') if m in sys.modules))" % str(HERE / "ds_zero2_hf_auto.json"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# --- configs the tools accept, read; keys that change numerics, named ----------------------------------

def test_ds_configs_the_tool_accepts_are_read_and_ignored_keys_are_named():
    # bf16 with torch_autocast: DeepSpeed 0.19.8 trains it (autocast over the bf16 module)
    both = recipes.from_deepspeed({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
                                   "zero_optimization": {"stage": 3}})
    assert both.result.compute_dtype == "bfloat16" and settings(both) == ["torch_autocast.enabled"]
    # DeepSpeed refuses "bfp16" (get_communication_data_type accepts fp16, bf16, fp32)
    with pytest.raises(PolicyError, match="communication_data_type: not a DeepSpeed communication data type"):
        recipes.from_deepspeed({"bf16": {"enabled": True}, "communication_data_type": "bfp16"})
    quantized = recipes.from_deepspeed({"bf16": {"enabled": True}, "seq_parallel_communication_data_type": "bf16",
                                        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                              "zero_quantized_weights": True}})
    assert settings(quantized) == ["seq_parallel_communication_data_type", "zero_optimization.zero_quantized_gradients",
                                   "zero_optimization.zero_quantized_weights"]
    assert recipes.from_deepspeed({"seq_parallel_communication_data_type": "fp32"}).exact


def test_accelerate_fills_the_missing_precision_section_as_deepspeedplugin_does():
    # transformers' ds_config_zero2.json style: no bf16 section at all; Accelerate adds {"bf16": {"enabled": true}}
    c = recipes.from_deepspeed({"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}, auto="bf16")
    assert c.result.compute_dtype == "bfloat16" and any("set_mixed_precision adds bf16" in n for n in c.notes)
    fp16 = recipes.from_deepspeed({"zero_optimization": {"stage": 2}}, auto="fp16", version="0.17.0")
    assert fp16.result.loss_scale == DS_FP16 and fp16.exact
    with pytest.raises(PolicyError, match="Accelerate raises"):
        recipes.from_deepspeed({"fp16": {"enabled": True}}, auto="bf16")
    assert recipes.from_deepspeed({"zero_optimization": {"stage": 2}}, auto="no").result.compute_dtype == "float32"


def test_accelerate_unquoted_no_parallelism_config_and_cpu():
    c = recipes.from_accelerate({"distributed_type": False, "mixed_precision": "bf16",
                                 "parallelism_config": {"parallelism_config_tp_size": 1}})
    assert c.result.compute_dtype == "bfloat16" and c.exact
    assert any("YAML 1.1's false; read as 'NO'" in n for n in c.notes)
    cpu = recipes.from_accelerate({"mixed_precision": "fp16"}, device="cpu")  # no autocast, no scaler on CPU
    assert cpu.result == Policy(loss_scale=NO_SCALING) and cpu.exact
    assert recipes.from_accelerate({"mixed_precision": "fp16", "use_cpu": True}).result.compute_dtype == "float32"


def test_grad_scaler_factors_torch_applies_as_doubles_are_a_loss_naming_where_they_part():
    c = recipes.from_accelerate({"mixed_precision": "fp16"}, grad_scaler_kwargs={"growth_factor": 1.1})
    assert settings(c) == ["grad_scaler_kwargs.growth_factor"]
    assert "growth number 7 (127711.1328125 in torch, 127711.140625 here)" in c.losses[0].reason
    assert recipes.from_grad_scaler({"growth_factor": 1.5, "backoff_factor": 0.25}).exact  # float32 numbers


@pytest.mark.parametrize("fmt", ["grad-scaler", "optax", "flax"])
def test_loss_scale_only_formats_name_the_rest_of_a_policy_as_lost(fmt):
    """GradScaler, optax and DynamicScale arguments hold the loss scale only: a whole policy's pins and
    [fp8] table are named as lost (they used to be dropped without a word, --strict passing)."""
    from ampbridge.core.policy import Fp8Config

    p = Policy(compute_dtype="float16", keep_float32=("kind:norm",), fp8=Fp8Config(match=("kind:linear",)))
    lost = {loss.setting for loss in recipes.write(p, fmt).losses}
    assert {"fp8", "keep_float32"} <= lost
    # a bare LossScaleConfig is the loss scale alone: nothing else to lose
    only = recipes.write(LossScaleConfig(mode="dynamic"), fmt).losses
    assert not {loss.setting for loss in only} & {"fp8", "keep_float32"}
