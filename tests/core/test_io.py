import json
from pathlib import Path

import pytest

import ampbridge
from ampbridge import Policy, PolicyError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

TOML = """\
version = 1
compute_dtype = "fp16"
keep_float32 = ["kind:norm", "lm_head"]

[[override]]
match = "decoder.**.attn"
compute_dtype = "float32"

[loss_scale]
growth_interval = 100
min_scale = 1.0
"""


def expected():
    return Policy(compute_dtype="float16", keep_float32=("kind:norm", "lm_head"),
                  overrides=(ampbridge.Rule("decoder.**.attn", compute_dtype="float32"),),
                  loss_scale=ampbridge.LossScaleConfig(growth_interval=100, min_scale=1.0))


def test_the_three_formats_and_pyproject_carry_the_same_policy(tmp_path):
    (tmp_path / "amp.toml").write_text(TOML)
    (tmp_path / "amp.yaml").write_text(
        "compute_dtype: fp16\nkeep_float32: [kind:norm, lm_head]\noverride:\n"
        "  - match: decoder.**.attn\n    compute_dtype: float32\nloss_scale:\n  growth_interval: 100\n  min_scale: 1.0\n")
    (tmp_path / "amp.json").write_text(json.dumps({
        "compute_dtype": "fp16", "keep_float32": ["kind:norm", "lm_head"],
        "override": [{"match": "decoder.**.attn", "compute_dtype": "float32"}],
        "loss_scale": {"growth_interval": 100, "min_scale": 1.0}}))
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.ampbridge]\ncompute_dtype = "fp16"\nkeep_float32 = ["kind:norm", "lm_head"]\n'
        '[[tool.ampbridge.override]]\nmatch = "decoder.**.attn"\ncompute_dtype = "float32"\n'
        '[tool.ampbridge.loss_scale]\ngrowth_interval = 100\nmin_scale = 1.0\n')
    for name in ("amp.toml", "amp.yaml", "amp.json", "pyproject.toml"):
        p = ampbridge.load(tmp_path / name)
        assert p == expected(), name
        assert p.source == str(tmp_path / name)


