"""Planning large Flax models: the linen memo (repeated leaf calls traced once) and NNX's walk.

The memo must never change a Plan: every test here compares the memoised Plan with a full trace
(``_memo=False``) row by row, parameter counts and notes included, on models built to defeat it
(helper methods that call submodules, setup-style leaves, lifted transforms, shared modules).
"""

from __future__ import annotations

import gc

import pytest

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge import Policy, Rule  # noqa: E402
from ampbridge.cli.demo.run import EXAMPLES  # noqa: E402
from ampbridge.backends.jax.linen import linen_plan  # noqa: E402
from ampbridge.jax import resolve_policy  # noqa: E402

CALLS: list[str] = []

POLICY = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "re:.*_1$", "c1"),
                overrides=(Rule(("**.b3",), compute_dtype="float32", output_dtype="float16"),))


class Counted(nn.Module):
    """A leaf that notes every execution of its method (a memo hit does not execute it)."""

    features: int = 4
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        CALLS.append(self.name)
        return x @ self.param("w", nn.initializers.ones, (x.shape[-1], self.features), self.param_dtype)


class Stack(nn.Module):
    n: int = 40

    @nn.compact
    def __call__(self, x):
        for i in range(self.n):
            x = Counted(name=f"c{i}")(x)
        return x


class Helper(nn.Module):
    """__call__ reaches its child only through another method of the same module."""

    @nn.compact
    def __call__(self, x):
        return self.through(x)

    def through(self, x):
        return nn.LayerNorm(name="norm")(x)


