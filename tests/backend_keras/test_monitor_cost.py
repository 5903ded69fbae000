"""ampbridge.keras.MonitorCallback between samples (issue 24): an unsampled ``fit`` step runs Keras's
own train function traced without the monitor, so its exact counts equal an unmonitored model's
(TensorFlow: ops of the traced step's graph; JAX: StableHLO ops of the lowered step; torch: aten
ops dispatched per step); a non-finite unsampled step is replayed on its batch, in a sandbox,
and still names the layer where it started."""

from __future__ import annotations

import numpy as np

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge import LossScaleConfig  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402

L = keras.layers
BACKEND = keras.backend.backend()
POLICY = ampbridge.preset("mixed_float16").replace(
    loss_scale=LossScaleConfig(initial_scale=1.0, growth_interval=10_000))
BATCH = 4


def _model(kx, *, monitored_path=None, every=100, policy=POLICY):
    """Dense a (kernel 1) -> Dense boom (kernel 10) -> Dropout -> Dense head: on ones boom emits
    320; on a batch of 1000s 320000, past float16's 65504 (boom's output overflows)."""
    kx.seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(8, name="a"), L.Dense(8, name="boom"),
                              L.Dropout(0.25, seed=1, name="drop"), L.Dense(1, name="head")], name="net")
    for name, value in (("a", 1.0), ("boom", 10.0), ("head", 1e-3)):
        layer = model.get_layer(name)
        layer.set_weights([np.full(w.shape, value if w.ndim == 2 else 0.0, "float32") for w in layer.get_weights()])
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.Adam(1e-3), policy), "mse")
    callbacks = [] if monitored_path is None else [ak.MonitorCallback(monitored_path, every=every)]
    return model, callbacks


def _data(steps, poisoned=()):
    x = np.ones((steps * BATCH, 4), "float32")
    for step in poisoned:
        x[step * BATCH:(step + 1) * BATCH] = 1000.0
    return x, np.zeros((steps * BATCH, 1), "float32")


def _closure_find(fn, test, depth=0):
    """The object in ``fn``'s closures (Keras's train function, nested) that passes ``test``."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        for candidate in (value, getattr(value, "__wrapped__", None)):
            if candidate is not None and test(candidate):
                return candidate
        if callable(value) and depth < 4 and not isinstance(value, (type, keras.layers.Layer)):
            found = _closure_find(getattr(value, "__wrapped__", value), test, depth + 1)
            if found is not None:
                return found
    return None


def _traced_ops(model, train_function, batch):
    """Ops of the traced train step inside ``train_function`` (a cache hit: fit traced it)."""
    if BACKEND == "tensorflow":
        fn = _closure_find(train_function, lambda v: hasattr(v, "get_concrete_function")
                           and getattr(v, "__name__", "") == "one_step_on_data")
        traces = fn.experimental_get_tracing_count()
        graph = fn.get_concrete_function(batch).graph.as_graph_def()
        assert fn.experimental_get_tracing_count() == traces  # the step fit ran, not a new trace
        return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
    fn = _closure_find(train_function, lambda v: hasattr(v, "lower"))
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    text = fn.lower(state, batch).as_text()
    return sum("= stablehlo." in line or "stablehlo.return" in line for line in text.splitlines())


def _aten_ops(model, batch):
    """The aten ops one call of ``model.train_function`` dispatches (torch runs Keras eagerly)."""
    from ampbridge._testing import aten_op_counts

    with aten_op_counts() as ops:
        model.train_function([batch])
    return ops


def test_unsampled_step_counts_equal_no_monitor(kx, tmp_path):
    """every=100: after fit ran the sampled step 0 and unsampled steps, the program an unsampled
    step runs has exactly the ops of the unmonitored model's; the sampled program has more."""
    x, y = _data(3)
    plain, _ = _model(kx)
    monitored, callbacks = _model(kx, monitored_path=tmp_path / "run.jsonl")
    plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    monitored.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    dispatch = callbacks[0]._dispatch
    assert monitored.train_function is dispatch and dispatch.step == 3
    batch = (keras.ops.convert_to_tensor(x[:BATCH]), keras.ops.convert_to_tensor(y[:BATCH]))
    if BACKEND == "torch":
        import torch

        torch.manual_seed(0)
        want = _aten_ops(plain, batch)
        got = _aten_ops(monitored, batch)  # step 3: unsampled
        assert dispatch.step == 4 and got == want and sum(got.values()) > 100
        dispatch.step = 100  # the next call is sampled: the statistics function
        assert sum(_aten_ops(monitored, batch).values()) > sum(want.values())
    else:
        want = _traced_ops(plain, plain.train_function, batch)
        assert _traced_ops(monitored, dispatch.plain, batch) == want
        assert _traced_ops(monitored, dispatch.stats, batch) > want
    callbacks[0].close()
    # torch ran the fifth step (optimizer step 4) through the statistics function: it is logged
    assert [s["step"] for s in read_log(tmp_path / "run.jsonl").steps] == [0] + ([4] if BACKEND == "torch" else [])


