"""The loss-scaling optimizer under data parallelism with 2 replicas: ``tf.distribute.MirroredStrategy``
on 2 logical CPU devices (TensorFlow backend) and ``keras.distribution.DataParallel`` on 2 host
devices (JAX backend). Each runs in a subprocess of this file (the devices must be set before the
framework starts). An overflow on one replica's shard only: every replica skips that step, the
loss-scale state on every replica follows the core reference, every replica holds the same
weights, equal to one device's ``fit`` on the same global batches; ``reduce_dtype`` other than
the variables' dtype is refused by name. What each engine reduces the gradients in, for float32
and bfloat16 variables: the dtype of the collective op TensorFlow builds, the element type of the
all-reduce in the HLO XLA partitions and compiles.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
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


def _bfloat16_fit() -> dict:
    """A bfloat16-variable model (reduce_dtype = param_dtype = bfloat16: accepted) fitted on one global
    batch under the strategy or distribution in force: its variables' dtypes, and whether it moved."""
    import keras
    import numpy as np

    import ampbridge

    policy = ampbridge.Policy(compute_dtype="bfloat16", param_dtype="bfloat16")
    keras.utils.set_random_seed(0)
    model = ampbridge.keras.apply(keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                                                    keras.layers.Dense(2)]), policy)
    model.compile(optimizer=ampbridge.keras.optimizer(keras.optimizers.SGD(0.05), policy), loss="mse")
    before = [np.asarray(w).astype(np.float32) for w in model.get_weights()]
    x, y = _data()
    model.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"dtypes": sorted({str(w.dtype) for w in model.weights}),
            "moved": max(float(np.max(np.abs(np.asarray(w).astype(np.float32) - b)))
                         for w, b in zip(model.get_weights(), before))}