class ViaHelpers(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Helper(name=f"h{i}")(x)
        return x


class SetupLeaf(nn.Module):
    def setup(self):
        self.w = self.param("w", nn.initializers.ones, (4, 4))

    def __call__(self, x):
        return x @ self.w


class Mixed(nn.Module):
    """Repeats with other shapes, other configurations, tuple outputs, setup leaves, sharing."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(4, name="shared")
        x = shared(nn.Dense(4, name="a0")(x))
        x = shared(nn.Dense(4, name="a1")(x))
        y = nn.Dense(6, name="b0")(x)  # another configuration
        y = nn.Dense(4, name="b1")(y)  # the first one's configuration, another input shape
        y = nn.Dense(4, use_bias=False, name="b2")(y)
        y = nn.Dense(4, name="b3")(y)  # another row: float32, float16 out
        for i in range(3):
            y = SetupLeaf(name=f"s{i}")(y)
        y = nn.BatchNorm(use_running_average=False, name="bn")(y)
        y = nn.Dropout(0.5, deterministic=True, name="drop")(y)
        return Pair(name="pair")(y)[0] * Pair(name="pair_1")(y)[1]


class Pair(nn.Module):
    """A leaf with a tuple output, one of its items a static value."""

    @nn.compact
    def __call__(self, x):
        return x * 2.0, x.shape[-1]


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.LayerNorm(name="norm")(nn.Dense(4, name="dense")(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="pre")(x)  # the same configuration as the scanned Dense, outside the scan
        x = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)(name="layers")(x, None)[0]
        x = nn.remat(nn.Dense)(4, name="post")(x)
        return nn.Dense(4, name="after")(x)


def plans(model, *inputs, policy=POLICY):
    resolved, notes = resolve_policy(policy, warn=False)
    fast = linen_plan(model, resolved, inputs, warn=False, notes=notes)
    full = linen_plan(model, resolved, inputs, warn=False, notes=notes, _memo=False)
    return fast, full


@pytest.mark.parametrize("model", [Stack(), ViaHelpers(), Mixed(), Scanned()],
                         ids=["stack", "helper-methods", "mixed", "scan-remat"])
def test_the_memoised_plan_is_the_full_traces_plan(model):
    fast, full = plans(model, jnp.ones((2, 4)))
    assert fast.rows == full.rows
    assert fast.unmatched_rules == full.unmatched_rules and fast.notes == full.notes


def test_the_demo_models_plan_is_unchanged(demo):
    tokens = jnp.zeros((2, 8), jnp.int32)
    policy = ampbridge.load(EXAMPLES / "amp.toml")
    fast, full = plans(demo[0], tokens, policy=policy)
    assert fast.rows == full.rows and len(fast) > 10


def test_repeated_leaf_calls_are_traced_once():
    CALLS.clear()
    plan = abj.plan(Stack(), POLICY, jnp.ones((2, 4)), warn=False)
    # the rows differ (c1 is pinned by the regex: another dtype), so two configurations trace
    assert sorted(CALLS) == ["c0", "c1"]
    assert [r.path for r in plan] == [""] + [f"c{i}" for i in range(40)]
    assert all(plan[f"c{i}"].param_count == 16 for i in range(40))
    assert plan["c1"].compute_dtype == "float32" and plan["c2"].compute_dtype == "bfloat16"
    CALLS.clear()
    plans(Stack(), jnp.ones((2, 4)))
    assert len(CALLS) == 2 + 40  # the full trace executes every call


def test_children_reached_through_helper_methods_are_all_planned():
    plan = abj.plan(ViaHelpers(), POLICY, jnp.ones((2, 4)), warn=False)
    assert [r.path for r in plan if r.kind == "norm"] == ["h0.norm", "h1.norm", "h2.norm"]
    assert all(plan[f"h{i}.norm"].param_count == 8 for i in range(3))


def test_a_plan_leaves_the_cycle_collector_as_it_found_it():
    assert gc.isenabled()
    abj.plan(Stack(n=3), POLICY, jnp.ones((2, 4)), warn=False)
    assert gc.isenabled()
    gc.disable()
    try:
        abj.plan(Stack(n=3), POLICY, jnp.ones((2, 4)), warn=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cast_params_learns_a_large_tree_through_the_memo():
    model = Stack()
    variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    amp = abj.apply(model, Policy(compute_dtype="bfloat16", param_dtype="bfloat16", keep_float32=("c3",)))
    CALLS.clear()
    cast = amp.cast_params(variables, jnp.ones((2, 4)))
    assert len(CALLS) == 2  # c3 has another row
    assert cast["params"]["c3"]["w"].dtype == jnp.float32 and cast["params"]["c7"]["w"].dtype == jnp.bfloat16


# --- NNX: tree-mode walk, graph mode for shared references ----------------------------------

class Tied(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 4, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.again = self.blocks[1]  # a shared module: Flax's tree mode refuses it

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(self.again(x)))


def test_nnx_models_with_shared_modules_plan_and_apply():
    net = Tied(nnx.Rngs(0))
    policy = Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm",))
    plan = abj.plan(net, policy)
    # each module once, at the path Flax's own graph walk gives it (the first in its key order)
    assert sorted(r.path for r in plan) == sorted(".".join(map(str, p)) for p, _ in nnx.iter_modules(net))
    assert "blocks.1" not in plan and plan["again"].param_count == 4 * 4 + 4
    amp = abj.apply(net, policy)
    assert amp.again is amp.blocks[1]  # the copy keeps the sharing
    assert amp.blocks[1].kernel[...].dtype == jnp.bfloat16 and amp.norm.scale[...].dtype == jnp.float32
    assert net.blocks[1].kernel[...].dtype == jnp.float32  # the original is untouched
    out = amp(jnp.arange(6).reshape(2, 3))
    assert out.dtype == jnp.float32 and out.shape == (2, 3, 10)


def test_nnx_apply_keeps_class_bookkeeping_out_of_the_pytree():
    amp = abj.apply(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), Policy(compute_dtype="bfloat16"))
    assert "__class__" not in amp.layers[0]._pytree__nodes
    graphdef, state = nnx.split(amp)
    again = nnx.merge(graphdef, state)
    assert type(again.layers[0]) is type(amp.layers[0])
    assert again(jnp.ones((1, 2))).dtype == jnp.float32