def test_nonfinite_unsampled_step_replayed_in_a_sandbox(kx, tmp_path):
    """Steps 5 and 9 overflow in "boom"'s output (unsampled at every=100): each is logged with
    every layer's statistics and named; the replay leaves no trace: the weights, the optimizer
    (loss-scale state included) and the loss metric end bit-for-bit as an unmonitored fit's."""
    x, y = _data(12, poisoned=(5, 9))
    plain, _ = _model(kx)
    monitored, callbacks = _model(kx, monitored_path=tmp_path / "run.jsonl")
    want = plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    got = monitored.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks).history
    callbacks[0].close()
    log = read_log(tmp_path / "run.jsonl")
    assert [s["step"] for s in log.steps] == [0, 5, 9]
    for s in log.steps[1:]:
        assert s["found_inf"] and s["skipped"] and s["first_nonfinite"] == {"path": "boom", "where": "output"}
        assert sorted(s["layers"]) == ["a", "boom", "head"] and s["layers"]["a"]["nonfinite"] > 0
    assert [s["loss_scale"] for s in log.steps] == [1.0, 1.0, 0.5]  # the scale each step used
    assert log.end == {"kind": "end", "steps": 12, "skipped": 2, "first_step": 0, "last_step": 11}
    for a, b in zip(plain.weights + plain.optimizer.variables, monitored.weights + monitored.optimizer._saved_variables()):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path
    assert monitored.optimizer.state == plain.optimizer.state and plain.optimizer.state.skipped == 2
    np.testing.assert_array_equal(got["loss"], want["loss"])


def test_a_replay_starts_from_the_scale_the_step_used(kx, tmp_path):
    """The scale grows every 2 finite steps between the skips at 5 and 9 (the host folds the
    unsampled finite steps into its loss-scale state only when a replay needs it): each replayed
    record equals the one a run sampling every step logged, loss scale included."""
    policy = POLICY.replace(loss_scale=LossScaleConfig(initial_scale=1.0, growth_interval=2))
    x, y = _data(12, poisoned=(5, 9))
    logs = {}
    for every in (100, 1):
        model, callbacks = _model(kx, monitored_path=tmp_path / f"{every}.jsonl", every=every, policy=policy)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        callbacks[0].close()
        logs[every] = {s["step"]: s for s in read_log(tmp_path / f"{every}.jsonl").steps}
    assert sorted(logs[100]) == [0, 5, 9]
    assert [logs[100][k]["loss_scale"] for k in (5, 9)] == [logs[1][k]["loss_scale"] for k in (5, 9)] == [4.0, 4.0]
    for k in (5, 9):
        assert logs[100][k]["first_nonfinite"] == logs[1][k]["first_nonfinite"] == {"path": "boom", "where": "output"}


def test_the_last_step_of_each_epoch_nonfinite_is_replayed(kx, tmp_path):
    """Two epochs whose last steps overflow: each is replayed and named before the next epoch
    starts, and the run stays bit-identical to an unmonitored fit."""
    x, y = _data(8, poisoned=(3, 7))  # step 7: the last of the first epoch
    plain, _ = _model(kx)
    monitored, callbacks = _model(kx, monitored_path=tmp_path / "run.jsonl")
    want = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    got = monitored.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks).history
    callbacks[0].close()
    log = read_log(tmp_path / "run.jsonl")
    assert [s["step"] for s in log.steps] == [0, 3, 7, 11, 15]
    assert all(s["first_nonfinite"] == {"path": "boom", "where": "output"} for s in log.steps[1:])
    assert log.end["steps"] == 16 and log.end["skipped"] == 4
    for a, b in zip(plain.weights, monitored.weights):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path
    np.testing.assert_array_equal(got["loss"], want["loss"])


