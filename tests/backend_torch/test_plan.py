"""Plans of torch models: paths, kinds, autocast's behaviour per device, the registry and the CLI."""

import json
import textwrap

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import Policy

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch.layers import class_name  # noqa: E402
from ampbridge.backends.torch.environment import cpu_lstm_runs  # noqa: E402
from ampbridge.backends.torch.plan import _behaviour, realise_plan  # noqa: E402

nn = torch.nn

KINDS = [
    (nn.BatchNorm1d(4), "norm"), (nn.BatchNorm2d(4), "norm"), (nn.BatchNorm3d(4), "norm"),
    (nn.SyncBatchNorm(4), "norm"), (nn.LazyBatchNorm1d(), "norm"), (nn.LayerNorm(4), "norm"),
    (nn.GroupNorm(2, 4), "norm"), (nn.InstanceNorm1d(4), "norm"), (nn.InstanceNorm2d(4), "norm"),
    (nn.InstanceNorm3d(4), "norm"), (nn.RMSNorm(4), "norm"), (nn.LocalResponseNorm(2), "norm"),
    (nn.Embedding(3, 4), "embedding"), (nn.EmbeddingBag(3, 4), "embedding"),
    (nn.Softmax(-1), "softmax"), (nn.LogSoftmax(-1), "softmax"), (nn.Softmin(-1), "softmax"),
    (nn.Softmax2d(), "softmax"),
    (nn.Linear(2, 2), "linear"), (nn.LazyLinear(2), "linear"), (nn.Bilinear(2, 2, 2), "linear"),
    (nn.Conv1d(2, 2, 1), "conv"), (nn.Conv2d(2, 2, 1), "conv"), (nn.Conv3d(2, 2, 1), "conv"),
    (nn.ConvTranspose2d(2, 2, 1), "conv"), (nn.LazyConv2d(2, 1), "conv"),
    (nn.MultiheadAttention(4, 2), "attention"),
    (nn.RNN(2, 2), "recurrent"), (nn.LSTM(2, 2), "recurrent"), (nn.GRU(2, 2), "recurrent"),
    (nn.RNNCell(2, 2), "recurrent"), (nn.LSTMCell(2, 2), "recurrent"), (nn.GRUCell(2, 2), "recurrent"),
    (nn.ReLU(), None), (nn.Sequential(), None), (nn.TransformerEncoderLayer(4, 2, 8), None),
]


@pytest.mark.parametrize("module,kind", KINDS, ids=[type(m).__name__ for m, _ in KINDS])
def test_kinds_of_torch_nn_classes(module, kind):
    assert abt.kind_of(module) == kind


def test_ampbridge_kind_wins_on_classes_and_instances():
    class Attention(nn.Module):
        ampbridge_kind = "attention"

    class MyNorm(nn.LayerNorm):
        ampbridge_kind = None  # opting out of the class mapping

    lin = nn.Linear(2, 2)
    lin.ampbridge_kind = "conv"
    assert abt.kind_of(Attention()) == "attention" and abt.kind_of(MyNorm(2)) is None and abt.kind_of(lin) == "conv"
    bad = nn.Linear(2, 2)
    bad.ampbridge_kind = "nrom"
    with pytest.raises(ValueError, match="unknown kind 'nrom'; accepted: norm"):
        abt.kind_of(bad)


def test_paths_counts_and_the_root(tiny):
    layers = abt.layers(tiny)
    assert [layer.path for layer in layers][:4] == ["", "embed", "ln1", "attn"]
    assert (layers[0].kind, layers[0].class_name, layers[0].param_count) == (None, "Tiny", 0)
    assert dict((la.path, la.param_count) for la in layers)["attn"] == 16 * 48 + 48  # in_proj only: out_proj is its own row
    assert sum(la.param_count for la in layers) == sum(p.numel() for p in tiny.parameters())
    single = abt.layers(nn.Linear(3, 2))
    assert [(la.path, la.kind, la.class_name, la.param_count) for la in single] == [("", "linear", "Linear", 8)]
    assert abt.plan(nn.Linear(3, 2), "mixed_bfloat16")[""].output_dtype == "float32"  # the model's output


def test_the_registry_dispatches_torch_models(tiny, tmp_path):
    plan = ampbridge.plan(tiny, "mixed_float16")
    assert plan.framework == "torch" and plan["fc1"].compute_dtype == "float16"
    path = tmp_path / "amp.toml"
    path.write_text('extends = "mixed_bfloat16"\nkeep_float32 = ["kind:norm"]\n')
    plan = ampbridge.plan(tiny, str(path))
    assert plan["ln2"].compute_dtype == "float32" and plan["ln2"].rule == "keep_float32[0]"
    assert json.loads(plan.to_json())["framework"] == "torch"
    with pytest.warns(ampbridge.UnmatchedRuleWarning, match="decoder"):
        ampbridge.plan(tiny, Policy(compute_dtype="bfloat16", keep_float32=("decoder",)))


