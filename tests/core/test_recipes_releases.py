"""Reading by tool release: Lightning's and Accelerate's rules by version, DeepSpeed's NaN-step cells outside
the measured release (what is known is said with its source; what is not is a named loss)."""

from __future__ import annotations

import doctest

import pytest

from ampbridge import PolicyError, UnsupportedOptionError, recipes
from ampbridge.cli.commands import main
from ampbridge.recipes import deepspeed_releases, tool_releases


@pytest.mark.parametrize("module", [deepspeed_releases, tool_releases])
def test_docstring_examples_run(module):
    assert doctest.testmod(module).failed == 0


def settings(conversion):
    return [loss.setting for loss in conversion.losses]


# --- Lightning ------------------------------------------------------------------------------------------

def test_lightning_default_is_the_current_release_and_exact():
    assert tool_releases.LIGHTNING_CURRENT == "2.6.6"
    c = recipes.from_lightning("bf16-true", api="fabric")
    assert c.exact and c.result.compute_dtype == c.result.param_dtype == "bfloat16"


@pytest.mark.parametrize("precision, version, refused", [
    ("16-mixed", "1.9.5", "'-mixed'/'-true' names came in 2.0.0"),
    ("bf16-mixed", "1.9.5", "'-mixed'/'-true' names came in 2.0.0"),
    ("bf16-true", "2.0.9", "came in Lightning 2.1.0"),
    ("16-true", "2.0.0", "came in Lightning 2.1.0"),
    ("bf16", "1.4.9", "no bfloat16 precision: it came in 1.5.0"),
])
def test_lightning_names_a_release_does_not_accept_are_refused(precision, version, refused):
    with pytest.raises(PolicyError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        recipes.from_lightning(precision, lightning_version=version, api="fabric")


@pytest.mark.parametrize("precision, version, compute", [
    (16, "1.9.5", "float16"), ("bf16", "1.5.0", "bfloat16"), ("bf16-true", "2.1.0", "bfloat16"),
    ("16-mixed", "2.0.0", "float16"),
])
def test_lightning_names_a_release_accepts_read_exactly(precision, version, compute):
    c = recipes.from_lightning(precision, lightning_version=version, api="fabric")
    assert c.exact and c.result.compute_dtype == compute


def test_lightning_16_on_cpu_by_release():
    with pytest.raises(PolicyError, match="raises for precision=16 on CPU"):
        recipes.from_lightning(16, device="cpu", lightning_version="1.4.9", api="fabric")
    assert recipes.from_lightning(16, device="cpu", lightning_version="1.5.0", api="fabric").result.compute_dtype \
        == "bfloat16"


@pytest.mark.parametrize("version, words", [("3.0", "newer than 2.6.6"), ("1.2.0", "older than 1.5.0")])
def test_lightning_outside_the_known_releases_is_a_named_loss(version, words):
    c = recipes.from_lightning("16", lightning_version=version, api="fabric")
    assert settings(c) == ["lightning_version"] and words in c.losses[0].reason


@pytest.mark.parametrize("preset, version, written", [
    ("mixed_float16", "1.9.5", 16), ("mixed_bfloat16", "1.9.5", "bf16"), ("float32", "1.9.5", 32),
    ("mixed_float16", "2.0.0", "16-mixed"), ("bfloat16", "2.1.0", "bf16-true"),
])
def test_lightning_written_as_the_release_spells_it(preset, version, written):
    import ampbridge

    policy = ampbridge.preset(preset)
    out = recipes.to_lightning(policy, lightning_version=version)
    assert out.result["precision"] == written
    back = recipes.from_lightning(written, grad_scaler=out.result["grad_scaler"], lightning_version=version,
                                  api="fabric")
    assert back.result.compute_dtype == policy.compute_dtype


def test_lightning_true_half_before_2_1_is_a_loss_and_bf16_before_1_5_refused():
    import ampbridge

    out = recipes.to_lightning(ampbridge.preset("bfloat16"), lightning_version="2.0.9")
    assert out.result["precision"] == "bf16-mixed" and "param_dtype" in settings(out)
    with pytest.raises(UnsupportedOptionError, match="no bfloat16 precision"):
        recipes.to_lightning(ampbridge.preset("mixed_bfloat16"), lightning_version="1.4.0")


# --- Accelerate -----------------------------------------------------------------------------------------

def test_accelerate_other_releases_are_a_named_loss():
    assert tool_releases.ACCELERATE_CURRENT == "1.16.0"
    config = {"distributed_type": "MULTI_GPU", "mixed_precision": "bf16"}
    assert recipes.from_accelerate(config).exact
    assert recipes.from_accelerate(config, accelerate_version="1.16.0").exact
    newer = recipes.from_accelerate(config, accelerate_version="2.0.0")
    assert settings(newer) == ["accelerate_version"] and "newer than 1.16.0" in newer.losses[0].reason
    old = recipes.from_accelerate(config, accelerate_version="0.12.0")
    assert "PR 906" in old.losses[0].reason
    # under DEEPSPEED the precision is DeepSpeed's, and the Accelerate release is still named
    ds = recipes.from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16"},
                                 accelerate_version="1.2.0")
    assert "accelerate_version" in settings(ds)


