"""The model zoo: third-party torch models (transformers, tiny configs, random init, no downloads) and
``torch.nn.TransformerEncoder`` under ``keep_float32 = ["kind:norm", "kind:embedding"]``.

For every model and float16/bfloat16 compute: every norm and embedding layer, counted here by class
(lists written for each model, independent of ampbridge's kinds), is pinned to float32 in the Plan;
the dtypes each module really ran in (the conftest probe: module hooks plus a dispatch mode) equal
the Plan row by row, compute and output; ``kind:attention`` matches every attention module.

``pytest -s tests/backend_torch/test_zoo.py`` prints the closing table (layers, recognised kinds,
pinned layers, Plan-vs-observed mismatches per model).
"""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import ZOO_HEADER, require, zoo_line
from ampbridge.core.table import render_table

require("torch")
transformers = pytest.importorskip("transformers")  # in the dev extra (constraints.txt pins it)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampbridge  # noqa: E402

POLICY = {"keep_float32": ["kind:norm", "kind:embedding"]}
#: ViT's embedding stage is a patch convolution, no lookup table: inference gives it no kind (a
#: container holding a conv is no embedding), so a user who wants it pinned names it, as here
KINDS = {"vit": {"embedding": ["ViTEmbeddings", "ViTPatchEmbeddings"]}}


class Encoder(nn.Module):
    """torch.nn.TransformerEncoder behind an embedding (what a user builds around it)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.embed(ids))


def _ids(*shape):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(0))


def _build(name):
    t = transformers
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=32)
    if name == "bert":
        return t.BertModel(t.BertConfig(**small)), (_ids(2, 8),), {}
    if name == "gpt2":
        cfg = t.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
        return t.GPT2LMHeadModel(cfg), (_ids(2, 8),), {}
    if name == "t5":
        cfg = t.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                         decoder_start_token_id=0)
        return t.T5ForConditionalGeneration(cfg), (_ids(2, 8),), {"decoder_input_ids": _ids(2, 4)}
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**small, num_key_value_heads=1)), (_ids(2, 8),), {}
    if name == "vit":
        cfg = t.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32)
        pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        return t.ViTModel(cfg), (pixels,), {}
    if name == "mixtral":
        cfg = t.MixtralConfig(**small, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
        return t.MixtralForCausalLM(cfg), (_ids(2, 8),), {}
    if name == "transformer_encoder":
        return Encoder(), (_ids(2, 8),), {}
    raise KeyError(name)


#: per model, written by hand from the model's code: the classes of its norm, embedding and attention layers
EXPECTED = {
    "bert": ({"LayerNorm"}, {"Embedding", "BertEmbeddings"}, {"BertAttention", "BertSelfAttention"}),
    "gpt2": ({"LayerNorm"}, {"Embedding"}, {"GPT2Attention"}),
    "t5": ({"T5LayerNorm"}, {"Embedding"}, {"T5Attention", "T5LayerSelfAttention", "T5LayerCrossAttention"}),
    "llama": ({"LlamaRMSNorm"}, {"Embedding"}, {"LlamaAttention"}),
    "vit": ({"LayerNorm"}, {"ViTEmbeddings", "ViTPatchEmbeddings"}, {"ViTAttention"}),
    "mixtral": ({"MixtralRMSNorm"}, {"Embedding"}, {"MixtralAttention"}),
    "transformer_encoder": ({"LayerNorm"}, {"Embedding"}, {"MultiheadAttention"}),
}
MODELS = list(EXPECTED)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
RESULTS: dict = {}


def _run(name, compute, probe_kit, pins=True):
    model, args, kwargs = _build(name)
    model.eval()
    norms, embeddings, attentions = EXPECTED[name]
    policy = ampbridge.Policy(compute_dtype=compute, **(dict(POLICY, kinds=KINDS.get(name, {})) if pins else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unmatched rule or an unrecognised kind fails the test
        amp = ampbridge.torch.apply(model, policy)
    plan = amp.plan
    by_class = {p: type(m).__name__ for p, m in model.named_modules()}
    expected_pinned = {p for p, c in by_class.items() if c in norms | embeddings}
    pinned = {r.path for r in plan.rows if r.rule != "default"}
    unpinned = sorted(p for p in expected_pinned
                      if plan[p].compute_dtype != "float32" or plan[p].output_dtype != "float32"
                      or plan[p].rule == "default")
    with torch.no_grad(), probe_kit.Probe(model) as probe:
        model(*args, **kwargs)
    try:
        # lists have no forward; a module its parent never calls (sdpa's dropout, T5's tied ``shared``) ran in nothing
        idle = {p for p, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
                or p not in probe.ran}
        checked = probe_kit.check_plan(plan, probe, ignore=idle, model=model)
        mismatches = []
    except AssertionError as e:
        checked, mismatches = None, str(e).splitlines()
    attention_plan = ampbridge.torch.plan(model, ampbridge.Policy(compute_dtype=compute,
                                                                  keep_float32=("kind:attention",)))
    attention_paths = {p for p, c in by_class.items() if c in attentions}
    matched_attention = {r.path for r in attention_plan.rows if r.pattern == "kind:attention" and r.inherited_from is None}
    kinds = {}
    for r in plan.rows:
        if r.kind:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return dict(model=model, plan=plan, layers=len(plan.rows), kinds=kinds, pinned=len(pinned), ran=len(probe.ran),
                expected_pinned=expected_pinned, unpinned=unpinned, mismatches=mismatches, checked=checked,
                attention_paths=attention_paths, matched_attention=matched_attention)


@pytest.mark.parametrize("compute", list(DTYPES))
@pytest.mark.parametrize("name", MODELS)
def test_zoo_plan_pins_and_runs(name, compute, probe):
    got = RESULTS[(name, compute)] = _run(name, compute, probe)
    assert got["expected_pinned"], f"{name}: the hand-written class lists found no norm or embedding"
    assert not got["unpinned"], f"{name}: norm/embedding layers not pinned: {got['unpinned']}"
    assert not got["mismatches"], "\n".join(got["mismatches"])
    assert got["attention_paths"] and got["matched_attention"] == got["attention_paths"], (
        f"kind:attention matched {sorted(got['matched_attention'] ^ got['attention_paths'])} wrongly")
    width = max(map(len, got["plan"].table().splitlines()))
    assert width <= 120, f"{name}: the Plan table has a line of {width} characters (notes are footnotes)"


@pytest.mark.parametrize("compute", list(DTYPES))
@pytest.mark.parametrize("name", MODELS)
def test_zoo_unpinned_rows_say_what_runs(name, compute, probe):
    """With no rule at all, the static rows still match what ran (norms that follow their input, custom
    modules whose own code decides, embedding lookups in their weights' dtype)."""
    got = RESULTS[(name, compute, "no rules")] = _run(name, compute, probe, pins=False)
    assert not got["mismatches"], "\n".join(got["mismatches"])


def test_zoo_table(probe):
    """The closing table (run with -s to see it): every model, float16 and bfloat16."""
    lines = []
    for name in MODELS:
        for compute in DTYPES:
            got = RESULTS.get((name, compute)) or _run(name, compute, probe)
            bare = RESULTS.get((name, compute, "no rules")) or _run(name, compute, probe, pins=False)
            lines.append(zoo_line(name, compute, got, bare))
            assert not got["mismatches"] and not got["unpinned"] and not bare["mismatches"]
    print()
    print(render_table(ZOO_HEADER, lines))
