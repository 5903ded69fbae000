"""ampbridge.keras.Monitor / MonitorCallback: the numerics log, overflow attribution, sampling."""

from __future__ import annotations

import io
import json
import warnings
from contextlib import redirect_stdout

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.cli.commands  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge import LossScaleConfig  # noqa: E402
from ampbridge.backends.keras import numerics as keras_numerics  # noqa: E402
from ampbridge.backends.keras.apply import probe_of  # noqa: E402
from ampbridge.diagnostics.runlog import layer_stats, read_log  # noqa: E402

L = keras.layers
ops = keras.ops
BACKEND = keras.backend.backend()
MIXED = ampbridge.preset("mixed_float16")
# a loss scale that plants nothing itself: only the planted layers overflow
GENTLE = MIXED.replace(loss_scale=LossScaleConfig(initial_scale=1.0, growth_interval=10_000))
SCALE = 2.0 ** 11


# --- planted layers -----------------------------------------------------------------------------

def _boosted(x, gain, factor):
    """x * gain, whose backward multiplies the incoming gradient by ``factor`` (in float32, then
    back to the gradient's dtype: in float16 that is inf)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def f(x, gain):
            def grad(g):
                g = tf.cast(tf.cast(g, "float32") * factor, g.dtype)
                return g * gain, tf.reduce_sum(g * x)

            return x * gain, grad

        return f(x, gain)
    if BACKEND == "jax":
        import jax

        @jax.custom_vjp
        def f(x, gain):
            return x * gain

        def fwd(x, gain):
            return x * gain, (x, gain)

        def bwd(res, g):
            x, gain = res
            g = (g.astype("float32") * factor).astype(g.dtype)
            return g * gain, (g * x).sum()

        f.defvjp(fwd, bwd)
        return f(x, gain)
    import torch

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, gain):
            ctx.save_for_backward(x, gain)
            return x * gain

        @staticmethod
        def backward(ctx, g):
            x, gain = ctx.saved_tensors
            g = (g.float() * factor).to(g.dtype)
            return g * gain, (g * x).sum()

    return F.apply(x, gain)


class GradBoost(L.Layer):
    """A scalar gain (1) whose backward multiplies the gradient by 1e30: a backward-only overflow."""

    def build(self, shape):
        self.gain = self.add_weight(shape=(), initializer="ones", name="gain")

    def call(self, x):
        return _boosted(x, ops.cast(self.gain, x.dtype), 1e30)


class Float32Gain(L.Layer):
    """A per-feature gain read without autocast: its gradient is computed in float32 although the
    row computes in float16, so finite values beyond float16's max can appear ("overflow")."""

    def build(self, shape):
        self.gain = self.add_weight(shape=(shape[-1],), initializer="ones", name="gain", autocast=False)

    def call(self, x):
        return ops.cast(ops.cast(x, "float32") * self.gain, x.dtype)


def _set(layer, kernel, bias=0.0):
    layer.set_weights([np.full(w.shape, v, "float32") for w, v in zip(layer.get_weights(), (kernel, bias))])


def _chain(kx, middle, *, units=8):
    """Input(4) -> Dense a (outputs 1e-3 on ones) -> middle -> Dense head (ones)."""
    kx.seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(units, name="a"), *middle, L.Dense(1, name="head")],
                             name="chain")
    _set(model.get_layer("a"), 2.5e-4)
    _set(model.get_layer("head"), 1.0)
    return model


def _fit_monitored(model, policy, path, *, steps, every=1, y=0.0, sample_weight=None):
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-6), policy), "mse")
    x = np.ones((4 * steps, 4), "float32")
    callback = ak.MonitorCallback(path, every=every)
    model.fit(x, np.full((4 * steps, 1), y, "float32"), sample_weight=sample_weight, batch_size=4, shuffle=False,
              verbose=0, callbacks=[callback])
    callback.close()
    return read_log(path)


# --- attribution ----------------------------------------------------------------------------------

