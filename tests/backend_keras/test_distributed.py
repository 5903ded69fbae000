"""The loss-scaling optimizer under data parallelism with 2 replicas: ``tf.distribute.MirroredStrategy``
on 2 logical CPU devices (TensorFlow backend) and ``keras.distribution.DataParallel`` on 2 host
devices (JAX backend). Each runs in a subprocess of this file (the devices must be set before the
framework starts). An overflow on one replica's shard only: every replica skips that step, the
loss-scale state on every replica follows the core reference, every replica holds the same
weights, equal to one device's ``fit`` on the same global batches; ``reduce_dtype`` other than
the variables' dtype is refused by name.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

if __name__ == "__main__":  # a worker: the repository's ampbridge
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ampbridge._testing import require  # noqa: E402

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
STEPS = 6
OVERFLOW_STEP = 2  # its global batch overflows in row 6: the second replica's half only
GLOBAL_BATCH = 8
# max |weights - one device's| after 6 steps: the reduction order (a sum of 2 replica gradients
# vs one batch), float32; measured in the 1e-8 range
TOLERANCE = 1e-6


def _policy(reduce_dtype: str = "float32"):
    import ampbridge

    return ampbridge.Policy(reduce_dtype=reduce_dtype,
                            loss_scale={"mode": "dynamic", "initial_scale": 1024.0, "growth_interval": 2})


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 3)).astype(np.float32)
    y = rng.normal(size=(STEPS * GLOBAL_BATCH, 2)).astype(np.float32)
    y[OVERFLOW_STEP * GLOBAL_BATCH + 6, 0] = 3e38  # the squared error is inf: that replica's loss
    return x, y


def _model():
    import keras

    import ampbridge

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.Dense(2, name="head")])
    model = ampbridge.keras.apply(model, _policy())
    return model


def _compile(model, reduce_dtype: str = "float32"):
    import keras

    import ampbridge

    opt = ampbridge.keras.optimizer(keras.optimizers.SGD(0.05), _policy(reduce_dtype))
    model.compile(optimizer=opt, loss="mse")
    return opt


class _PerReplica:
    """After every batch: each replica's loss-scale state and whether the replicas' weights agree."""

    def __init__(self, read):
        import keras

        outer = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                outer.steps.append(read(self.model))

        self.steps: list = []
        self.callback = Callback()


def _state_names():
    return ("step_counter", "dynamic_scale", "hysteresis_left", "loss_scale_steps", "skipped_steps")


def _as_state(values):
    good, scale, hyst, steps, skipped = values
    return {"scale": float(scale), "good_steps": int(good), "hysteresis_left": int(hyst), "steps": int(steps),
            "skipped": int(skipped)}


def _single_device() -> dict:
    import numpy as np

    model = _model()
    opt = _compile(model)
    initial = [np.asarray(w).tolist() for w in model.get_weights()]
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"state": opt.state.to_dict(), "weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "initial": initial}


def _worker_tf_mirrored() -> dict:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np

    from ampbridge.errors import UnsupportedOptionError

    reference = _single_device()
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = _model()
        opt = _compile(model)
        try:
            _compile(_model(), "bfloat16")
            refused = None
        except UnsupportedOptionError as e:
            refused = str(e)

    def read(model):
        states = [_as_state([np.asarray(c) for c in per]) for per in
                  zip(*(strategy.experimental_local_results(getattr(opt, n).value) for n in _state_names()))]
        same = all(all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                       zip(*strategy.experimental_local_results(w.value))) for w in model.weights)
        return {"states": states, "weights_equal": same}

    record = _PerReplica(read)
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record.callback])
    # the control: Keras's own _tf_apply, which takes the first replica's finite flag for all
    import keras

    import ampbridge

    with strategy.scope():
        control = _model()
        control_opt = _compile(control)
        control_opt._tf_apply = functools.partial(keras.optimizers.LossScaleOptimizer._tf_apply, control_opt)
        control_opt._step_verified = True  # (the first-step guard is another test's business)
    control.fit(x[:(OVERFLOW_STEP + 1) * GLOBAL_BATCH], y[:(OVERFLOW_STEP + 1) * GLOBAL_BATCH],
                batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert isinstance(control_opt, ampbridge.keras.LossScaleOptimizer)
    return {"per_step": record.steps, "weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "reference": reference, "refused": refused,
            "control_finite": bool(all(np.isfinite(w).all() for w in control.get_weights())),
            "control_skipped": int(control_opt.state.skipped)}


def _worker_jax_data_parallel() -> dict:
    import jax
    import keras
    import numpy as np

    from ampbridge.errors import UnsupportedOptionError

    assert jax.device_count() == 2
    reference = _single_device()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = _model()
    opt = _compile(model)
    try:
        _compile(_model(), "bfloat16")
        refused = None
    except UnsupportedOptionError as e:
        refused = str(e)

    def per_device(v):
        return [np.asarray(s.data) for s in sorted(v.value.addressable_shards, key=lambda s: s.device.id)]

    def read(model):
        state = model._jax_state  # fit keeps the live values here between steps (synced at the end)
        by_var = {id(v): x for v, x in zip(opt.variables, state["optimizer_variables"])}
        states = [_as_state(vals) for vals in zip(*(
            [np.asarray(s.data) for s in sorted(by_var[id(getattr(opt, n))].addressable_shards,
                                                 key=lambda s: s.device.id)] for n in _state_names()))]
        same = all(all(np.array_equal(shards[0], s) for s in shards[1:]) for shards in (
            [np.asarray(s.data) for s in sorted(w.addressable_shards, key=lambda s: s.device.id)]
            for w in state["trainable_variables"]))
        return {"states": states, "weights_equal": same}

    record = _PerReplica(read)
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record.callback])
    assert all(len(per_device(w)) == 2 for w in model.weights)
    return {"per_step": record.steps, "weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "reference": reference, "refused": refused}


if __name__ == "__main__":
    import keras

    keras.config.disable_traceback_filtering()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.debugging.disable_traceback_filtering()
    result = {"tf_mirrored": _worker_tf_mirrored, "jax_data_parallel": _worker_jax_data_parallel}[sys.argv[1]]()
    print(json.dumps(result))
    sys.exit(0)


# --- the tests --------------------------------------------------------------------------------

def _run(worker: str, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, HERE, worker], env=env, capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected_states() -> list[dict]:
    from ampbridge.core.loss_scale import trajectory

    cfg = _policy().resolved_loss_scale
    return [s.to_dict() for s in trajectory(cfg, [step == OVERFLOW_STEP for step in range(STEPS)])]


def _check(run: dict) -> None:
    import numpy as np

    expected = _expected_states()
    assert [s["skipped"] for s in expected] == [0, 0, 1, 1, 1, 1]
    assert len(run["per_step"]) == STEPS
    for step, got in enumerate(run["per_step"]):
        assert got["states"] == [expected[step], expected[step]], step  # both replicas, every step
        assert got["weights_equal"], step
    assert run["reference"]["state"] == expected[-1]  # one device skipped the same step
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(run["weights"], run["reference"]["weights"]))
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(run["reference"]["weights"], _initial_weights(run)))
    assert moved > 1e-2 and diff <= TOLERANCE, (diff, moved)
    assert "reduce_dtype=bfloat16" in run["refused"] and "variables' dtype" in run["refused"]


def _initial_weights(run: dict) -> list:
    return run["reference"]["initial"]


def _backend() -> str:
    import keras

    return keras.backend.backend()


@pytest.mark.slow
def test_mirrored_strategy_two_replicas_skip_together():
    """TensorFlow: tf.distribute.MirroredStrategy over 2 logical CPU devices, model.fit; row 6 of
    step 2's global batch (the second replica's half) overflows."""
    if _backend() != "tensorflow":
        pytest.skip("runs once, under KERAS_BACKEND=tensorflow")
    require("tensorflow")
    run = _run("tf_mirrored", {"KERAS_BACKEND": "tensorflow"})
    _check(run)
    # the control: Keras's own apply takes the first replica's flag and steps with the inf sum
    assert not run["control_finite"] and run["control_skipped"] == 0


@pytest.mark.slow
def test_keras_data_parallel_on_jax_two_devices_skip_together():
    """JAX: keras.distribution.DataParallel over 2 host devices, model.fit (one global program:
    the finite check sees both replicas' gradients)."""
    if _backend() != "jax":
        pytest.skip("runs once, under KERAS_BACKEND=jax")
    require("jax")
    run = _run("jax_data_parallel", {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
                                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    _check(run)
