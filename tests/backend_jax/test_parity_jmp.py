"""ampbridge against a hand-written jmp + optax step: the same training, bit for bit.

jmp can express: no pins, one compute dtype, float32 master weights, DynamicLossScale (whose
min_loss_scale is 1 after jit, factor 2 both ways, no hysteresis), StaticLossScale, NoOpLossScale,
with the skip written by hand (``jmp.select_tree`` on ``jmp.all_finite``).
"""

from __future__ import annotations

import pytest

from ampbridge._testing import require

jax = require("jax")
jmp = require("jmp")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402

CASES = {
    "float16-dynamic": (Policy(compute_dtype="float16", loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** 26, growth_interval=3, min_scale=1.0)),
        "p=f32,c=f16,o=f32", lambda: jmp.DynamicLossScale(jnp.float32(2.0 ** 26), period=3)),
    # jmp's StaticLossScale is an empty pytree: jitted as is, its scale becomes a compile-time
    # constant that XLA folds into the float16 backward pass. ampbridge keeps the scale in its state
    # (it is checkpointed), so the hand-written step is given the scale as an argument too.
    "float16-static": (Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="static", initial_scale=256.0)),
                       "p=f32,c=f16,o=f32", lambda: jnp.float32(256.0)),
    "bfloat16-none": (ampbridge.preset("mixed_bfloat16"), "p=f32,c=bf16,o=f32", lambda: jmp.NoOpLossScale()),
}


def ampbridge_step(model, loss_fn, policy, inner):
    amp = abj.apply(model, policy)
    tx = abj.optimizer(inner, policy)

    def step(params, opt_state, x, y):
        def scaled_loss(p):
            loss = loss_fn(amp.apply({"params": p}, x), y)
            return abj.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step


def jmp_step(model, loss_fn, jmp_policy, inner):
    def step(params, opt_state, loss_scale, x, y):
        static = not isinstance(loss_scale, (jmp.DynamicLossScale, jmp.NoOpLossScale))
        if static:
            loss_scale = jmp.StaticLossScale(loss_scale)

        def scaled_loss(p):
            logits = model.apply({"params": jmp_policy.cast_to_compute(p)}, jmp_policy.cast_to_compute(x))
            loss = loss_fn(jmp_policy.cast_to_output(logits), y)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale.loss_scale if static else loss_scale, loss

    return step


@pytest.mark.parametrize("case", list(CASES))
def test_thirty_steps_equal_jmp_bit_for_bit(case, demo, bits_equal):
    model, variables, batches, loss_fn = demo
    policy, jmp_name, make_scale = CASES[case]
    # adam where overflows happen; momentum SGD elsewhere (XLA compiles it faster, and it has state)
    inner = optax.adam(1e-2) if case == "float16-dynamic" else optax.sgd(0.1, momentum=0.9)
    tx, amp_step = ampbridge_step(model, loss_fn, policy, inner)
    ref_step = jax.jit(jmp_step(model, loss_fn, jmp.get_policy(jmp_name), inner))
    amp_step = jax.jit(amp_step)
    params_a, state_a = variables["params"], jax.jit(tx.init)(variables["params"])
    params_j, state_j, scale_j = variables["params"], jax.jit(inner.init)(variables["params"]), make_scale()
    losses = []
    for i, (x, y) in enumerate(batches):
        params_a, state_a, loss_a = amp_step(params_a, state_a, x, y)
        params_j, state_j, scale_j, loss_j = ref_step(params_j, state_j, scale_j, x, y)
        assert bits_equal(params_a, params_j), f"parameters differ after step {i}"
        assert bits_equal(loss_a, loss_j)
        losses.append(float(loss_a))
        if isinstance(scale_j, jmp.DynamicLossScale):
            assert float(abj.loss_scale(state_a).scale) == float(scale_j.loss_scale), i
    assert bits_equal(state_a.inner_state, state_j)
    skipped = int(abj.loss_scale(state_a).skipped)
    if case == "float16-dynamic":
        assert 3 <= skipped <= 25, "the run should overflow now and then (so skips are compared too)"
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # and it trains


def test_the_jitted_train_step_has_no_host_callbacks(demo, inspect):
    model, variables, batches, loss_fn = demo
    for policy in (ampbridge.preset("mixed_float16"),
                   Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                          loss_scale=LossScaleConfig(min_scale=1.0, on_min_scale="error", hysteresis=2))):
        tx, step = ampbridge_step(model, loss_fn, policy, optax.adam(1e-3))
        args = (variables["params"], tx.init(variables["params"]), *batches[0])
        assert inspect.callbacks(step, *args) == []
        text = jax.jit(step).lower(*args).as_text()
        assert "custom_call" not in text and "infeed" not in text and "outfeed" not in text
