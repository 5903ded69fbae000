"""torch kinds: the core's inference after torch.nn's classes, structure (GPT-2's Conv1D is a linear
map), ``register_kind``, and the policy's [kinds] table beating both, realised in what runs."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

require("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampbridge  # noqa: E402
from ampbridge.backends.torch.layers import _REGISTERED  # noqa: E402


class ScaleNorm(nn.Module):  # a custom norm: no torch.nn base, a kind by its name
    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True)


class Gate(nn.Module):  # no name hint at all
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        return x @ self.w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = ScaleNorm(8)
        self.gate = Gate(8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.gate(self.norm(self.embed(ids))))


def test_inferred_registered_and_table_kinds(probe):
    torch.manual_seed(0)
    model = Net()
    assert ampbridge.torch.kind_and_source(model.norm) == ("norm", "class name")
    assert ampbridge.torch.kind_and_source(model.head) == ("linear", "framework class")
    assert ampbridge.torch.kind_and_source(model.gate) == (None, None)
    try:
        ampbridge.torch.register_kind(Gate, "attention")
        assert ampbridge.torch.kind_and_source(model.gate) == ("attention", "registered")
        policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "kind:attention"))
        plan = ampbridge.torch.plan(model, policy)
        assert plan["gate"].compute_dtype == "float32" and plan["gate"].kind_text == "attention (registered)"
        # the [kinds] table beats the registration: Gate is no kind, ScaleNorm stays a norm
        table = policy.replace(keep_float32=("kind:norm",), kinds={"none": ["Gate"]})
        amp = ampbridge.torch.apply(model, table)
        assert amp.plan["gate"].kind is None and amp.plan["gate"].kind_source.startswith("[kinds] table; overrules")
        assert amp.plan["norm"].compute_dtype == "float32" and amp.plan["gate"].compute_dtype == "bfloat16"
        ids = torch.randint(0, 16, (2, 4))
        with torch.no_grad(), probe.Probe(model) as seen:
            model(ids)
        assert seen.out["norm"] == torch.float32 and seen.cast_ops["gate"] == [torch.bfloat16]
        probe.check_plan(amp.plan, seen, model=model)
    finally:
        _REGISTERED.unregister(Gate)
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        ampbridge.torch.register_kind(int, "norm")
    with pytest.raises(ValueError, match="unknown kind"):
        ampbridge.torch.register_kind(Gate, "normal")


def test_gpt2_conv1d_is_linear_by_structure():
    transformers = pytest.importorskip("transformers")
    conv1d = transformers.pytorch_utils.Conv1D(8, 4)
    kind, source = ampbridge.torch.kind_and_source(conv1d)
    assert kind == "linear" and source.startswith("structure: a 2-D weight")

    class PatchConv2d(nn.Module):  # a real convolution keeps its name's kind
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3, 2, 2))

    assert ampbridge.torch.kind_and_source(PatchConv2d()) == ("conv", "class name")


def test_rule_reaching_no_recognised_class_is_said_once():
    class NormedProjection(nn.Module):  # looks like a norm by name, is not recognised as one
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    model = nn.Sequential(NormedProjection(), nn.LayerNorm(4))
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ampbridge.torch.apply(model, policy).remove()
            ampbridge.torch.plan(model, policy)
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.UnmatchedRuleWarning)]
    assert len(said) == 1 and "NormedProjection look like norm" in said[0]


class PreNorm(nn.Module):  # the common ViT wrapper: a LayerNorm and the block it normalises for
    def __init__(self, d, fn):
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(d), fn

    def forward(self, x):
        return self.fn(self.norm(x))


class TinyNorm(nn.Module):  # a model whose own class name ends in Norm
    def __init__(self, d=8):
        super().__init__()
        self.pre = PreNorm(d, nn.Linear(d, d))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(x + self.pre(x))


def test_a_prenorm_wrapper_and_the_root_get_no_inferred_kind(probe):
    torch.manual_seed(0)
    model = TinyNorm()
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    amp = ampbridge.torch.apply(model, policy)
    plan = amp.plan
    assert plan[""].kind is None and plan[""].kind_source == "norm by name, not inferred: the model itself"
    assert plan["pre"].kind is None and plan["pre"].kind_source == "norm by name, not inferred: holds linear"
    assert [plan[p].compute_dtype for p in ("", "pre", "pre.norm", "pre.fn", "head")] == \
        ["bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16"]
    x = torch.randn(2, 8)
    with torch.no_grad(), probe.Probe(model) as seen:
        model(x)
    assert seen.out["pre.norm"] == torch.float32 and seen.out["pre.fn"] == torch.bfloat16  # what really ran
    probe.check_plan(plan, seen, model=model)
    amp.remove()
    # an explicit [kinds] entry still makes the wrapper a norm: the rule reaches what it holds
    with pytest.warns(ampbridge.BroadRuleWarning, match=r"kind:norm\) reaches .* \(pre\)"):
        amp = ampbridge.torch.apply(model, policy.replace(kinds={"norm": ["PreNorm"]}))
    assert amp.plan["pre"].kind_text == "norm ([kinds] table)" and amp.plan["pre.fn"].compute_dtype == "float32"
    with torch.no_grad(), probe.Probe(model) as seen:
        model(x)
    assert seen.out["pre.fn"] == torch.float32
    amp.remove()


class TimestepEmbedding(nn.Module):  # as diffusers writes it: an MLP on sinusoidal features, no lookup table
    def __init__(self, d=8):
        super().__init__()
        self.linear_1, self.act, self.linear_2 = nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)

    def forward(self, t):
        return self.linear_2(self.act(self.linear_1(t)))


def test_a_timestep_embedding_mlp_is_no_embedding():
    model = nn.Sequential(TimestepEmbedding(), nn.Linear(8, 2))
    plan = ampbridge.torch.plan(model, ampbridge.Policy(compute_dtype="bfloat16"))
    assert plan["0"].kind is None and plan["0"].kind_source == "embedding by name, not inferred: holds linear"
