"""Must show (issue 40): a tf_keras model applied by ampbridge trains bit-identical to the native
Keras 2 mixed-precision version written by hand (``mixed_float16``, the same layers built float32,
Keras 2's ``LossScaleOptimizer``), with an overflow injected on one step; and a model saved after
``apply`` loads and predicts in a process that never imports ampbridge.

The native model is what a Keras 2 user writes: the model's config edited (``"dtype"`` of each
pinned layer ``"float32"``, the rest ``"mixed_float16"``), rebuilt with ``from_config`` and given the
float32 model's weights. Each step is one ``fit`` call on one batch, so the loss per step, the
weights and the loss scale after each step are compared exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ampbridge._testing import require

tf_keras = require("tf_keras")

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402
from ampbridge import LossScaleConfig  # noqa: E402

L = tf_keras.layers
SCALE = LossScaleConfig(mode="dynamic", initial_scale=16.0, growth_interval=2, min_scale=1.0)
STEPS, OVERFLOW = 4, 1  # step 1's loss is inf: skipped, scale halves; growth after 2 finite steps
# batch 8, scale 16: at batch 2 MobileNetV2's BatchNormalization on its 1x1 last feature map sees
# near-zero variances, and float16 gradients overflow on every step at any scale (natively too)
BATCH = 8


def functional() -> tf_keras.Model:
    tf_keras.utils.set_random_seed(0)
    x = L.Input((6,), name="x")
    h = L.Dense(16, activation="relu", name="dense")(x)
    h = L.LayerNormalization(name="norm")(h)
    h = L.Dense(8, activation="relu", name="ffn")(h)
    return tf_keras.Model(x, L.Dense(3, name="head")(h), name="toy")


def mobilenet() -> tf_keras.Model:
    tf_keras.utils.set_random_seed(0)
    return tf_keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3)


def native(model: tf_keras.Model, pinned: set[str]) -> tf_keras.Model:
    """The hand-written Keras 2 version: per-layer dtypes in the config, the float32 weights."""
    config = model.get_config()
    for layer in config["layers"]:
        if layer["class_name"] != "InputLayer":
            layer["config"]["dtype"] = "float32" if layer["config"]["name"] in pinned else "mixed_float16"
    twin = tf_keras.Model.from_config(config)
    twin.set_weights(model.get_weights())
    return twin


def batches(model: tf_keras.Model) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    shape = (BATCH, *model.input_shape[1:])
    classes = model.output_shape[-1]
    out = []
    for step in range(STEPS):
        x = rng.normal(size=shape).astype("float32")
        y = np.eye(classes, dtype="float32")[rng.integers(0, classes, BATCH)]
        weight = np.ones(BATCH, "float32")
        weight[0] = np.inf if step == OVERFLOW else 1.0
        out.append((x, y, weight))
    return out


def train(model: tf_keras.Model, opt, loss: str, eager: bool) -> list[tuple[float, list[np.ndarray], float, list[np.ndarray]]]:
    model.compile(opt, loss, run_eagerly=eager)
    trail = []
    for x, y, w in batches(model):
        hist = model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        # every weight (BatchNormalization's moving statistics too), then the trainable ones
        trail.append((hist.history["loss"][0], model.get_weights(), float(opt.loss_scale.numpy()),
                      [v.numpy() for v in model.trainable_weights]))
    return trail


# the functional model trains through fit's compiled step; MobileNetV2 through fit's eager step (its
# graph takes ~25 s to trace twice on a busy 2-core machine, which eager saves)
CASES = {
    "functional": (functional, {"norm", "head"}, ("kind:norm", "head"), "mse", False),
    "mobilenet_v2": (mobilenet, None, ("kind:norm", "predictions"), "categorical_crossentropy", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fit_bit_identical_to_native_mixed_float16(case):
    build, pinned, keep, loss, eager = CASES[case]
    model = build()
    if pinned is None:  # every BatchNormalization, and the head
        pinned = {layer.name for layer in model.layers if isinstance(layer, L.BatchNormalization)} | {"predictions"}
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=keep, loss_scale=SCALE)
    hand = native(model, pinned)
    ours = atk.apply(model, policy)

    # the realised dtypes are the hand-written ones, layer by layer
    assert {l.name: l.dtype_policy.name for l in ours.layers} == {l.name: l.dtype_policy.name for l in hand.layers}
    assert {l.name for l in ours.layers if l.dtype_policy.name == "float32" and l.weights} >= pinned
    assert any(l.compute_dtype == "float16" for l in ours.layers)
    opt = atk.optimizer(tf_keras.optimizers.SGD(0.05), policy)
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)

    native_opt = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.05), initial_scale=16.0, dynamic_growth_steps=2)
    start = [v.numpy() for v in ours.trainable_weights]
    got, want = train(ours, opt, loss, eager), train(hand, native_opt, loss, eager)
    for step, ((l1, w1, s1, i1), (l2, w2, s2, i2)) in enumerate(zip(got, want)):
        assert np.array_equal(l1, l2, equal_nan=True), (step, l1, l2)
        assert s1 == s2, (step, s1, s2)
        for a, b in zip(w1, w2, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), step
    # only the injected step was skipped (trainable weights unmoved), and the scale is the core reference's
    before = [start] + [t for _, _, _, t in got[:-1]]
    skipped = [all(np.array_equal(a, b) for a, b in zip(w0, w1)) for w0, (_, _, _, w1) in zip(before, got)]
    assert skipped == [step == OVERFLOW for step in range(STEPS)] and not np.isfinite(got[OVERFLOW][0])
    assert [s for _, _, s, _ in got] == [st.scale for st in ampbridge.trajectory(SCALE, skipped)]
    assert [s for _, _, s, _ in got] == [16.0, 8.0, 8.0, 16.0]


def test_saved_after_apply_loads_and_predicts_without_ampbridge(tmp_path):
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    model = atk.apply(functional(), policy)  # head float16: the output cast layer is saved too
    x = np.random.default_rng(2).normal(size=(2, 6)).astype("float32")
    want = model.predict(x, verbose=0)
    paths = [str(tmp_path / "savedmodel"), str(tmp_path / "model.h5"), str(tmp_path / "model.keras")]
    for path in paths:
        model.save(path)
    np.save(tmp_path / "x.npy", x)
    # a subclassed model applied before build (the demo's): its output cast is traced into the SavedModel
    from ampbridge.cli.demo import tf_keras_model

    demo = tf_keras_model.build(policy=ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",)))
    tokens = np.arange(16, dtype="int32").reshape(2, 8) % 32
    demo_want = demo(tokens).numpy()
    demo.save(str(tmp_path / "demo"))
    np.save(tmp_path / "tokens.npy", tokens)
    # one process without ampbridge loads every format (a process costs TensorFlow's import)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tf_keras
        x = np.load({str(tmp_path / 'x.npy')!r})
        for i, path in enumerate({paths!r}):
            model = tf_keras.models.load_model(path)
            np.save(f"{tmp_path}/out{{i}}.npy", model.predict(x, verbose=0))
            print(model.get_layer("dense").dtype_policy.name, model.get_layer("norm").dtype_policy.name,
                  model.get_layer("{atk.OUTPUT_CAST}").dtype_policy.name)
        demo = tf_keras.models.load_model({str(tmp_path / 'demo')!r})
        np.save(f"{tmp_path}/demo_out.npy", demo(np.load({str(tmp_path / 'tokens.npy')!r})).numpy())
        assert "ampbridge" not in sys.modules
    """)
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-9:] == ["mixed_float16", "float32", "float32"] * 3
    demo_out = np.load(tmp_path / "demo_out.npy")
    assert demo_out.dtype == np.float32 and np.array_equal(demo_out, demo_want)
    for i in range(len(paths)):
        out = np.load(tmp_path / f"out{i}.npy")
        assert out.dtype == np.float32 and np.array_equal(out, want), paths[i]