def test_forward_overflow_named_and_reported(kx, tmp_path):
    """Dense "boom" (kernel 1e4) emits > 65504 in float16: named as where the overflow happened,
    not "after" or "head" which only carry it; the report says so, and counts the skips."""
    model = _chain(kx, [L.Dense(8, name="boom"), L.Dense(8, name="after")])
    _set(model.get_layer("a"), 1.0)  # a emits 4 on ones: boom emits 8 * 4 * 1e4 = 320000 > 65504
    _set(model.get_layer("boom"), 1e4)
    log = _fit_monitored(model, GENTLE, tmp_path / "run.jsonl", steps=6)
    assert log.header["layers"] == ["a", "boom", "after", "head"]
    assert log.header["framework"] == f"keras ({BACKEND})" and log.header["compute_dtype"] == "float16"
    assert [s["step"] for s in log.steps] == list(range(6))
    for s in log.steps:
        assert s["found_inf"] and s["skipped"]
        assert s["first_nonfinite"] == {"path": "boom", "where": "output"}
    # the scale used, step by step: the reference algorithm's backoff
    assert [s["loss_scale"] for s in log.steps] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]

    out = io.StringIO()
    with redirect_stdout(out):
        code = ampbridge.cli.commands.main(["report", str(tmp_path / "run.jsonl"), "--plot", str(tmp_path / "run.png")])
    text = out.getvalue()
    assert code == 0, text
    assert f"run: keras ({BACKEND}), compute float16, 6 step(s) (steps 0-5), 6 in the log" in text
    assert "skipped steps: 6" in text and "boom (6)" in text and 'keep_float32 = ["boom"]' in text
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_backward_overflow_named(kx, tmp_path):
    """GradBoost's backward overflows (its gradient x 1e30 in float16) while every forward output
    is finite: named with where="gradient" on every backend (its input gradient on TensorFlow and
    torch, its own parameter gradient on JAX)."""
    model = _chain(kx, [L.Dense(8, name="mid"), GradBoost(name="boost"), L.Dense(8, name="after")])
    log = _fit_monitored(model, GENTLE, tmp_path / "run.jsonl", steps=3)
    assert [s["first_nonfinite"] for s in log.steps] == [{"path": "boost", "where": "gradient"}] * 3
    assert all(s["skipped"] for s in log.steps)
    stats = log.steps[0]["layers"]
    assert stats["after"]["nonfinite"] == 0.0 and stats["head"]["nonfinite"] == 0.0  # after it in forward order
    assert stats["boost"]["nonfinite"] == 1.0 and stats["mid"]["nonfinite"] > 0


def test_input_gradient_overflow(kx, tmp_path):
    """Dense "wide" (kernel 1e4) multiplies its input gradient past 65504 while its own kernel
    gradient stays finite. TensorFlow and torch see input gradients: "wide". JAX's backward cannot
    report them, so it names the last layer whose own gradients went non-finite: "a", before it
    (the documented difference)."""
    model = _chain(kx, [L.Dense(8, name="wide")])
    _set(model.get_layer("wide"), 1e4)
    # a emits 1e-3, wide 80, head 640; y = 600: dL/dwide_out = 20, d/dinput = 1.6e6 > 65504
    log = _fit_monitored(model, GENTLE, tmp_path / "run.jsonl", steps=2, y=600.0)
    expected = "a" if BACKEND == "jax" else "wide"
    assert [s["first_nonfinite"] for s in log.steps] == [{"path": expected, "where": "gradient"}] * 2
    stats = log.steps[0]["layers"]
    assert stats["wide"]["nonfinite"] == 0.0 and stats["head"]["nonfinite"] == 0.0
    assert stats["a"]["nonfinite"] == 1.0


