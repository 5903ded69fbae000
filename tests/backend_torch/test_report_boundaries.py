"""Issue 41: ``report`` attribution at block boundaries. A residual model whose overflow comes from
the data (one embedding row of 1e5) with ``kind:norm`` pinned: the value goes non-finite in a block's
own code (its learned skip projection, cast to float16 by autocast), not in any leaf. The report
names where it first became non-finite (checked with forward hooks on every module), never a
layer whose inputs were already non-finite, and never advises a pin the policy already has."""

from __future__ import annotations

import json

from ampbridge._testing import require

torch = require("torch")

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402
from ampbridge.diagnostics.report import format_summary, summarize  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402

nn = torch.nn
F = torch.nn.functional


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.skip = nn.Parameter(torch.eye(d))  # a learned skip projection, in the block's own code

    def forward(self, x):
        return F.linear(x, self.skip) + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, vocab=10, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, 1)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def _origin_by_hooks(model, tokens):
    """The first module, in the order forwards finish, whose output is non-finite while its
    inputs were finite (an independent recorder: plain forward hooks on every module)."""
    seen = []

    def hook(path):
        def record(module, args, out):
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            seen.append((path, all(bool(torch.isfinite(a).all()) for a in inputs), bool(torch.isfinite(out).all())))
        return record

    handles = [m.register_forward_hook(hook(p)) for p, m in model.named_modules() if p]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return next(p for p, finite_in, finite_out in seen if finite_in and not finite_out), seen


def test_report_names_the_block_where_the_value_first_went_nonfinite(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.embed.weight[3] = 1e5  # the data: one embedding row beyond float16's range
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    amp = abt.apply(model, policy)
    tokens = torch.tensor([[1, 3, 2]])
    expected, seen = _origin_by_hooks(model, tokens)
    assert expected == "encoder.0"  # the block's own code; every leaf in it stayed finite
    # what the old leaf-only attribution named: the pinned norm of the next block, fed non-finite inputs
    assert ("encoder.1.norm", False, False) in seen

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = tmp_path / "run.jsonl"
    with amp.monitor(path, every=1):
        for _ in range(3):
            amp.step(model(tokens).float().mean(), opt)
            opt.zero_grad()
    log = read_log(path)
    assert [s["first_nonfinite"] for s in log.steps] == [{"path": "encoder.0", "where": "output"}] * 3
    summary = summarize(log)
    assert list(summary.overflow_origins) == ["encoder.0"]
    text = format_summary(summary)
    assert "encoder.1.norm" not in " ".join(summary.advice)
    # the advice names a rule the policy does not have; the norms it pins are never advised again
    assert 'keep_float32 = ["encoder.0"]' in text
    assert log.header["pinned"] == {"encoder.0.norm": "keep_float32[0]", "encoder.1.norm": "keep_float32[0]"}
    assert not any(f'"{p}"' in a for a in summary.advice for p in log.header["pinned"])
    json.dumps(summary.to_dict())


def test_a_pinned_layer_named_first_is_not_advised_a_pin_again():
    from ampbridge.diagnostics.runlog import RunLog

    step = {"step": 0, "loss": float("nan"), "loss_scale": 1.0, "found_inf": True, "skipped": True,
            "first_nonfinite": {"path": "norm", "where": "output"}, "layers": {}}
    summary = summarize(RunLog({"layers": ["norm"], "pinned": {"norm": "keep_float32[0]"}}, [step]))
    assert not any("keep_float32 = [" in a for a in summary.advice)
    assert any("already computes in float32 (keep_float32[0])" in a for a in summary.advice)


def test_nonfinite_model_inputs_are_named_as_such(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    amp = abt.apply(model, "mixed_float16")
    x = torch.ones(2, 4)
    x[0, 0] = float("inf")
    path = tmp_path / "run.jsonl"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp.monitor(path, every=1):
        amp.step(model(x).float().mean(), opt)
    log = read_log(path)
    assert log.steps[0]["first_nonfinite"] == {"path": "", "where": "input"}
    assert any("the model's inputs" in a for a in summarize(log).advice)
