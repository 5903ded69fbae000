"""A pinned module called from another module's own code (Flax linen and NNX): the row says that its
float32 output meets the caller's float16 stream and promotes it, in the same words as torch's and
Keras's rows; jnp promotes indeed; an [[override]] with ``output_dtype`` returns it to the stream."""

from __future__ import annotations

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge.core.plan import stream_note  # noqa: E402

POLICY = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
OVERRIDE = POLICY.replace(overrides=({"match": ("*.norm",), "compute_dtype": "float32",
                                      "output_dtype": "float16"},))
SEEN: dict[str, str] = {}  # what the block's code met, recorded at trace time
X = jnp.ones((2, 4), jnp.float32)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        normed = nn.LayerNorm(name="norm")(nn.Dense(4, name="dense")(x))
        SEEN["norm"] = str(normed.dtype)
        stream = normed + x  # jnp promotes float16 + float32
        SEEN["stream"] = str(stream.dtype)
        return stream


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Block(name="block")(nn.Dense(4, name="embed")(x))
        x = Block(name="again")(x)  # its leaf calls come from the planning trace's memo
        return nn.Dense(2, name="head")(nn.Sequential([nn.LayerNorm()], name="tail")(x))


def _run(policy):
    amp = abj.apply(Model(), policy)
    variables = amp.init(jax.random.key(0), X)
    out = jax.jit(lambda v: amp.apply(v, X))(variables)
    return amp.plan(X), out


def test_linen_row_says_the_stream_promotes_and_jnp_does():
    SEEN.clear()
    plan, out = _run(POLICY)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype) == ("float32", "float32")
    assert row.note.startswith(stream_note("float16", "block", "float32"))
    assert plan["again.norm"].note.startswith(stream_note("float16", "again", "float32"))
    assert "called from" not in (plan["LayerNorm_0"].note or "")  # fed by a Sequential: cast at its input
    assert SEEN == {"norm": "float32", "stream": "float32"}
    assert plan["block"].output_dtype == "float16" and out.dtype == jnp.float32


def test_linen_override_output_dtype_returns_it_to_the_stream():
    SEEN.clear()
    plan, out = _run(OVERRIDE)
    row = plan["block.norm"]
    assert (row.compute_dtype, row.output_dtype, row.rule) == ("float32", "float16", "override[0]")
    assert "called from" not in (row.note or "")
    assert SEEN == {"norm": "float16", "stream": "float16"}


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        normed = self.norm(self.dense(x))
        SEEN["norm"] = str(normed.dtype)
        return normed + x


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(4, 4, rngs=rngs)
        self.block = NnxBlock(rngs)
        self.tail = nnx.Sequential(nnx.LayerNorm(4, rngs=rngs))

    def __call__(self, x):
        return self.tail(self.block(self.embed(x)))


def test_nnx_row_and_override_are_the_same():
    net = NnxModel(nnx.Rngs(0))
    plan = abj.plan(net, POLICY)
    assert plan["block.norm"].note.startswith(stream_note("float16", "block", "float32"))
    assert "called from" not in (plan["tail.layers.0"].note or "")
    SEEN.clear()
    assert abj.apply(net, POLICY).block(X.astype(jnp.float16)).dtype == jnp.float16  # the block's own row
    assert SEEN == {"norm": "float32"}
    SEEN.clear()
    assert "called from" not in (abj.plan(net, OVERRIDE)["block.norm"].note or "")
    abj.apply(net, OVERRIDE).block(X.astype(jnp.float16))
    assert SEEN == {"norm": "float16"}
