"""``ampbridge.jax.tune`` (issue 41) on a Flax linen model with one layer whose outputs leave
float16's range: non-finite on every forward under ``mixed_float16``; tune pins that layer and
what its float32 output needs next; the tuned policy trains 30 finite steps with a falling loss;
the user's variables are unchanged."""

from __future__ import annotations

import math

from ampbridge._testing import require, tune_batches

jax = require("jax")
nn = require("flax.linen")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402


class Scale(nn.Module):
    """Multiplies by 1e6: every output element is beyond float16's 65504."""

    @nn.compact
    def __call__(self, x):
        return x * 1e6


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Scale(name="scale")(nn.Dense(8, name="first")(x))
        small = lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype) * 1e-6  # noqa: E731
        x = nn.Dense(8, name="shrink", kernel_init=small)(x)  # back to O(1): float32 trains fine
        return nn.Dense(1, name="head")(jnp.tanh(x))


_data = tune_batches


def _loss(out, target):
    return jnp.mean((out.astype(jnp.float32) - target) ** 2)


def _train(module, policy, variables, data, steps):
    amp = abj.apply(module, policy)
    params = amp.cast_params(variables, data[0][0])["params"]
    tx = abj.optimizer(optax.adam(1e-2), policy)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = abj.value_and_grad(lambda p: _loss(amp.apply({"params": p}, x), y), opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return losses


def test_tune_pins_the_overflowing_layer_then_what_its_output_needs_next():
    module, data = Model(), _data()
    variables = module.init(jax.random.key(0), data[0][0])
    before = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), variables)
    # under mixed_float16 every forward is non-finite
    amp = abj.apply(module, "mixed_float16")
    out = amp.apply(amp.cast_params(variables, data[0][0]), data[0][0])
    assert not np.isfinite(np.asarray(out, np.float32)).any()

    result = abj.tune(module, "mixed_float16", variables, data, _loss, steps=6)

    assert result.added == ("scale", "shrink")
    assert result.finite and result.policy.compute_dtype == "float16"
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=("scale", "shrink"))
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    assert result.evidence["scale"].nonfinite == "output" and not result.evidence["first"].pinned
    # finite; its loss gap (the mean over the steps) holds the updates the skipped steps did not make
    # (the loss scale backing off from 65536): no pin lowers that, and the reason says so
    assert result.chosen.gap_after is not None and result.chosen.skipped > 0
    assert result.chosen.close or "did not lower it" in result.reason

    # the user's variables: same values, same dtypes
    same = jax.tree_util.tree_map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), before, variables)
    assert all(jax.tree_util.tree_leaves(same))

    losses = _train(module, result.policy, variables, data, 30)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4


OFFSET = 1000.0  # bfloat16 holds 1000 + s to the nearest 4: the signal s (std 1) is lost


class OffsetModel(nn.Module):
    """A first Dense that removes a large offset from its inputs (kernel I, bias -1000), then an MLP."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="center", kernel_init=lambda *a: jnp.eye(4),
                     bias_init=lambda key, shape, dtype=jnp.float32: jnp.full(shape, -OFFSET, dtype))(x)
        return nn.Dense(1, name="head")(jnp.tanh(nn.Dense(8, name="hidden")(x)))


def test_tune_pins_the_layer_a_finite_run_diverges_at():
    """Finite but far off under mixed_bfloat16 (the offset layer's input loses its signal); tune
    pins that layer for the loss gap and the gap falls under the tolerance."""
    module = OffsetModel()
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 1)).astype("float32")
    variables = module.init(jax.random.key(0), jnp.zeros((1, 4)) + OFFSET)
    data = []
    for _ in range(4):
        s = rng.standard_normal((16, 4)).astype("float32")
        y = np.asarray(module.apply(variables, s + OFFSET)) + 0.3 * np.tanh(s @ w)
        data.append((s + OFFSET, y.astype("float32")))
    before = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), variables)
    result = abj.tune(module, "mixed_bfloat16", variables, data, _loss, steps=8)
    c = result.chosen
    assert c.finite and c.skipped == 0 and c.gap_before > 0.3
    assert result.added == ("center",) and result.evidence["center"].diverged
    assert c.gap_after < 0.05 < c.gap_before and c.close
    assert result.policy == ampbridge.preset("mixed_bfloat16").replace(keep_float32=("center",))
    same = jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), before, variables)
    assert all(jax.tree_util.tree_leaves(same))


def test_nnx_tune_pins_the_overflowing_layer_and_leaves_the_model_as_it_was():
    """The same model as an NNX module: ``tune(model, policy, batches, loss_fn)``; the same pins;
    the user's model keeps its values and dtypes; 30 steps with the tuned policy are finite and fall."""
    nnx = require("flax.nnx")

    class NScale(nnx.Module):
        def __call__(self, x):
            return x * 1e6

    class NModel(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(4, 8, rngs=rngs)
            self.scale = NScale()
            self.shrink = nnx.Linear(8, 8, rngs=rngs)
            self.shrink.kernel.set_value(self.shrink.kernel.get_value() * 1e-6)  # back to O(1)
            self.head = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.shrink(self.scale(self.first(x)))))

    model, data = NModel(nnx.Rngs(0)), _data()
    before = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), nnx.state(model, nnx.Param))
    out = abj.apply(model, "mixed_float16")(jnp.asarray(data[0][0]))
    assert not np.isfinite(np.asarray(out, np.float32)).any()

    result = abj.tune(model, "mixed_float16", data, _loss, steps=6)

    assert result.added == ("scale", "shrink") and result.finite
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=("scale", "shrink"))
    assert result.evidence["scale"].nonfinite == "output" and not result.evidence["first"].pinned
    after = nnx.state(model, nnx.Param)
    same = jax.tree_util.tree_map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), before, after)
    assert all(jax.tree_util.tree_leaves(same))

    work = abj.apply(model, result.policy)
    opt = nnx.Optimizer(work, abj.optimizer(optax.adam(1e-2), result.policy), wrt=nnx.Param)

    @nnx.jit
    def step(work, opt, x, y):
        loss, grads = abj.value_and_grad(lambda m: _loss(m(x), y), opt)(work)
        opt.update(work, grads)
        return loss

    losses = [float(step(work, opt, *data[i % len(data)])) for i in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4
