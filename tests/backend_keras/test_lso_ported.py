"""Keras's own ``keras/src/optimizers/loss_scale_optimizer_test.py`` (Keras 3.15), ported to
ampbridge's optimizer: every case runs against ``ampbridge.keras.LossScaleOptimizer`` built with
Keras's arguments, and against ``ampbridge.keras.optimizer(...)`` where a policy can say the same.

Differences, each named where it occurs:
- Keras skips stateful ``apply`` on JAX (its class must use ``stateless_apply`` there); ampbridge's
  ``apply`` works on JAX (it runs ``stateless_apply`` compiled), so those cases run on all backends.
  Keras skips ``stateless_apply`` on TensorFlow; so does this port (TF variables are stateful).
- ``test_config``: the serialisation round trip through ``deserialize_keras_object`` gives Keras's
  own class back, by design (a policy Keras runs the same way is saved in Keras's format, so a
  ``.keras`` file loads without ampbridge): the configs are compared, not the attribute lists.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from keras import ops  # noqa: E402

SGD = keras.optimizers.SGD
LossScaleOptimizer = ak.LossScaleOptimizer
BACKEND = keras.backend.backend()
both = pytest.mark.parametrize("stateless", [True, False], ids=["stateless", "stateful"])


def _skip_stateless_on_tf(stateless):
    # Keras's own skip; its other skip (stateful on JAX) is not needed: ampbridge's apply runs there
    if stateless and BACKEND == "tensorflow":
        pytest.skip("stateless_apply is not supported with the TF backend.")


def _step(optimizer, grads, variables, stateless):
    if stateless:
        optimizer.build(variables)
        new, _ = optimizer.stateless_apply([v.value for v in optimizer.variables], grads,
                                           [v.value for v in variables])
        return new
    optimizer.apply(grads, variables)
    return variables


def _close(actual, expected):
    np.testing.assert_allclose(ops.convert_to_numpy(actual), expected, rtol=1e-4, atol=1e-4)


def test_config():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004))
    config = optimizer.get_config()
    revived = type(optimizer).from_config(json.loads(json.dumps(config)))
    assert revived.get_config() == config and set(dir(revived)) == set(dir(optimizer))
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["module"] == "keras.optimizers" and serialized["class_name"] == "LossScaleOptimizer"
    # difference: Keras's own class comes back (ampbridge saves in Keras's format); same config
    revived = keras.saving.deserialize_keras_object(json.loads(json.dumps(serialized)))
    assert type(revived) is keras.optimizers.LossScaleOptimizer and revived.get_config() == config


def test_apply_with_no_vars():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    optimizer.apply(grads)
    _close(variables[0], [0.5, -1.0, -0.5, 3.0])


@both
@pytest.mark.parametrize("inner_factor", [None, 100], ids=["plain", "inner_loss_scale"])
def test_finite_step(stateless, inner_factor):
    _skip_stateless_on_tf(stateless)
    # with inner_factor: the inner optimizer's loss scale does not interfere with the update
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5, loss_scale_factor=inner_factor))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale]
    variables = _step(optimizer, grads, [keras.Variable([1.0, 2.0, 3.0, 4.0])], stateless)
    _close(variables[0], [0.5, -1.0, -0.5, 3.0])


@both
def test_infinite_step(stateless):
    _skip_stateless_on_tf(stateless)
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    grads = [ops.array([np.inf, np.inf, np.inf, np.inf])]
    variables = _step(optimizer, grads, [keras.Variable([1.0, 2.0, 3.0, 4.0])], stateless)
    _close(variables[0], [1.0, 2.0, 3.0, 4.0])


@both
def test_finite_step_with_overwrite(stateless):
    _skip_stateless_on_tf(stateless)
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0])]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    variables[0].overwrite_with_gradient = True
    variables = _step(optimizer, grads, variables, stateless)
    _close(variables[0], ops.convert_to_numpy(grads[0]))


def _run(optimizer, grads, steps, stateless):
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    values = [v.value for v in optimizer.variables]
    for _ in range(steps):
        if stateless:
            _, values = optimizer.stateless_apply(values, grads, [v.value for v in variables])
            for ref, v in zip(optimizer.variables, values):
                ref.assign(v)
        else:
            optimizer.apply(grads, variables)
    return optimizer


@both
def test_downscaling(stateless):
    _skip_stateless_on_tf(stateless)
    optimizer = _run(LossScaleOptimizer(SGD(learning_rate=0.5), initial_scale=400.0),
                     [ops.array([np.inf] * 4)], 4, stateless)
    _close(optimizer.scale_loss(1.0), 25.0)


@both
def test_upscaling(stateless):
    _skip_stateless_on_tf(stateless)
    optimizer = _run(LossScaleOptimizer(SGD(learning_rate=0.5), initial_scale=2.0, dynamic_growth_steps=2),
                     [ops.array([1.0, 6.0, 7.0, 2.0])], 8, stateless)
    _close(optimizer.scale_loss(1.0), 32.0)


@both
def test_upscaling_through_a_policy(stateless):
    """The same case written as ampbridge users write it: a policy, then ``optimizer(...)``."""
    _skip_stateless_on_tf(stateless)
    policy = ampbridge.preset("mixed_float16").replace(
        loss_scale=ampbridge.LossScaleConfig(initial_scale=2.0, growth_interval=2))
    optimizer = _run(ak.optimizer(SGD(learning_rate=0.5), policy), [ops.array([1.0, 6.0, 7.0, 2.0])], 8,
                     stateless)
    _close(optimizer.scale_loss(1.0), 32.0)
    config = optimizer.get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (2.0, 2) and len(config) == 4


@both
def test_iterations_update(stateless):
    _skip_stateless_on_tf(stateless)
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    values = [v.value for v in optimizer.variables]
    grads = [ops.array([1.0, 6.0, 7.0, 2.0])]
    assert int(ops.convert_to_numpy(optimizer.iterations.value)) == 0
    for i in range(3):
        if stateless:
            _, values = optimizer.stateless_apply(values, grads, [v.value for v in variables])
            for ref, v in zip(optimizer.variables, values):
                ref.assign(v)
        else:
            optimizer.apply(grads, variables)
        assert int(ops.convert_to_numpy(optimizer.iterations.value)) == i + 1


def test_serialization():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5), initial_scale=3.0, dynamic_growth_steps=2,
                                   name="test_opt")
    config = optimizer.get_config()
    assert len(config) == 4
    assert config["name"] == "test_opt"
    assert config["initial_scale"] == 3.0
    assert config["dynamic_growth_steps"] == 2
    assert "inner_optimizer" in config
    LossScaleOptimizer.from_config(config)


def test_serialization_of_settings_keras_cannot_run():
    """Not in Keras's file: settings beyond Keras's (hysteresis here) keep Keras's keys and add
    ``loss_scale`` and ``policy``, under ampbridge's class name."""
    cfg = ampbridge.LossScaleConfig(mode="dynamic", initial_scale=3.0, growth_interval=2, hysteresis=2)
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5), loss_scale=cfg, name="test_opt")
    config = optimizer.get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (3.0, 2)
    assert set(config) == {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps", "loss_scale", "policy"}
    assert keras.saving.serialize_keras_object(optimizer)["registered_name"] == "ampbridge>LossScaleOptimizer"
    assert LossScaleOptimizer.from_config(config).loss_scale_config == cfg
    with pytest.raises(ValueError, match="initial_scale=5.0 and loss_scale"):
        LossScaleOptimizer(SGD(), initial_scale=5.0, loss_scale=cfg)


def test_init_dynamic_arg():
    LossScaleOptimizer(SGD(learning_rate=0.5), dynamic=True)
    with pytest.raises(ValueError, match="set `loss_scale_factor`"):
        LossScaleOptimizer(SGD(learning_rate=0.5), dynamic=False)


def test_init_unsupported_arg():
    with pytest.raises(ValueError, match="arguments: `foo`, `bar`"):
        LossScaleOptimizer(SGD(learning_rate=0.5), foo=True, bar=3)


@pytest.mark.parametrize("arg_name, arg_value", [
    ("weight_decay", 0.5), ("clipnorm", 0.5), ("global_clipnorm", 0.5), ("clipvalue", 0.5), ("use_ema", True),
    ("ema_momentum", 0.5), ("ema_overwrite_frequency", 2), ("loss_scale_factor", 0.5),
    ("gradient_accumulation_steps", 2)])
def test_init_base_optimizer_unsupported_args(arg_name, arg_value):
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(SGD(learning_rate=0.5), **{arg_name: arg_value})


def test_deserialization_backwards_compatibility():
    # a config with all the base optimizer's arguments (no longer serialized)
    base = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
            "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
            "gradient_accumulation_steps": None}
    config = {"name": "loss_scale_optimizer", **base,
              "inner_optimizer": {"module": "keras.optimizers", "class_name": "SGD",
                                  "config": {"name": "SGD", "learning_rate": 0.5, **base, "momentum": 0.0,
                                             "nesterov": False},
                                  "registered_name": None},
              "initial_scale": 2.0, "dynamic_growth_steps": 2}
    optimizer = LossScaleOptimizer.from_config(config)
    assert (optimizer.loss_scale_config.initial_scale, optimizer.loss_scale_config.growth_interval) == (2.0, 2)
