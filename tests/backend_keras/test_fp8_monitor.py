"""The Keras monitor's float8 records (each Keras backend): a spike after a quiet amax history
saturates a layer quantized by ``model.quantize("float8")`` through ``[fp8]``; the logged amax and
scale are the layer's own variables (the divisor stored before the step, the history's newest
entry after it); ``ampbridge report`` names the layer."""

import numpy as np
import pytest

import ampbridge
from ampbridge import Fp8Config, Policy
from ampbridge._testing import require
from ampbridge.diagnostics.report import format_summary, summarize
from ampbridge.diagnostics.runlog import read_log

keras = require("keras")
import ampbridge.keras as ak  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method:UserWarning")
POLICY = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=4))
SPIKE = 4  # the step whose inputs are 1000 times the others'
TENSORS = (("input", "inputs"), ("weight", "kernel"), ("grad_output", "outputs_grad"))


def batches(n=6):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(4, 4)).astype("float32") * (1000.0 if i == SPIKE else 1.0)
        out.append((x, rng.normal(size=(4, 2)).astype("float32")))
    return out


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc1"), keras.layers.Dense(2, name="head")])
    m = ak.apply(m, POLICY)
    m.compile(ak.optimizer(keras.optimizers.SGD(1e-4), POLICY), "mse")
    return m


def native_trajectory():
    """Per step, per float8 layer and tensor: (the layer's divisor before the step, its history's
    newest entry after it), read from the variables around each train_on_batch."""
    m, out = model(), []
    for x, y in batches():
        before = {p: [float(m.get_layer(p).__dict__[f"{v}_scale"].numpy()) for _, v in TENSORS] for p in ("fc1", "head")}
        m.train_on_batch(x, y)
        after = {p: [float(m.get_layer(p).__dict__[f"{v}_amax_history"].numpy()[0]) for _, v in TENSORS]
                 for p in ("fc1", "head")}
        out.append({p: list(zip(before[p], after[p])) for p in before})
    return out


def clipped(amax, divisor, fp8_max):
    """Whether Keras's own arithmetic (quantize_and_dequantize's x / divisor in the bfloat16 compute
    dtype, then the clip to the format's max) clips a value of size amax."""
    def bf(v):
        return keras.ops.cast(keras.ops.convert_to_tensor(v, "float32"), "bfloat16")

    return bool(keras.ops.convert_to_numpy(keras.ops.divide(bf(amax), bf(divisor)) > bf(fp8_max)))


def check_against(log, every):
    native = native_trajectory()
    logged = {s["step"]: s for s in log.steps}
    assert sorted(logged) == list(range(0, len(native), every))
    for step, record in logged.items():
        assert set(record["fp8"]) == {"fc1", "head"}
        for path in ("fc1", "head"):
            for (name, _), (scale, amax) in zip(TENSORS, native[step][path]):
                t = record["fp8"][path][name]
                assert (t["scale"], t["amax"]) == (scale, amax), (step, path, name)
                assert t["saturated"] == clipped(amax, scale, t["fp8_max"]), (step, path, name)
    fc1 = {s: r["fp8"]["fc1"]["input"]["saturated"] for s, r in logged.items()}
    assert fc1 == {s: s == SPIKE for s in logged}, fc1  # the spike, scaled by the quiet history's divisor
    assert native[SPIKE]["fc1"][0][1] / native[SPIKE]["fc1"][0][0] > 448 * 100
    # step 1 uses the divisor computed from the empty history (kept, 1), step 2 the first moved one:
    # the divisor stored after a step instead of before it shows at step 1
    assert native[1]["fc1"][0][0] == 1.0 != native[2]["fc1"][0][0]


def test_fit_spike_saturates_and_matches_the_layers_variables(tmp_path):
    path = tmp_path / "run.jsonl"
    m, data = model(), batches()
    x, y = np.concatenate([b[0] for b in data]), np.concatenate([b[1] for b in data])
    callback = ak.MonitorCallback(str(path), every=2)
    m.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[callback])
    callback.close()
    check_against(read_log(path), every=2)


@pytest.mark.parametrize("every", [1, 2])  # 2: the divisors travel with the unsampled step's read
def test_custom_loop_and_report(tmp_path, every):
    path = tmp_path / "run.jsonl"
    m = model()
    with ak.Monitor(str(path), m, every=every) as monitor:
        for x, y in batches():
            m.train_on_batch(x, y)
            monitor.record()
    log = read_log(path)
    check_against(log, every=every)
    text = format_summary(summarize(log))
    assert f"float8 saturation, by steps: fc1 (" in text
    assert "fc1 saturated float8 on" in text and "input (1 step(s), up to" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("fc1") and " input " in line)
    assert f" 1 ({SPIKE}) " in row and "/ " in row  # one saturated step, the spike; the scale divides


class NoTraining(keras.Model):
    """A subclassed model that neither declares nor passes ``training``: Keras's float8 Dense then never
    updates its input and kernel scales (scale 1 under TensorFlow and torch, 0 under JAX)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.head = keras.layers.Dense(8, name="fc1"), keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.fc1(x))


def test_a_float8_layer_called_without_training_is_named_in_the_report(tmp_path):
    keras.utils.set_random_seed(0)
    m = NoTraining()
    m(np.zeros((4, 4), "float32"))
    m = ak.apply(m, POLICY)
    m.compile(ak.optimizer(keras.optimizers.SGD(1e-4), POLICY), "mse")
    path = tmp_path / "run.jsonl"
    with ak.Monitor(str(path), m) as monitor:
        for x, y in batches(4):
            m.train_on_batch(x / 1000 if abs(x).max() > 100 else x, y)
            monitor.record()
    assert float(m.fc1.inputs_amax_history.numpy().max()) == 0.0  # Keras recorded nothing: the case itself
    text = format_summary(summarize(read_log(path)))
    assert "fc1: its float8 input and weight recorded no amax on any of 4 recorded steps" in text
    assert "pass training=training down to it" in text
