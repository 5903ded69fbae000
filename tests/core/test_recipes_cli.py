"""``ampbridge convert`` and ``ampbridge check``: exit codes, outputs, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ampbridge
from ampbridge.cli.commands import main

HERE = Path(__file__).parent / "recipes"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_deepspeed_to_a_policy(capsys):
    code, out, err = run(capsys, "convert", HERE / "ds_fp16_dynamic.json", "--deepspeed-release", "modulo")
    assert code == 0 and err.count("lost:") == 0
    policy = ampbridge.loads(out)
    assert policy.compute_dtype == "float16" and policy.loss_scale.hysteresis == 2
    assert policy == ampbridge.recipes.load(HERE / "ds_fp16_dynamic.json", release="modulo").result


def test_convert_lists_losses_and_strict_fails_writing_nothing(capsys, tmp_path):
    out_file = tmp_path / "amp.toml"
    code, out, err = run(capsys, "convert", HERE / "ds_zero2_hf_auto.json", "-o", out_file)
    assert code == 0 and out_file.exists()
    assert "lost: fp16.enabled = 'auto'" in err and "lost: bf16.enabled = 'auto'" in err
    assert "2 settings could not be expressed (deepspeed -> ampbridge)" in err
    out_file.unlink()
    code, out, err = run(capsys, "convert", HERE / "ds_zero2_hf_auto.json", "-o", out_file, "--strict")
    assert code == 1 and not out_file.exists() and "--strict: nothing written" in err
    code, out, err = run(capsys, "convert", HERE / "ds_zero2_hf_auto.json", "--auto", "bf16", "--strict")
    assert code == 0 and ampbridge.loads(out).compute_dtype == "bfloat16"


def test_convert_between_tools(capsys):
    code, out, err = run(capsys, "convert", HERE / "accelerate_fp16.yaml", "--to", "lightning")
    assert code == 0 and json.loads(out) == {"precision": "16-mixed", "grad_scaler": None} and "lost" not in err
    code, out, err = run(capsys, "convert", "bf16-mixed", "--to", "accelerate")
    assert code == 0 and out == "mixed_precision: 'bf16'\n"
    code, out, err = run(capsys, "convert", "lightning:16-true", "--to", "deepspeed")
    assert code == 0 and json.loads(out)["fp16"]["fp16_master_weights_and_grads"] is True
    assert "lost: output_dtype = 'float32'" in err
    code, out, err = run(capsys, "convert", "p=f32,c=bf16,o=f32", "--to", "keras")
    assert code == 0 and json.loads(out)["dtype_policy"] == "mixed_bfloat16"
    code, out, err = run(capsys, "convert", HERE / "amp_bf16.toml", "--to", "fsdp")
    assert code == 0 and json.loads(out)["pinned"][0]["patterns"] == ["kind:norm"]
    code, out, err = run(capsys, "convert", HERE / "grad_scaler_state.json", "--to", "flax")
    assert code == 0 and json.loads(out)["growth_interval"] == 1999 and "good_steps=1234" in err


def test_convert_writes_yaml_and_json_policies(capsys, tmp_path):
    for suffix in (".yaml", ".json"):
        out_file = tmp_path / f"amp{suffix}"
        assert run(capsys, "convert", "16-mixed", "-o", out_file)[0] == 0
        assert ampbridge.load(out_file) == ampbridge.recipes.from_lightning("16-mixed").result
    code, out, _ = run(capsys, "convert", HERE / "flax_dynamic_scale.json")
    assert code == 0 and out.startswith("# only loss-scale settings: flax")
    assert ampbridge.loads(out).loss_scale.growth_interval == 2001


def test_convert_bad_input_and_usage(capsys, tmp_path):
    code, _, err = run(capsys, "convert", tmp_path / "missing.json")
    assert code == 1 and "missing.json: no such file" in err
    code, _, err = run(capsys, "convert", "bf16")
    assert code == 1 and "'bf16' means different things in lightning, jmp" in err
    code, _, err = run(capsys, "convert", "transformer-engine")
    assert code == 1 and "fp8" in err and "Traceback" not in err
    bad = tmp_path / "ds.json"
    bad.write_text('{"fp16": {"enabled": true, "hysterisis": 2}}')
    code, _, err = run(capsys, "convert", bad)
    assert code == 1 and f"{bad}:1: fp16.hysterisis: unknown key" in err and "did you mean 'hysteresis'" in err
    code, _, err = run(capsys, "convert", HERE / "grad_scaler_state.json", "--to", "deepspeed")
    assert code == 2 and "holds only a loss scale" in err or "hold only a loss scale" in err
    with pytest.raises(SystemExit) as e:
        main(["convert", "16-mixed", "--auto", "fp17"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["convert", "16-mixed", "--to", "tensorflow"])
    assert e.value.code == 2


def test_check_catches_fp16_deepspeed_against_a_bf16_trainer(capsys, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    code, out, err = run(capsys, "check", HERE / "amp_bf16.toml", "--against", ds, HERE / "accelerate_fsdp_bf16.yaml")
    assert code == 1
    assert "vs " + str(ds) + " (deepspeed):" in out
    assert "compute_dtype: policy 'bfloat16', deepspeed 'float16' (fp16.enabled)" in out
    assert "keep_float32: policy ['kind:norm'], deepspeed none (fp16.enabled (casts the whole module))" in out
    assert "reduce_dtype: policy 'float32', accelerate 'bfloat16'" in out
    assert "torch.autocast still runs its float32-list ops" in out


def test_check_agreement_and_auto_filled_by_the_trainer(capsys):
    policy = HERE / "accelerate_fp16.yaml"
    code, out, err = run(capsys, "check", policy, "--against", "lightning:16-mixed")
    assert code == 0 and "agrees" in out and "0 disagreements" in err
    # the HF config's "auto" is filled by the Accelerate file's bf16: DeepSpeed then runs bf16
    code, out, err = run(capsys, "check", "mixed_bfloat16", "--against", HERE / "ds_zero2_hf_auto.json",
                         HERE / "accelerate_fsdp_bf16.yaml")
    assert code == 1
    assert "compute_dtype" not in out.split("(accelerate)")[0]  # DeepSpeed's auto became bf16: no dtype clash
    assert "'auto' filled with bfloat16" in err


def test_check_compares_every_phase(capsys, tmp_path):
    policy = tmp_path / "amp.toml"
    policy.write_text('compute_dtype = "bfloat16"\n[[phase]]\nuntil_epoch = 2\ncompute_dtype = "float32"\n')
    code, out, _ = run(capsys, "check", policy, "--against", "lightning:bf16-mixed")
    assert code == 1
    assert "phase[0] (epoch 0-1) vs lightning:bf16-mixed (lightning): 2 disagreements" in out
    assert "after the schedule (epoch 2+) vs lightning:bf16-mixed (lightning): 1 disagreement" in out


def test_cli_leaves_frameworks_out():
    code = ("import sys; from ampbridge.cli.commands import main; main(['convert', %r, '--to', 'deepspeed']); "
            "main(['check', 'mixed_float16', '--against', %r]); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax', 'optax', 'numpy') "
            "if m in sys.modules))" % (str(HERE / "accelerate_fp16.yaml"), str(HERE / "ds_fp16_dynamic.json")))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_check_with_auto_and_format_prefixes(capsys):
    # --auto reaches only the formats that take it; FORMAT:FILE names the format of a file
    code, out, err = run(capsys, "check", "mixed_bfloat16", "--auto", "bf16", "--against",
                         HERE / "accelerate_fsdp_bf16.yaml", f"deepspeed:{HERE / 'ds_zero2_hf_auto.json'}",
                         "lightning:bf16-mixed")
    assert code == 1 and "Traceback" not in err
    # output and reduce dtype; skip_nonfinite agrees: DeepSpeed 0.19.8's ZeRO 2 skips non-finite bf16 steps
    assert "(deepspeed): 2 disagreements" in out and "compute_dtype" not in out
    code, out, err = run(capsys, "check", "mixed_float16", "--against", f"deepspeed:{HERE / 'ds_zero2_hf_auto.json'}")
    assert code == 1 and "'auto' filled with float16" in err  # no trainer given: the policy's own dtype


def test_deepspeed_version_and_the_old_release_switch(capsys):
    ds = HERE / "ds_fp16_dynamic.json"
    code, out, err = run(capsys, "convert", ds, "--strict")
    # 0.19.8's growth timing is a setting now (issue 38): exact, said once in a note
    assert code == 0 and "first_growth_interval = 1001" in out and "lost:" not in err, err
    assert err.count("PR 6976") == 1  # the long explanation once per conversion
    for option in (["--deepspeed-version", "0.17.0"], ["--deepspeed-release", "modulo"]):
        code, out, err = run(capsys, "convert", ds, "--strict", *option)
        assert code == 0 and "lost:" not in err, err
    code, out, err = run(capsys, "convert", ds, "--deepspeed-version", "0.17.0", "--deepspeed-release",
                         "stable_interval")
    assert code == 2 and "contradicts" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:  # argparse: exit 2 with a one-line message
        run(capsys, "convert", ds, "--deepspeed-version", "latest")
    assert e.value.code == 2 and "expected a release number" in capsys.readouterr().err


def test_device_cpu_reads_what_the_tools_do_there(capsys):
    code, out, err = run(capsys, "convert", "lightning:16-mixed", "--device", "cpu", "--lightning-api", "fabric")
    assert code == 0 and 'compute_dtype = "bfloat16"' in out and "switches to 'bf16-mixed'" in err


def test_convert_reads_and_writes_optax_apply_if_finite(capsys, tmp_path):
    src = tmp_path / "optax.json"
    src.write_text('{"max_consecutive_errors": 3, "notfinite_count": 1}')
    code, out, err = run(capsys, "convert", src)  # detected by its keys
    assert code == 0 and ampbridge.loads(out).loss_scale.max_consecutive_skips == 3
    assert "optax scales no loss" in err
    policy = tmp_path / "p.toml"
    policy.write_text('[loss_scale]\nmode = "none"\nmax_consecutive_skips = 4\n')
    code, out, _ = run(capsys, "convert", policy, "--to", "optax")
    assert code == 0 and json.loads(out) == {"max_consecutive_errors": 4}
