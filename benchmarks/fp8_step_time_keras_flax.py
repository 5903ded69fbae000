"""Step time of ampbridge's ``[fp8]`` (delayed scaling) against each framework's own float8 path on CPU:
Keras (``model.quantize("float8")`` of a ``mixed_bfloat16`` model, ``train_on_batch``) and Flax linen
(``Dense(dot_general_cls=Fp8DirectDotGeneralOp)``, ``TrainState``, jitted).

Interleaved rounds of 10 steps each; a 4-layer 256-wide MLP, batch 64; prints the median step times and
the median of the per-round ratios (each round times both paths back to back, so a busy machine slows
both). Both sides run the framework's own float8 code, so the ratio is 1 up to ampbridge's wrapper
(Keras: its optimizer; Flax: the method interceptor, traced once into the same jitted step).

Usage: KERAS_BACKEND=tensorflow python benchmarks/fp8_step_time_keras_flax.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import numpy as np

from ampbridge import Fp8Config, Policy

POLICY = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=16))
STEPS = 10


def _timed(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def keras_steps():
    import keras

    import ampbridge.keras as ak

    x, y = np.random.default_rng(0).normal(size=(2, 64, 256)).astype("float32")

    def mlp():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(256, activation="relu") for _ in range(4)])

    keras.config.set_dtype_policy("mixed_bfloat16")
    native = mlp()
    keras.config.set_dtype_policy("float32")
    native.quantize("float8")
    native.compile(keras.optimizers.SGD(1e-3), "mse")
    mine = ak.apply(mlp(), POLICY)
    mine.compile(ak.optimizer(keras.optimizers.SGD(1e-3), POLICY), "mse")
    return (lambda: native.train_on_batch(x, y)), (lambda: mine.train_on_batch(x, y))


def flax_steps():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.linen import fp8_ops
    from flax.training.train_state import TrainState

    import ampbridge.jax as abj

    class Mlp(nn.Module):
        fp8: bool = False
        dtype: object = None

        @nn.compact
        def __call__(self, x):
            for i in range(4):
                cls = (lambda: fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=16)) if self.fp8 else None
                x = nn.relu(nn.Dense(256, dtype=self.dtype, dot_general_cls=cls, name=f"fc{i}")(x))
            return x

    x, y = (jnp.asarray(a) for a in np.random.default_rng(0).normal(size=(2, 64, 256)).astype("float32"))

    def stepper(apply_fn, variables):
        state = [TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.sgd(1e-3))]

        @jax.jit
        def step(state):
            grads = jax.grad(lambda v: jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2))(state.params)
            return state.apply_gradients(grads=grads)

        def run():
            state[0] = step(state[0])
            jax.block_until_ready(state[0].params)
        return run

    native = Mlp(fp8=True, dtype=jnp.bfloat16)
    amp = abj.apply(Mlp(), POLICY)
    return (stepper(native.apply, native.init(jax.random.key(0), x)),
            stepper(amp.apply, amp.init(jax.random.key(0), x)))


def main(rounds: int) -> None:
    warnings.simplefilter("ignore")
    print(f"{'framework':<10} {'native ms':>10} {'ampbridge ms':>13} {'ratio':>6}  (median of {rounds} interleaved "
          f"rounds of {STEPS} steps; ratio range)")
    for name, make in (("keras", keras_steps), ("flax", flax_steps)):
        native, mine = make()
        for f in (native, mine):  # compile and warm up
            _timed(f, 3)
        pairs = [(_timed(native, STEPS), _timed(mine, STEPS)) for _ in range(rounds)]
        ratios = [m / n for n, m in pairs]
        print(f"{name:<10} {1e3 * statistics.median(n for n, _ in pairs):>10.2f} "
              f"{1e3 * statistics.median(m for _, m in pairs):>13.2f} {statistics.median(ratios):>6.3f}  "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
