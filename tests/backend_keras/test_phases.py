"""PhaseCallback: a precision schedule applied live during fit."""

from __future__ import annotations

import numpy as np

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge import trajectory  # noqa: E402

L = keras.layers

SCHEDULE = """
compute_dtype = "float16"
[loss_scale]
initial_scale = 256.0
growth_interval = 2
[[phase]]
until_epoch = 2
compute_dtype = "float32"
[[phase]]
until_epoch = 4
[[phase]]
keep_float32 = ["kind:norm"]
"""
STEPS = 3  # per epoch
EPOCHS = 6
FOUND_INF = [False] * (STEPS * EPOCHS)
FOUND_INF[7] = FOUND_INF[14] = True


def model_and_data(kx):
    kx.seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(8, activation="relu", name="a"),
                              L.LayerNormalization(name="norm"), L.Dense(1, name="head")], name="small")
    rng = np.random.RandomState(0)
    x, y = rng.randn(2 * STEPS, 4).astype("float32"), rng.randn(2 * STEPS, 1).astype("float32")
    return model, np.tile(x, (EPOCHS, 1)), np.tile(y, (EPOCHS, 1))


class Epochs(keras.callbacks.Callback):
    """Per epoch: the dtypes the train step ran with (recorded when it was traced, or on every
    eager step), the train function that ran, and the Adam step count."""

    def __init__(self, records, x):
        super().__init__()
        self.records, self.x, self.by_function, self.seen, self.iterations, self.outputs = records, x, {}, [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.records.clear()

    def on_epoch_end(self, epoch, logs=None):
        function = id(self.model.train_function)
        if self.records:  # traced this epoch (or eager)
            self.by_function[function] = {k: {f: set(v) for f, v in r.items()} for k, r in self.records.items()}
        self.seen.append(self.by_function[function])
        self.iterations.append(int(np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.iterations))))
        # JAX's fit runs the model through stateless_call (its call, not __call__): look directly
        self.outputs.append(keras.backend.standardize_dtype(self.model(self.x).dtype))


def test_three_phases_switch_dtypes_and_carry_state(kx):
    policy = ampbridge.loads(SCHEDULE)
    model, x, y = model_and_data(kx)
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.Adam(1e-2), policy)
    model.compile(opt, "mse")
    records = kx.probe(model)
    phases, epochs, log = ak.PhaseCallback(policy), Epochs(records, x[:2]), kx.StateLog()
    w = np.repeat(np.where(FOUND_INF, np.inf, 1.0), 2).astype("float32")
    model.fit(x, y, sample_weight=w, batch_size=2, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False,
              verbose=0, callbacks=[phases, epochs, log])

    assert phases.switches == [(0, 0), (2, 1), (4, 2)]
    for epoch, seen in enumerate(epochs.seen):
        active = policy.at(epoch=epoch)
        plan = ak.plan(model, active)
        kx.assert_runs_plan(model, plan, seen)  # stored, computed and emitted dtypes, every layer
        assert seen["a"]["vars"] == {active.compute_dtype}
        assert seen["norm"]["outputs"] == {"float16" if epoch in (2, 3) else "float32"}
    assert model.get_layer("norm").dtype_policy.name == "float32"
    assert epochs.outputs == ["float32"] * EPOCHS

    # loss scaling: none in float32, then dynamic from initial_scale (the mode changed), carried on
    none_phase = policy.at(epoch=0).resolved_loss_scale
    dynamic = policy.at(epoch=2).resolved_loss_scale
    first = trajectory(none_phase, FOUND_INF[:2 * STEPS])
    restart = ampbridge.LossScaleState(dynamic.initial_scale, 0, dynamic.hysteresis, first[-1].steps,
                                       first[-1].skipped)
    assert log.states == first + trajectory(dynamic, FOUND_INF[2 * STEPS:], state=restart)

    # Adam was never reset: its step count runs on across the phases
    applied = np.cumsum([not f for f in FOUND_INF]).reshape(EPOCHS, STEPS)[:, -1].tolist()
    assert epochs.iterations == applied


def test_reset_phase_and_step_schedule(kx):
    policy = ampbridge.loads("""
compute_dtype = "float16"
[loss_scale]
initial_scale = 64.0
growth_interval = 1
[[phase]]
until_step = 4
[[phase]]
keep_float32 = ["kind:norm", "a"]
[phase.loss_scale]
reset = true
""")
    model, x, y = model_and_data(kx)
    ak.apply(model, policy)
    opt = ak.optimizer(keras.optimizers.SGD(1e-2), policy)
    model.compile(opt, "mse")
    phases, log = ak.PhaseCallback(policy), kx.StateLog()
    model.fit(x[:12], y[:12], batch_size=2, epochs=2, steps_per_epoch=3, shuffle=False, verbose=0,
              callbacks=[phases, log])
    assert phases.switches == [(0, 0), (4, 1)]
    assert [s.scale for s in log.states] == [128.0, 256.0, 512.0, 1024.0, 128.0, 256.0]
    assert model.get_layer("a").dtype_policy.name == "float32" and model.get_layer("head").compute_dtype == "float16"


def test_schedule_needs_the_ampbridge_optimizer(kx):
    policy = ampbridge.loads(SCHEDULE)
    model, x, y = model_and_data(kx)
    model.compile(keras.optimizers.SGD(), "mse")
    import pytest

    with pytest.raises(ampbridge.UnsupportedOptionError, match="ampbridge.keras.optimizer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[ak.PhaseCallback(policy)])


def test_the_demo_schedule_trains_through_fit_on_this_backend(kx):
    # the demo's Keras runner reads the optimizer in fit callbacks: under JAX, fit keeps the state off
    # the variables mid-epoch, and reading them there raised a TypeError (only tests/parity, run under
    # TensorFlow, ran this runner)
    from ampbridge.cli.demo.runners import run_keras

    policy = ampbridge.loads("""
        compute_dtype = "float16"
        [loss_scale]
        initial_scale = 1024.0
        growth_interval = 2
        [[phase]]
        until_step = 2
        compute_dtype = "float32"
        [[phase]]
    """)
    run = run_keras(policy, 4, inject={3})
    assert run.phases == [0, 0, 1, 1]
    assert run.skipped == [False, False, False, True]
    assert run.final_state.skipped == 1 and run.final_state.steps == 4