def test_sampling_every_100_and_loss_attribution(kx, tmp_path):
    """every=100: steps 0, 100, 200 carry statistics; the poisoned (non-finite loss) steps are
    logged too, with every layer's statistics (replayed on the same batch, on every backend),
    attributed to the loss; nothing else is logged."""
    kx.seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, name="a"), L.Dense(1, name="head")])
    steps, poisoned = 201, (7, 150)
    weights = np.ones(steps, "float32")
    weights[list(poisoned)] = np.inf
    policy = MIXED.replace(loss_scale=LossScaleConfig(initial_scale=256.0, growth_interval=10_000))
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), policy), "mse")
    rng = np.random.RandomState(0)
    callback = ak.MonitorCallback(tmp_path / "run.jsonl", every=100)
    model.fit(rng.randn(steps, 4).astype("float32"), rng.randn(steps, 1).astype("float32"), sample_weight=weights,
              batch_size=1, shuffle=False, verbose=0, callbacks=[callback])
    log = read_log(tmp_path / "run.jsonl")
    assert log.header["every"] == 100
    assert [s["step"] for s in log.steps] == [0, 7, 100, 150, 200]
    by_step = {s["step"]: s for s in log.steps}
    for step in (0, 100, 200):
        assert sorted(by_step[step]["layers"]) == ["a", "head"] and not by_step[step]["found_inf"]
        assert by_step[step]["first_nonfinite"] is None and np.isfinite(by_step[step]["loss"])
    for step in poisoned:
        s = by_step[step]
        assert s["found_inf"] and s["skipped"] and np.isnan(s["loss"])
        assert sorted(s["layers"]) == ["a", "head"] and all(v["nonfinite"] > 0 for v in s["layers"].values())
        assert s["first_nonfinite"] == {"path": "", "where": "loss"}
    assert by_step[150]["loss_scale"] == 128.0  # halved once, at step 7
    # fit's end wrote the closing record (issue 23): every step seen, logged or not
    assert log.end == {"kind": "end", "steps": 201, "skipped": 2, "first_step": 0, "last_step": 200}

    # a second fit with the same callback appends; the step numbers continue
    model.fit(np.ones((100, 4), "float32"), np.zeros((100, 1), "float32"), batch_size=1, verbose=0,
              callbacks=[callback])
    callback.close()
    log = read_log(tmp_path / "run.jsonl")
    assert [s["step"] for s in log.steps][-1] == 300
    assert log.end == {"kind": "end", "steps": 301, "skipped": 2, "first_step": 0, "last_step": 300}


# --- the statistics ---------------------------------------------------------------------------------

def _scaled_grads(model, opt, x, y, loss_fn, poison):
    """This backend's own autodiff: the scaled gradients of the model's trainable variables."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) * poison
            scaled = opt.scale_loss(loss)
        return loss, tape.gradient(scaled, model.trainable_variables)
    if BACKEND == "torch":
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True)) * poison
        opt.scale_loss(loss).backward()
        return loss.detach(), [v.value.grad.clone() for v in model.trainable_variables]
    import jax

    scale = float(kx_numpy(opt.scale))

    def scaled_loss(trainable, non_trainable):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        loss = loss_fn(y, y_pred) * poison
        return loss * scale, loss

    grads, loss = jax.jit(jax.grad(scaled_loss, has_aux=True))([v.value for v in model.trainable_variables],
                                                               [v.value for v in model.non_trainable_variables])
    return loss, grads


def kx_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def _apply(opt, model):
    """The optimizer step, compiled where the backend compiles fit's (tf.function; JAX: jit)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda grads: opt.apply(grads, model.trainable_variables))
    return lambda grads: opt.apply(grads, model.trainable_variables)


def _assert_matches_reference(record, model, grads, scale):
    rows = ak.plan(model, model._ampbridge_policy, warn=False)
    owned = {path: [id(v) for v in layer._trainable_variables] for path, layer in ak.walk(model)}
    by_id = {id(v): kx_numpy(g) for v, g in zip(model.trainable_variables, grads)}
    expected_paths = [row.path for row in rows if owned[row.path]]
    assert sorted(record["layers"]) == sorted(expected_paths)
    for row in rows:
        if not owned[row.path]:
            continue
        g = np.concatenate([by_id[i].astype("float64").ravel() for i in owned[row.path]])
        want = layer_stats(g, scale, row.compute_dtype)
        got = record["layers"][row.path]
        for key in ("zero", "nonfinite", "underflow", "overflow"):
            assert got[key] == want[key], (row.path, key, got[key], want[key])
        for key in ("grad_max_abs", "grad_rms"):
            if np.isnan(want[key]):
                assert np.isnan(got[key]), (row.path, key)
            else:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), (row.path, key)


