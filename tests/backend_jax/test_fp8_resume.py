"""FP8 on Flax linen: a checkpoint of the variables (parameters and the ``_overwrite_with_gradient``
scales and amax histories) written with Flax's own serialization mid-run, restored into a fresh
``abj.apply`` of the model, trains on exactly as the run never interrupted (losses, parameters,
scales and histories bit for bit)."""

import numpy as np

from ampbridge._testing import require

jax = require("jax")
flax = require("flax")
optax = require("optax")
from flax import serialization  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

import ampbridge.jax as abj  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

from ampbridge import Fp8Config, Policy  # noqa: E402

POLICY = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=4))  # the history wraps


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="head")(nn.relu(nn.Dense(32, name="fc1")(x)))


def batches(n):
    rng = np.random.default_rng(1)
    return [(jnp.asarray(rng.normal(size=(16, 24)) * 3, jnp.float32), jnp.asarray(rng.normal(size=(16, 16)), jnp.float32))
            for _ in range(n)]


def train(apply_fn, variables, data):
    """SGD on the parameters; TrainState.apply_gradients overwrites the float8 collection with its "gradient"."""
    state = TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.sgd(0.05))

    @jax.jit
    def step(state, x, y):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2))(
            state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state.params, losses


def _equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_restored_checkpoint_trains_on_bit_identically():
    policy, data = POLICY, batches(10)
    amp = abj.apply(Net(), policy)
    start = amp.init(jax.random.key(0), data[0][0])
    whole, whole_losses = train(amp.apply, start, data)

    first, first_losses = train(amp.apply, start, data[:6])
    blob = serialization.to_bytes(first)
    fresh = abj.apply(Net(), policy)
    template = fresh.init(jax.random.key(1), data[0][0])  # other random weights: all of them are restored
    restored = serialization.from_bytes(template, blob)
    assert _equal(restored, first)
    meta = restored[fp8_ops.OVERWRITE_WITH_GRADIENT]["fc1"]["Fp8DirectDotGeneralOp_0"]
    assert float(meta["input_scale"].reshape(())) != 1.0 and np.count_nonzero(meta["input_amax_history"]) == 4
    rest, rest_losses = train(fresh.apply, restored, data[6:])
    assert first_losses + rest_losses == whole_losses
    assert _equal(rest, whole)