def test_pyproject_without_the_table(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(PolicyError, match=r"no \[tool.ampbridge\] table"):
        ampbridge.load(tmp_path / "pyproject.toml")


@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
def test_dumps_round_trips_exactly_and_is_canonical(fmt):
    for p in [expected(), ampbridge.load(EXAMPLES / "reference.toml"), ampbridge.load(EXAMPLES / "amp.toml")] + [
            ampbridge.preset(n) for n in ampbridge.PRESETS]:
        text = ampbridge.dumps(p, fmt)
        again = ampbridge.loads(text, fmt)
        assert again == p
        assert ampbridge.dumps(again, fmt) == text


def test_dump_and_load_a_file(tmp_path):
    p = ampbridge.load(EXAMPLES / "reference.toml")
    for name in ("out.toml", "out.yml", "out.json"):
        ampbridge.dump(p, tmp_path / name)
        assert ampbridge.load(tmp_path / name) == p
    with pytest.raises(PolicyError, match="cannot tell the format"):
        ampbridge.dump(p, tmp_path / "out.txt")


def test_errors_name_file_line_key_value_and_accepted(tmp_path):
    f = tmp_path / "amp.toml"
    f.write_text('version = 1\ncompute_dtype = "float16"\n\n[loss_scale]\nbackoff_factor = 2.0\n')
    with pytest.raises(PolicyError) as info:
        ampbridge.load(f)
    e = info.value
    assert (e.file, e.line, e.key, e.value) == (str(f), 5, "loss_scale.backoff_factor", 2.0)
    assert "strictly between 0 and 1" in e.accepted
    assert str(e).startswith(f"{f}:5: loss_scale.backoff_factor:")


@pytest.mark.parametrize("name,text,line,key", [
    ("a.yaml", "compute_dtype: float16\nloss_scale:\n  growth_interval: -3\n", 3, "loss_scale.growth_interval"),
    ("a.json", '{\n  "compute_dtype": "float16",\n  "override": [\n    {"match": "x", "param_dtype": "f8"}\n  ]\n}\n',
     4, "override[0].param_dtype"),
    ("a.toml", 'keep_float32 = [\n  "kind:norm",\n]\n\n[[override]]\nmatch = "a"\n\n[[override]]\nmatch = "re:(b"\n'
     'compute_dtype = "float32"\n', 9, "override[1].match[0]"),
])
def test_line_numbers_in_every_format(tmp_path, name, text, line, key):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(PolicyError) as info:
        ampbridge.load(f)
    problems = {p.key: p for p in info.value.problems}
    assert key in problems, [str(p) for p in info.value.problems]
    assert problems[key].line == line


def test_misspelt_keys_get_did_you_mean():
    with pytest.raises(PolicyError) as info:
        ampbridge.loads('compute_dtyp = "float16"\n[loss_scale]\ngrowth_intervall = 10\n')
    text = str(info.value)
    assert "did you mean 'compute_dtype'" in text and "did you mean 'growth_interval'" in text
    with pytest.raises(PolicyError, match="belongs in the \\[loss_scale\\] table"):
        ampbridge.loads("growth_interval = 10\n")


def test_syntax_errors_are_policy_errors_with_lines(tmp_path):
    # a trailing comma: Python < 3.13 reports the "}" (line 3, "Expecting property name"), 3.13+
    # the comma itself (line 2, "Illegal trailing comma"); both name the file and a line
    cases = {"bad.toml": ("a = 1\nb = = 2\n", {2}), "bad.json": ('{\n  "a": 1,\n}\n', {2, 3}),
             "bad.yaml": ("a: [1, 2\nb: 3\n", {2})}
    for name, (text, lines) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(PolicyError) as info:
            ampbridge.load(tmp_path / name)
        assert info.value.line in lines, name
        assert info.value.file == str(tmp_path / name)


def test_yaml_python_tags_are_refused_never_run(tmp_path):
    marker = tmp_path / "ran"
    f = tmp_path / "evil.yaml"
    f.write_text(f'compute_dtype: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(PolicyError, match="safe loader"):
        ampbridge.load(f)
    assert not marker.exists()


def test_duplicate_keys_are_errors_in_json_and_yaml():
    with pytest.raises(PolicyError, match="duplicate key 'compute_dtype'"):
        ampbridge.loads('{"compute_dtype": "float16", "compute_dtype": "float32"}', format="json")
    with pytest.raises(PolicyError, match="duplicate key 'compute_dtype'"):
        ampbridge.loads("compute_dtype: float16\ncompute_dtype: float32\n", format="yaml")


def test_wrong_shapes():
    for doc, message in [("[1, 2]", "table/mapping at the top level"),
                         ('{"loss_scale": 3}', "must be a table"),
                         ('{"override": {"match": "x"}}', "array of tables"),
                         ('{"phase": [1]}', "array of tables")]:
        with pytest.raises(PolicyError, match=message):
            ampbridge.loads(doc, format="json")


def test_version_must_be_1():
    with pytest.raises(PolicyError, match="unsupported policy file version"):
        ampbridge.loads("version = 2")
    with pytest.raises(PolicyError, match="unsupported"):
        ampbridge.loads('version = "1"')


def test_null_means_absent_for_optional_keys_only():
    p = ampbridge.loads('{"loss_scale": {"min_scale": null}, "reduce_dtype": null}', format="json")
    assert p.loss_scale.min_scale is None and p.reduce_dtype == "float32"
    with pytest.raises(PolicyError, match="growth_factor"):
        ampbridge.loads('{"loss_scale": {"growth_factor": null}}', format="json")


def test_extends_a_preset_merging_tables_key_by_key():
    p = ampbridge.loads('extends = "mixed_float16"\n[loss_scale]\ngrowth_interval = 5\n')
    assert p.compute_dtype == "float16" and p.loss_scale.mode == "dynamic"
    assert p.loss_scale.growth_interval == 5


def test_extends_a_relative_file_chain(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "root.yaml").write_text("compute_dtype: bf16\nkeep_float32: [kind:norm]\nloss_scale:\n  hysteresis: 2\n")
    (tmp_path / "base" / "mid.toml").write_text('extends = "root.yaml"\nparam_dtype = "bf16"\n[loss_scale]\nmin_scale = 2.0\n')
    (tmp_path / "top.json").write_text('{"extends": "base/mid.toml", "keep_float32": ["kind:embedding"]}')
    p, origins = ampbridge.core.io.load_with_origins(tmp_path / "top.json")
    assert (p.compute_dtype, p.param_dtype, p.keep_float32) == ("bfloat16", "bfloat16", ("kind:embedding",))
    assert (p.loss_scale.hysteresis, p.loss_scale.min_scale) == (2, 2.0)
    assert origins["compute_dtype"].endswith("root.yaml")
    assert origins["keep_float32"].endswith("top.json")
    assert origins["loss_scale.min_scale"].endswith("mid.toml")
    assert "growth_factor" not in origins  # defaulted


def test_extends_errors(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(PolicyError, match=r"cycle: a.toml -> b.toml -> a.toml"):
        ampbridge.load(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('extends = "mixed_flaot16"\n')
    with pytest.raises(PolicyError, match="did you mean 'mixed_float16'"):
        ampbridge.load(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text('extends = "base.toml"\n')
    (tmp_path / "base.toml").write_text('[loss_scale]\ngrowth_factor = 0.1\n')
    with pytest.raises(PolicyError) as info:
        ampbridge.load(tmp_path / "d.toml")
    assert info.value.file == str((tmp_path / "base.toml").resolve()) and info.value.line == 2


def test_loads_extends_relative_to_base_dir(tmp_path):
    (tmp_path / "base.toml").write_text('compute_dtype = "bf16"\n')
    assert ampbridge.loads('extends = "base.toml"', base_dir=tmp_path).compute_dtype == "bfloat16"


def test_presets():
    assert ampbridge.preset("float32") == Policy()
    b = ampbridge.preset("bfloat16")
    assert (b.compute_dtype, b.param_dtype, b.output_dtype) == ("bfloat16",) * 3
    f = ampbridge.preset("float16")
    assert f.param_dtype == "float16" and f.resolved_loss_scale.mode == "dynamic"
    assert ampbridge.preset("mixed_bfloat16").resolved_loss_scale.mode == "none"
    with pytest.raises(PolicyError, match="did you mean 'mixed_bfloat16'"):
        ampbridge.preset("mixed_bfloat")


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(PolicyError, match="no such file"):
        ampbridge.load(tmp_path / "nope.toml")
    (tmp_path / "amp.ini").write_text("")
    with pytest.raises(PolicyError, match="cannot tell the policy format"):
        ampbridge.load(tmp_path / "amp.ini")


def test_from_dict_is_the_inverse_of_to_dict():
    p = ampbridge.load(EXAMPLES / "reference.toml")
    assert Policy.from_dict(p.to_dict()) == p
    assert json.loads(json.dumps(p.to_dict())) == p.to_dict()


@pytest.mark.parametrize("bad", ["a\x00b.toml", "\ud800.toml", "x" * 5000 + ".toml"])
def test_unusable_extends_paths_are_policy_errors(bad):
    with pytest.raises(PolicyError, match="extends"):
        ampbridge.loads(json.dumps({"extends": bad}), format="json")


def test_from_dict_resolves_a_preset_and_refuses_a_file():
    p = Policy.from_dict({"extends": "mixed_float16", "loss_scale": {"growth_interval": 10}})
    assert p.compute_dtype == "float16" and p.loss_scale.mode == "dynamic" and p.loss_scale.growth_interval == 10
    with pytest.raises(PolicyError, match="from_dict resolves a preset"):
        Policy.from_dict({"extends": "base.toml"})


@pytest.mark.parametrize("name, text", [("amp.toml", ""), ("amp.toml", "# only a comment\n"), ("amp.json", "{}"),
                                        ("amp.yaml", ""), ("pyproject.toml", "[tool.ampbridge]\n")])
def test_an_empty_policy_is_an_error_not_silent_float32(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(PolicyError, match="is empty: it sets nothing") as e:
        ampbridge.load(tmp_path / name)
    assert "version = 1" in str(e.value)


@pytest.mark.parametrize("name, text", [("amp.toml", 'compute_dtype = "bf16"\n'),
                                        ("amp.json", '{"compute_dtype": "bf16"}'),
                                        ("amp.yaml", "compute_dtype: bf16\n")])
def test_a_byte_order_mark_is_not_part_of_the_policy(tmp_path, name, text):
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert ampbridge.load(tmp_path / name).compute_dtype == "bfloat16"
    assert ampbridge.loads("\ufeff" + text, format=name.split(".")[1]).compute_dtype == "bfloat16"


def test_finding_line_numbers_is_linear_in_the_file_size():
    """The JSON line index is built once: 4x the entries costs about 4x the time (recounting the
    newlines before every value, as before, cost 10-16x here). End to end: make bench."""
    import time

    from ampbridge.core.io import _json_lines

    def seconds(n: int) -> float:
        text = json.dumps({"version": 1, "keep_float32": [f"layers.{i}.norm" for i in range(n)]}, indent=1)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            lines = _json_lines(text)
            best = min(best, time.perf_counter() - t0)
        assert lines[("keep_float32", n - 1)] == n + 3
        return best

    small, large = seconds(10_000), seconds(40_000)
    assert large / small < 4 * 2, f"10k: {small:.3f} s, 40k: {large:.3f} s"