def test_statistics_equal_numpy_reference(kx, tmp_path):
    """A custom loop: the monitor's per-layer statistics == _runlog.layer_stats on the same scaled
    gradients, each with its row's compute dtype (the norm's row computes in float32); zero,
    underflow and overflow fractions all non-trivial; then a poisoned step (all non-finite)."""
    kx.seed(0)
    model = keras.Sequential([keras.Input((6,)), L.Dense(4, name="a"), L.LayerNormalization(name="norm"),
                              L.Dense(3, activation="relu", name="mid"), L.Dense(1, name="head"),
                              Float32Gain(name="gain")], name="stats")
    policy = MIXED.replace(loss_scale=LossScaleConfig(mode="static", initial_scale=SCALE))
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5 + (w.ndim == 1) for w in model.get_weights()])
    a = model.get_layer("a")
    a.set_weights([w * 1000 for w in a.get_weights()])  # the norm divides a's output gradient by ~1000
    ak.apply(model, policy)
    _set(model.get_layer("head"), 3.0)
    opt = ak.optimizer(keras.optimizers.SGD(1e-3), policy)
    opt.build(model.trainable_variables)
    x = rng.randn(8, 6).astype("float32")
    x[:, 2:4] = 2.0 ** -24  # float16's smallest subnormal: their kernel rows' gradients underflow unscaled
    x[:, 4:] = 0.0  # theirs are exactly zero
    # 3 below the prediction: dL/dpred * scale = 1536 into "gain" (finite in float16) while its own
    # float32 gradient, summed over the batch, passes 65504
    y = kx_numpy(model(x)) - 3.0
    loss_fn = keras.losses.MeanSquaredError()
    monitor = ak.Monitor(tmp_path / "run.jsonl", model, optimizer=opt, every=1)
    step = _apply(opt, model)
    totals = dict.fromkeys(("zero", "underflow", "overflow"), 0.0)
    for poison in (1.0, np.inf):
        loss, grads = _scaled_grads(model, opt, x, y, loss_fn, np.float32(poison))
        step(grads)
        record = monitor.record(loss)
        _assert_matches_reference(record, model, grads, SCALE)
        assert record["found_inf"] == (poison == np.inf)
        if poison == 1.0:
            assert record["loss"] == pytest.approx(float(kx_numpy(loss)), rel=1e-6)
            for key in totals:
                totals[key] = {path: s[key] for path, s in record["layers"].items()}
    assert all(sum(v.values()) > 0 for v in totals.values()), totals
    assert record["loss"] is None and record["first_nonfinite"] == {"path": "", "where": "loss"}
    monitor.close()
    assert [s["step"] for s in read_log(tmp_path / "run.jsonl").steps] == [0, 1]


@pytest.mark.parametrize("compute_dtype,scale", [("float16", 2.0 ** 10), ("bfloat16", 2.0 ** 16),
                                                 ("float32", 2.0 ** 40)])
