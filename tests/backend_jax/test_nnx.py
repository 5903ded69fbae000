"""Flax NNX under a policy: a copy of the module whose calls follow the Plan."""

from __future__ import annotations

from ampbridge._testing import require

jax = require("jax")
nnx = require("flax.nnx")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge import Policy  # noqa: E402
from ampbridge.backends.jax.nnx import nnx_key  # noqa: E402

SEEN: list[tuple[str, str, str]] = []


class Gate(nnx.Module):
    """A custom leaf with its own parameter and no dtype attribute: ampbridge must cast both."""

    def __init__(self, dim: int):
        # float32 given, not inferred: jnp.full's inferred float32 is weak-typed, and the first optimizer
        # update makes it strong, so a jitted step would trace and compile twice
        self.w = nnx.Param(jnp.full((dim,), 0.5, jnp.float32))

    def __call__(self, x):
        SEEN.append(("gate", str(x.dtype), str(self.w[...].dtype)))
        return x * jax.nn.sigmoid(self.w[...])


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, dtype=jnp.float32, rngs=rngs)  # a fixed dtype, overridden
        self.gate = Gate(dim)

    def __call__(self, x):
        return x + self.gate(self.down(jax.nn.relu(self.up(self.norm(x)))))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dim: int = 8, vocab: int = 16):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([Block(dim, rngs) for _ in range(2)])
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.bn(x))


POLICY = Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm", "layers.1.gate"))
TOKENS = jnp.arange(12).reshape(3, 4) % 16


@pytest.fixture(scope="module")
def net():
    return Net(nnx.Rngs(0))


def test_plan_paths_kinds_and_counts(net):
    plan = abj.plan(net, POLICY)
    paths = [r.path for r in plan]
    assert paths[:4] == ["", "bn", "embed", "head"] and "layers.0.norm" in paths and "layers" in paths
    assert plan["layers.0.up"].kind == "linear" and plan["bn"].kind == "norm" and plan["embed"].kind == "embedding"
    assert plan["layers.0.gate"].param_count == 8 and plan["layers.0.up"].param_count == 8 * 16 + 16
    assert plan["layers.1.gate"].compute_dtype == "float32" and plan["layers.0.gate"].compute_dtype == "float16"
    assert (plan[""].class_name, plan[""].output_dtype, plan[""].note) == (
        "Net", "float32", "model outputs cast to output_dtype float32")


def test_apply_returns_a_copy_whose_params_follow_the_plan(net):
    amp = abj.apply(net, POLICY)
    plan = abj.plan(net, POLICY)
    assert type(net.layers[0].up) is nnx.Linear and net.head.kernel[...].dtype == jnp.float32  # untouched
    assert isinstance(amp.layers[0].up, nnx.Linear) and type(amp).__name__ == "Net"
    assert amp.head.kernel[...].dtype == jnp.bfloat16 and amp.layers[0].norm.scale[...].dtype == jnp.float32
    assert amp.layers[0].gate.w[...].dtype == jnp.bfloat16 and amp.layers[1].gate.w[...].dtype == jnp.float32
    assert amp.bn.mean[...].dtype == jnp.float32
    assert amp.layers[0].down.dtype == jnp.float16 and plan["layers.0.down"].compute_dtype == "float16"


def test_every_module_computes_in_its_rows_dtype(net, inspect):
    amp = abj.apply(net, POLICY)
    plan = abj.plan(net, POLICY)
    SEEN.clear()
    graphdef, state = nnx.split(amp)
    dots = inspect.dot_dtypes(lambda s: nnx.merge(graphdef, s)(TOKENS), state)
    assert {path for path, _ in dots} == {"layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down", "head"}
    for path, dtypes in dots:
        assert set(dtypes) == {plan[path].compute_dtype}, path
    assert SEEN == [("gate", "float16", "float16"), ("gate", "float32", "float32")]
    out = jax.jit(lambda s: nnx.merge(graphdef, s)(TOKENS))(state)
    assert out.dtype == jnp.float32  # the policy's output dtype


