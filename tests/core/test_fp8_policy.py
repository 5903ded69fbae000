"""The [fp8] table: validation, extends, phases, the dump round trip, the schema and the Plan rows."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ampbridge
from ampbridge import Fp8Config, Layer, Plan, Policy, PolicyError, build_plan
from ampbridge.core.schema import json_schema

FP8 = """
compute_dtype = "bfloat16"
keep_float32 = ["head"]
[fp8]
match = ["kind:linear"]
amax_history = 16
amax_compute = "most_recent"
margin = 1
"""


def error_of(text, source="p.toml"):
    with pytest.raises(PolicyError) as info:
        ampbridge.loads(text, source=source)
    return str(info.value)


def test_the_table_is_read_with_its_defaults():
    p = ampbridge.loads(FP8)
    assert p.fp8 == Fp8Config(("kind:linear",), "e4m3", "e5m2", "delayed", 16, "most_recent", 1)
    assert p.fp8.enabled and not Policy().fp8.enabled
    assert ampbridge.loads('[fp8]\nmatch = ["fc"]\n').fp8.amax_history == 1024


@pytest.mark.parametrize("text,where,says", [
    ('[fp8]\nmatch = ["kind:linear"]\nscalling = "current"\n', "p.toml:3: fp8.scalling", "did you mean 'scaling'"),
    ('[fp8]\nscaling = "curent"\n', "p.toml:2: fp8.scaling", "accepted: delayed | current"),
    ('[fp8]\nforward = "e4m3fn"\n', "p.toml:2: fp8.forward", "accepted: e4m3 | e5m2"),
    ('[fp8]\namax_history = 0\n', "p.toml:2: fp8.amax_history", "an integer from 1 to"),
    ('[fp8]\namax_compute = "mean"\n', "p.toml:2: fp8.amax_compute", "max | most_recent"),
    ('[fp8]\nmargin = 1.5\n', "p.toml:2: fp8.margin", "must be an integer"),
    ('[fp8]\nmatch = "kind:linear"\n', "p.toml:2: fp8.match", "write ['kind:linear']"),
    ('[fp8]\nmatch = ["kind:lineer"]\n', "p.toml:2: fp8.match[0]", "linear"),
    ('[fp8]\nscaling = "current"\namax_history = 16\n', "p.toml:3: fp8.amax_history", "delayed scaling only"),
    ('fp8 = 1\n', "p.toml:1: fp8", "must be a table"),
    ('[[phase]]\n[phase.fp8]\nmargn = 1\n', "p.toml:3: phase[0].fp8.margn", "did you mean 'margin'"),
    ('amax_history = 16\n', "p.toml:1: amax_history", "it belongs in the [fp8] table"),
    ('[fp9]\nmatch = ["fc"]\n', "p.toml:1: fp9", "did you mean 'fp8'"),
])
def test_bad_values_are_one_line_naming_file_key_value_and_what_is_accepted(text, where, says):
    message = error_of(text)
    assert message.startswith(where) and says in message and "\n" not in message


def test_the_objects_validate_too():
    with pytest.raises(PolicyError, match="fp8.backward"):
        Fp8Config(backward="e3m4")
    with pytest.raises(PolicyError, match="delayed scaling only"):
        Fp8Config(scaling="current", amax_compute="most_recent")
    assert Policy(fp8={"match": ["fc"], "scaling": "current"}).fp8.scaling == "current"


def test_extends_merges_the_table_key_by_key(tmp_path):
    (tmp_path / "base.toml").write_text('[fp8]\nmatch = ["kind:linear"]\namax_history = 16\n')
    (tmp_path / "top.toml").write_text('extends = "base.toml"\n[fp8]\nmargin = 2\n')
    p, origins = ampbridge.core.io.load_with_origins(tmp_path / "top.toml")
    assert (p.fp8.match, p.fp8.amax_history, p.fp8.margin) == (("kind:linear",), 16, 2)
    assert origins["fp8.margin"].endswith("top.toml") and origins["fp8.amax_history"].endswith("base.toml")
    # a child switching to current scaling does not inherit the parent's delayed-only keys
    (tmp_path / "cur.toml").write_text('extends = "base.toml"\n[fp8]\nscaling = "current"\n')
    assert ampbridge.load(tmp_path / "cur.toml").fp8 == Fp8Config(("kind:linear",), scaling="current")
    (tmp_path / "bad.toml").write_text('extends = "base.toml"\n[fp8]\nforward = "e8"\n')
    with pytest.raises(PolicyError) as info:
        ampbridge.load(tmp_path / "bad.toml")
    assert info.value.file.endswith("bad.toml") and info.value.line == 3


def test_a_phase_turns_fp8_on_after_warm_up():
    p = ampbridge.loads('compute_dtype = "bf16"\n[fp8]\nmargin = 1\n[[phase]]\nuntil_step = 100\n'
                        '[[phase]]\n[phase.fp8]\nmatch = ["kind:linear"]\n')
    assert not p.at(step=99).fp8.enabled
    late = p.at(step=100).fp8
    assert late.enabled and late.margin == 1
    layers = [Layer(""), Layer("fc", "linear", "Linear", 4)]
    assert not build_plan(layers, p.at(step=0), warn=False)["fc"].fp8
    assert build_plan(layers, p.at(step=100), warn=False)["fc"].fp8


def test_a_phase_switching_to_current_scaling_drops_the_delayed_only_keys():
    p = ampbridge.loads('[fp8]\nmatch = ["fc"]\namax_history = 8\n[[phase]]\nuntil_step = 5\n'
                        '[[phase]]\n[phase.fp8]\nscaling = "current"\n')
    assert p.at(step=9).fp8 == Fp8Config(("fc",), scaling="current")
    assert ampbridge.loads(ampbridge.dumps(p)) == p


formats = st.sampled_from(["e4m3", "e5m2"])
fp8_tables = st.builds(
    lambda match, fwd, bwd, scaling, hist, compute, margin: Fp8Config(
        match, fwd, bwd, scaling, *((hist, compute) if scaling == "delayed" else (1024, "max")), margin),
    st.lists(st.sampled_from(["kind:linear", "fc", "encoder.**", "type:Dense"]), max_size=3).map(tuple),
    formats, formats, st.sampled_from(["delayed", "current"]), st.integers(1, 4096),
    st.sampled_from(["max", "most_recent"]), st.integers(0, 64))


@settings(max_examples=60, deadline=None)
@given(fp8_tables, st.one_of(st.none(), fp8_tables), st.sampled_from(["toml", "yaml", "json"]))
def test_dump_and_load_round_trip(fp8, late, fmt):
    phases = ()
    if late is not None:
        phases = (ampbridge.Phase(Policy(fp8=fp8), until_step=3), ampbridge.Phase(Policy(fp8=late)))
    p = Policy(compute_dtype="bfloat16", fp8=fp8, phases=phases)
    assert ampbridge.loads(ampbridge.dumps(p, fmt), fmt) == p
    assert Policy.from_dict(p.to_dict()) == p


def test_a_policy_without_fp8_dumps_as_before():
    assert "fp8" not in ampbridge.dumps(ampbridge.preset("mixed_bfloat16"))


def test_the_schema_describes_the_table():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json_schema()
    props = schema["properties"]["fp8"]["properties"]
    assert props["scaling"]["enum"] == ["delayed", "current"] and props["amax_history"]["default"] == 1024
    validator = jsonschema.Draft202012Validator(schema)
    p = ampbridge.loads(FP8)
    assert not list(validator.iter_errors(json.loads(ampbridge.dumps(p, "json"))))
    assert list(validator.iter_errors({"fp8": {"scalling": "current"}}))
    assert "fp8" in schema["properties"]["phase"]["items"]["properties"]


def model_layers():
    return [Layer(""), Layer("fc1", "linear", "Linear", 10), Layer("block", None, "Block"),
            Layer("block.fc", "linear", "Linear", 6), Layer("head", "linear", "Linear", 5),
            Layer("norm", "norm", "LayerNorm", 2)]


def test_plan_rows_say_float8_format_and_scaling_and_pins_win():
    p = Policy(compute_dtype="bfloat16", keep_float32=("head",),
               overrides=(ampbridge.Rule("block", compute_dtype="float16"),),
               fp8=Fp8Config(("kind:linear", "norm"), scaling="current"))
    plan = build_plan(model_layers(), p, warn=False)
    assert [r.path for r in plan if r.fp8] == ["fc1", "norm"]
    row = plan["fc1"]
    assert (row.fp8_forward, row.fp8_backward, row.fp8_scaling, row.fp8_by) == ("e4m3", "e5m2", "current", None)
    assert not plan["head"].fp8 and not plan["block.fc"].fp8  # keep_float32; an override via its container
    assert "float8 matmuls: e4m3 forward, e5m2 backward, current scaling" in plan.table()
    assert "fp8 e4m3/e5m2 current" in plan.table().splitlines()[0]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_plans_differ_when_only_fp8_differs_and_a_pattern_matching_nothing_is_said():
    layers = model_layers()
    on = build_plan(layers, Policy(fp8=Fp8Config(("fc1", "fc9"))), warn=False)
    off = build_plan(layers, Policy(), warn=False)
    assert on.differences(off) == ["fc1: fp8_backward 'e5m2' != None", "fc1: fp8_forward 'e4m3' != None",
                                   "fc1: fp8_scaling 'delayed' != None"]
    assert on.unmatched_rules == ("fp8.match[1] (fc9)",)
    with pytest.warns(ampbridge.UnmatchedRuleWarning, match=r"fp8.match\[1\] \(fc9\)"):
        build_plan(layers, Policy(fp8=Fp8Config(("fc1", "fc9"))))


def test_the_traced_row_resolver_agrees():
    p = Policy(fp8=Fp8Config(("kind:linear",)))
    resolver = ampbridge.core.plan.RowResolver(p)
    row = resolver.row([Layer(""), Layer("fc1", "linear", "Linear", 10)])
    assert row == build_plan(model_layers(), p, warn=False)["fc1"]