def test_grad_stats_thresholds(compute_dtype, scale):
    """The device reduction against the reference on planted values around every threshold
    (just under and over the smallest subnormal once unscaled, the max, 0, inf, nan)."""
    from ampbridge.core.dtypes import formats

    fmt = formats()[compute_dtype]
    sub = fmt.smallest_subnormal * scale
    values = np.array([0.0, -0.0, sub * 0.5, -sub * 0.75, sub, sub * 1.5, 1.0, -3.0, np.inf, -np.inf, np.nan,
                       min(fmt.max * 1.5, 3e38), -fmt.max, 65504.0, 70000.0], "float32")
    parts = [values[:7], values[7:].reshape(2, 4)]
    row = kx_numpy(keras_numerics.grad_stats([ops.convert_to_tensor(p) for p in parts],
                                              ops.convert_to_tensor(np.float32(scale)), compute_dtype))
    counts = [int(row[i]) * 4096 + int(row[i + 1]) for i in range(2, 12, 2)]
    zero, nonfinite, under, over, size = counts
    want = layer_stats(values, scale, compute_dtype)
    assert size == values.size
    assert (zero / size, nonfinite / size, under / size, over / size) == (
        want["zero"], want["nonfinite"], want["underflow"], want["overflow"])
    assert under > 0 and (over > 0) == (compute_dtype == "float16")
    assert float(row[0]) / scale == pytest.approx(want["grad_max_abs"], rel=1e-6)
    assert float(row[1]) / scale == pytest.approx(want["grad_rms"], rel=1e-6)


# --- the optimizer and model around it --------------------------------------------------------------

def test_monitor_leaves_checkpoints_and_model_as_they_were(kx, tmp_path):
    """The monitor's variables are scratch: a checkpoint saved while monitoring loads into an
    unmonitored model (and back); after detach the model and optimizer have the variables and
    call methods they had."""
    kx.seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, name="a"), L.Dense(1, name="head")])
    ak.apply(model, MIXED)
    model.compile(ak.optimizer(keras.optimizers.Adam(1e-3), MIXED), "mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    before = (len(model.weights), len(model.non_trainable_variables), len(model.optimizer.variables))
    monitor = ak.Monitor(tmp_path / "run.jsonl", model)
    assert len(model.optimizer.variables) == before[2] + 2 and len(model.weights) == before[0]
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Skipping variable loading for optimizer" would be a warning
        plain = ak.load_model(tmp_path / "m.keras")
    assert plain.optimizer.state == model.optimizer.state and plain.optimizer.state.steps == 4
    monitor.close()
    assert (len(model.weights), len(model.non_trainable_variables), len(model.optimizer.variables)) == before
    assert "compute_loss" not in model.__dict__ and all(
        probe_of(layer) is None for _, layer in ak.walk(model))
    model.fit(x, y, batch_size=4, verbose=0)  # runs unmonitored
    assert model.optimizer.state.steps == 6


def test_monitor_refuses_what_it_cannot_log(kx, tmp_path):
    model = keras.Sequential([keras.Input((4,)), L.Dense(1, name="head")])
    model.compile(keras.optimizers.SGD(), "mse")
    with pytest.raises(ampbridge.UnsupportedOptionError, match="ampbridge.keras.optimizer"):
        ak.Monitor(tmp_path / "run.jsonl", model)
    with pytest.raises(ValueError, match="every must be a positive integer"):
        ak.MonitorCallback(tmp_path / "run.jsonl", every=0)
    model.compile(ak.optimizer(keras.optimizers.SGD(), MIXED), "mse", steps_per_execution=4)
    with pytest.raises(ampbridge.UnsupportedOptionError, match="steps_per_execution"):
        ak.Monitor(tmp_path / "run.jsonl", model)
    unbuilt = keras.Sequential([L.Dense(1)])
    unbuilt.compile(ak.optimizer(keras.optimizers.SGD(), MIXED), "mse")
    with pytest.raises(ValueError, match="build the model first"):
        ak.Monitor(tmp_path / "run.jsonl", unbuilt)


def test_log_lines_are_the_shared_format(kx, tmp_path):
    """The header carries what every backend's header does; the policy is policy_to_dict's."""
    from ampbridge.core.io import policy_to_dict

    model = _chain(kx, [L.LayerNormalization(name="norm")])
    log = _fit_monitored(model, GENTLE.replace(keep_float32=("kind:norm",)), tmp_path / "run.jsonl", steps=1)
    header = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[0])
    assert header["kind"] == "run" and header["version"] == 1 and header["min_scale"] is None
    assert header["policy"] == json.loads(json.dumps(policy_to_dict(GENTLE.replace(keep_float32=("kind:norm",)))))
    assert header["layers"] == ["a", "norm", "head"]
    assert sorted(log.steps[0]["layers"]) == ["a", "head", "norm"]


