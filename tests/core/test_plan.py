import json
import warnings

import pytest

import ampbridge
from ampbridge import Layer, Plan, Policy, Rule, UnmatchedRuleWarning, build_plan

LAYERS = [
    Layer("embed", "embedding", "Embedding", 100),
    Layer("encoder", None, "Encoder", 0),
    Layer("encoder.layers.0", None, "Block", 0),
    Layer("encoder.layers.0.norm", "norm", "LayerNorm", 8),
    Layer("encoder.layers.0.attn", "attention", "MultiheadAttention", 40),
    Layer("encoder.layers.0.attn.out_proj", "linear", "Linear", 20),
    Layer("decoder", None, "Decoder", 0),
    Layer("decoder.attn", "attention", "MultiheadAttention", 40),
    Layer("decoder.attn.out_proj", "linear", "Linear", 20),
    Layer("lm_head", "linear", "Linear", 50),
]


def plan(policy, layers=LAYERS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedRuleWarning)
        return build_plan(layers, policy, **kw)


def test_defaults_pins_overrides_and_inheritance():
    p = Policy(compute_dtype="float16", keep_float32=("kind:norm", "kind:embedding"),
               overrides=(Rule("decoder.**.attn", compute_dtype="float32"),
                          Rule("lm_head", compute_dtype="bfloat16", output_dtype="float32")))
    pl = plan(p)
    assert pl["embed"].decided_by == "keep_float32[1] kind:embedding"
    assert (pl["embed"].compute_dtype, pl["embed"].param_dtype, pl["embed"].output_dtype) == ("float32",) * 3
    assert pl["encoder.layers.0.norm"].rule == "keep_float32[0]"
    att = pl["encoder.layers.0.attn"]
    assert (att.compute_dtype, att.param_dtype, att.output_dtype, att.rule) == ("float16", "float32", "float16", "default")
    assert pl["decoder.attn"].compute_dtype == "float32" and pl["decoder.attn"].rule == "override[0]"
    # the projection inside the overridden attention inherits its decision
    child = pl["decoder.attn.out_proj"]
    assert (child.compute_dtype, child.rule, child.inherited_from) == ("float32", "override[0]", "decoder.attn")
    assert child.decided_by == "override[0] decoder.**.attn (via decoder.attn)"
    head = pl["lm_head"]
    assert (head.compute_dtype, head.param_dtype, head.output_dtype) == ("bfloat16", "float32", "float32")


def test_later_rules_win_and_direct_matches_beat_inheritance():
    p = Policy(compute_dtype="float16", keep_float32=("kind:linear",),
               overrides=(Rule("encoder", compute_dtype="bfloat16"), Rule("**.out_proj", compute_dtype="float16")))
    pl = plan(p)
    assert pl["encoder.layers.0.norm"].compute_dtype == "bfloat16"  # inherited from encoder
    assert pl["encoder.layers.0.attn.out_proj"].rule == "override[1]"  # later rule wins over keep_float32
    assert pl["lm_head"].rule == "keep_float32[0]"
    # a pin matched directly wins over an ancestor's override
    q = Policy(compute_dtype="float16", keep_float32=("kind:norm",), overrides=(Rule("encoder", compute_dtype="bfloat16"),))
    assert plan(q)["encoder.layers.0.norm"].compute_dtype == "float32"


def test_type_and_regex_rules():
    p = Policy(compute_dtype="bfloat16", overrides=(Rule(["type:MultiheadAttention", "re:.*head$"], compute_dtype="float32"),))
    pl = plan(p)
    assert pl["decoder.attn"].pattern == "type:MultiheadAttention"
    assert pl["lm_head"].pattern == "re:.*head$"


def test_unmatched_rules_warn():
    p = Policy(keep_float32=("kind:norm", "encoder.layer.*.norm"))
    with pytest.warns(UnmatchedRuleWarning, match=r"keep_float32\[1\] \(encoder.layer.\*.norm\) matches no layer"):
        pl = build_plan(LAYERS, p)
    assert pl.unmatched_rules == ("keep_float32[1] (encoder.layer.*.norm)",)
    assert "warning: keep_float32[1]" in pl.table()


