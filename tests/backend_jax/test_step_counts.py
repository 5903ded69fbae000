"""The exact size of ampbridge's JAX train step on the benchmark MLP (issue 24), so it cannot grow
unnoticed: the optimizer state's leaves (each one a buffer the jitted call passes, host dispatch on
every step), the lowered StableHLO ops, the optimised HLO instructions and the compiled kernels (the
optimised ENTRY's fusions, dots and calls), next to the hand-written jmp + optax step with the same
dynamic loss scaling (``benchmarks/bench_jax.py``).

The kernels are the bar on any version: no more than the hand-written step. The instructions were
678 (under jmp's 767) while the finite check chained each leaf's reduction through ``lax.reduce``'s
start value, which XLA drops for a scalar, size-1 or empty leaf (the overflow bug of issue 36);
reducing each leaf on its own costs 140 instructions inside the same 76 kernels as jmp's."""

from __future__ import annotations


from ampbridge._testing import compiled_instructions, compiled_kernels, lowered_ops, require

jax = require("jax")
jmp = require("jmp")
optax = require("optax")
nn = require("flax.linen")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

# measured with jax 0.10.2 on the CPU; ampbridge's step before issue 24: 6 state leaves, 300 lowered
# ops, 874 optimised instructions (jmp's: 2 scalars, 292, 767); after issue 36's finite-check fix:
# 2, 310, 818 and 76 kernels (jmp's 76); with issue 38's sixth counter (nonfinite_streak):
# 2, 314, 819, still 76 kernels
MEASURED_ON = "0.10.2"
MAX_STATE_LEAVES, MAX_LOWERED_OPS, MAX_INSTRUCTIONS = 2, 314, 819

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (512, 512, 512):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, y):  # the benchmark's loss (ampbridge.cli.demo.flax_model.loss_fn)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def test_the_mlp_step_is_no_bigger_than_measured():
    model, key = MLP(), jax.random.key(0)
    x, y = jax.random.normal(key, (64, 256)), jax.random.randint(key, (64,), 0, 10)
    params = model.init(key, x)["params"]
    policy = ampbridge.Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** 15, growth_interval=2000, min_scale=1.0))
    amp, tx = abj.apply(model, policy), abj.optimizer(optax.sgd(1e-2), policy)

    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: abj.scale_loss(cross_entropy(amp.apply({"params": p}, x), y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jmp_policy, inner = jmp.get_policy("p=f32,c=f16,o=f32"), optax.sgd(1e-2)

    def jmp_step(params, opt_state, scale, counter, x, y):
        loss_scale = jmp.DynamicLossScale(scale, counter, period=2000)
        grads = jax.grad(lambda p: loss_scale.scale(cross_entropy(jmp_policy.cast_to_output(model.apply(
            {"params": jmp_policy.cast_to_compute(p)}, jmp_policy.cast_to_compute(x))), y)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_state = inner.update(grads, opt_state, params)
        params, opt_state = jmp.select_tree(finite, (optax.apply_updates(params, updates), new_state),
                                            (params, opt_state))
        return params, opt_state, loss_scale.loss_scale, loss_scale.counter

    opt_state = tx.init(params)
    lowered = jax.jit(step).lower(params, opt_state, x, y)
    lowered_j = jax.jit(jmp_step).lower(params, inner.init(params), jnp.float32(2.0 ** 15), jnp.int32(0), x, y)
    leaves = len(jax.tree_util.tree_leaves(opt_state))
    ops, ops_j = sum(lowered_ops(lowered.as_text()).values()), sum(lowered_ops(lowered_j.as_text()).values())
    compiled, compiled_j = lowered.compile().as_text(), lowered_j.compile().as_text()
    inst, inst_j = compiled_instructions(compiled), compiled_instructions(compiled_j)
    kern, kern_j = compiled_kernels(compiled), compiled_kernels(compiled_j)
    counts = (f"state leaves {leaves}, lowered ops {ops} (jmp {ops_j}), instructions {inst} (jmp {inst_j}), "
              f"kernels {kern} (jmp {kern_j})")
    assert leaves <= MAX_STATE_LEAVES, counts  # jmp's DynamicLossScale: 2
    assert kern <= kern_j, counts  # holds on any version: no more kernels run than in the hand-written step
    if jax.__version__ == MEASURED_ON and jax.default_backend() == "cpu":
        assert ops <= MAX_LOWERED_OPS and inst <= MAX_INSTRUCTIONS, counts
