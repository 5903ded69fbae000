"""``torch.compile(amp.model)`` computes what eager computes, eval and train, with pins before,
inside and after a fused-path-capable ``nn.TransformerEncoder`` (the graph Dynamo captures is
checked with ``backend="aot_eager"``: its decisions, without inductor's own float arithmetic)."""

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn
PINS = ("pre", "enc.layers.0.norm1", "enc.layers.1.linear1", "head")  # before, inside, after


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)  # fused eval path
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.enc(self.pre(x)))


def applied(pins):
    torch.manual_seed(0)
    model = Encoder()
    return model, abt.apply(model, ampbridge.Policy(compute_dtype="float16", keep_float32=pins))


@pytest.mark.slow
@pytest.mark.parametrize("pins", [PINS, ("head",), ("pre",)], ids=["before-inside-after", "after", "before"])
def test_compiled_equals_eager_in_eval(pins):
    model, amp = applied(pins)
    model.eval()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), amp.autocast():  # no gradients: torch's fused paths are candidates
        eager, graph = model(x), compiled(x)
    assert eager.dtype == graph.dtype == torch.float32
    assert torch.equal(eager, graph), (eager - graph).abs().max()
    assert torch.backends.mha.get_fastpath_enabled()  # ampbridge's switch is restored after each call


@pytest.mark.slow
def test_compiled_equals_eager_in_training():
    model, amp = applied(PINS)
    twin, twin_amp = applied(PINS)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    # called bare (amp.model enters its own region): AOTAutograd traces the backward under an autocast
    # active around the compiled call, so float32 regions would get float16 gradients (plain
    # torch.amp code too); docs/torch.md says so
    eager, graph = model(x), compiled(x)
    assert torch.equal(eager, graph)
    eager.pow(2).mean().backward()
    graph.pow(2).mean().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_the_attention_switch_is_restored_when_the_call_fails():
    model, amp = applied(("pre",))
    model.eval()
    with torch.no_grad(), amp.autocast():
        with pytest.raises(RuntimeError):
            model.enc.layers[0].self_attn(torch.randn(2, 3, 16), torch.randn(2, 3, 7), torch.randn(2, 3, 7))
    assert torch.backends.mha.get_fastpath_enabled()
    amp.remove()
    assert not model.enc.layers[0].self_attn._forward_pre_hooks  # remove() takes the hooks away