def test_jax_unsampled_steps_are_read_at_the_next_sample(kx, tmp_path, monkeypatch):
    """JAX: an unsampled step is queued and not read (the host reads nothing from the device
    between samples, so it queues ahead as without a monitor); its finite flag is read with the
    window's others in one transfer at the next sample or the epoch's end, and a skipped step is
    replayed from the window's saved state: its record equals, field for field (layer statistics
    and loss included: the replay draws the step's own dropout mask), the record a run that
    samples every step logged, and the run stays bit-identical to an unmonitored one."""
    if BACKEND != "jax":
        import pytest

        pytest.skip("the late read is Keras-on-JAX's (TensorFlow and torch read each step at the step)")
    import jax

    from ampbridge.backends.keras import sampling

    x, y = _data(12, poisoned=(7,))
    plain, _ = _model(kx)
    want = plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    logs = {}
    for every in (1, 5):
        model, callbacks = _model(kx, monitored_path=tmp_path / f"{every}.jsonl", every=every)
        if every == 5:
            reads, windows = [], []
            device_get, flush = jax.device_get, sampling.FitDispatch.flush
            monkeypatch.setattr(jax, "device_get", lambda tree: reads.append(tree) or device_get(tree))
            monkeypatch.setattr(sampling, "host_value", lambda value: reads.append(value) or np.asarray(value))

            def spy(self):
                windows.append([step for step, _, _ in self._window])
                return flush(self)
            monkeypatch.setattr(sampling.FitDispatch, "flush", spy)
            late_step = sampling.FitDispatch._late_step

            def unread(self, *args):
                before = len(reads)
                out = late_step(self, *args)
                assert len(reads) == before  # queued, nothing read
                return out
            monkeypatch.setattr(sampling.FitDispatch, "_late_step", unread)
            copies, copy_state = [], sampling._copy_state
            monkeypatch.setattr(sampling, "_copy_state", lambda state: copies.append(1) or copy_state(state))
        got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks).history
        callbacks[0].close()
        monkeypatch.undo()
        logs[every] = {s["step"]: s for s in read_log(tmp_path / f"{every}.jsonl").steps}
        np.testing.assert_array_equal(got["loss"], want["loss"])
        for a, b in zip(plain.weights, model.weights):
            assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path
    # windows flushed at the samples 5 and 10, at the epoch's end, then (empty) at the end of fit and close
    assert [w for w in windows if w] == [[1, 2, 3, 4], [6, 7, 8, 9], [11]]
    assert len(copies) == 4  # one state copy per window, and one for step 7's replay (which donates it)
    assert sorted(logs[5]) == [0, 5, 7, 10]
    np.testing.assert_equal(logs[5][7], logs[1][7])  # NaN statistics (every gradient non-finite) equal too
    assert logs[5][7]["skipped"] and 0 < logs[5][7]["layers"]["boom"]["nonfinite"] < 1


def test_jax_a_window_that_cannot_be_rerun_is_said_and_logged_bare(kx, tmp_path):
    """A batch changed in place after fit used it (as a data source that refills one array would):
    the rerun cannot reproduce fit's step, so the monitor says so by name and logs the skipped
    step without statistics, rather than a replay of other data; training is untouched."""
    if BACKEND != "jax":
        import pytest

        pytest.skip("the late read is Keras-on-JAX's")
    import pytest

    x, y = _data(6, poisoned=(3,))
    model, callbacks = _model(kx, monitored_path=tmp_path / "run.jsonl")
    dispatch = []

    class Refill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:  # step 3's batch, kept for the window's replay, overwritten in place
                dispatch.append(callbacks[0]._dispatch)
                step, data, flag = dispatch[0]._window[2]
                assert step == 3
                if isinstance(data[0], np.ndarray):  # Keras 3.15 hands the step numpy arrays
                    data[0][...] = 1.0
                else:  # 3.12 JAX arrays (immutable): the same change, made by replacing the batch
                    dispatch[0]._window[2] = (step, (np.ones_like(data[0]),) + tuple(data[1:]), flag)
    with pytest.warns(ampbridge.AmpBridgeWarning, match=r"rerunning step 3 .* changed in place"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks + [Refill()])
    callbacks[0].close()
    log = read_log(tmp_path / "run.jsonl")
    assert [(s["step"], s["skipped"], s["first_nonfinite"], s["layers"]) for s in log.steps] == [
        (0, False, None, log.steps[0]["layers"]), (3, True, None, {})]
    assert log.steps[0]["layers"] and log.end["steps"] == 6 and log.end["skipped"] == 1
    assert model.optimizer.state.skipped == 1


def test_jax_windows_are_read_at_least_every_window_steps(kx, tmp_path, monkeypatch):
    """every=1000 samples only step 0 here, yet the window is read every _WINDOW steps (4 in this
    test: fewer batches kept, fewer steps a replay reruns): the skip at 6 is replayed from the
    second window's saved state and named, and the run stays bit-identical."""
    if BACKEND != "jax":
        import pytest

        pytest.skip("the late read is Keras-on-JAX's")
    from ampbridge.backends.keras import sampling

    monkeypatch.setattr(sampling, "_WINDOW", 4)
    x, y = _data(12, poisoned=(6,))
    plain, _ = _model(kx)
    want = plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    model, callbacks = _model(kx, monitored_path=tmp_path / "run.jsonl", every=1000)
    windows, flush = [], sampling.FitDispatch.flush

    def spy(self):
        windows.append([step for step, _, _ in self._window])
        return flush(self)
    monkeypatch.setattr(sampling.FitDispatch, "flush", spy)
    got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks).history
    callbacks[0].close()
    assert [w for w in windows if w] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    log = read_log(tmp_path / "run.jsonl")
    assert [s["step"] for s in log.steps] == [0, 6] and log.end["steps"] == 12 and log.end["skipped"] == 1
    assert log.steps[1]["first_nonfinite"] == {"path": "boom", "where": "output"}
    np.testing.assert_array_equal(got["loss"], want["loss"])
    for a, b in zip(plain.weights, model.weights):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path
