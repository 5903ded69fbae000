"""keras-hub BERT, GPT-2 and Llama (tiny, random init) and keras.applications MobileNetV2 trained
6 ``fit`` steps with ``keep_float32 = ["kind:norm", "kind:embedding"]`` (MobileNetV2 has no
embedding: norms only): no crash, finite weights, and every layer really runs its Plan row. And
each with a policy equal to native ``mixed_float16``: bit-identical to the same model built under
Keras's own mixed precision (Llama's float32 attention softmax is the model's own pin, kept)."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
keras_hub = pytest.importorskip("keras_hub")  # installed --no-deps by the Makefile (constraints.txt pins it)

import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

pytestmark = pytest.mark.slow
L = keras.layers
NATIVE = ampbridge.preset("mixed_float16").replace(  # Keras's LossScaleOptimizer defaults
    loss_scale=ampbridge.LossScaleConfig(initial_scale=2.0**15, growth_interval=2000))
PINNED = NATIVE.replace(keep_float32=("kind:norm", "kind:embedding"))
STEPS = 6


def _model(name):
    """The model with a one-number head (a regression target keeps the loss simple)."""
    hub = keras_hub.models
    small = dict(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32)
    if name == "mobilenetv2":
        return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=1,
                                              classifier_activation=None)
    if name == "bert":
        backbone = hub.BertBackbone(**small, num_heads=2, max_sequence_length=16)
    elif name == "gpt2":
        backbone = hub.GPT2Backbone(**small, num_heads=2, max_sequence_length=16)
    else:
        backbone = hub.LlamaBackbone(**small, num_query_heads=2, num_key_value_heads=1)
    inputs = {k: keras.Input((8,), dtype="int32", name=k) for k in backbone.input}
    x = backbone(inputs)
    x = x["sequence_output"] if isinstance(x, dict) else x
    return keras.Model(inputs, L.Dense(1, name="head")(L.GlobalAveragePooling1D(name="pool")(x)))


def _data(name):
    rng = np.random.default_rng(0)
    y = rng.normal(size=(2 * STEPS, 1)).astype("float32")
    if name == "mobilenetv2":
        return rng.random((2 * STEPS, 32, 32, 3)).astype("float32"), y
    x = {"token_ids": rng.integers(0, 64, (2 * STEPS, 8)).astype("int32"),
         "padding_mask": np.ones((2 * STEPS, 8), "int32")}
    if name == "bert":
        x["segment_ids"] = np.zeros((2 * STEPS, 8), "int32")
    return x, y


def _fit(model, optimizer, name):
    model.compile(optimizer, "mse")
    x, y = _data(name)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    return model


class _Losses(keras.callbacks.Callback):
    """The loss ``fit`` reports after each step (a running mean: equal lists mean equal step losses)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _fit_recording(model, optimizer, name):
    losses = _Losses()
    model.compile(optimizer, "mse")
    x, y = _data(name)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[losses])
    return losses.losses


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", pytest.param("mobilenetv2", marks=pytest.mark.heavy)])
def test_six_steps_bit_identical_to_native_mixed_float16(kx, name):
    """A policy equal to ``mixed_float16`` trains exactly as Keras's own mixed precision: the same
    step losses, weights, loss scale and iterations. Llama's attention softmax is float32 by its
    author: the Plan keeps it (it differed in all 21 weight arrays when it was overridden). Where
    native Keras itself cannot train the model (XLA:CPU compiles no float16 dot_general with a
    float32 result for the keras-hub transformers), the test skips with native Keras's error."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        kx.seed(0)
        native = _model(name)
    finally:
        keras.config.set_dtype_policy(previous)
    try:
        native_losses = _fit_recording(native, keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), name)
    except Exception as error:  # noqa: BLE001 - the native model's own failure decides the skip
        pytest.skip(f"native Keras mixed_float16 cannot train {name} on {keras.backend.backend()} here: "
                    f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}")

    kx.seed(0)
    ours = ak.apply(_model(name), NATIVE)
    assert {p: l.dtype_policy.name for p, l in ak.walk(ours) if p} == {
        p: l.dtype_policy.name for p, l in ak.walk(native) if p}  # the Plan is Keras's mixed_float16
    our_losses = _fit_recording(ours, ak.optimizer(keras.optimizers.Adam(1e-3), NATIVE), name)
    assert len(our_losses) == STEPS and our_losses == native_losses
    kx.assert_bitwise(native.weights, ours.weights, f"{name} weights after {STEPS} steps")
    assert ours.optimizer.state.scale == float(kx.numpy(native.optimizer.dynamic_scale))
    # iterations: the applied steps (Keras's first steps at scale 2**15 overflow and are skipped)
    assert int(kx.numpy(ours.optimizer.iterations)) == int(kx.numpy(native.optimizer.iterations))
    assert ours.optimizer.state.steps == STEPS
    if name == "llama":
        assert ak.plan(ours, NATIVE)["llama_backbone.transformer_layer_0.self_attention.softmax"].rule == (
            "set by the model")


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", pytest.param("mobilenetv2", marks=pytest.mark.heavy)])
def test_six_steps_with_norms_and_embeddings_pinned_run_their_plan(kx, name):
    if name == "llama" and keras.backend.backend() == "jax" and "cpu" in str(keras.ops.ones(()).device).lower():
        pytest.skip("XLA:CPU cannot compile Llama's float16 dot_general (F16_F16_F32), native Keras included")
    policy = PINNED.replace(keep_float32=("kind:norm",)) if name == "mobilenetv2" else PINNED  # no embedding
    # no override on TensorFlow: keras-hub's layers add pinned float32 outputs to their float16 stream
    # with a raw `+`, which ampbridge promotes there as JAX and torch do (tests/backend_keras/test_streams.py)
    kx.seed(0)
    pinned = ak.apply(_model(name), policy)
    plan = ak.plan(pinned, policy)
    assert any(row.rule.startswith(("keep_float32", "override")) and row.compute_dtype == "float32" for row in plan)
    _fit(pinned, ak.optimizer(keras.optimizers.Adam(1e-3), policy), name)
    assert pinned.optimizer.state.steps == STEPS and all(np.isfinite(kx.numpy(w)).all() for w in pinned.weights)
    records = kx.probe(pinned)  # what each layer really runs, on the trained model
    x, _ = _data(name)
    pinned(keras.tree.map_structure(lambda a: a[:2], x))
    kx.assert_runs_plan(pinned, plan, records)