def test_training_with_nnx_optimizer_and_a_skipped_step(net, bits_equal):
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 10))
    model = abj.apply(net, policy)
    opt = nnx.Optimizer(model, abj.optimizer(optax.adam(1e-2), policy), wrt=nnx.Param)
    targets = (TOKENS + 1) % 16

    @nnx.jit
    def step(model, opt, tokens, poison):
        def loss_fn(model):
            logits = model(tokens)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
            return abj.scale_loss(loss * poison, opt), loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, TOKENS, jnp.float32(1.0))) for _ in range(5)]
    assert losses[-1] < losses[0]
    def snapshot(tree):  # arrays, not the Variables nnx updates in place
        return jax.tree_util.tree_map(lambda v: v.get_value(), tree, is_leaf=lambda v: isinstance(v, nnx.Variable))

    assert {str(a.dtype) for a in jax.tree_util.tree_leaves(snapshot(nnx.state(model, nnx.Param)))} == {"float32"}
    params_before, opt_before = snapshot(nnx.state(model, nnx.Param)), snapshot(opt.opt_state)
    step(model, opt, TOKENS, jnp.float32(jnp.inf))  # an overflowing step
    params_after, opt_after = snapshot(nnx.state(model, nnx.Param)), snapshot(opt.opt_state)
    assert bits_equal(params_after, params_before)
    assert bits_equal(opt_after.inner_state, opt_before.inner_state)
    ls_before, ls_after = abj.loss_scale(opt_before), abj.loss_scale(opt)
    assert int(ls_after.skipped) == 1 and float(ls_after.scale) == float(ls_before.scale) / 2


def test_equal_plans_give_equal_graphdefs_and_jit_traces_once(bits_equal):
    """The plan each module carries is static graph data: copies applied with the same policy (a
    model rebuilt to restore a checkpoint) and a split/merge round trip reuse the compiled step;
    another policy compiles anew."""
    block, x = Block(4, nnx.Rngs(0)), jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    policy = Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm",))
    traces = []

    @nnx.jit
    def forward(model, x):
        traces.append(type(model).__name__)  # runs only while tracing
        return model(x)

    first, second = abj.apply(block, policy), abj.apply(block, policy)
    assert nnx.graphdef(first) == nnx.graphdef(second) and hash(nnx.graphdef(first)) == hash(nnx.graphdef(second))
    assert nnx_key(first) is nnx_key(second)  # one shared key: jit's per-call comparison stops at `is`
    out = forward(first, x)
    assert bits_equal(forward(second, x), out) and traces == ["Block"]
    assert bits_equal(forward(nnx.merge(*nnx.split(second)), x), out) and traces == ["Block"]
    other = abj.apply(block, Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",)))
    assert nnx.graphdef(other) != nnx.graphdef(first)
    assert not bits_equal(forward(other, x), out) and len(traces) == 2  # bfloat16 compute

    # a plain jax.jit over (graphdef, state): the graphdef is its static argument
    merged = jax.jit(lambda g, s: nnx.merge(g, s)(x), static_argnums=0)
    for model in (first, second, nnx.merge(*nnx.split(first))):
        merged(*nnx.split(model))
    assert merged._cache_size() == 1
    merged(*nnx.split(other))
    assert merged._cache_size() == 2

    # a training step with numerics, for a model rebuilt with the same policy and optimizer
    # (the transformation is static in nnx.Optimizer's graphdef too: build it once)
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 10))
    tx = abj.optimizer(optax.sgd(1e-2), policy)
    steps = []

    @nnx.jit
    def step(model, opt, x):
        steps.append(1)
        _, grads, stats = abj.numerics(model, lambda m: jnp.mean(m(x) ** 2), opt)(model)
        opt.update(model, grads)
        return stats

    for model in (abj.apply(block, policy), abj.apply(block, policy)):
        stats = step(model, nnx.Optimizer(model, tx, wrt=nnx.Param), x)
        assert stats.layers == ("norm", "up", "down", "gate") and not bool(stats.skipped)
    assert len(steps) == 1


def test_nested_apply_is_refused_by_name():
    """issue 37: an applied copy, or a module of one, runs its Plan already (a second apply would wrap
    its calls twice); the original stays free to apply, and linen's Applied is refused too."""
    from ampbridge.backends.jax.apply import ModelNotSupportedError

    net = Net(nnx.Rngs(0))
    applied = abj.apply(net, POLICY)
    for target in (applied, applied.layers[0], applied.layers[0].up):
        with pytest.raises(ModelNotSupportedError, match="belongs to a model ampbridge.jax.apply returned"):
            abj.apply(target, POLICY)
    abj.apply(net, POLICY)  # the original: fine, as often as wanted
    import flax.linen as nn

    amp = abj.apply(nn.Dense(2), POLICY)
    with pytest.raises(ModelNotSupportedError, match=r"apply\(amp.module, policy\)"):
        abj.apply(amp, POLICY)