@pytest.mark.skipif(BACKEND != "jax", reason="a functional JAX loop: stateless_call / stateless_apply in jax.jit")
def test_functional_jax_loop_records_returned_state(kx, tmp_path):
    """The documented JAX custom loop: the values a jitted step returns go to record() as they are."""
    import jax

    model = _chain(kx, [L.Dense(8, name="boom"), L.Dense(8, name="after")])
    _set(model.get_layer("a"), 1.0)
    _set(model.get_layer("boom"), 1e4)
    ak.apply(model, GENTLE)
    opt = ak.optimizer(keras.optimizers.SGD(1e-6), GENTLE)
    opt.build(model.trainable_variables)
    monitor = ak.Monitor(tmp_path / "run.jsonl", model, optimizer=opt)
    loss_fn = keras.losses.MeanSquaredError()
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 1), "float32")

    @jax.jit
    def step(trainable, non_trainable, opt_values):
        def scaled_loss(trainable, non_trainable):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            loss = loss_fn(y, y_pred)
            with keras.StatelessScope(state_mapping=list(zip(opt.variables, opt_values))):
                return opt.scale_loss(loss), (loss, non_trainable)

        (_, (loss, non_trainable)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable, non_trainable)
        trainable, opt_values = opt.stateless_apply(opt_values, grads, trainable)
        return loss, trainable, non_trainable, opt_values

    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in opt.variables])
    records = []
    for _ in range(2):
        loss, *state = step(*state)
        records.append(monitor.record(loss, non_trainable_variables=state[1], optimizer_variables=state[2]))
    monitor.close()
    assert [r["first_nonfinite"] for r in records] == [{"path": "boom", "where": "output"}] * 2
    assert [r["loss_scale"] for r in records] == [1.0, 0.5] and all(r["skipped"] for r in records)


def test_record_twice_logs_once(kx, tmp_path):
    """record() without an optimizer step in between logs nothing new."""
    model = _chain(kx, [])
    ak.apply(model, MIXED)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), MIXED), "mse")
    model.fit(np.ones((4, 4), "float32"), np.zeros((4, 1), "float32"), verbose=0)
    with ak.Monitor(tmp_path / "run.jsonl", model) as monitor:
        model.fit(np.ones((4, 4), "float32"), np.zeros((4, 1), "float32"), verbose=0)
        first = monitor.record()
        assert first["step"] == 1 and sorted(first["layers"]) == ["a", "head"]
        assert monitor.record() is None
    log = read_log(tmp_path / "run.jsonl")
    assert [s["step"] for s in log.steps] == [1]
    assert log.end == {"kind": "end", "steps": 1, "skipped": 0, "first_step": 1, "last_step": 1}  # counted once


def test_apply_tells_the_attached_monitor_about_the_new_plan(kx, tmp_path):
    """apply reaches the monitor through its observers (apply.observe_apply): a re-apply rebuilds
    the optimizer's record layout from the new rows (their compute dtypes set the thresholds);
    a closed monitor observes nothing."""
    model = _chain(kx, [])
    ak.apply(model, MIXED)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), MIXED), "mse")
    monitor = ak.Monitor(tmp_path / "run.jsonl", model)
    assert {path: dtype for path, dtype, _ in model.optimizer.monitor_spec.stats} == {"a": "float16",
                                                                                     "head": "float16"}
    ak.apply(model, MIXED.replace(keep_float32=("head",)))
    assert {path: dtype for path, dtype, _ in model.optimizer.monitor_spec.stats} == {"a": "float16",
                                                                                     "head": "float32"}
    monitor.close()
    ak.apply(model, MIXED)
    assert model.optimizer.monitor_spec is None
