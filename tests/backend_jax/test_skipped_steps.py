"""A skipped step leaves everything as it was: params and optimizer state by the optimizer itself,
any other state (BatchNorm's batch_stats) by ``abj.rollback`` in one line; and ``abj.value_and_grad``
is the scaled ``jax.value_and_grad`` that ``tx.update`` takes, bit for bit."""

from __future__ import annotations

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")
optax = require("optax")

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def same_bits(a, b) -> bool:
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and bits(a) == bits(b)


# --- a ResNet in the style of Flax's ImageNet example ------------------------------------------

class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        residual = x
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if residual.shape != y.shape:
            residual = norm(name="norm_proj")(
                nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, name="conv_proj")(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x))
        x = ResNetBlock(16, strides=(2, 2))(x, train)  # one block, with its projection (CPU compiles are slow)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def resnet_setup():
    policy = ampbridge.preset("mixed_float16")
    amp = abj.apply(ResNet(), policy)
    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 3))
    y = jnp.arange(8) % 4
    variables = jax.jit(amp.init)(jax.random.key(0), x)
    tx = abj.optimizer(optax.sgd(0.1, momentum=0.9, nesterov=True), policy)

    @jax.jit
    def train_step(params, batch_stats, opt_state, x, y):
        def loss_fn(p):
            logits, state = amp.apply({"params": p, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state["batch_stats"]

        (loss, new_stats), grads = abj.value_and_grad(loss_fn, opt_state, has_aux=True)(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        kept = abj.rollback(new_stats, batch_stats, new_opt_state, opt_state)  # the one line
        return optax.apply_updates(params, updates), kept, new_opt_state, loss, new_stats

    return amp, tx, variables, x, y, train_step


def test_resnet_skipped_step_rolls_back_params_optimizer_and_batch_stats_bit_for_bit():
    amp, tx, variables, x, y, train_step = resnet_setup()
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    for _ in range(2):  # a few real steps: momentum and running statistics away from their start
        params, stats, opt_state, loss, _ = train_step(params, stats, opt_state, x, y)
    assert int(abj.loss_scale(opt_state).skipped) == 0 and np.isfinite(float(loss))
    bad = x.at[0, 0, 0, 0].set(1e5)  # beyond float16: inf at the first conv, nan statistics and gradients
    before = (params, stats, opt_state)
    p1, s1, o1, _, s_no = train_step(params, stats, opt_state, bad, y)
    assert int(abj.loss_scale(o1).skipped) == 1 and bool(abj.skipped(o1, opt_state))
    assert float(abj.loss_scale(o1).scale) == float(abj.loss_scale(opt_state).scale) / 2
    assert same_bits(p1, before[0])  # the optimizer: -0.0 updates
    assert same_bits(o1.inner_state, before[2].inner_state)  # the optimizer: inner state kept
    assert same_bits(s1, before[1])  # abj.rollback
    # without the rollback the statistics took the bad batch in (the test above can fail)
    assert not same_bits(s_no, before[1])
    assert not all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(s_no))
    # the next good step moves all three again
    p2, s2, o2, _, _ = train_step(p1, s1, o1, x, y)
    assert not bool(abj.skipped(o2, o1))
    assert not same_bits(p2, p1) and not same_bits(s2, s1) and not same_bits(o2.inner_state, o1.inner_state)
    assert {str(v.dtype) for v in jax.tree_util.tree_leaves(s2)} == {"float32"}


def test_skipped_agrees_with_what_the_optimizer_did_including_a_halted_run():
    """skipped(after, before) is True exactly when the optimizer left the parameters as they were:
    non-finite steps, and every step after on_min_scale='error' stopped the run."""
    policy = ampbridge.Policy(compute_dtype="float16", loss_scale={
        "mode": "dynamic", "initial_scale": 4.0, "growth_interval": 2, "min_scale": 1.0, "on_min_scale": "error"})
    tx = abj.optimizer(optax.sgd(0.1), policy)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    pattern = [False, True, False, False, True, True, True, False, False]  # non-finite steps
    seen = []
    for bad in pattern:
        grads = {"w": jnp.array([jnp.nan if bad else 1.0, 2.0, 3.0])}
        updates, new_state = update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        seen.append((bool(abj.skipped(new_state, state)), same_bits(new_params, params)))
        params, state = new_params, new_state
    assert all(flag == unchanged for flag, unchanged in seen)
    assert [flag for flag, _ in seen] == [False, True, False, False, True, True, True, True, True]  # halted at 1


def test_value_and_grad_is_the_scaled_gradient_bit_for_bit():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))))

    policy = ampbridge.preset("mixed_float16")
    amp = abj.apply(Net(), policy)
    x, y = jax.random.normal(jax.random.key(1), (8, 3)), jnp.arange(8) % 4
    variables = amp.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = abj.optimizer(optax.adam(1e-3), policy).init(params)

    def loss_fn(p, x):
        logits, state = amp.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state

    (loss, aux), grads = jax.jit(lambda p, x: abj.value_and_grad(loss_fn, opt_state, has_aux=True)(p, x))(params, x)

    def by_hand(p, x):
        loss, aux = loss_fn(p, x)
        return abj.scale_loss(loss, opt_state), (loss, aux)

    (_, (loss2, aux2)), grads2 = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(params, x)
    assert same_bits(grads, grads2) and same_bits(loss, loss2) and same_bits(aux, aux2)
    assert loss.dtype == jnp.float32 and 0 < float(loss) < 10  # the loss as computed, not scaled
    assert float(jnp.max(jnp.abs(grads["Dense_0"]["bias"]))) > 1000  # gradients of loss * 65536
    # argnums reaches the other arguments, as jax.value_and_grad's
    _, gx = abj.value_and_grad(lambda p, x: loss_fn(p, x)[0], opt_state, argnums=1)(params, x)
    assert gx.shape == x.shape


