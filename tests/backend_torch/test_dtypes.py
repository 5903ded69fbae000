"""The dtype every module really computes in (seen from the dispatcher) is the one its Plan row says."""

import warnings

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import Policy, Rule

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Block(nn.Module):
    ampbridge_kind = "attention"  # a custom attention block declares its portable kind

    def __init__(self, d):
        super().__init__()
        self.q, self.sm, self.o = nn.Linear(d, d), nn.Softmax(-1), nn.Linear(d, d)

    def forward(self, x):
        return self.o(self.sm(self.q(x)) * x)


class Zoo(nn.Module):
    """One of (nearly) every class the backend maps, wired into one network."""

    def __init__(self, d=8):
        super().__init__()
        self.embed, self.bag = nn.Embedding(20, d), nn.EmbeddingBag(20, d)
        self.conv, self.bn, self.gn = nn.Conv1d(d, d, 3, padding=1), nn.BatchNorm1d(d), nn.GroupNorm(2, d)
        self.inorm, self.lrn = nn.InstanceNorm1d(d, affine=True), nn.LocalResponseNorm(2)
        self.rnn, self.rms = nn.GRU(d, d, batch_first=True), nn.RMSNorm(d)
        self.enc = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)
        self.block, self.bil, self.drop, self.act = Block(d), nn.Bilinear(d, d, d), nn.Dropout(0.1), nn.ReLU()
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d), nn.LayerNorm(d))
        self.head, self.lsm = nn.Linear(d, 5), nn.LogSoftmax(-1)

    def forward(self, tokens):
        h = self.drop(self.embed(tokens) + self.bag(tokens)[:, None, :])
        c = self.lrn(self.inorm(self.gn(self.bn(self.conv(h.transpose(1, 2))))))
        h = h + c.transpose(1, 2)
        r, _ = self.rnn(h)
        h = self.enc(self.rms(h + r))
        h = self.act(self.block(h)) + self.bil(h, h)
        return self.lsm(self.head(h + self.mlp(h)))


POLICIES = {
    "float16, norms and embeddings pinned": Policy(compute_dtype="float16", keep_float32=("kind:norm", "kind:embedding")),
    "bfloat16, nothing pinned": Policy(compute_dtype="bfloat16"),
    "float16 with a bfloat16 override, and one inside a pinned block": Policy(
        compute_dtype="float16", keep_float32=("kind:norm", "enc"),
        overrides=(Rule(("mlp",), compute_dtype="bfloat16"), Rule(("enc.linear1",), compute_dtype="bfloat16"))),
    "float32 with bfloat16 islands": Policy(overrides=(Rule(("block", "mlp"), compute_dtype="bfloat16"),)),
    "bfloat16 storage (the bfloat16 preset)": ampbridge.preset("bfloat16").replace(keep_float32=("kind:embedding",)),
    "float32 compute from bfloat16 storage": Policy(param_dtype="bfloat16"),
    "bfloat16, head delivers float32": Policy(compute_dtype="bfloat16", overrides=(
        Rule(("head",), output_dtype="float32"),)),
}


def zoo():
    torch.manual_seed(0)
    return Zoo()


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_module_computes_in_its_plan_dtype(name, probe):
    model, tokens = zoo(), torch.randint(0, 20, (2, 6))
    amp = abt.apply(model, POLICIES[name])
    with probe.Probe(model) as seen:
        out = model(tokens)
    checked = probe.check_plan(amp.plan, seen, model=model)
    assert checked >= 28  # every module but out_proj, whose forward MultiheadAttention never calls
    assert out.dtype == abt.native_dtype(amp.active_policy.output_dtype)
    out.float().sum().backward()  # and it trains


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_traced_plan_is_exact_for_every_row(name, probe):
    model, tokens = zoo(), torch.randint(0, 20, (2, 6))
    traced = abt.plan(model, POLICIES[name], tokens)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # traced on a copy
    abt.apply(model, POLICIES[name])
    with probe.Probe(model) as seen:
        model(tokens)
    wrong = [(r.path, r.compute_dtype, seen.computed(r.path)) for r in traced.rows
             if seen.computed(r.path) is not None and {NAMES[d] for d in seen.computed(r.path)} != {r.compute_dtype}]
    assert not wrong


