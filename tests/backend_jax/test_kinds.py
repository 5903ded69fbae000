"""Flax kinds: the core's inference for a model's own classes (Gemma's ``RMSNorm``, the SST-2
example's ``Embedder``), ``ampbridge.jax.register_kind``, and the unmatched-rule warning said once
per policy and model, not on every ``apply``."""

from __future__ import annotations

import warnings

from ampbridge._testing import require

jax = require("jax")
nnx = require("flax.nnx")
nn = require("flax.linen")

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


# --- cautious inference: a wrapper named like a norm, and the model itself, get no inferred kind ---

class PreNorm(nnx.Module):  # the common ViT wrapper: a LayerNorm and the block it normalises for
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.fn = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        return self.fn(self.norm(x))


class TinyNorm(nnx.Module):  # a model whose own class name ends in Norm
    def __init__(self, rngs: nnx.Rngs):
        self.pre = PreNorm(4, rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.pre(x))


class LinenPreNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fn")(nn.LayerNorm(name="norm")(x))


class LinenTinyNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(x + LinenPreNorm(name="pre")(x))


NORM = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
X = jnp.ones((2, 4), jnp.float32)


def _check_rows(plan):
    assert plan[""].kind is None and plan[""].kind_source == "norm by name, not inferred: the model itself"
    assert plan["pre"].kind is None and plan["pre"].kind_source == "norm by name, not inferred: holds linear"
    assert [plan[p].compute_dtype for p in ("", "pre", "pre.norm", "pre.fn", "head")] == \
        ["bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16"]


def test_nnx_prenorm_wrapper_and_root_get_no_inferred_kind():
    net = TinyNorm(nnx.Rngs(0))
    _check_rows(abj.plan(net, NORM))
    applied = abj.apply(net, NORM)
    # what runs: the applied copy's modules carry their rows' dtypes
    dtypes = (applied.pre.fn.dtype, applied.pre.norm.dtype, applied.head.dtype)
    assert dtypes == (jnp.bfloat16, jnp.float32, jnp.bfloat16)
    assert applied.pre.fn(X).dtype == jnp.bfloat16
    table = NORM.replace(kinds={"norm": ["PreNorm"]})  # explicit: the wrapper is a norm again
    with pytest.warns(ampbridge.BroadRuleWarning, match=r"kind:norm\) reaches .* \(pre\)"):
        plan = abj.plan(net, table)  # the wrapper holds most of the model: said once
    assert plan["pre"].kind_text == "norm ([kinds] table)" and plan["pre.fn"].compute_dtype == "float32"
    assert abj.apply(net, table).pre.fn(X).dtype == jnp.float32


def test_linen_prenorm_wrapper_and_root_get_no_inferred_kind():
    _check_rows(abj.plan(LinenTinyNorm(), NORM, X))
    amp = abj.apply(LinenTinyNorm(), NORM)
    x = jax.random.normal(jax.random.key(1), (2, 4))
    out, variables = amp.init_with_output(jax.random.key(0), x)  # the first call already follows settled rows
    assert (out == amp.apply(variables, x)).all()
    seen = {o.path: o for o in amp.observe(variables, X)}
    assert (seen["pre.fn"].outputs, seen["pre.norm"].outputs, seen["head"].outputs) == \
        (("bfloat16",), ("float32",), ("bfloat16",))
    table = NORM.replace(kinds={"norm": ["LinenPreNorm"]})
    amp = abj.apply(LinenTinyNorm(), table)
    with pytest.warns(ampbridge.BroadRuleWarning, match=r"kind:norm\) reaches .* \(pre\)"):
        assert amp.plan(X)["pre"].kind_text == "norm ([kinds] table)"
    seen = {o.path: o for o in amp.observe(amp.init(jax.random.key(0), X), X)}
    assert seen["pre.fn"].outputs == ("float32",)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