def test_explain_on_a_torch_model_through_the_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "ab_cli_models.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2),
                                       torch.nn.Softmax(-1))
        def build_traced():
            return build(), torch.tensor([[1, 2, 3]])
    """))
    (tmp_path / "amp.toml").write_text('extends = "mixed_float16"\nkeep_float32 = ["kind:norm"]\n')
    monkeypatch.chdir(tmp_path)
    from ampbridge.cli.commands import main

    assert main(["explain", "amp.toml", "--model", "ab_cli_models:build"]) == 0
    out = capsys.readouterr().out
    assert "Plan (torch)" in out and "keep_float32[0] kind:norm" in out
    assert "its weights' dtype (float32)" in out and "follows its input's dtype" in out
    assert main(["explain", "amp.toml", "--model", "ab_cli_models:build_traced", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["path"]: r for r in data["rows"]}
    assert rows["3"]["compute_dtype"] == "float16" and "traced: ran in float16" in rows["3"]["note"]
    assert rows["1"]["compute_dtype"] == "float32"


# --- autocast's per-device behaviour, checked against torch itself -------------------------------

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
BEHAVIOUR_CASES = [
    (nn.Linear(8, 8), lambda d: (torch.randn(2, 8, dtype=d),)),
    (nn.Conv1d(4, 4, 3), lambda d: (torch.randn(2, 4, 8, dtype=d),)),
    (nn.ConvTranspose2d(4, 4, 3), lambda d: (torch.randn(2, 4, 5, 5, dtype=d),)),
    (nn.Bilinear(4, 4, 2), lambda d: (torch.randn(2, 4, dtype=d), torch.randn(2, 4, dtype=d))),
    (nn.LayerNorm(8), lambda d: (torch.randn(2, 8, dtype=d),)),
    (nn.GroupNorm(2, 4), lambda d: (torch.randn(2, 4, 8, dtype=d),)),
    (nn.BatchNorm1d(4), lambda d: (torch.randn(3, 4, 8, dtype=d),)),
    (nn.InstanceNorm1d(4, affine=True), lambda d: (torch.randn(3, 4, 8, dtype=d),)),
    (nn.LocalResponseNorm(2), lambda d: (torch.randn(3, 4, 8, dtype=d),)),
    (nn.Softmax(-1), lambda d: (torch.randn(2, 8, dtype=d),)),
    (nn.LogSoftmax(-1), lambda d: (torch.randn(2, 8, dtype=d),)),
    (nn.MultiheadAttention(8, 2, batch_first=True), lambda d: (torch.randn(2, 3, 8, dtype=d),) * 3),
    (nn.RNN(8, 8, batch_first=True), lambda d: (torch.randn(2, 3, 8, dtype=d),)),
    (nn.GRU(8, 8, batch_first=True), lambda d: (torch.randn(2, 3, 8, dtype=d),)),
    (nn.GRUCell(8, 8), lambda d: (torch.randn(2, 8, dtype=d),)),
    (nn.LSTM(8, 8, batch_first=True), lambda d: (torch.randn(2, 3, 8, dtype=d),)),
    (nn.Embedding(10, 8), lambda d: (torch.tensor([1, 2]),)),
    (nn.EmbeddingBag(10, 8), lambda d: (torch.tensor([[1, 2]]),)),
    (nn.GELU(), lambda d: (torch.randn(2, 8, dtype=d),)),
]


@pytest.mark.parametrize("module,make", BEHAVIOUR_CASES, ids=[type(m).__name__ for m, _ in BEHAVIOUR_CASES])
@pytest.mark.parametrize("region", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_autocast_does_what_the_backend_says(module, make, region, probe):
    behaviour = _behaviour(module, "cpu")
    for fed in (torch.float32, region):
        if isinstance(module, nn.LSTM) and fed == torch.float32 and not abt.cpu_lstm_takes_float32_inputs(
                NAMES[region]):
            with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=region):
                module(*make(fed))  # oneDNN cannot on this CPU; the plan row says so:
            row = abt.plan(nn.Sequential(module), Policy(compute_dtype=NAMES[region]), device_type="cpu")["0"]
            runs_at_all = cpu_lstm_runs(NAMES[region], NAMES[region])
            assert (f"needs {NAMES[region]} inputs on this CPU" if runs_at_all else "cannot run under") in row.note
            continue
        if isinstance(module, nn.LSTM) and fed == region and not cpu_lstm_runs(NAMES[region], NAMES[region]):
            with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=region):
                module(*make(fed))  # not even on its own dtype's inputs here: the row above says "pin it"
            continue
        if isinstance(module, nn.Bilinear) and fed != torch.float32:
            continue  # torch's bilinear cannot mix dtypes: ampbridge presents its parameters (test below)
        with probe.Probe(module) as seen, torch.autocast("cpu", dtype=region):
            module(*make(fed))
        got = seen.computed("")
        want = {"cast": region, "input": fed, "weights": torch.float32}[behaviour]
        assert got == {want}, (behaviour, fed, got)


def _autocast_kernel(op, key):
    line = next(x for x in torch._C._dispatch_dump_table(op).splitlines() if x.startswith(key + ":"))
    return "fallthrough" not in line


@pytest.mark.parametrize("op,module,expect", [
    ("aten::layer_norm", nn.LayerNorm(4), "float32"), ("aten::group_norm", nn.GroupNorm(2, 4), "float32"),
    ("aten::rms_norm", nn.RMSNorm(4), "float32"), ("aten::softmax.int", nn.Softmax(-1), "float32"),
    ("aten::log_softmax.int", nn.LogSoftmax(-1), "float32"), ("aten::pow.Tensor_Scalar", nn.LocalResponseNorm(2), "float32"),
    ("aten::linear", nn.Linear(2, 2), "cast"), ("aten::conv1d", nn.Conv1d(2, 2, 1), "cast"),
    ("aten::bilinear", nn.Bilinear(2, 2, 2), "cast"), ("aten::bmm", nn.MultiheadAttention(4, 2), "cast"),
    ("aten::batch_norm", nn.BatchNorm1d(4), "input"), ("aten::instance_norm", nn.InstanceNorm1d(4), "input"),
    ("aten::embedding", nn.Embedding(3, 4), "weights"), ("aten::embedding_bag", nn.EmbeddingBag(3, 4), "weights"),
])
def test_the_cuda_table_matches_torchs_autocast_registrations(op, module, expect):
    """No GPU here: the CUDA rows come from torch's op lists; the dispatcher confirms which ops
    AutocastCUDA handles (a kernel: cast to float32 or to the region; a fallthrough: left alone)."""
    assert _behaviour(module, "cuda") == expect
    assert _autocast_kernel(op, "AutocastCUDA") == (expect in ("float32", "cast"))


def test_cuda_plans_say_where_autocast_overrides_the_row(tiny):
    plan = abt.plan(tiny, Policy(compute_dtype="float16", keep_float32=("kind:embedding",)), device_type="cpu")
    assert plan["ln2"].compute_dtype == "float16" and "follows its input" in plan["ln2"].note
    rows = realise_plan(tiny, Policy(compute_dtype="float16", keep_float32=("kind:embedding",)), "cuda").plan
    assert rows["ln2"].compute_dtype == "float32" and rows["ln2"].output_dtype == "float32"
    assert rows["ln2"].note == "cuda autocast runs LayerNorm in float32"
    assert rows["fc1"].compute_dtype == "float16" and rows["fc1"].note is None


@pytest.mark.filterwarnings("ignore:`torch.jit.script.*` is deprecated")
def test_scripted_models_are_planned_by_their_original_classes():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))
    plan = abt.plan(scripted, Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",)))
    assert [(r.path, r.kind, r.class_name, r.compute_dtype, r.output_dtype) for r in plan.rows] == [
        ("", None, "Sequential", "bfloat16", "float32"), ("0", "linear", "Linear", "bfloat16", "bfloat16"),
        ("1", "norm", "LayerNorm", "float32", "float32")]
    assert plan[""].note == "model outputs cast to output_dtype float32"
    assert any("TorchScript" in n for n in plan.notes)


def test_fsdp2_classes_report_their_base_name():
    FSDPModule = type("FSDPModule", (), {})
    fsdp_norm = type("FSDPLayerNorm", (FSDPModule, nn.LayerNorm), {})(4)
    assert class_name(fsdp_norm) == "LayerNorm" and abt.kind_of(fsdp_norm) == "norm"


def test_bilinear_fed_lower_precision_runs_in_it(probe):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bil = nn.Linear(4, 4), nn.Bilinear(4, 4, 2)

        def forward(self, x):
            h = self.lin(x)
            return self.bil(h, h) + self.bil(x, x).to(h.dtype)

    model = Net()
    with pytest.raises(RuntimeError, match="same dtype"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))  # plain autocast
    amp = abt.apply(model, "mixed_bfloat16")
    with probe.Probe(model) as seen:
        model(torch.randn(2, 4)).sum().backward()
    assert seen.main["bil"] == [torch.bfloat16, torch.float32]  # each call in its input's dtype
    assert "presented in that dtype" in amp.plan["bil"].note and model.bil.weight.dtype == torch.float32
    assert model.bil.weight.grad is not None and model.bil.weight.grad.dtype == torch.float32
