"""tf.keras 2 recipes (framework-free): Keras 2 policy names and LossScaleOptimizer settings in and out.
tests/backend_tf_keras/test_recipes_native.py runs what to_tf_keras writes in Keras 2 itself."""

import json

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


# --- ampbridge convert --from / --to tf_keras -------------------------------------------------------

def _run(capsys, *argv):
    from ampbridge.cli.commands import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_writes_tf_keras_and_reads_it_back(capsys, tmp_path):
    policy = tmp_path / "amp.toml"
    policy.write_text('extends = "mixed_float16"\noutput_dtype = "float16"\n[loss_scale]\n'
                      'initial_scale = 1024.0\ngrowth_interval = 8\nmin_scale = 1.0\n')
    out_file = tmp_path / "tf_keras.json"
    code, out, err = _run(capsys, "convert", policy, "--to", "tf_keras", "--strict", "-o", out_file)
    assert code == 0 and "lost" not in err
    written = json.loads(out_file.read_text())
    assert written == {"dtype_policy": "mixed_float16",
                       "loss_scale_optimizer": {"dynamic": True, "initial_scale": 1024.0, "dynamic_growth_steps": 8}}
    code, out, err = _run(capsys, "convert", out_file)  # detected: what --to tf_keras writes
    assert code == 0
    back = ampbridge.loads(out)
    assert back.loss_scale == ampbridge.load(policy).loss_scale and back.compute_dtype == "float16"
    # a Keras 2 LossScaleOptimizer.get_config() alone, and a bare name said to be Keras 2's
    lso = tmp_path / "lso.json"
    lso.write_text(json.dumps({"name": "LossScaleOptimizer", "dynamic": False, "initial_scale": 128.0,
                               "dynamic_growth_steps": None}))
    code, out, _ = _run(capsys, "convert", lso)
    assert code == 0 and ampbridge.loads(out).loss_scale.mode == "static"
    code, out, _ = _run(capsys, "convert", "tf_keras:mixed_float16")
    assert code == 0 and ampbridge.loads(out).loss_scale.min_scale == 1.0  # Keras 2's floor


def test_convert_to_tf_keras_names_every_loss_and_strict_fails(capsys, tmp_path):
    code, out, err = _run(capsys, "convert", "mixed_float16", "--to", "tf_keras")  # Keras 3's: no floor
    assert code == 0 and "lost: loss_scale.min_scale = None: Keras 2 halves the scale down to 1" in err
    assert "(keras -> tf_keras)" in err
    out_file = tmp_path / "out.json"
    code, _, err = _run(capsys, "convert", "mixed_float16", "--to", "tf_keras", "--strict", "-o", out_file)
    assert code == 1 and not out_file.exists() and "--strict: nothing written" in err


def test_convert_tf_keras_bad_input_and_usage(capsys, tmp_path):
    bad = tmp_path / "tf_keras.json"
    bad.write_text('{"dtype_policy": "mixed_float16", "loss_scale_optimizer": {"dynamic_growth_stepz": 10}}')
    code, _, err = _run(capsys, "convert", bad)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{bad}:1: loss_scale_optimizer.dynamic_growth_stepz: unknown key" in err and "dynamic_growth_steps" in err
    bad.write_text('{"dtype_policy": "mixed_float17"}')
    code, _, err = _run(capsys, "convert", bad)
    assert code == 1 and f"{bad}: dtype_policy: not a Keras dtype policy name; received 'mixed_float17'" in err
    both = tmp_path / "lso.json"  # dynamic=True: Keras 3's config may say so too, and the two read differently
    both.write_text('{"dynamic": true, "initial_scale": 8.0, "dynamic_growth_steps": 10}')
    code, _, err = _run(capsys, "convert", both)
    assert code == 1 and "could be keras or tf_keras" in err and "--from" in err
    code, out, _ = _run(capsys, "convert", both, "--from", "tf_keras")
    assert code == 0 and ampbridge.loads(out).loss_scale.min_scale == 1.0
    code, _, err = _run(capsys, "convert", both, "--to", "tf_keras", "--from", "tf_keras")
    assert code == 2 and "hold only a loss scale" in err
    with pytest.raises(SystemExit) as e:
        _run(capsys, "convert", "mixed_float16", "--to", "tf-keras")
    assert e.value.code == 2