class _TFAllReduces:
    """Records every ``ReplicaContext.all_reduce`` (what Keras's optimizer and ampbridge's flag
    agreement call while ``fit`` traces its step): the [dtype, shape] of the values each replica
    hands over (``values``), and the reduction ops those calls added to the graph being traced
    (``ops``: [op type, dtype, elements, device], each once): what is sent."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.values: list = []
        self._ops: dict = {}
        original = tf.distribute.ReplicaContext.all_reduce

        def all_reduce(context, reduce_op, value, options=None):
            graph = tf.compat.v1.get_default_graph()  # the tf.function (or cond branch) being traced
            before = set(graph.get_operations())
            out = original(context, reduce_op, value, options)
            # MirroredStrategy's merge_call builds the ops of every replica at once: seen by each caller
            for op in graph.get_operations():
                if op not in before and op.type.startswith(("Collective", "Nccl", "AddN")):
                    self._ops[id(graph), op.name] = [op.type, op.get_attr("T").name,
                                                     int(op.inputs[0].shape.num_elements()),
                                                     op.device.rsplit("device:", 1)[-1]]
            self.values.append([[v.dtype.name, list(v.shape)] for v in tf.nest.flatten(value)])
            return out

        tf.distribute.ReplicaContext.all_reduce = all_reduce

    def take(self) -> dict:
        """What was recorded since the last take."""
        taken = {"values": self.values[:], "ops": sorted(self._ops.values())}
        self.values.clear()
        self._ops.clear()
        return taken


def _monitor_refusals(model, scope=None) -> dict:
    """The numerics monitor on the 2-replica model: ``MonitorCallback`` in ``fit``, ``Monitor`` built
    outside and (TensorFlow) inside the strategy's scope; each refusal's text, or "ran"."""
    import tempfile

    import ampbridge
    from ampbridge.errors import UnsupportedOptionError

    path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    x, y = _data()
    attempts = {"callback": lambda: model.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0,
                                              callbacks=[ampbridge.keras.MonitorCallback(path)]),
                "outside": lambda: ampbridge.keras.Monitor(path, model)}
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "ran"
        except UnsupportedOptionError as e:
            out[name] = str(e)
    if scope is not None:
        with scope:
            try:
                ampbridge.keras.Monitor(path, model)
                out["inside"] = "ran"
            except UnsupportedOptionError as e:
                out["inside"] = str(e)
    out["log_written"] = os.path.exists(path)
    return out


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
    recorder = _TFAllReduces()
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
    sent = {"float32": recorder.take()}
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
    recorder.take()  # the control's
    with strategy.scope():
        bfloat16 = _bfloat16_fit()
    sent["bfloat16"] = recorder.take()
    monitor = _monitor_refusals(model, strategy.scope())
    return {"per_step": record.steps, "weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "reference": reference, "refused": refused, "sent": sent, "bfloat16": bfloat16, "monitor": monitor,
            "control_finite": bool(all(np.isfinite(w).all() for w in control.get_weights())),
            "control_skipped": int(control_opt.state.skipped)}


def _all_reduce_types(hlo_text: str) -> list[list]:
    """(element type, shape) of every all-reduce in an HLO module's text (a tuple all-reduce: each)."""
    found = []
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(", line)
        if m:
            found.extend([t, shape] for t, shape in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", m.group(1)))
    return found


def _train_step_hlo(dump: str, seen: set) -> dict:
    """The all-reduces of the train steps XLA compiled since ``seen`` (XLA_FLAGS --xla_dump_to=dump):
    after SPMD partitioning (what Keras's program sends) and after all optimizations (what runs)."""
    files = set(glob.glob(os.path.join(dump, "*jit_train_step*.txt"))) - seen
    seen |= files

    def types(tag: str) -> list:
        return [t for f in sorted(files) if tag in os.path.basename(f) for t in _all_reduce_types(open(f).read())]

    return {"partitioned": types("after_spmd-partitioning"), "compiled": types("cpu_after_optimizations.txt")}


def _worker_jax_data_parallel() -> dict:
    import jax
    import keras
    import numpy as np

    from ampbridge.errors import UnsupportedOptionError

    assert jax.device_count() == 2
    dump = sys.argv[2]  # XLA dumps the HLO of every module it compiles here
    reference = _single_device()
    seen = set(glob.glob(os.path.join(dump, "*.txt")))  # the one-device run's (no all-reduce)
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
    hlo = {"float32": _train_step_hlo(dump, seen)}
    bfloat16 = _bfloat16_fit()
    hlo["bfloat16"] = _train_step_hlo(dump, seen)
    return {"per_step": record.steps, "weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "reference": reference, "refused": refused, "hlo": hlo, "bfloat16": bfloat16,
            "monitor": _monitor_refusals(model)}


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

def _run(worker: str, env_extra: dict[str, str], *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, HERE, worker, *args], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected_states() -> list[dict]:
    from ampbridge.core.loss_scale import trajectory

    cfg = _policy().resolved_loss_scale
    # the fields the replicas' variables hold (nonfinite_streak counts only under max_consecutive_skips)
    return [{k: v for k, v in s.to_dict().items() if k != "nonfinite_streak"}
            for s in trajectory(cfg, [step == OVERFLOW_STEP for step in range(STEPS)])]


def _check(run: dict) -> None:
    import numpy as np

    expected = _expected_states()
    assert [s["skipped"] for s in expected] == [0, 0, 1, 1, 1, 1]
    assert len(run["per_step"]) == STEPS
    for step, got in enumerate(run["per_step"]):
        assert got["states"] == [expected[step], expected[step]], step  # both replicas, every step
        assert got["weights_equal"], step
    reference = {k: v for k, v in run["reference"]["state"].items() if k != "nonfinite_streak"}
    assert reference == expected[-1]  # one device skipped the same step
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


@pytest.fixture(scope="module")
def tf_mirrored():
    if _backend() != "tensorflow":
        pytest.skip("runs once, under KERAS_BACKEND=tensorflow")
    require("tensorflow")
    return _run("tf_mirrored", {"KERAS_BACKEND": "tensorflow"})


@pytest.fixture(scope="module")
def jax_data_parallel(tmp_path_factory):
    if _backend() != "jax":
        pytest.skip("runs once, under KERAS_BACKEND=jax")
    require("jax")
    dump = str(tmp_path_factory.mktemp("xla_dump"))
    return _run("jax_data_parallel", {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
                                      "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_dump_hlo_as_text "
                                                   f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"},
                dump)


@pytest.mark.slow
def test_mirrored_strategy_two_replicas_skip_together(tf_mirrored):
    """TensorFlow: tf.distribute.MirroredStrategy over 2 logical CPU devices, model.fit; row 6 of
    step 2's global batch (the second replica's half) overflows."""
    run = tf_mirrored
    _check(run)
    # the control: Keras's own apply takes the first replica's flag and steps with the inf sum
    assert not run["control_finite"] and run["control_skipped"] == 0


@pytest.mark.slow
def test_keras_data_parallel_on_jax_two_devices_skip_together(jax_data_parallel):
    """JAX: keras.distribution.DataParallel over 2 host devices, model.fit (one global program:
    the finite check sees both replicas' gradients)."""
    _check(jax_data_parallel)


GRADIENT_SHAPES = [[2], [2, 8], [3, 8], [8]]  # the two Dense layers' kernels and biases, dims sorted
GRADIENT_ELEMENTS = 3 * 8 + 8 + 8 * 2 + 2


def _bfloat16_trained(run: dict) -> None:
    assert run["bfloat16"]["dtypes"] == ["bfloat16"] and run["bfloat16"]["moved"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mirrored_strategy_sends_gradients_in_the_variables_dtype(tf_mirrored, dtype):
    """What Keras's optimizer hands tf.distribute (ReplicaContext.all_reduce) and the collective op
    that builds: the gradients in the variables' dtype; the overflow flag agreement: one int32."""
    sent = tf_mirrored["sent"][dtype]
    grads = [v for v in sent["values"] if v != [["int32", []]]]  # the rest: ampbridge's flag agreement
    assert len(grads) == 2 and len(sent["values"]) == 4  # each replica's call, traced once
    for values in grads:  # float32: reduce_dtype = param_dtype = float32, the accepted case
        assert sorted(sorted(shape) for _, shape in values) == GRADIENT_SHAPES
        assert {t for t, _ in values} == {dtype}
    # MirroredStrategy on CPUs: CollectiveAllReduce packs the 4 gradients into one collective of 50
    # elements per device, in their dtype; the int32 flag counts go to one device (AddN)
    assert sent["ops"] == [["AddN", "int32", 1, "CPU:0"], ["CollectiveReduceV2", dtype, GRADIENT_ELEMENTS, "CPU:0"],
                           ["CollectiveReduceV2", dtype, GRADIENT_ELEMENTS, "CPU:1"]], sent["ops"]
    if dtype == "bfloat16":
        _bfloat16_trained(tf_mirrored)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,compiled", [("float32", "f32"), ("bfloat16", "f32")])
def test_keras_data_parallel_on_jax_sends_gradients_in_the_variables_dtype(jax_data_parallel, dtype, compiled):
    """The train step's all-reduces in the HLO XLA compiled for fit: after SPMD partitioning the
    gradients are reduced in the variables' dtype (and the loss, f32); XLA's CPU compiler then
    widens bf16 all-reduces to f32 (its AllReducePromotion pass), so on CPU f32 is what is sent."""
    hlo = jax_data_parallel["hlo"][dtype]
    wire = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    for stage, element in (("partitioned", wire), ("compiled", compiled)):
        grads = [[t, sorted(int(d) for d in shape.split(","))] for t, shape in hlo[stage] if shape]
        assert sorted(shape for _, shape in grads) == GRADIENT_SHAPES, (stage, hlo[stage])
        assert {t for t, _ in grads} == {element}, (stage, hlo[stage])
        assert [t for t, shape in hlo[stage] if not shape] == ["f32"], (stage, hlo[stage])  # the loss
    if dtype == "bfloat16":
        _bfloat16_trained(jax_data_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tf_mirrored", "jax_data_parallel"])
def test_the_monitor_refuses_two_replicas_by_name(engine, request):
    """The numerics monitor reads one replica's statistics and flags: refused, before any log is
    written. Under MirroredStrategy, MonitorCallback starts outside the strategy's scope (fit's
    callbacks run there): it used to run and log 0 skipped steps of 5 for a run that skipped one."""
    run = request.getfixturevalue(engine)  # each skips outside its own KERAS_BACKEND
    refusals = dict(run["monitor"])
    assert refusals.pop("log_written") is False
    assert set(refusals) == ({"callback", "outside", "inside"} if engine == "tf_mirrored" else {"callback", "outside"})
    for text in refusals.values():
        assert text.startswith("Monitor: a distributed (multi-replica) run is not supported (2 replicas"), text
