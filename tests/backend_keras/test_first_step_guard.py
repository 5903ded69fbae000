"""The first-step guard (issue 22): on Keras 3.7-3.11 an older ampbridge's loss-scale optimizer
stepped without updating anything. A finite step moves the weights (eager and in ``fit``, on every
Keras backend), and a step whose update is suppressed raises naming the Keras version."""

import re

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")

import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge.errors import UnsupportedOptionError  # noqa: E402

# a scale float16 gradients of these tiny models never overflow at: every step applies
POLICY = ampbridge.preset("mixed_float16").replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=256.0))


def _layer_and_optimizer():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    return layer, ak.optimizer(keras.optimizers.SGD(0.5), POLICY)


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def test_a_finite_eager_step_moves_the_weights_by_the_unscaled_gradient():
    layer, opt = _layer_and_optimizer()
    before = _values(layer.trainable_variables)
    opt.build(layer.trainable_variables)
    scale = float(keras.ops.convert_to_numpy(opt.scale))
    grads = [keras.ops.full(v.shape, 0.25 * scale) for v in layer.trainable_variables]  # scaled gradients
    opt.apply(grads, layer.trainable_variables)
    for old, new in zip(before, _values(layer.trainable_variables)):
        np.testing.assert_array_equal(new, old - np.float32(0.5) * np.float32(0.25))
    assert int(keras.ops.convert_to_numpy(opt.inner_optimizer.iterations)) == 1


def test_fit_moves_the_weights():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    ak.apply(model, POLICY)
    model.compile(ak.optimizer(keras.optimizers.SGD(0.1), POLICY), "mse")
    before = _values(model.trainable_variables)
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)
    model.fit(x, np.ones((4, 2), "float32"), batch_size=4, epochs=2, verbose=0)
    assert all(np.abs(new - old).max() > 1e-3 for old, new in zip(before, _values(model.trainable_variables)))
    assert int(keras.ops.convert_to_numpy(model.optimizer.inner_optimizer.iterations)) == 2
    assert model.optimizer.state.skipped == 0


def test_the_guard_fires_when_the_inner_update_is_suppressed():
    layer, opt = _layer_and_optimizer()
    inner = opt.inner_optimizer
    inner.apply = lambda grads, trainable_variables=None: None  # an update that never happens
    inner.stateless_apply = lambda variables, grads, trainable: (list(trainable), list(variables))
    before = _values(layer.trainable_variables)
    grads = [keras.ops.ones(v.shape) for v in layer.trainable_variables]
    with pytest.raises(UnsupportedOptionError, match=rf"iterations unchanged.*keras {re.escape(keras.__version__)}"):
        opt.apply(grads, layer.trainable_variables)
    for old, new in zip(before, _values(layer.trainable_variables)):
        np.testing.assert_array_equal(new, old)


def test_gradients_that_cannot_reach_the_inner_optimizer_are_an_error_in_fit(monkeypatch):
    # what Keras 3.7-3.11 did to an older ampbridge: no variables to pair the gradients with
    build = ak.LossScaleOptimizer.build
    monkeypatch.setattr(ak.LossScaleOptimizer, "build", lambda self, var_list: (
        build(self, var_list), setattr(self, "_trainable_variables", []))[0])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(ak.optimizer(keras.optimizers.SGD(0.1), POLICY), "mse")
    with pytest.raises(UnsupportedOptionError, match=rf"2 gradients for 0 variables.*keras {re.escape(keras.__version__)}"):
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), batch_size=4, verbose=0)
