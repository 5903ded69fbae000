"""A pinned module called from another module's own forward: the row says that its float32 output
meets the caller's float16 stream and promotes it, in the same words as Keras's and Flax's rows;
torch promotes indeed, and nothing casts the caller's output back (as with autocast by hand); an
[[override]] with ``output_dtype`` returns the pinned output to the stream."""

from __future__ import annotations

from ampbridge._testing import require

torch = require("torch")

from torch import nn  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.torch  # noqa: E402
from ampbridge.core.plan import stream_note  # noqa: E402

POLICY = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
OVERRIDE = POLICY.replace(overrides=({"match": ("block.norm",), "compute_dtype": "float32",
                                      "output_dtype": "float16"},))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        normed = self.norm(self.dense(x))
        stream = normed + x  # torch promotes float16 + float32
        self.seen = (normed.dtype, stream.dtype)
        return stream


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Linear(4, 4), Block()
        self.tail = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.tail(self.block(self.embed(x))))


def _run(policy):
    torch.manual_seed(0)
    model = Model()
    amp = ampbridge.torch.apply(model, policy)
    seen = {}
    model.block.register_forward_hook(lambda m, i, o: seen.__setitem__("block", o.dtype))
    out = amp.model(torch.ones(2, 4))
    return amp.plan, model.block.seen, seen["block"], out


def test_row_says_the_stream_promotes_and_torch_does():
    plan, (normed, stream), block, out = _run(POLICY)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype) == ("float32", "float32")
    assert row.note.startswith(stream_note("float16", "block", "float32"))
    assert "called from" not in (plan["tail.1"].note or "")  # fed by nn.Sequential: autocast casts its input
    assert (normed, stream) == (torch.float32, torch.float32)
    # nothing casts the block's output back (autocast by hand does not): the promoted stream goes on
    assert block == torch.float32 == getattr(torch, plan["block"].output_dtype)
    assert "follows the data flow" in plan["block"].note
    assert out.dtype == torch.float32
    assert "called from" not in (ampbridge.torch.plan(Model(), ampbridge.preset("mixed_float16"))["block.norm"].note
                                 or "")


def test_override_output_dtype_returns_it_to_the_stream():
    plan, (normed, stream), block, _ = _run(OVERRIDE)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype, row.rule) == ("float32", "float16", "override[0]")
    assert "called from" not in (row.note or "")
    assert (normed, stream, block) == (torch.float16,) * 3
