"""``.keras`` files saved after ``ampbridge.keras.apply``: they load in plain Keras (a fresh
process where ampbridge cannot be imported) as working models, and ``ampbridge.keras.load_model``
restores the policy, the pins and the full loss-scale state from the file alone."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
POLICY = ampbridge.preset("mixed_float16").replace(
    keep_float32=("kind:norm",), loss_scale=ampbridge.LossScaleConfig(initial_scale=256.0, growth_interval=3))
# a setting Keras's own LossScaleOptimizer cannot run: the optimizer is saved under ampbridge's name
HYSTERESIS = POLICY.replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=256.0, hysteresis=2))

PLAIN_KERAS = textwrap.dedent("""
    import importlib.util, json, sys
    def ours(hook):  # the editable install's finder and path hook
        return "ampbridge" in getattr(hook, "__module__", "") + type(hook).__module__ + repr(hook)
    sys.meta_path[:] = [f for f in sys.meta_path if not ours(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not ours(h)]
    sys.path[:] = [p for p in sys.path if "ampbridge" not in p]
    sys.path_importer_cache.clear()
    assert importlib.util.find_spec("ampbridge") is None, "ampbridge is importable"
    import keras, numpy as np
    out = {}
    for name, compile in json.loads(sys.argv[1]):
        model = keras.saving.load_model(name + ".keras", compile=compile)
        opt = model.optimizer if compile else None
        out[name] = {
            "dtypes": {l.name: [l.dtype_policy.name, l.compute_dtype, l.variable_dtype] for l in model.layers},
            "predictions": np.asarray(model.predict(np.load("x.npy"), verbose=0), "float32").tolist(),
            "optimizer": None if opt is None else [type(opt).__module__, float(opt.dynamic_scale.numpy()),
                                                    int(opt.step_counter.numpy()), int(opt.iterations.numpy())],
        }
    print(json.dumps(out))
""")


def _plain_keras(tmp_path, files):
    """Load ``files`` ([name, compile]) in a fresh interpreter with ampbridge hidden (-I drops the
    repository from the path; the editable install's finder is removed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-I", "-c", PLAIN_KERAS, json.dumps(files)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _trained(kx, policy):
    kx.seed(1)
    tokens = keras.Input((6,), name="x")
    h = L.Dense(8, activation="relu", name="ffn")(tokens)
    h = L.LayerNormalization(name="norm")(h)
    logits = L.Dense(3, name="head")(h)
    probs = L.Activation("softmax", dtype="float32", name="probs")(logits)  # the author's float32 head
    model = ak.apply(keras.Model(tokens, probs, name="clf"), policy)
    model.compile(ak.optimizer(keras.optimizers.Adam(1e-2), policy), "mse")
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = np.random.default_rng(1).uniform(size=(8, 3)).astype("float32")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    return model, x, y


def _dtypes(model):
    return {layer.name: [layer.dtype_policy.name, layer.compute_dtype, layer.variable_dtype]
            for layer in model.layers}


def test_saved_file_loads_in_plain_keras_and_back_in_ampbridge(kx, tmp_path):
    native_format, x, y = _trained(kx, POLICY)
    ours_format, _, _ = _trained(kx, HYSTERESIS)
    np.save(tmp_path / "x.npy", x)
    native_format.save(tmp_path / "native.keras")
    ours_format.save(tmp_path / "ours.keras")
    expected = {name: np.asarray(m.predict(x, verbose=0), "float32")
                for name, m in (("native", native_format), ("ours", ours_format))}

    plain = _plain_keras(tmp_path, [["native", True], ["ours", False]])
    for name, model in (("native", native_format), ("ours", ours_format)):
        assert plain[name]["dtypes"] == _dtypes(model)
        assert plain[name]["dtypes"]["norm"][0] == "float32" and plain[name]["dtypes"]["ffn"][0] == "mixed_float16"
        np.testing.assert_array_equal(np.asarray(plain[name]["predictions"], "float32"), expected[name])
    state = native_format.optimizer.state
    # Keras's own class, with Keras's part of the state (scale, good steps, iterations)
    assert plain["native"]["optimizer"] == ["keras.src.optimizers.loss_scale_optimizer", state.scale,
                                            state.good_steps, 4]

    for name, model in (("native", native_format), ("ours", ours_format)):
        restored = ak.load_model(tmp_path / f"{name}.keras")  # no policy argument: it is in the file
        assert restored._ampbridge_policy == model._ampbridge_policy
        assert isinstance(restored.optimizer, ak.LossScaleOptimizer)
        assert restored.optimizer.state == model.optimizer.state
        assert restored.optimizer.loss_scale_config == model.optimizer.loss_scale_config
        assert restored.optimizer.policy == model.optimizer.policy
        assert _dtypes(restored) == _dtypes(model)
        np.testing.assert_array_equal(np.asarray(restored.predict(x, verbose=0), "float32"), expected[name])
        # and it trains on, saving again in the same format
        restored.fit(x, y, batch_size=2, epochs=1, verbose=0)
        assert restored.optimizer.state.steps == 8
        assert ak.stored_policy(tmp_path / f"{name}.keras") == model._ampbridge_policy


def _layer_table(model):
    """[class, Keras path, the policy the layer runs, compute, variable] per layer, in Keras's order
    (a layer's policy may be a DTypePolicyMap shared with its parent: its own entry is what it runs)."""
    out = []
    for layer in model._flatten_layers(include_self=True):
        policy = layer.dtype_policy
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            policy = policy[layer.path] if layer.path else policy.default_policy
        out.append([type(layer).__name__, layer.path, policy.name, layer.compute_dtype, layer.variable_dtype])
    return out


PLAIN_KERAS_TABLE = textwrap.dedent("""
    import json, sys
    exec(sys.argv[2])  # hides ampbridge, as in PLAIN_KERAS
    import keras, keras_hub, numpy as np
    model = keras.saving.load_model(sys.argv[1], compile=False)
    x = dict(np.load("x.npz"))
""") + inspect.getsource(_layer_table) + textwrap.dedent("""
    outputs = keras.tree.map_structure(lambda t: np.asarray(keras.ops.convert_to_numpy(t), "float32").tolist(),
                                       model(x))
    print(json.dumps({"dtypes": _layer_table(model), "outputs": outputs, "class": type(model).__name__}))
""")
HIDE_AMPBRIDGE = PLAIN_KERAS[:PLAIN_KERAS.index("import keras")]


def test_keras_hub_pins_survive_plain_keras(kx, tmp_path):
    """A keras-hub task and its backbone store one ``dtype`` each: ``apply`` makes the backbone's
    config a ``DTypePolicyMap`` (its policy plus one entry per pinned sublayer path), so plain Keras
    in a fresh process without ampbridge rebuilds every pinned layer pinned, with the same
    predictions, and ``ak.load_model`` gives the same model back. On TensorFlow the block's two norms
    return float32 into its float16 ``x + residual``, which ``apply`` makes TensorFlow promote while
    the block runs; plain Keras cannot, so the map leaves those two in the block's dtype (the file
    loads and predicts, close), and saving says so."""
    import warnings

    import pytest

    keras_hub = pytest.importorskip("keras_hub")
    kx.seed(0)
    policy = POLICY.replace(keep_float32=("kind:norm", "kind:embedding"))
    block_norms = ["transformer_layer_0/self_attention_layer_norm", "transformer_layer_0/feedforward_layer_norm"]
    tensorflow = keras.backend.backend() == "tensorflow"
    backbone = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32,
                                             num_heads=2, max_sequence_length=16)
    task = ak.apply(keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None), policy)
    saved = _layer_table(task)
    pinned = {row[1] for row in saved if row[2] == "float32" and row[0] != "InputLayer"}
    assert pinned == {"token_embedding", "position_embedding", "segment_embedding", "embeddings_layer_norm",
                      *block_norms}
    x = {"token_ids": np.arange(16).reshape(2, 8).astype("int32") % 64, "segment_ids": np.zeros((2, 8), "int32"),
         "padding_mask": np.ones((2, 8), "int32")}
    expected = np.asarray(kx.numpy(task(x)), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task.save(tmp_path / "bert.keras")
    said = [str(w.message) for w in caught if "saved config leaves" in str(w.message)]
    np.savez(tmp_path / "x.npz", **x)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-I", "-c", PLAIN_KERAS_TABLE, "bert.keras", HIDE_AMPBRIDGE],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    plain = json.loads(result.stdout.strip().splitlines()[-1])
    assert plain["class"] == "BertTextClassifier"
    if tensorflow:
        assert said and all(p.replace("/", ".") in said[0] for p in block_norms), said
        left = [row[:2] + ["mixed_float16", "float16", "float32"] if row[1] in block_norms else row for row in saved]
        assert plain["dtypes"] == left  # every other layer as saved, the embeddings' pins included
        np.testing.assert_allclose(np.asarray(plain["outputs"], "float32"), expected, atol=1e-2)
    else:
        assert not said, said
        assert plain["dtypes"] == [list(row) for row in saved]  # every layer, pins included
        np.testing.assert_array_equal(np.asarray(plain["outputs"], "float32"), expected)

    restored = ak.load_model(tmp_path / "bert.keras", compile=False)
    assert _layer_table(restored) == saved
    assert list(ak.plan(restored, policy)) == list(ak.plan(task, policy))  # the same rows, same paths
    np.testing.assert_array_equal(np.asarray(kx.numpy(restored(x)), "float32"), expected)


def test_keras_hub_causal_lm_keeps_its_optimizer_through_load_model(kx, tmp_path):
    """keras-hub's tasks override ``compile()``, so ``keras.saving.load_model`` skips their compile
    config and their optimizer's variables (with only Keras's warning); a resumed run would restart
    Adam's moments, the step count and the loss scale. ``ak.load_model`` compiles from the saved
    config and loads them: the next step equals the uninterrupted run's, bit for bit."""
    import pytest

    keras_hub = pytest.importorskip("keras_hub")
    kx.seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    # XLA:CPU cannot compile GPT-2's float16 dot_general (F16_F16_F32), native Keras included: JAX
    # runs the bfloat16 policy (Adam's moments and step count still at stake, no loss scale)
    policy = POLICY if keras.backend.backend() != "jax" else ampbridge.preset("mixed_bfloat16")
    lm = ak.apply(keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None), policy)
    lm.compile(optimizer=ak.optimizer(keras.optimizers.Adam(1e-2), policy),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (4, 8)).astype("int32"), "padding_mask": np.ones((4, 8), "int32")}
    y = rng.integers(0, 64, (4, 8)).astype("int32")
    lm.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    lm.save(tmp_path / "lm.keras")
    loaded = ak.load_model(tmp_path / "lm.keras")
    assert int(loaded.optimizer.iterations) == int(lm.optimizer.iterations) == 2
    assert [kx.numpy(v).tolist() for v in loaded.optimizer.variables] == [kx.numpy(v).tolist()
                                                                          for v in lm.optimizer.variables]
    for model in (lm, loaded):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(lm.weights, loaded.weights):
        np.testing.assert_array_equal(kx.numpy(a), kx.numpy(b), err_msg=a.path)