def test_cli_tool_versions(capsys, tmp_path):
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\n")
    assert main(["convert", str(yaml), "--accelerate-version", "1.16.0", "--strict"]) == 0
    assert main(["convert", str(yaml), "--accelerate-version", "1.3.0", "--strict"]) == 1
    assert "accelerate_version" in capsys.readouterr().err
    assert main(["convert", "bf16-mixed", "--lightning-api", "fabric", "--lightning-version", "2.6.6",
                 "--strict"]) == 0
    assert main(["convert", "16-mixed", "--lightning-version", "1.9.5"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "came in 2.0.0" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as bad:
        main(["convert", "16-mixed", "--lightning-version", "latest"])
    assert bad.value.code == 2


# --- DeepSpeed: the NaN-step cells by release ----------------------------------------------------------

CELLS = [(precision, stage) for precision in ({"bf16": {"enabled": True}},
                                              {"bf16": {"enabled": True, "check_grad_overflow": False}},
                                              {"bf16": {"enabled": True, "check_grad_overflow": True}}, {})
         for stage in range(4)]


def cell(version, precision, stage):
    return recipes.from_deepspeed({**precision, "zero_optimization": {"stage": stage}}, version=version)


def source_note(c):
    return next(n for n in c.notes if n.startswith("skip_nonfinite for DeepSpeed"))


def test_measured_release_says_so_and_has_no_loss():
    for precision, stage in CELLS:
        c = cell("0.19.8", precision, stage)
        assert "zero_optimization.stage" not in settings(c)
        assert "measured on real DeepSpeed 0.19.8 engines" in source_note(c)


@pytest.mark.parametrize("version", ["0.17.0", "0.19.2", "0.19.3"])
def test_releases_read_from_source_say_so(version):
    for precision, stage in CELLS:
        c = cell(version, precision, stage)
        assert "zero_optimization.stage" not in settings(c), (precision, stage)
        assert f"read from the DeepSpeed {version} sources" in source_note(c)
        assert "not measured" in source_note(c)


@pytest.mark.parametrize("version, side, like", [("0.16.4", "older than the oldest", "0.17.0"),
                                                 ("0.9.3", "older than the oldest", "0.17.0"),
                                                 ("0.20.0", "newer than the newest", "0.19.8")])
def test_releases_outside_those_read_name_a_loss_on_every_bf16_and_fp32_cell(version, side, like):
    for precision, stage in CELLS:
        c = cell(version, precision, stage)
        reason = next(loss.reason for loss in c.losses if loss.setting == "zero_optimization.stage")
        assert side in reason and f"read as {like}" in reason
        assert c.result.loss_scale.skip_nonfinite == cell(like, precision, stage).result.loss_scale.skip_nonfinite
        assert "not read" in source_note(c)
    # fp16 skips an overflowing step in every release: a loss scaler's own check
    fp16 = recipes.from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, version=version)
    assert "zero_optimization.stage" not in settings(fp16) and fp16.result.loss_scale.skip_nonfinite


def test_between_read_releases_a_differing_cell_is_a_loss_an_agreeing_one_is_not():
    differ = cell("0.19.5", {"bf16": {"enabled": True}}, 3)  # 0.19.3 does not skip, 0.19.8 does
    agree = cell("0.19.5", {"bf16": {"enabled": True, "check_grad_overflow": True}}, 2)
    assert "zero_optimization.stage" in settings(differ) and "zero_optimization.stage" not in settings(agree)


def test_writing_for_a_release_outside_those_read_names_the_loss():
    policy = recipes.from_lightning("bf16-mixed", api="fabric").result.replace(output_dtype="bfloat16")
    assert recipes.to_deepspeed(policy, stage=2, version="0.19.8").exact
    c = recipes.to_deepspeed(policy, stage=2, version="0.20.0")
    assert settings(c) == ["loss_scale.skip_nonfinite"] and "not known for DeepSpeed 0.20.0" in c.losses[0].reason
