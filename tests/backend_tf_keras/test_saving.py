"""Saving after ``apply`` and loading with ampbridge: ``ampbridge.tf_keras.load_model`` restores the policy
and the optimizer (inner slots, iterations, loss-scale state), so training resumed from a ``.keras`` file
or a SavedModel equals the uninterrupted run bit for bit (losses, every weight, the loss scale); the
same files still load in a process that never imports ampbridge."""

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
STEPS, SAVED_AFTER, OVERFLOWS = 6, 3, (1, 4)  # an overflow before the save and one after
POLICIES = {  # Keras 2's own dynamic algorithm, and the reference state (hysteresis, no floor)
    "keras2": ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",), loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=16.0, growth_interval=2, min_scale=1.0)),
    "reference": ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",), loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=16.0, growth_interval=2, hysteresis=2)),
}


def model_and_optimizer(policy):
    tf_keras.utils.set_random_seed(0)
    x = L.Input((6,), name="x")
    h = L.Dense(16, activation="relu", name="dense")(x)
    h = L.LayerNormalization(name="norm")(h)
    model = atk.apply(tf_keras.Model(x, L.Dense(3, name="head")(h), name="toy"), policy)
    model.compile(atk.optimizer(tf_keras.optimizers.Adam(1e-2), policy), "mse")  # Adam: its slots must resume
    return model


def batches():
    rng = np.random.default_rng(1)
    out = []
    for step in range(STEPS):
        weight = np.ones(4, "float32")
        weight[0] = np.inf if step in OVERFLOWS else 1.0
        out.append((rng.normal(size=(4, 6)).astype("float32"), rng.normal(size=(4, 3)).astype("float32"), weight))
    return out


def train(model, data):
    trail = []
    for x, y, w in data:
        loss = model.fit(x, y, sample_weight=w, batch_size=4, epochs=1, verbose=0, shuffle=False).history["loss"][0]
        trail.append((loss, model.get_weights(), atk.state_of(model.optimizer)))
    return trail


def assert_same(got, want):
    for step, ((l1, w1, s1), (l2, w2, s2)) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(l1, l2, equal_nan=True), (step, l1, l2)
        assert s1 == s2, (step, s1, s2)
        for a, b in zip(w1, w2, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), step


@pytest.mark.parametrize("case", list(POLICIES))
def test_resumed_training_equals_the_uninterrupted_run(case, tmp_path):
    policy, data = POLICIES[case], batches()
    whole = train(model_and_optimizer(policy), data)
    assert [s["scale"] for _, _, s in whole] != [16.0] * STEPS  # the scale moved: overflows and growth
    first = model_and_optimizer(policy)
    assert_same(train(first, data[:SAVED_AFTER]), whole[:SAVED_AFTER])
    for name in ("run.keras", "savedmodel"):
        first.save(str(tmp_path / name))
        assert atk.stored_policy(tmp_path / name) == first._ampbridge_policy
        resumed = atk.load_model(tmp_path / name)  # no policy argument: it is in the file
        assert resumed._ampbridge_policy == first._ampbridge_policy
        assert type(resumed.optimizer._loss_scale) is type(first.optimizer._loss_scale)
        assert {l.name: l.dtype_policy.name for l in resumed.layers} == {l.name: l.dtype_policy.name
                                                                        for l in first.layers}
        assert_same(train(resumed, data[SAVED_AFTER:]), whole[SAVED_AFTER:])
        assert int(resumed.optimizer.iterations.numpy()) == STEPS  # Keras 2 counts skipped steps too


def test_compiled_files_load_without_ampbridge_and_h5_says_what_it_lost(tmp_path):
    """The policy record in a SavedModel's checkpoint and the .keras asset are ignored by plain Keras 2;
    an .h5 file keeps no optimizer state in Keras 2, and load_model says so."""
    policy = POLICIES["reference"]
    model = model_and_optimizer(policy)
    train(model, batches()[:2])
    x = batches()[0][0]
    np.save(tmp_path / "x.npy", x)
    paths = [str(tmp_path / "savedmodel"), str(tmp_path / "run.keras"), str(tmp_path / "run.h5")]
    for path in paths:
        model.save(path)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tf_keras
        x = np.load({str(tmp_path / 'x.npy')!r})
        for i, path in enumerate({paths!r}):
            model = tf_keras.models.load_model(path)
            np.save(f"{tmp_path}/out{{i}}.npy", model.predict(x, verbose=0))
            print(type(model.optimizer).__name__, model.get_layer("norm").dtype_policy.name)
        assert "ampbridge" not in sys.modules
    """)
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-6:] == ["LossScaleOptimizerV3", "float32"] * 3
    want = model.predict(x, verbose=0)
    for i in range(len(paths)):
        assert np.array_equal(np.load(tmp_path / f"out{i}.npy"), want), paths[i]

    assert atk.stored_policy(tmp_path / "run.h5") is None
    with pytest.warns(ampbridge.errors.AmpBridgeWarning, match="keeps no optimizer state"):
        loaded = atk.load_model(tmp_path / "run.h5", policy)
    assert loaded._ampbridge_policy == policy and atk.state_of(loaded.optimizer)["scale"] == 16.0
