"""A pin equals the native hand-pinned model (issue 37): residual models (a small one of ours,
transformers' BERT, GPT-2 and Llama, tiny and random) with norms, embeddings and the head pinned,
trained with an injected overflow beside the same model pinned by hand (each pinned module under
``autocast(enabled=False)`` on float32 inputs, the rest under ``torch.autocast``, torch's own
``GradScaler``): bit-identical losses, parameters and scales, and every module's output dtype
(forward hooks on both) equal to native."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

torch = require("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402
from ampbridge import LossScaleConfig  # noqa: E402

from .native_pins import hand_pin, mismatches, record_outputs, train  # noqa: E402

PINS = ("kind:norm", "kind:embedding")
SCALE = LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=2)
STEPS, INJECT = 6, (2,)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(self.norm(x)))


class Residual(nn.Module):
    """The issue's model: embedding -> blocks ``x + relu(fc(norm(x)))`` -> head."""

    def __init__(self, vocab: int = 32, d: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ids(seed: int, shape=(2, 8), vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _batches(vocab: int = 32):
    return [((_ids(i, vocab=vocab),), _ids(100 + i, vocab=vocab)) for i in range(STEPS)]


def _logits_loss(out, y):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _policy(compute: str, head: str):
    return ampbridge.Policy(compute_dtype=compute, keep_float32=PINS + (head,), loss_scale=SCALE)


def _residual():
    torch.manual_seed(0)
    return Residual()


def _transformer(name: str):
    transformers = pytest.importorskip("transformers")
    t = transformers
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=16)

    def build():
        torch.manual_seed(0)
        if name == "bert":
            model = t.BertForMaskedLM(t.BertConfig(**small))
        elif name == "gpt2":
            model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                                   bos_token_id=0, eos_token_id=0))
        else:
            model = t.LlamaForCausalLM(t.LlamaConfig(**small, num_key_value_heads=1))
        return model.eval()  # no dropout: both runs see the same graph

    return build


HEADS = {"bert": "cls.predictions.decoder", "gpt2": "lm_head", "llama": "lm_head"}


def _compare(build, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native, _ = train(build, policy, _batches(), _logits_loss, native=True, inject=INJECT)
        ours, amp = train(build, policy, _batches(), _logits_loss, native=False, inject=INJECT)
    return native, ours, amp


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_residual_model_trains_bit_identical_to_hand_pinning(compute):
    native, ours, amp = _compare(_residual, _policy(compute, "head"))
    assert mismatches(native, ours) == []
    assert native.scales == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 2048.0]  # grows after 2, step 2 skipped
    # the residual stream stays float32, as by hand: the embedding's float32 output plus a low branch
    assert {ours.outputs[f"blocks.{i}"] for i in range(3)} == {torch.float32}
    assert {ours.outputs[f"blocks.{i}.fc"] for i in range(3)} == {getattr(torch, compute)}
    for i in range(3):  # and the Plan says what ran
        row = amp.plan[f"blocks.{i}"]
        assert (row.compute_dtype, row.output_dtype) == (compute, "float32")
        assert "in torch blocks.%d returns the promoted stream uncast" % i in amp.plan[f"blocks.{i}.norm"].note


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformers_train_bit_identical_to_hand_pinning(name):
    policy = _policy("float16", HEADS[name])
    native, ours, amp = _compare(_transformer(name), policy)
    assert mismatches(native, ours) == []
    assert sum(1 for r in amp.plan.rows if r.rule.startswith("keep_float32") and r.inherited_from is None) >= 4
    assert torch.float16 in set(ours.outputs.values())  # the rest really ran in float16
    assert native.scales[2:4] == [2048.0, 1024.0]  # the injected step was skipped and backed off


def test_a_value_the_hand_pinned_model_carries_does_not_overflow():
    """1e5 in the embedding: the hand-pinned model carries it in its float32 stream (float16 would be inf)."""
    policy = _policy("float16", "head")
    models = [_residual(), _residual()]
    for m in models:
        with torch.no_grad():
            m.embed.weight[3] = 1e5
    hand_pin(models[0], ["embed", "blocks.0.norm", "blocks.1.norm", "blocks.2.norm", "head"])
    amp = abt.apply(models[1], policy)
    ids = torch.tensor([[3, 1, 2]])
    native_seen, _ = record_outputs(models[0])
    with torch.autocast("cpu", dtype=torch.float16):
        native = models[0](ids)
    ours = amp.model(ids)
    assert torch.isfinite(native).all() and torch.equal(native, ours)
    assert native_seen["blocks.2"] == torch.float32


def test_a_pinned_module_output_is_not_cast_unless_a_rule_asks():
    """An [[override]] with output_dtype still casts (the user asked); a plain pin emits what it computes."""
    policy = _policy("float16", "head").replace(overrides=(
        ampbridge.Rule(("blocks.0.norm",), compute_dtype="float32", output_dtype="float16"),))
    model = _residual()
    amp = abt.apply(model, policy)
    seen, _ = record_outputs(model)
    amp.model(_ids(0))
    assert (seen["blocks.0.norm"], seen["blocks.1.norm"]) == (torch.float16, torch.float32)
    assert amp.plan["blocks.0.norm"].output_dtype == "float16"
