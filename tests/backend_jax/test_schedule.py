"""Precision phases with Schedule: one jitted step per phase, state carried across boundaries."""

from __future__ import annotations

from ampbridge._testing import require

jax = require("jax")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

THREE_PHASES = """
compute_dtype = "float16"
[loss_scale]
growth_interval = 2
[[phase]]
until_epoch = 1
compute_dtype = "float32"
[[phase]]
until_epoch = 2
[[phase]]
keep_float32 = ["kind:norm"]
"""


def train_step(amp, tx, params, opt_state, x, y, loss_fn):
    def scaled(p):
        loss = loss_fn(amp.apply({"params": p}, x), y)
        return abj.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def adam_state(opt_state):
    return opt_state.inner_state[0]  # optax.adam = chain(scale_by_adam, scale_by_learning_rate)


def test_three_phases_follow_the_policy_at_every_step(demo, inspect, bits_equal):
    model, variables, batches, loss_fn = demo
    policy = ampbridge.loads(THREE_PHASES)
    sched = abj.Schedule(model, policy, optax.adam(1e-2), lambda *a: train_step(*a, loss_fn=loss_fn))
    params, opt_state = sched.init(jax.random.key(0), batches[0][0])
    tokens = batches[0][0]
    checked: dict = {}
    scales, count = [], 0
    for epoch in range(3):
        want = abj.plan(model, policy.at(epoch=epoch), tokens)
        for i, (x, y) in enumerate(batches[epoch * 4:(epoch + 1) * 4]):
            before = opt_state
            params, opt_state = sched.enter(params, opt_state, epoch=epoch)  # re-cast / move the scale
            if i == 0 and epoch > 0:  # a boundary: moments and their count carried over, untouched
                assert bits_equal(adam_state(opt_state), adam_state(before))
                assert int(adam_state(opt_state).count) == count
            step = sched.step_fn(epoch=epoch)
            if epoch not in checked:  # the compiled step's own matmuls, and every module's call
                dots = inspect.dot_dtypes(step, params, opt_state, x, y)
                assert dots and all(set(d) == {want[p].compute_dtype} for p, d in dots), (epoch, dots)
                seen = sched.model(epoch=epoch).observe({"params": params}, x)
                assert {o.path for o in seen} == {r.path for r in want}
                assert all(set(o.inputs) <= {want[o.path].compute_dtype} for o in seen)
                assert all(set(o.params) <= {want[o.path].compute_dtype} for o in seen)
                checked[epoch] = step
            assert step is checked[epoch]
            params, opt_state, _ = step(params, opt_state, x, y)
            count += 1
            scales.append(float(abj.loss_scale(opt_state).scale))
    assert sched.traces == {0: 1, 1: 1, 2: 1}  # each phase compiled exactly once
    assert want["block.norm1"].compute_dtype == "float32" and want["block.mlp_in"].compute_dtype == "float16"
    ls = abj.loss_scale(opt_state)
    assert int(ls.steps) == 12 and int(adam_state(opt_state).count) == 12 - int(ls.skipped)
    # float32 (no scaling) -> float16: a fresh dynamic scale; then carried into the pinned phase
    assert scales[:4] == [1.0] * 4
    assert scales[4] in (65536.0, 131072.0, 32768.0) and scales[8] in (scales[7], 2 * scales[7], scales[7] / 2)


def tiny():
    """A small MLP with a norm (fast to compile), a regression batch, and its loss."""
    nn = require("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, name="mlp_in")(x)
            return nn.Dense(1, name="head")(nn.LayerNorm(name="norm")(jax.nn.relu(x)))

    x = jax.random.normal(jax.random.key(0), (8, 4))
    return MLP(), [(x, x.sum(-1, keepdims=True))] * 6, lambda out, y: jnp.mean((out - y) ** 2)


def test_param_dtype_change_recasts_at_the_boundary_and_reset_restarts_the_scale():
    model, batches, loss_fn = tiny()
    policy = ampbridge.loads("""
compute_dtype = "bfloat16"
[[phase]]
until_step = 2
compute_dtype = "float16"
[phase.loss_scale]
mode = "dynamic"
initial_scale = 1024.0
[[phase]]
until_step = 4
compute_dtype = "float16"
param_dtype = "bfloat16"
keep_float32 = ["kind:norm"]
[phase.loss_scale]
mode = "dynamic"
initial_scale = 8.0
reset = true
""")
    sched = abj.Schedule(model, policy, optax.sgd(0.1, momentum=0.9), lambda *a: train_step(*a, loss_fn=loss_fn))
    params, opt_state = sched.init(jax.random.key(0), batches[0][0])
    kinds = {}
    for step in range(6):
        params, opt_state, _ = sched(params, opt_state, *batches[step], step=step)
        kinds[step] = (str(params["mlp_in"]["kernel"].dtype), str(params["norm"]["scale"].dtype),
                       float(abj.loss_scale(opt_state).scale), int(abj.loss_scale(opt_state).steps))
    assert [kinds[s][:2] for s in range(6)] == [("float32", "float32")] * 2 + [("bfloat16", "float32")] * 2 + [
        ("float32", "float32")] * 2
    assert kinds[0][2] == 1024.0 and kinds[2][2] == 8.0  # reset = true in the second phase
    assert kinds[4][2] == 1.0  # after the last closed phase: bfloat16, no loss scaling
    assert [kinds[s][3] for s in range(6)] == [1, 2, 3, 4, 5, 6]
    assert sched.traces == {0: 1, 1: 1, None: 1}
    momentum = opt_state.inner_state[0].trace
    assert all(bool(jnp.any(m != 0)) for m in jax.tree_util.tree_leaves(momentum))


def test_resume_declares_the_phase_without_converting():
    model, batches, loss_fn = tiny()
    sched = abj.Schedule(model, ampbridge.loads(THREE_PHASES), optax.sgd(0.1),
                         lambda *a: train_step(*a, loss_fn=loss_fn))
    params, opt_state = sched.init(jax.random.key(0), batches[0][0], epoch=2)
    assert sched.phase == 2 and float(abj.loss_scale(opt_state).scale) == 65536.0
    sched.resume(epoch=1)
    same_params, same_state = sched.enter(params, opt_state, epoch=1)
    assert same_params is params and same_state is opt_state
    assert np.isclose(float(abj.scale_loss(jnp.float32(1.0), opt_state)), 65536.0)


def test_the_demo_runs_an_epoch_schedule_in_its_first_phase():
    # the demo trains its steps as one epoch (Keras fits epochs=1); its JAX runner asked an epoch
    # schedule for a step's phase and ended `ampbridge demo examples/reference.toml` with an error
    from ampbridge.cli.demo.runners import run_jax

    policy = ampbridge.loads("""
        compute_dtype = "float16"
        [[phase]]
        until_epoch = 1
        [[phase]]
        compute_dtype = "float32"
    """)
    run = run_jax(policy, 3)
    assert run.phases == [0, 0, 0]
    assert run.final_state.steps == 3 and run.plan.rows[0].compute_dtype == "float16"