def test_value_and_grad_and_rollback_with_nnx_optimizer():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    policy = ampbridge.preset("mixed_float16")
    model = abj.apply(Net(nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(model, abj.optimizer(optax.adam(1e-2), policy), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        stats_before = nnx.state(model, nnx.BatchStat)
        scale_before = abj.loss_scale(optimizer)  # arrays: the optimizer changes in place
        loss, grads = abj.value_and_grad(lambda m: jnp.mean(m(x) ** 2), optimizer)(model)
        optimizer.update(model, grads)
        nnx.update(model, abj.rollback(nnx.state(model, nnx.BatchStat), stats_before, optimizer, scale_before))
        return loss

    x = jax.random.normal(jax.random.key(0), (16, 4))
    loss = step(model, optimizer, x)
    assert np.isfinite(float(loss))
    good_stats = nnx.state(model, nnx.BatchStat)
    assert not same_bits(good_stats["bn"]["mean"], jnp.zeros(4))
    params_before = nnx.state(model, nnx.Param)
    step(model, optimizer, x.at[0, 0].set(1e6))  # float16 overflow: skipped
    assert int(abj.loss_scale(optimizer).skipped) == 1
    assert same_bits(nnx.state(model, nnx.BatchStat), good_stats)
    assert same_bits(nnx.state(model, nnx.Param), params_before)


@pytest.mark.parametrize("bad", [False, True])
def test_rollback_selects_bit_for_bit_including_negative_zero(bad):
    policy = ampbridge.preset("mixed_float16")
    tx = abj.optimizer(optax.sgd(0.1), policy)
    state = tx.init({"w": jnp.ones(1)})
    _, after = tx.update({"w": jnp.array([jnp.inf if bad else 1.0])}, state)
    old = {"a": jnp.array([-0.0, 1.5], jnp.float32), "n": jnp.array(3, jnp.int32)}
    new = {"a": jnp.array([0.0, 2.5], jnp.float32), "n": jnp.array(4, jnp.int32)}
    out = abj.rollback(new, old, after, state)
    assert same_bits(out, old if bad else new)


def test_orbax_checkpoint_resumes_bit_for_bit(tmp_path):
    """params (bfloat16 rows and float32 pinned ones), optimizer + loss-scale state (after a skipped
    step) and batch_stats through orbax: restored as saved, and two more steps from the restored
    state equal two more steps from the live one, bit for bit."""
    ocp = require("orbax.checkpoint")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))))

    policy = ampbridge.Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm",))
    amp = abj.apply(Net(), policy)
    tx = abj.optimizer(optax.adam(1e-2), policy)
    x, y = jax.random.normal(jax.random.key(1), (8, 3)), jnp.arange(8) % 4

    @jax.jit
    def train_step(state, x):
        def loss_fn(p):
            logits, new = amp.apply({"params": p, "batch_stats": state["batch_stats"]}, x, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

        (_, stats), grads = abj.value_and_grad(loss_fn, state["opt_state"], has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "batch_stats": abj.rollback(stats, state["batch_stats"], opt_state, state["opt_state"])}

    def fresh():
        v = amp.init(jax.random.key(0), x)
        return {"params": v["params"], "batch_stats": v["batch_stats"], "opt_state": tx.init(v["params"])}

    state = fresh()
    for batch in (x, x.at[0, 0].set(1e6), x):  # one skipped step in the history
        state = train_step(state, batch)
    ls = abj.loss_scale(state["opt_state"])
    assert int(ls.skipped) == 1 and int(ls.steps) == 3 and float(ls.scale) == 32768.0
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", fresh())
    assert same_bits(restored, state)
    dtypes = {k: str(v.dtype) for k, v in restored["params"]["BatchNorm_0"].items()}
    assert dtypes == {"scale": "float32", "bias": "float32"} and restored["params"]["Dense_0"]["kernel"].dtype == jnp.bfloat16
    live, resumed = state, restored
    for _ in range(2):
        live, resumed = train_step(live, x), train_step(resumed, x)
    assert same_bits(live, resumed) and not same_bits(live, state)


def test_nnx_orbax_checkpoint_restores_model_and_optimizer(tmp_path):
    ocp = require("orbax.checkpoint")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    policy = ampbridge.Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm",))

    def build():
        model = abj.apply(Net(nnx.Rngs(0)), policy)
        return model, nnx.Optimizer(model, abj.optimizer(optax.adam(1e-2), policy), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        _, grads = abj.value_and_grad(lambda m: jnp.mean(m(x) ** 2), optimizer)(model)
        optimizer.update(model, grads)

    x = jax.random.normal(jax.random.key(1), (8, 3))
    model, optimizer = build()
    for batch in (x, x.at[0, 0].set(1e6), x):
        step(model, optimizer, batch)
    assert int(abj.loss_scale(optimizer).skipped) == 1
    saved = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "nnx", saved)
        ckpt.wait_until_finished()
        model2, optimizer2 = build()
        target = {"model": nnx.state(model2), "optimizer": nnx.state(optimizer2)}
        restored = ckpt.restore(tmp_path / "nnx", target)
    nnx.update(model2, restored["model"])
    nnx.update(optimizer2, restored["optimizer"])
    assert same_bits(nnx.state(model2), nnx.state(model)) and same_bits(nnx.state(optimizer2), nnx.state(optimizer))
    assert model2.lin.kernel[...].dtype == jnp.bfloat16 and model2.bn.scale[...].dtype == jnp.float32
    assert float(abj.loss_scale(optimizer2).scale) == float(abj.loss_scale(optimizer).scale)
    step(model, optimizer, x)
    step(model2, optimizer2, x)
    assert same_bits(nnx.state(model2), nnx.state(model))
