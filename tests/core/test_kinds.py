"""Kinds for classes no backend table knows: inference from names (and what it means for containers),
the policy's [kinds] table (explicit beats inferred), the source on each Plan row, and warnings said
once per policy and model."""

from __future__ import annotations

import json
import warnings

import pytest

import ampbridge
from ampbridge import Layer, Plan, Policy, build_plan
from ampbridge.core.kinds import ROTARY, KindRegistry, KindTable, infer_kind
from ampbridge.core.schema import json_schema


@pytest.mark.parametrize("names, leaf, expected", [
    (["LlamaRMSNorm"], True, ("norm", "class name")),
    (["T5LayerNorm"], True, ("norm", "class name")),
    (["MixtralRMSNorm"], True, ("norm", "class name")),
    (["FrozenBatchNorm2d"], True, ("norm", "class name")),
    (["LlamaLayerNorm", "Layer"], True, ("norm", "class name")),  # keras-hub
    (["Embedder"], None, ("embedding", "class name")),  # the Flax SST-2 example's
    (["BertEmbeddings"], False, ("embedding", "class name")),  # a container named for a kind has it
    (["BertAttention"], False, ("attention", "class name")),
    (["BertSelfAttention"], True, ("attention", "class name")),
    (["GPT2Attention"], False, ("attention", "class name")),
    (["Conv1D"], True, ("conv", "class name")),  # torch's structure check makes GPT-2's a linear map
    (["T5DenseActDense"], False, (None, None)),  # an MLP block: linear/conv/softmax/recurrent need a leaf
    (["T5DenseActDense"], True, ("linear", "class name")),
    (["MyBlock", "T5LayerNorm", "Module"], False, ("norm", "base class T5LayerNorm")),
    (["LlamaRotaryEmbedding", "Module"], True, (None, ROTARY)),
    (["GELUActivation", "Module"], True, (None, None)),
    (["Normalize"], True, (None, None)),  # an input transform, not a norm layer
    (["LlamaDecoderLayer", "Module"], False, (None, None)),
])
def test_inference_from_names(names, leaf, expected):
    assert infer_kind(names, leaf=leaf) == expected


def test_kinds_table_round_trips_in_every_format_and_is_in_the_schema():
    text = '''
compute_dtype = "bf16"
keep_float32 = ["kind:norm"]
[kinds]
norm = ["LlamaRMSNorm", "re:.*RMSNorm$"]
attention = ["MyAttention"]
none = ["Odd"]
[[phase]]
until_step = 3
compute_dtype = "float32"
[[phase]]
'''
    p = ampbridge.loads(text)
    assert p.kinds == (("norm", ("LlamaRMSNorm", "re:.*RMSNorm$")), ("attention", ("MyAttention",)), ("none", ("Odd",)))
    for fmt in ("toml", "yaml", "json"):
        assert ampbridge.loads(ampbridge.dumps(p, fmt), fmt) == p
    assert '[kinds]\nnorm = ["LlamaRMSNorm", "re:.*RMSNorm$"]' in ampbridge.dumps(p)
    assert p.at(step=0).kinds == p.kinds and p.at(step=5).kinds == p.kinds  # not per phase
    assert Policy.from_dict(p.to_dict()) == p
    assert Policy(kinds={"norm": ["X"]}).kinds == (("norm", ("X",)),)
    props = json_schema()["properties"]["kinds"]
    assert set(props["properties"]) == set(ampbridge.KINDS) | {"none"} and props["additionalProperties"] is False


def test_kinds_table_errors_name_the_key_and_line():
    with pytest.raises(ampbridge.PolicyError) as e:
        ampbridge.loads('[kinds]\nnrom = ["X"]\nnorm = "Y"\nembedding = ["re:(", "Z"]\nlinear = ["Z"]\n')
    text = str(e.value)
    assert "<string>:2: kinds.nrom: unknown kind in [kinds]; did you mean 'norm'?" in text
    assert "<string>:3: kinds.norm: must be a list of class names" in text
    assert "<string>:4: kinds.embedding[0]: not a valid regular expression" in text
    assert "<string>:5: kinds.linear[0]: 'Z' is already listed under 'embedding'" in text
    with pytest.raises(ampbridge.PolicyError, match="unknown key in \\[\\[phase\\]\\]"):
        ampbridge.loads('[[phase]]\n[phase.kinds]\nnorm = ["X"]\n')


