import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampbridge.cli.commands import main
from ampbridge._testing import require

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_ok_and_invalid(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('compute_dtype = "fp8"\n[loss_scale]\ngrowth_factor = 0.5\n')
    code, out, err = run(capsys, "validate", str(EXAMPLES / "amp.toml"), str(bad))
    assert code == 1
    assert f"ok: {EXAMPLES / 'amp.toml'}" in out
    assert f"invalid: {bad}" in err
    assert f"{bad}:1: compute_dtype" in err and f"{bad}:3: loss_scale.growth_factor" in err
    assert run(capsys, "validate", str(EXAMPLES / "amp.toml"), str(EXAMPLES / "reference.toml"))[0] == 0


def test_validate_missing_file(capsys):
    code, _, err = run(capsys, "validate", "nope.toml")
    assert code == 1 and "nope.toml: no such file" in err


def test_show_fills_and_marks_defaults(capsys):
    code, out, _ = run(capsys, "show", str(EXAMPLES / "amp.toml"))
    assert code == 0
    assert 'compute_dtype = "float16"  # from preset:mixed_float16' in out
    assert "matmul_precision = \"highest\"  # default" in out
    assert "growth_interval = 10\n" in out
    assert "initial_scale = 65536.0  # default" in out


@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
def test_show_output_loads_back_to_the_same_policy(capsys, fmt):
    import ampbridge

    code, out, err = run(capsys, "show", str(EXAMPLES / "reference.toml"), "--format", fmt)
    assert code == 0
    assert ampbridge.loads(out, fmt) == ampbridge.load(EXAMPLES / "reference.toml")
    if fmt == "json":
        assert "defaults filled: " in err


def test_show_at_a_phase(capsys):
    code, out, _ = run(capsys, "show", str(EXAMPLES / "reference.toml"), "--at", "epoch=1")
    assert code == 0 and 'compute_dtype = "float32"' in out and "[[phase]]" not in out
    assert run(capsys, "show", str(EXAMPLES / "reference.toml"), "--at", "step=3")[0] == 2
    assert run(capsys, "show", str(EXAMPLES / "reference.toml"), "--at", "epoch")[0] == 2


def test_explain_layers_table_and_json(capsys):
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--layers", str(EXAMPLES / "layers.json"))
    assert code == 0 and "block.norm1" in out and "keep_float32[0] kind:norm" in out
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--layers", str(EXAMPLES / "layers.json"),
                       "--format", "json")
    rows = {r["path"]: r for r in json.loads(out)["rows"]}
    assert rows["head"]["compute_dtype"] == "float32" and rows["head"]["rule"] == "override[0]"


def test_explain_all_phases(capsys):
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "reference.toml"), "--layers", str(EXAMPLES / "layers.json"),
                       "--all-phases")
    assert code == 0
    assert "== phase[0] (epoch 0-1)" in out and "== phase[2] (epoch 10+)" in out


def test_explain_bad_usage(tmp_path, capsys):
    # a missing input file is bad input (1) for every command, as for validate and show (issue 23)
    assert run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--layers", str(tmp_path / "none.json"))[0] == 1
    (tmp_path / "l.json").write_text('[{"path": 3, "kind": "nrm"}]')
    code, _, err = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--layers", str(tmp_path / "l.json"))
    assert code == 1 and "unknown kind 'nrm'" in err  # a bad input file, not bad usage (issue 23)
    assert run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--model", "nocolon")[0] == 2
    assert run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--model", "no_such_module_xyz:f")[0] == 2


def test_explain_model_from_a_module(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import ampbridge\n"
        "def build():\n    return [ampbridge.Layer('x', 'norm', 'LN', 2)]\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--model", "mymodels:build")
    assert code == 0 and "keep_float32[0] kind:norm" in out


def test_formats(capsys):
    code, out, _ = run(capsys, "formats")
    assert code == 0 and "float8_e4m3fn" in out and "65504" in out
    code, out, _ = run(capsys, "formats", "--json")
    assert json.loads(out)["bfloat16"]["mantissa_bits"] == 7


def test_schema_validates_every_shipped_example(capsys):
    jsonschema = require("jsonschema")
    import tomllib

    code, out, _ = run(capsys, "schema")
    schema = json.loads(out)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    examples = sorted(EXAMPLES.glob("*.toml"))
    assert len(examples) >= 2
    for path in examples:
        validator.validate(tomllib.loads(path.read_text()))
    assert list(validator.iter_errors({"compute_dtype": "fp8"}))
    assert list(validator.iter_errors({"loss_scale": {"growth_factr": 2}}))


def test_bad_usage_exits_2_without_traceback():
    for argv in (["nosuchcommand"], [], ["show"], ["explain", "x.toml"]):
        proc = subprocess.run([sys.executable, "-m", "ampbridge", *argv], capture_output=True, text=True)
        assert proc.returncode == 2, argv
        assert "Traceback" not in proc.stderr


def test_invalid_policy_exits_1_without_traceback(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("loss_scale: {mode: sometimes}\n")
    proc = subprocess.run([sys.executable, "-m", "ampbridge", "show", str(f)], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "x.yaml:1: loss_scale.mode" in proc.stderr


def test_demo_without_frameworks_shows_the_policy_and_its_plan(capsys):
    code, out, _ = run(capsys, "demo", "--frameworks", "none")
    assert code == 0 and "== policy amp.toml" in out and "growth_interval = 10" in out
    assert "block.norm1" in out and "keep_float32[0] kind:norm" in out


def test_demo_bad_usage(capsys):
    assert run(capsys, "demo", "--frameworks", "tensorflowx")[0] == 2
    assert run(capsys, "demo", "--steps", "2", "--frameworks", "none")[0] == 2


def test_explain_prints_each_note_once_as_a_footnote_and_json_keeps_every_note(tmp_path, capsys, monkeypatch):
    require("torch")
    (tmp_path / "demo_models.py").write_text(
        "from ampbridge.cli.demo import torch_model\ndef build():\n    return torch_model.build(0)\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--model", "demo_models:build")
    assert code == 0 and max(map(len, out.splitlines())) <= 120
    stream = "called from block's own code, which computes in float16"
    assert out.count(stream) == 1  # block.norm1 and block.norm2 share it: one footnote, two references
    number = re.search(r"\[(\d+)\] " + re.escape(stream), out).group(1)
    assert sum(1 for line in out.splitlines() if re.match(r"\s*block\.norm[12]\b.*\b" + number + r"\b", line)) == 2
    code, out, _ = run(capsys, "explain", str(EXAMPLES / "amp.toml"), "--model", "demo_models:build",
                       "--format", "json")
    rows = {r["path"]: r for r in json.loads(out)["rows"]}
    assert rows["block.norm1"]["note"].startswith(stream) and rows["block.norm2"]["note"] == rows["block.norm1"]["note"]
