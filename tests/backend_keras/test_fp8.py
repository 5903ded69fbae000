"""FP8 on Keras (each backend): ``[fp8] scaling = "delayed"`` against Keras's own
``model.quantize("float8")`` under ``mixed_bfloat16``, the scale against ``keras.quantizers``,
and what Keras refuses by name."""

import math
import os

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ampbridge
from ampbridge import Fp8Config, Policy
from ampbridge._testing import require
from ampbridge.core.fp8 import delayed_initial, delayed_step, delayed_trajectory

keras = require("keras")
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
# the native model.quantize("float8") says so for each layer without float8 (InputLayer, LayerNormalization)
pytestmark = pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method:UserWarning")
EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 40
DELAYED = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=1024))


def net(dtype=None):
    kw = {"dtype": dtype} if dtype else {}
    return keras.Sequential([keras.Input((32,)), L.Dense(48, name="fc1", **kw), L.LayerNormalization(name="norm", **kw),
                             L.Dense(32, activation="relu", name="fc2", **kw), L.Dense(16, name="head", **kw)])


def data(n=8):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(16, 32)).astype("float32") * 3, rng.normal(size=(16, 16)).astype("float32"))
            for _ in range(n)]


def loss(y, p):
    return keras.ops.mean(keras.ops.square(keras.ops.cast(p, "float32") - y))


def train(model, batches):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    return [float(model.train_on_batch(x, y)) for x, y in batches]


def pair(match, filters):
    keras.utils.set_random_seed(0)
    mine, native = net(), net("mixed_bfloat16")
    native.set_weights(mine.get_weights())
    if filters is None or "filters" in inspect.signature(native.quantize).parameters:
        native.quantize("float8", filters=filters) if filters is not None else native.quantize("float8")
    else:  # Keras before `filters` (3.12): what a user writes there, the layer's own quantize
        from ampbridge.backends.keras.fp8 import quantize_layers

        quantize_layers(native, [native.get_layer(filters)])
    ak.apply(mine, DELAYED.replace(fp8=DELAYED.fp8.replace(match=match)))
    return mine, native


@pytest.mark.parametrize("match,filters,fp8_layers", [
    (("kind:linear",), None, {"fc1", "fc2", "head"}), (("fc2",), "fc2", {"fc2"})])
def test_delayed_scaling_trains_bit_identical_to_keras_quantize_float8(match, filters, fp8_layers):
    mine, native = pair(match, filters)
    assert {layer.name for layer in mine.layers if layer.dtype_policy.quantization_mode == "float8"} == fp8_layers
    batches = data(8)
    assert train(mine, batches) == train(native, batches)
    assert [w.path.split("/", 1)[1] for w in mine.weights] == [w.path.split("/", 1)[1] for w in native.weights]
    for a, b in zip(mine.weights, native.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), err_msg=a.path)
    plan = ak.plan(mine, DELAYED.replace(fp8=DELAYED.fp8.replace(match=match)))
    assert {r.path for r in plan if r.fp8} == fp8_layers and plan["fc2"].fp8_by == "Keras float8 quantize (emulated)"


def test_the_scales_follow_the_reference_trajectory():
    mine, _ = pair(("kind:linear",), None)
    batches = data(6)
    train(mine, batches)
    fc1 = mine.get_layer("fc1")
    history = [float(v) for v in keras.ops.convert_to_numpy(fc1.inputs_amax_history)]
    n = len(batches)
    # roll(-1) then [0] = amax: after n steps the history reads [a_n, 0, ..., 0, a_1, ..., a_(n-1)]
    amaxes = history[len(history) - (n - 1):] + history[:1]
    assert all(a > 0 for a in amaxes) and history[1:len(history) - (n - 1)] == [0.0] * (len(history) - n)
    expected = delayed_trajectory(amaxes, "e4m3", len(history))[-1]
    assert float(keras.ops.convert_to_numpy(fc1.inputs_scale)) == expected.divisor
    assert tuple(history) == expected.history