def test_extends_merges_kinds_kind_by_kind(tmp_path):
    (tmp_path / "base.toml").write_text('[kinds]\nnorm = ["A"]\nattention = ["B"]\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[kinds]\nnorm = ["C"]\n')
    assert dict(ampbridge.load(tmp_path / "child.toml").kinds) == {"norm": ("C",), "attention": ("B",)}


LAYERS = [Layer("", None, "Model"), Layer("embed", "embedding", "Embedding", 64, "framework class"),
          Layer("norm", "norm", "LlamaRMSNorm", 16, "class name"),
          Layer("attn", "attention", "GemmaAttention", 0, "class name"),
          Layer("odd", None, "OddNormish", 8), Layer("head", "linear", "Linear", 64, "framework class")]


def test_explicit_beats_inferred_and_each_row_says_how():
    p = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
               kinds={"norm": ["re:Odd.*"], "none": ["GemmaAttention"], "linear": ["LlamaRMSNorm"]})
    pl = build_plan(LAYERS, p, warn=False)
    assert (pl["odd"].kind, pl["odd"].kind_source, pl["odd"].compute_dtype) == ("norm", "[kinds] table", "float32")
    # the table and the inference disagree: the table wins, and the row says what it overruled
    assert pl["norm"].kind == "linear" and pl["norm"].compute_dtype == "float16"
    assert pl["norm"].kind_source == "[kinds] table; overrules norm (class name)"
    assert pl["attn"].kind is None and pl["attn"].kind_source.startswith("[kinds] table; overrules attention")
    assert pl["embed"].kind_source == "framework class" and pl["embed"].kind_text == "embedding"
    table = pl.table()
    assert "norm ([kinds] table)" in table and "- ([kinds] table; overrules attention (class name))" in table
    plain = build_plan(LAYERS, Policy(), warn=False)
    assert plain["norm"].kind_text == "norm (class name)" and "norm (class name)" in plain.table()


def test_plan_json_keeps_the_source_and_old_json_still_loads():
    pl = build_plan(LAYERS, Policy(), warn=False)
    data = json.loads(pl.to_json())
    assert data["rows"][2]["kind_source"] == "class name"
    assert Plan.from_dict(data) == pl
    for row in data["rows"]:
        del row["kind_source"]  # a Plan written before the field existed
    old = Plan.from_dict(data)
    assert old["norm"].kind_source is None and old["norm"].kind_text == "norm"


