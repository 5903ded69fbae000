"""The model author's dtypes in Flax (linen and NNX): a module whose code fixed its ``dtype``
(``nn.Dense(3, dtype=jnp.float32)`` in a model that otherwise runs in None/bfloat16) is kept in it by
default (the row says "set by the model"), and a rule naming it overrides it; a model that hands its
one ``dtype`` to every module fixes none. Dtypes asserted on the jaxpr of the applied model: the
dtype each matmul really runs in."""

from __future__ import annotations

import dataclasses

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

MIXED = ampbridge.preset("mixed_bfloat16")
HEAD_BF16 = MIXED.replace(overrides=({"match": ("head",), "compute_dtype": "bfloat16"},))
X = jnp.ones((2, 4))


def _matmuls(fn, *args):
    """The output dtypes of the matmuls ``fn`` runs, in order (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(str(eqn.outvars[0].aval.dtype))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


class Model(nn.Module):
    """``body`` gets the model's dtype; the author fixed ``head`` to float32."""

    dtype: object = None
    param_dtype: object = jnp.float32  # as Flax's own modules have it: not a dtype handed down

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=self.dtype, name="body")(x)
        return nn.Dense(3, dtype=jnp.float32, name="head")(x)


class SetupModel(nn.Module):
    """Every module made in ``setup`` with the model's ``dtype`` (float32 here: Flax's usual default)."""

    dtype: object = jnp.float32

    def setup(self):
        self.body = nn.Dense(8, dtype=self.dtype)
        self.head = nn.Dense(3, dtype=self.dtype)

    def __call__(self, x):
        return self.head(self.body(x))


class Literal(nn.Module):
    """No dtype setting anywhere, ``dtype=jnp.float32`` written on every module: Flax's default
    written out, not a decision."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=jnp.float32, name="body")(x)
        return nn.Dense(3, dtype=jnp.float32, name="head")(x)


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: object = jnp.float32


class ConfigModel(nn.Module):
    """The dtype handed down through a configuration object, as many Flax models do."""

    config: Config

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=self.config.dtype, name="body")(x)
        return nn.Dense(3, dtype=self.config.dtype, name="head")(x)


def _linen_run(model, policy):
    amp = abj.apply(model, policy)
    variables = amp.init(jax.random.key(0), X)
    return amp, variables, _matmuls(lambda v: amp.apply(v, X), variables)


def test_linen_head_fixed_by_the_author_is_kept_and_says_so():
    for model in (Model(), Model(dtype=jnp.bfloat16)):
        amp, variables, ran = _linen_run(model, MIXED)
        row = amp.plan(X)["head"]
        assert (row.compute_dtype, row.param_dtype, row.output_dtype, row.rule, row.decided_by) == (
            "float32", "float32", "float32", "set by the model", "set by the model")
        assert amp.plan(X)["body"].rule == "default"
        assert ran == ["bfloat16", "float32"]  # body, head
        assert variables["params"]["head"]["kernel"].dtype == jnp.float32


def test_linen_a_rule_naming_the_module_overrides_the_author():
    amp, _, ran = _linen_run(Model(), HEAD_BF16)
    assert amp.plan(X)["head"].rule == "override[0]"
    assert ran == ["bfloat16", "bfloat16"]


def test_linen_a_dtype_the_model_hands_down_is_not_a_pin():
    for model in (Model(dtype=jnp.float32), SetupModel(), ConfigModel(Config()), Literal()):
        amp, _, ran = _linen_run(model, MIXED)
        assert {r.rule for r in amp.plan(X)} == {"default"}, type(model).__name__
        assert ran == ["bfloat16", "bfloat16"], type(model).__name__


class NnxModel(nnx.Module):
    def __init__(self, rngs, dtype=None):
        self.dtype = dtype
        self.body = nnx.Linear(4, 8, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(8, 3, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


def _nnx_matmuls(model):
    graphdef, state = nnx.split(model)
    return _matmuls(lambda s: nnx.merge(graphdef, s)(X), state)


def test_nnx_head_fixed_by_the_author_is_kept_overridable_and_model_wide_float32_is_not_a_pin():
    for dtype in (None, jnp.bfloat16):
        applied = abj.apply(NnxModel(nnx.Rngs(0), dtype), MIXED)
        row = abj.plan(applied, MIXED)["head"]
        assert (row.compute_dtype, row.param_dtype, row.rule) == ("float32", "float32", "set by the model")
        assert _nnx_matmuls(applied) == ["bfloat16", "float32"]
    applied = abj.apply(NnxModel(nnx.Rngs(0)), HEAD_BF16)
    assert abj.plan(applied, HEAD_BF16)["head"].rule == "override[0]"
    assert _nnx_matmuls(applied) == ["bfloat16", "bfloat16"]
    applied = abj.apply(NnxModel(nnx.Rngs(0), jnp.float32), MIXED)
    assert {r.rule for r in abj.plan(applied, MIXED)} == {"default"}
    assert _nnx_matmuls(applied) == ["bfloat16", "bfloat16"]
