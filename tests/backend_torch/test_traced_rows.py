"""Traced torch rows claim only what ran (issue 37): a layer whose forward ran no op keeps its static
row and says so; MoE experts computing through ``torch._grouped_mm`` (which CPU autocast does not
cast) are traced in float32, and a row whose ops ran in two dtypes names the odd ones; a rule whose
layers never run their forward (the model reads their weights) warns that it has no effect."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

require("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampbridge  # noqa: E402
from ampbridge.core.plan import NO_OP  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.conv_weights = nn.Linear(4, 4), nn.Dropout(0.5), nn.Conv1d(4, 4, 1)

    def forward(self, x):
        # conv_weights: its weight is read directly (as Mamba reads conv1d's), its forward never runs
        w = self.conv_weights.weight[:, :, 0]
        return self.drop(self.fc(x)) @ w


class Mixed(nn.Module):  # an author's float32 op beside an autocast matmul: two dtypes in one row
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w  # autocast: bfloat16
        return torch.softmax(h.float(), -1)  # the author's float32 softmax


def test_an_eval_dropout_keeps_its_static_row_and_says_so_and_an_idle_rule_warns():
    torch.manual_seed(0)
    model = Net().eval()
    amp = ampbridge.torch.apply(model, ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:conv",)))
    with pytest.warns(ampbridge.IdleRuleWarning, match=r"keep_float32\[0\] \(kind:conv\) has no effect: the "
                      r"layers it matches \(conv_weights\) never ran their forward"):
        traced = amp.trace(torch.randn(2, 4))
    assert any(n.startswith("keep_float32[0] (kind:conv) has no effect") for n in traced.notes)
    drop = traced["drop"]
    assert drop.note.endswith("; " + NO_OP) and drop.compute_dtype == amp.plan["drop"].compute_dtype
    assert traced["fc"].note is None and traced["fc"].compute_dtype == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule whose layer runs has an effect: nothing to say
        ampbridge.torch.apply(Net().eval(), ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("fc",))) \
            .trace(torch.randn(2, 4))


def test_a_row_whose_ops_ran_in_two_dtypes_names_the_odd_ones():
    amp = ampbridge.torch.apply(Mixed(), ampbridge.Policy(compute_dtype="bfloat16"))
    row = amp.trace(torch.randn(2, 4))[""]
    assert row.compute_dtype == "bfloat16" and row.other_ops == ("_softmax float32",)
    assert "ops in another dtype than the row's bfloat16: _softmax float32" in amp.trace(torch.randn(2, 4)).table()


def test_moe_experts_through_grouped_mm_are_traced_in_float32():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).eval()
    experts = [p for p, m in model.named_modules() if type(m).__name__ == "MixtralExperts"]
    if not experts:
        pytest.skip("this transformers has no MixtralExperts module (experts as separate Linear layers)")
    ran = []

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):  # what really runs, independently
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "grouped_mm" in func.overloadpacket.__name__:
                ran.append(out.dtype)
            return out

    amp = ampbridge.torch.apply(model, ampbridge.Policy(compute_dtype="bfloat16"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Recorder():
        model(ids)
    if not ran:
        pytest.skip("this transformers runs its experts without torch._grouped_mm")
    assert set(ran) == {torch.float32}  # CPU autocast leaves _grouped_mm alone
    traced = amp.trace(ids)
    for path in experts:
        static = amp.plan[path]  # the static row says it too, and counts its parameters as float32
        assert (static.compute_dtype, static.output_dtype) == ("float32", "float32") and "grouped_mm" in static.note
        assert (traced[path].compute_dtype, traced[path].output_dtype) == ("float32", "float32")
        assert traced[path] == static  # what ran is what the static row said