def test_warnings_once_per_policy_and_model():
    p = Policy(keep_float32=("kind:softmax", "kind:norm"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            build_plan(LAYERS, p)
        said = [str(w.message) for w in caught]
        assert len(said) == 2, said  # the unmatched rule, and the class that looks like a norm
        assert said[0] == "keep_float32[0] (kind:softmax) matches no layer of the model (a typo?)"
        assert said[1].startswith("keep_float32[1] (kind:norm): class(es) OddNormish look like norm by name but "
                                  "were not recognised") and 'norm = ["OddNormish"]' in said[1]
        build_plan(LAYERS[:-1], p)  # another model: said again
        build_plan(LAYERS, p.replace(compute_dtype="float16"))  # another policy: said again
        assert len(caught) == 6
    pl = build_plan(LAYERS, p, warn=False)
    assert any("OddNormish" in n for n in pl.notes) and "note: keep_float32[1] (kind:norm)" in pl.table()
    # named in [kinds] (here as no kind), the class is decided: nothing left to say about it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_plan(LAYERS, Policy(keep_float32=("kind:norm",), kinds={"none": ["OddNormish"]}))


def test_kind_table_and_registry_helpers():
    t = KindTable((("norm", ("A", "re:.*Norm")), ("attention", ("re:.*",))))
    assert t.kind_of("A") == "norm" and t.kind_of("XNorm") == "norm" and t.kind_of("Y") == "attention"
    assert not KindTable(())
    r = KindRegistry()
    with pytest.raises(ValueError, match="unknown kind; did you mean 'norm'"):
        r.register(int, "nrom")
    with pytest.raises(TypeError):
        r.register("int", "norm")  # type: ignore[arg-type]
    r.register(int, None)
    assert r.found(r.lookup(bool)) and r.lookup(bool) is None and not r.found(r.lookup(str))


def test_show_and_explain_carry_the_kinds_table(tmp_path, capsys):
    from ampbridge.cli.commands import main

    f = tmp_path / "amp.toml"
    f.write_text('compute_dtype = "bf16"\nkeep_float32 = ["kind:norm"]\n[kinds]\nnorm = ["re:.*RMSNorm$"]\n')
    assert main(["show", str(f)]) == 0
    assert '[kinds]\nnorm = ["re:.*RMSNorm$"]' in capsys.readouterr().out
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([{"path": "", "class": "M"}, {"path": "n", "class": "GemmaRMSNorm"}]))
    assert main(["explain", str(f), "--layers", str(layers)]) == 0
    out = capsys.readouterr().out
    assert "norm ([kinds] table)" in out and "keep_float32[0] kind:norm" in out


# --- cautious inference (settle_kinds): no kind for the root, nor for a wrapper holding compute layers ---

import os  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ampbridge.core.kinds import COMPUTE_KINDS, settle_kinds  # noqa: E402

FUZZ = settings(max_examples=2000 if os.environ.get("AMPBRIDGE_FUZZ") else 150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
SOURCES = [None, "framework class", "class name", "base class FooNorm", "structure: x", "registered",
           "[kinds] table"]
#: what each inferred kind may hold, written out from the rule's statement (docs/kinds)
ALLOWED = {"norm": set(), "embedding": set(), "softmax": set(), "attention": {"linear", "conv", "attention"}}


@st.composite
def trees(draw):
    """Random module trees as Layers: every node's parent listed (torch, Keras) or not (an NNX list)."""
    paths = [""]
    for i in range(draw(st.integers(1, 14))):
        parent = draw(st.sampled_from(paths))
        hop = draw(st.sampled_from(["", "layers."]))  # "layers." : an unlisted list in between
        paths.append(f"{parent}.{hop}{i}" if parent else f"{hop}{i}")
    out = []
    for path in paths:
        kind = draw(st.sampled_from([None, "norm", "embedding", "attention", "softmax", "linear", "conv",
                                     "recurrent"]))
        source = draw(st.sampled_from(SOURCES)) if kind else None
        out.append(Layer(path, kind, f"C{len(out)}", 1, source))
    return draw(st.permutations(out))


def _inferred(source):
    return source in ("class name", "base class FooNorm", "structure: x")


def _oracle(layers):
    """settle_kinds by brute force: a listed layer's descendants are those under its path; an inferred
    kind goes where the layer is the root, or where a descendant's settled kind is a compute kind the
    layer's kind may not hold (descendants settled first: deepest paths first)."""
    by_depth = sorted(layers, key=lambda la: -1 if not la.path else la.path.count("."), reverse=True)
    final = {}
    for layer in by_depth:
        below = {final[o.path].kind for o in layers if layer.path == "" and o.path != ""
                 or o.path.startswith(layer.path + ".")} if layer.path or len(layers) > 1 else set()
        kind = layer.kind
        if kind and _inferred(layer.kind_source) and (
                not layer.path or ((below - {None}) & COMPUTE_KINDS) - ALLOWED.get(kind, COMPUTE_KINDS)):
            kind = None
        final[layer.path] = Layer(layer.path, kind, layer.class_name, 1, layer.kind_source)
    return [final[la.path].kind for la in layers]


@FUZZ
@given(trees())
def test_settle_kinds_matches_the_rule_on_random_trees(layers):
    assert [la.kind for la in settle_kinds(layers)] == _oracle(layers)


def test_settle_kinds_keeps_explicit_and_says_why_inferred_ones_go():
    layers = [Layer("", "norm", "ModelNorm", 0, "class name"), Layer("pre", "norm", "PreNorm", 0, "class name"),
              Layer("pre.norm", "norm", "LayerNorm", 8, "framework class"),
              Layer("pre.fn", "attention", "SelfAttention", 0, "class name"),
              Layer("pre.fn.q", "linear", "Linear", 8, "framework class"),
              Layer("t", "embedding", "TimestepEmbedding", 0, "class name"),
              Layer("t.linear_1", "linear", "Linear", 8, "framework class"),
              Layer("emb", "embedding", "BertEmbeddings", 0, "class name"),
              Layer("emb.word", "embedding", "Embedding", 8, "framework class"),
              Layer("emb.LayerNorm", "norm", "LayerNorm", 8, "framework class"),
              Layer("x", "norm", "ExplicitNorm", 0, "[kinds] table"),
              Layer("x.fc", "linear", "Linear", 8, "framework class")]
    got = {la.path: (la.kind, la.kind_source) for la in settle_kinds(layers)}
    assert got[""] == (None, "norm by name, not inferred: the model itself")
    assert got["pre"] == (None, "norm by name, not inferred: holds attention, linear")
    assert got["pre.fn"] == ("attention", "class name")  # an attention is built from linear maps
    assert got["t"] == (None, "embedding by name, not inferred: holds linear")  # an MLP, no table
    assert got["emb"] == ("embedding", "class name")  # a lookup, its norm: still an embedding
    assert got["x"] == ("norm", "[kinds] table")


def test_a_wrapper_named_like_a_norm_pins_only_its_norm_and_explicit_rules_still_pin_it():
    layers = [Layer("", None, "ViT"), Layer("pre", "norm", "PreNorm", 0, "class name"),
              Layer("pre.norm", "norm", "LayerNorm", 8, "framework class"),
              Layer("pre.fn", None, "FeedForward", 0), Layer("pre.fn.fc", "linear", "Linear", 72, "framework class")]
    base = Policy(compute_dtype="float16", keep_float32=("kind:norm",))
    plan = build_plan(layers, base)
    assert plan["pre"].kind is None and plan["pre"].kind_text == "- (norm by name, not inferred: holds linear)"
    assert [plan[p].compute_dtype for p in ("pre", "pre.norm", "pre.fn.fc")] == ["float16", "float32", "float16"]
    for explicit in (base.replace(kinds={"norm": ["PreNorm"]}), base.replace(keep_float32=("type:PreNorm",)),
                     base.replace(keep_float32=("pre",))):
        with pytest.warns(ampbridge.BroadRuleWarning, match=r"reaches (90|100)\.0% .* \(pre\)"):
            plan = build_plan(layers, explicit)  # 72 of 80 parameters through the wrapper: said
        assert plan["pre.fn.fc"].compute_dtype == "float32", explicit


def test_a_rule_reaching_most_parameters_through_containers_is_said_once():
    layers = [Layer("", None, "Net"), Layer("a", None, "Block"), Layer("a.fc", "linear", "Linear", 30),
              Layer("b", None, "Block"), Layer("b.fc", "linear", "Linear", 30),
              Layer("b.norm", "norm", "LayerNorm", 10), Layer("head", "linear", "Linear", 30)]
    broad = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "type:Block"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            plan = build_plan(layers, broad)
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.BroadRuleWarning)]
    # a.fc and b.fc follow Block's rule (60 of 100); b.norm is matched by kind:norm itself, not reached
    assert said == ["keep_float32[1] (type:Block) reaches 60.0% of the model's parameters through the "
                    "container(s) it matches (a, b): everything a matched container holds follows the rule; "
                    "name the layers themselves if that is not meant"]
    assert said[0] in plan.notes
    # a rule matching the layers themselves, however many, or reaching half or less, is not said
    for quiet in (Policy(compute_dtype="bfloat16", keep_float32=("kind:linear",)),
                  Policy(compute_dtype="bfloat16", keep_float32=("a", "b.norm"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not [n for n in build_plan(layers, quiet).notes if "reaches" in n]


def test_row_resolver_never_infers_the_root():
    from ampbridge.core.plan import RowResolver

    r = RowResolver(Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
    chain = [Layer("", "norm", "TinyNorm", 0, "class name"), Layer("fc", "linear", "Linear", 4, "framework class")]
    assert r.row(chain).compute_dtype == "float16"
    assert r.row([Layer("", "norm", "LayerNorm", 4, "framework class")]).compute_dtype == "float32"


def test_a_kinds_entry_naming_no_class_of_the_model_warns_once():
    layers = [Layer("", None, "Net"), Layer("norm", "norm", "LlamaRMSNorm", 4, "class name"),
              Layer("fc", "linear", "Linear", 16, "framework class")]
    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",),
                    kinds={"norm": ["LlamaRMSNrom", "re:.*RMSNorm$"], "none": ["re:Gemma.*"], "linear": ["Linear"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            plan = build_plan(layers, policy)
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.UnmatchedRuleWarning)]
    assert said == ['[kinds] norm = "LlamaRMSNrom" matches no class of the model (a typo?); '
                    "did you mean 'LlamaRMSNorm'?",
                    '[kinds] none = "re:Gemma.*" matches no class of the model (a typo?)']
    assert all(line in plan.notes for line in said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry names a class: nothing to say
        build_plan(layers, policy.replace(kinds={"norm": ["re:.*RMSNorm$"], "linear": ["Linear"]}))