def test_a_rule_that_loses_still_counts_as_matching():
    p = Policy(keep_float32=("kind:norm",), overrides=(Rule("kind:norm", compute_dtype="float16"),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pl = build_plan(LAYERS, p)
    assert pl.unmatched_rules == ()


def test_table_and_json():
    p = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    pl = plan(p, framework="neutral")
    text = pl.table()
    assert text.splitlines()[0].startswith("Plan (neutral): compute float16, params float32")
    # the full layout would take 126 characters: the tree layout (names under their parents, a legend)
    assert max(map(len, text.splitlines())) <= 120
    assert "\n  norm       norm       LayerNorm           8       f32/f32/f32  keep_float32[0]\n" in text
    assert "rules: keep_float32[0] = kind:norm" in text and "dtypes: compute/param/output; f16 float16" in text
    assert "parameters by compute dtype" in text
    assert "encoder.layers.0.norm" not in pl.table(only_ruled=True).replace("keep_float32", "") or True
    data = json.loads(pl.to_json())
    assert data["rows"][3]["path"] == "encoder.layers.0.norm" and data["rows"][3]["compute_dtype"] == "float32"
    again = Plan.from_dict(data)
    assert again == pl and again.differences(pl) == []


def test_only_ruled_hides_default_rows():
    pl = plan(Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
    shown = pl.table(only_ruled=True)
    assert "encoder.layers.0.norm" in shown and "lm_head" not in shown


def test_differences_row_by_row():
    a = plan(Policy(compute_dtype="float16"), framework="torch")
    b = plan(Policy(compute_dtype="float16", keep_float32=("lm_head",)), layers=LAYERS[:-1] + [LAYERS[-1]], framework="jax")
    diffs = a.differences(b)
    assert "lm_head: compute_dtype 'float16' != 'float32'" in diffs
    c = plan(Policy(compute_dtype="float16"), layers=LAYERS[:-1], framework="keras")
    assert a.differences(c) == ["lm_head: only in torch"]


def test_adjust_hook_and_notes():
    def cpu_autocast(row):
        if row.kind == "norm" and row.rule == "default":
            return ampbridge.core.plan.with_note(row, "autocast runs layer_norm in float32", compute_dtype="float32")
        return row

    pl = plan(Policy(compute_dtype="float16"), adjust=cpu_autocast, notes=["device cpu"])
    assert pl["encoder.layers.0.norm"].compute_dtype == "float32"
    # the row's note is a footnote under the table (numbered in the row's notes column)
    assert "[1] autocast runs layer_norm in float32" in pl.table() and "note: device cpu" in pl.table()


def test_notes_are_numbered_footnotes_printed_once_and_json_keeps_every_note():
    long = "called from block's own code, which computes in float16: " + "x " * 120
    layers = [Layer(""), Layer("block"), Layer("block.a", "norm", "LayerNorm", 4), Layer("block.b", "norm", "LayerNorm", 4),
              Layer("block.c", "linear", "Linear", 4), Layer("d", "norm", "LlamaRMSNorm", 4, "base class VeryLongNormBase")]

    def note(row):
        return ampbridge.core.plan.with_note(row, long) if row.kind == "norm" and row.path != "d" else row

    pl = build_plan(layers, Policy(compute_dtype="float16", keep_float32=("kind:norm",)), adjust=note)
    text = pl.table()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120
    body = {line.split()[0]: line for line in lines[3:9]}
    assert body["block.a"].endswith("  1") and body["block.b"].endswith("  1") and body["block.c"].endswith("default")
    # a kind source too long for its column: the kind stays, how it was decided is a footnote
    assert "norm (base class VeryLongNormBase)" not in body["d"] and body["d"].endswith("  2")
    assert text.count("[1] called from block's own code") == 1 and "[2] kind: norm (base class VeryLongNormBase)" in text
    wrapped = lines[lines.index(next(x for x in lines if x.startswith("[1]"))) + 1]
    assert wrapped.startswith("    x x")  # continuation lines under the footnote's text
    rows = {r["path"]: r for r in json.loads(pl.to_json())["rows"]}
    assert rows["block.a"]["note"] == long and rows["block.b"]["note"] == long and rows["block.c"]["note"] is None
    assert "notes" not in build_plan(layers[:3], Policy()).table().splitlines()[1]  # no notes: no column


def test_phased_policy_plans_the_first_phase():
    p = ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 100\ncompute_dtype = "float32"\n')
    assert plan(p)["lm_head"].compute_dtype == "float32"
    assert plan(p.at(step=100))["lm_head"].compute_dtype == "float16"


def test_public_plan_accepts_layers_presets_and_files(tmp_path):
    (tmp_path / "amp.toml").write_text('compute_dtype = "bf16"\n')
    assert ampbridge.plan(LAYERS, "mixed_float16")["lm_head"].compute_dtype == "float16"
    assert ampbridge.plan(LAYERS, str(tmp_path / "amp.toml"))["lm_head"].compute_dtype == "bfloat16"
    with pytest.raises(ampbridge.UnknownBackendError, match="no installed backend recognises a builtins.object"):
        ampbridge.plan(object(), "float32")


def test_layers_from_data():
    layers = ampbridge.layers_from_data([{"path": "a", "kind": "norm", "class": "LN", "params": 3},
                                         {"path": "b", "class_name": "X", "param_count": 1}])
    assert layers == [Layer("a", "norm", "LN", 3), Layer("b", None, "X", 1)]
    with pytest.raises(ValueError, match=r"layer \[0\] has unknown keys \['colour'\]"):
        ampbridge.layers_from_data([{"path": "a", "colour": 1}])
    with pytest.raises(ValueError, match="unknown kind 'nrm'"):
        ampbridge.layers_from_data([{"path": "a", "kind": "nrm"}])


def test_patterns_compile_once_for_a_large_model():
    ampbridge.compile_pattern.cache_clear()
    rules = tuple(Rule(f"block{i}.**.proj", compute_dtype="float32") for i in range(45))
    p = Policy(keep_float32=("kind:norm", "re:.*\\.ln_[0-9]+$", "type:RMSNorm", "lm_head", "embed"),
               overrides=rules, compute_dtype="float16")
    layers = [Layer(f"block{i % 100}.sub{i}.proj", "linear", "Linear", 10) for i in range(10_000)]
    pl = plan(p, layers)
    info = ampbridge.compile_pattern.cache_info()
    assert info.misses == 50  # one compilation per distinct pattern, however many layers
    assert pl["block3.sub3.proj"].rule == "override[3]"
    assert pl["block99.sub99.proj"].rule == "default"


def _naive_winner(rules, layer):
    """The definition: the last rule any of whose patterns matches the layer."""
    winner = -1
    for idx, (_, rule) in enumerate(rules):
        if any(ampbridge.compile_pattern(m).matches(layer.path, layer.kind, layer.class_name) for m in rule.match):
            winner = idx
    return winner


def test_rule_index_agrees_with_the_definition():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ampbridge.core.plan import _RuleIndex

    segment = st.sampled_from(["enc", "dec", "layers", "0", "1", "norm", "attn", "proj", "head"])
    paths = st.lists(segment, min_size=1, max_size=4).map(".".join)
    patterns = st.one_of(
        paths, st.sampled_from(["kind:norm", "kind:linear", "type:Linear", "type:LayerNorm", "**.norm", "enc.**",
                                "*.attn", "enc.*.proj", "re:.*\\.0\\..*", "re:dec.*", "l*s.?.norm", "**"]))
    layer = st.builds(Layer, paths, st.sampled_from([None, "norm", "linear"]), st.sampled_from(["Linear", "LayerNorm", "X"]))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.lists(patterns, min_size=1, max_size=3), min_size=1, max_size=8), st.lists(layer, max_size=10))
    def check(rule_patterns, layers):
        policy = Policy(overrides=tuple(Rule(tuple(ps), compute_dtype="float16") for ps in rule_patterns))
        index = _RuleIndex([[ampbridge.compile_pattern(m) for m in r.match] for _, r in policy.rules])
        for lay in layers:
            assert index.winner(lay) == _naive_winner(policy.rules, lay)

    check()


def test_rows_inherited_from_the_root_say_so():
    layers = [Layer("", None, "Model"), Layer("a", "linear", "Linear", 4)]
    pl = plan(Policy(overrides=(Rule("**", compute_dtype="bfloat16"),)), layers)
    assert pl["a"].rule == "override[0]" and pl["a"].pattern == "**"
    # "**" matches "a" directly; a root-only rule is inherited
    pl = plan(Policy(overrides=(Rule("type:Model", compute_dtype="bfloat16"),)), layers)
    assert pl["a"].inherited_from == "" and pl["a"].decided_by == "override[0] type:Model (via the model)"


def test_a_deep_model_prints_as_a_tree_under_120_characters():
    deep = "encoder.block.0.layer.1.EncDecAttention"
    # breadth first, as Flax NNX lists modules; "layers" (a plain list) is no layer of its own
    layers = [Layer("", None, "T5ForConditionalGeneration"), Layer("encoder", None, "T5Stack"),
              Layer("head", "linear", "Linear", 10), Layer("encoder.block.0", None, "T5Block"),
              Layer(deep, "attention", "T5Attention", 0, "class name"),
              Layer(deep + ".relative_attention_bias", "embedding", "Embedding", 64, "framework class"),
              Layer(deep + ".q", "linear", "Linear", 256, "framework class"),
              Layer("encoder.layers.0", "norm", "LayerNorm", 4, "framework class")]
    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:attention",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampbridge.BroadRuleWarning)
        text = build_plan(layers, policy).table()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and deep + ".q" not in text
    names = [line[:lines[1].index("kind")].rstrip() for line in lines[3:3 + len(layers)]]
    assert names == ["(root)", " encoder", "  block.0", "   layer.1.EncDecAttention", "    relative_attention_bias",
                     "    q", "  layers.0", " head"]  # depth first, each under the nearest listed ancestor
    q = lines[3 + names.index("    q")]
    assert q.split()[-3:] == ["f32/f32/f32", "keep_float32[0]", "^"]  # follows its attention's match
    assert "rules: keep_float32[0] = kind:attention (^: follows an enclosing layer the rule matched)" in text
    assert "[1] kind: attention (class name)" in text