def test_input_following_rows_are_named_and_traced():
    model, tokens = zoo(), torch.randint(0, 20, (2, 6))
    static = abt.plan(model, "mixed_bfloat16")
    traced = abt.plan(model, "mixed_bfloat16", tokens)
    # the residual stream is float32 (embedding + a bfloat16 branch promotes), so these ran in float32
    for path in ("drop", "bil"):
        assert static[path].compute_dtype == "bfloat16" and "follows its input's dtype" in static[path].note
        assert traced[path].compute_dtype == "float32" and "traced: ran in float32" in traced[path].note
    assert any("traces the exact dtypes" in n for n in static.notes)
    assert traced["conv"] == static["conv"]


def test_storage_and_buffers():
    model = zoo()
    amp = abt.apply(model, POLICIES["bfloat16 storage (the bfloat16 preset)"])
    assert model.conv.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.bfloat16
    assert model.embed.weight.dtype == torch.float32  # pinned
    # BatchNorm: torch needs its parameters in its running statistics' dtype, which stays float32
    assert model.bn.weight.dtype == torch.float32 and model.bn.running_mean.dtype == torch.float32
    assert amp.plan["bn"].param_dtype == "float32" and "running statistics" in amp.plan["bn"].note
    assert all(b.dtype in (torch.float32, torch.int64) for b in model.buffers())
    for row in amp.plan.rows:
        for p in getattr(model.get_submodule(row.path), "_parameters", {}).values():
            if p is not None and row.path != "enc.self_attn.out_proj":
                assert NAMES[p.dtype] == row.param_dtype, row.path


def test_a_parameter_shared_by_two_rows_is_stored_once_in_the_wider_dtype():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, t):
            return self.head(self.embed(t))

    model = Tied()
    amp = abt.apply(model, ampbridge.preset("bfloat16").replace(keep_float32=("kind:embedding",)))
    assert model.embed.weight.dtype == torch.float32 and model.head.weight is model.embed.weight
    assert amp.plan["head"].param_dtype == "float32" and "shared" in amp.plan["head"].note
    assert amp.plan["embed"].param_count == 40 and amp.plan["head"].param_count == 0  # counted once
    assert model(torch.tensor([[1, 2]])).dtype == torch.bfloat16


def test_model_outputs_of_every_structure_are_cast():
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            y = self.lin(x) * scale
            return {"y": y, "pair": (y, torch.arange(3)), "list": [y]}

    model = Many()
    abt.apply(model, Policy(compute_dtype="bfloat16", output_dtype="float16"))
    out = model(torch.ones(1, 2), scale=2.0)
    assert out["y"].dtype == out["pair"][0].dtype == out["list"][0].dtype == torch.float16
    assert out["pair"][1].dtype == torch.int64  # integers are left alone


def test_a_pinned_module_gets_its_floating_inputs_cast_and_its_ints_kept():
    seen = {}

    class Pinned(nn.Module):
        ampbridge_kind = "norm"

        def forward(self, x, index, *, extra=None):
            seen.update(x=x.dtype, index=index.dtype, extra=extra.dtype, autocast=torch.is_autocast_enabled("cpu"))
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.pin = nn.Linear(3, 3), Pinned()

        def forward(self, x):
            h = self.lin(x)
            return self.pin(h, torch.arange(2), extra=h)

    model = Net()
    abt.apply(model, Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
    model(torch.randn(2, 3))
    assert seen == {"x": torch.float32, "index": torch.int64, "extra": torch.float32, "autocast": False}


def test_buffers_and_dropout_rng_are_untouched_by_a_trace():
    model = zoo()
    amp = abt.apply(model, "mixed_bfloat16")
    tokens = torch.randint(0, 20, (2, 6))
    before = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.trace(tokens)
    assert all(torch.equal(v, before[k]) for k, v in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
