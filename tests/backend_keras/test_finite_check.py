"""The finite check over every leaf shape, order and position: a non-finite gradient anywhere skips the step.

For each of 18 of the 120 orders of the leaf shapes ``()``, ``(1,)``, ``(0,)``, ``(3,)``, ``(2, 2)`` (float32,
float16 and bfloat16 variables in turn; on compiled paths the 5 rotations, which put every shape at
every position, and all 18 under ``AMPBRIDGE_FUZZ=1``), inf and NaN in each non-empty leaf, on every path of the Keras
backend in force (eager ``apply``; ``tf.function`` with and without ``jit_compile``; ``jax.jit`` of
``stateless_apply``): the step is skipped, the variables and the inner optimizer's state stay as they
were, the scale backs off. The fuzzer (test_fuzz_loss_scale.py) draws the other orders.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ampbridge._testing import fuzzing, require

keras = require("keras")

from keras import ops  # noqa: E402

import ampbridge.keras as ak  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402

BACKEND = keras.backend.backend()
SHAPES = [(), (1,), (0,), (3,), (2, 2)]
ORDERS = list(itertools.permutations(SHAPES))[::7]
# traced paths compile once per order: the 5 rotations put every shape at every position (last included)
ROTATIONS = [tuple(SHAPES[i:] + SHAPES[:i]) for i in range(len(SHAPES))]
DTYPES = ["float32", "float16", "bfloat16"]
PATHS = {"tensorflow": ["eager", "tf.function", "jit_compile"], "jax": ["eager", "jax.jit"], "torch": ["eager"]}[BACKEND]
POLICY = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="dynamic", initial_scale=1024.0,
                                                                    growth_interval=1000))


def _numpy(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))


def _stepper(opt, variables, path):
    """A function (grads -> None) that steps ``opt`` along ``path`` and leaves the results in the variables."""
    if path == "eager":
        return lambda grads: opt.apply(grads, variables)
    if path in ("tf.function", "jit_compile"):
        import tensorflow as tf

        return tf.function(lambda grads: opt.apply(grads, variables), jit_compile=path == "jit_compile")
    import jax

    step = jax.jit(opt.stateless_apply)

    def run(grads):
        weights, values = step([v.value for v in opt.variables], grads, [v.value for v in variables])
        for v, x in zip(variables, weights):
            v.assign(x)
        for v, x in zip(opt.variables, values):
            v.assign(x)
    return run


@pytest.mark.parametrize("path", PATHS)
def test_every_nonempty_leaf_position_skips(path):
    compiled = path != "eager" or BACKEND == "jax"  # ampbridge's apply on JAX jits its step
    for n, order in enumerate(ROTATIONS if compiled and not fuzzing() else ORDERS):
        dtype = DTYPES[n % len(DTYPES)]
        variables = [keras.Variable(np.full(shape, 0.5, "float32"), dtype=dtype) for shape in order]
        opt = ak.optimizer(keras.optimizers.SGD(0.25, momentum=0.5), POLICY)
        opt.build(variables)
        step = _stepper(opt, variables, path)
        # one finite step first: the momentum exists, and a skip must leave it alone too
        step([ops.convert_to_tensor(np.full(s, 256.0, "float32"), dtype=dtype) for s in order])
        for bad_leaf, shape in enumerate(order):
            if not math.prod(shape):
                continue
            for bad in (math.inf, math.nan):
                before = [_numpy(v.value) for v in variables]
                state = [_numpy(v.value) for v in opt.inner_optimizer.variables]
                scale = float(_numpy(opt.dynamic_scale.value))
                grads = [np.full(s, 256.0, "float32") for s in order]
                flat = grads[bad_leaf].reshape(-1).copy()
                flat[-1] = bad
                grads[bad_leaf] = flat.reshape(shape)
                step([ops.convert_to_tensor(g, dtype=dtype) for g in grads])
                where = (order, dtype, bad_leaf, bad, path)
                assert float(_numpy(opt.dynamic_scale.value)) == scale / 2, where
                for a, b in zip([_numpy(v.value) for v in variables], before):
                    np.testing.assert_array_equal(a, b, err_msg=str(where))
                    assert np.isfinite(a).all(), where
                for a, b in zip([_numpy(v.value) for v in opt.inner_optimizer.variables], state):
                    np.testing.assert_array_equal(a, b, err_msg=str(where))
