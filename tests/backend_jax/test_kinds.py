"""Flax kinds: the core's inference for a model's own classes (Gemma's ``RMSNorm``, the SST-2
example's ``Embedder``), ``ampbridge.jax.register_kind``, and the unmatched-rule warning said once
per policy and model, not on every ``apply``."""

from __future__ import annotations

import warnings

from ampbridge._testing import require

jax = require("jax")
nnx = require("flax.nnx")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge import Policy  # noqa: E402
from ampbridge.backends.jax.layers import _REGISTERED  # noqa: E402


class RMSNorm(nnx.Module):  # as Gemma writes its own (no Flax base class)
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class Embedder(nnx.Module):  # the SST-2 example's lookup table
    def __init__(self, vocab: int, dim: int):
        self.table = nnx.Param(jnp.ones((vocab, dim)) * 0.1)

    def __call__(self, ids):
        return self.table[...][ids]


class Mixer(nnx.Module):  # no name hint
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.proj = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = Embedder(16, 8)
        self.norm = RMSNorm(8)
        self.mix = Mixer(8, rngs)

    def __call__(self, ids):
        return self.mix(self.norm(self.embed(ids)))


def test_inferred_and_registered_kinds_pin():
    net = Net(nnx.Rngs(0))
    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "kind:embedding"))
    plan = abj.plan(net, policy)
    assert (plan["norm"].kind, plan["embed"].kind, plan["mix"].kind) == ("norm", "embedding", None)
    assert plan["norm"].compute_dtype == "float32" and plan["embed"].compute_dtype == "float32"
    assert plan["mix.proj"].compute_dtype == "bfloat16"
    try:
        abj.register_kind(Mixer, "attention")
        plan = abj.plan(net, policy.replace(keep_float32=("kind:attention",)))
        assert plan["mix"].kind == "attention" and plan["mix.proj"].compute_dtype == "float32"
    finally:
        _REGISTERED.unregister(Mixer)
    out = abj.apply(net, policy)(jnp.arange(4).reshape(1, 4) % 16)
    assert out.dtype == jnp.float32


def test_nnx_unmatched_rule_is_said_once_per_policy_and_model():
    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:softmax",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            abj.apply(Net(nnx.Rngs(0)), policy)
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.UnmatchedRuleWarning)]
    assert said == ["keep_float32[0] (kind:softmax) matches no layer of the model (a typo?)"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