def test_amax_history_is_carried_saved_and_resumed(tmp_path):
    keras.utils.set_random_seed(0)
    model = net()
    ak.apply(model, DELAYED.replace(fp8=DELAYED.fp8.replace(amax_history=16)))
    assert model.get_layer("fc1").inputs_amax_history.shape == (16,)
    train(model, data(3))
    path = tmp_path / "m.keras"
    model.save(path)
    again = keras.saving.load_model(path, custom_objects={"loss": loss})
    def by_name(m):
        return {f"{layer.name}/{w.name}": keras.ops.convert_to_numpy(w) for layer in m.layers for w in layer.weights}

    saved, loaded = by_name(model), by_name(again)
    assert saved.keys() == loaded.keys() and "fc1/inputs_amax_history" in saved
    for name, value in saved.items():  # scales and histories resume exactly
        np.testing.assert_array_equal(value, loaded[name], err_msg=name)
    assert again.get_layer("fc1").inputs_amax_history.shape == (16,)
    more = data(6)[3:]  # resuming trains on exactly as the model that was never saved
    assert train(again, more) == train(model, more)


@pytest.mark.parametrize("fp8,says", [
    (Fp8Config(("kind:linear",), amax_compute="most_recent"), "fp8.amax_compute = 'most_recent'"),
    (Fp8Config(("kind:linear",), margin=2), "fp8.margin = 2 is not realised on Keras"),
    (Fp8Config(("kind:linear",), forward="e5m2"), "fp8.forward = 'e5m2'"),
    (Fp8Config(("norm",)), "'norm' (LayerNormalization) in float8, but Keras trains Dense"),
])
def test_what_keras_float8_cannot_carry_is_refused_by_name(fp8, says):
    model = net()
    with pytest.raises(ampbridge.UnsupportedOptionError) as info:
        ak.apply(model, Policy(compute_dtype="bfloat16", fp8=fp8))
    assert says in str(info.value)
    assert not any(layer.dtype_policy.quantization_mode for layer in model.layers)


floats = st.floats(0.0, 3.4028234663852886e38, width=32) | st.sampled_from([0.0, math.inf, math.nan])


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(floats, min_size=1, max_size=4), floats, st.sampled_from(["e4m3", "e5m2"]),
       st.floats(2.0 ** -20, 2.0 ** 20, width=32))
def test_the_reference_step_is_keras_quantizers(history, amax, fmt, divisor):
    state = delayed_initial(len(history), divisor)
    state = type(state)(state.divisor, tuple(np.float32(history).tolist()))
    top = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    h = keras.ops.convert_to_tensor(np.float32(history))
    new_scale = keras.quantizers.compute_float8_scale(keras.ops.max(h, axis=0), keras.ops.convert_to_tensor(
        np.float32(divisor)), keras.ops.cast(top, "float32"))
    new_history = keras.quantizers.compute_float8_amax_history(keras.ops.convert_to_tensor(np.float32([amax])), h)
    # XLA and TF compute with subnormals as zero; torch does not
    got = delayed_step(state, amax, fmt, flush_denormals=keras.backend.backend() != "torch")
    np.testing.assert_array_equal(np.float32(got.divisor), keras.ops.convert_to_numpy(new_scale))
    np.testing.assert_array_equal(np.float32(got.history), keras.ops.convert_to_numpy(new_history))


def test_the_float8_row_says_emulated_only_where_the_device_has_no_float8_units(monkeypatch):
    from ampbridge.backends.keras import environment
    from ampbridge.diagnostics.hardware import Device

    policy = DELAYED.replace(fp8=DELAYED.fp8.replace(match=("fc2",)))
    assert ak.plan(pair(("fc2",), "fc2")[0], policy)["fc2"].fp8_by == "Keras float8 quantize (emulated)"  # this CPU
    monkeypatch.setattr(environment, "device", lambda: Device("cuda", capability=(9, 0)))
    assert ak.plan(pair(("fc2",), "fc2")[0], policy)["fc2"].fp8_by == "Keras float8 quantize"
