"""Plans of Keras models, and apply(): per-layer dtype policies that really run."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
MIXED = ampbridge.preset("mixed_float16")
PINNED = MIXED.replace(keep_float32=("kind:norm", "kind:embedding"))


class Block(L.Layer):
    """A subclassed block with nested layers; declares itself an attention block."""

    ampbridge_kind = "attention"

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.proj = L.Dense(dim, name="proj")
        self.norm = L.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.proj(x))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = L.Embedding(16, 8, name="embed")
        self.block = Block(8, name="block")
        self.head = L.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(self.embed(x)))


def test_paths_kinds_and_roles(kx):
    model = kx.transformer()
    plan = ak.plan(model, PINNED)
    assert [r.path for r in plan] == [
        "", "embed", "ffn", "norm", "attn", "attn.query", "attn.key", "attn.value", "attn.softmax",
        "attn.dropout", "attn.attention_output", "residual", "pool", "head"]
    kinds = {r.path: r.kind for r in plan}
    assert kinds["embed"] == "embedding" and kinds["norm"] == "norm" and kinds["attn"] == "attention"
    assert kinds["attn.query"] == "linear" and kinds["attn.softmax"] == "softmax" and kinds["head"] == "linear"
    assert plan["embed"].param_count == 32 * 16 and plan["attn"].param_count == 0
    assert plan["embed"].rule == "keep_float32[1]" and plan["ffn"].compute_dtype == "float16"
    assert plan["attn.query"].rule == "default" and plan.framework.startswith("keras")


def test_kind_table_covers_keras_classes():
    cases = {
        "norm": [L.BatchNormalization(), L.LayerNormalization(), L.GroupNormalization(groups=1),
                 L.UnitNormalization(), L.RMSNormalization()],
        "embedding": [L.Embedding(4, 2)], "softmax": [L.Softmax()],
        "linear": [L.Dense(2), L.EinsumDense("ab,bc->ac", output_shape=2)],
        "conv": [L.Conv1D(2, 3), L.Conv2D(2, 3), L.Conv3D(2, 3), L.Conv2DTranspose(2, 3),
                 L.DepthwiseConv2D(3), L.SeparableConv2D(2, 3)],
        "attention": [L.MultiHeadAttention(2, 2), L.Attention()],
        "recurrent": [L.LSTM(2), L.GRU(2), L.SimpleRNN(2), L.Bidirectional(L.LSTM(2)), L.LSTMCell(2)],
        None: [L.Dropout(0.1), L.Flatten(), L.Add()],
    }
    for kind, layer_list in cases.items():
        for layer in layer_list:
            assert ak.kind_of(layer) == kind, type(layer).__name__
    dense = L.Dense(2)
    dense.ampbridge_kind = "attention"  # the attribute convention wins over the class
    assert ak.kind_of(dense) == "attention"


def test_subclassed_nested_paths_and_ampbridge_kind():
    model = Net(name="net")
    model(np.zeros((2, 5), "int32"))
    plan = ak.plan(model, MIXED.replace(keep_float32=("kind:attention",)))
    assert [r.path for r in plan] == ["", "embed", "block", "block.proj", "block.norm", "head"]
    assert plan["block"].kind == "attention" and plan["block"].compute_dtype == "float32"
    assert plan["block.proj"].compute_dtype == "float32" and plan["block.proj"].inherited_from == "block"


def test_notes_say_what_keras_runs(kx):
    plan = ak.plan(kx.transformer(), MIXED)
    assert plan["norm"].compute_dtype == "float32" and plan["norm"].output_dtype == "float16"
    assert "float32 internally" in plan["norm"].note
    assert "runs only when" in plan["attn.softmax"].note
    assert plan[""].output_dtype == "float32" and "output_dtype" in plan[""].note
    pinned = ak.plan(kx.transformer(), PINNED)
    assert pinned["norm"].note is None and pinned["norm"].output_dtype == "float32"


def test_registry_dispatch(kx):
    model = kx.transformer()
    assert ampbridge.plan(model, PINNED).rows == ak.plan(model, PINNED).rows
    # under the torch Keras backend a Keras model is also a torch.nn.Module: it stays Keras's
    require("torch", "the torch backend's owns()")
    import ampbridge.torch as abt

    assert not abt.owns(model)
    assert ak.owns(model) and ak.owns(L.Dense(2)) and not ak.owns(np.zeros(2))


def test_shared_layer_listed_once():
    shared = L.Dense(4, name="shared")
    x = keras.Input((4,))
    model = keras.Model(x, shared(shared(x)))
    assert [p for p, _ in ak.walk(model)] == ["", "shared"]


@pytest.mark.parametrize("style", ["sequential", "functional", "subclassed"])
def test_apply_runs_the_plan(kx, style):
    kx.seed(1)
    if style == "sequential":
        model = keras.Sequential([keras.Input((5,)), L.Dense(8, name="a"), L.LayerNormalization(name="norm"),
                                  L.Dense(3, name="head")], name="seq")
        x = np.random.RandomState(0).randn(2, 5).astype("float32")
    elif style == "functional":
        model = kx.transformer()
        x = kx.tokens(2)[0]
    else:
        model = Net(name="net")
        x = np.random.RandomState(0).randint(0, 16, (2, 5)).astype("int32")
    before = [kx.numpy(w) for w in model.weights] if model.built else None
    policy = MIXED.replace(keep_float32=("kind:norm",), overrides=(ampbridge.Rule(("head",), output_dtype="bfloat16"),))
    ak.apply(model, policy)
    records = kx.probe(model)
    y = model(x)
    if before is not None:  # params stay float32: same values, untouched
        kx.assert_bitwise(before, model.weights, "weights")
    plan = ak.plan(model, policy)
    kx.assert_runs_plan(model, plan, records)
    assert kx.dtype_name(y) == "float32"
    assert records["head"]["outputs"] == {"bfloat16"}
    assert records[[r.path for r in plan if r.class_name == "Dense"][0]]["vars"] == {"float16"}


def test_apply_pinned_mha_softmax_runs_float32(kx):
    model = kx.transformer(dropout=0.25)  # dropout > 0: MultiHeadAttention uses its Softmax layer
    policy = MIXED.replace(keep_float32=("kind:softmax",))
    ak.apply(model, policy)
    records = kx.probe(model)
    model(kx.tokens(2)[0], training=False)
    assert records["attn.softmax"]["inputs"] == {"float32"} and records["attn.softmax"]["outputs"] == {"float32"}
    assert records["attn.query"]["outputs"] == {"float16"}
    kx.assert_runs_plan(model, ak.plan(model, policy), records)


def test_recast_changes_storage_keeps_values(kx):
    kx.seed(2)
    model = keras.Sequential([keras.Input((4,)), L.Dense(6, name="a"), L.Dense(2, name="b")])
    x = np.random.RandomState(0).randn(3, 4).astype("float32")
    before = [kx.numpy(w) for w in model.weights]
    policy = ampbridge.Policy(compute_dtype="float32", param_dtype="bfloat16",
                              overrides=(ampbridge.Rule(("b",), param_dtype="float32"),))
    ak.apply(model, policy)
    a, b = model.get_layer("a"), model.get_layer("b")
    assert a.dtype_policy.name == "float32/bfloat16" and a.kernel.dtype == "bfloat16" and b.kernel.dtype == "float32"
    import ml_dtypes

    np.testing.assert_array_equal(kx.numpy(a.kernel).astype("float32"),
                                  before[0].astype(ml_dtypes.bfloat16).astype("float32"))
    kx.assert_bitwise(before[2:], b.weights, "unchanged layer")
    records = kx.probe(model)
    assert kx.dtype_name(model(x)) == "float32"
    kx.assert_runs_plan(model, ak.plan(model, policy), records)
    model.compile(keras.optimizers.SGD(0.1), "mse")  # trains on the re-created variables
    model.fit(x, np.ones((3, 2), "float32"), verbose=0)
    assert not np.array_equal(kx.numpy(a.kernel).astype("float32"), before[0].astype(ml_dtypes.bfloat16).astype("float32"))


def test_reapply_and_unapply(kx):
    model = kx.transformer()
    x = kx.tokens(2)[0]
    ak.apply(model, PINNED)
    ak.apply(model, PINNED)
    assert kx.dtype_name(model(x)) == "float32"
    ak.apply(model, ampbridge.preset("float32"))
    records = kx.probe(model)
    model(x)
    assert all(rec["outputs"] <= {"float32"} for rec in records.values())
    ak.apply(model, ampbridge.preset("bfloat16").replace(output_dtype="bfloat16"))
    assert kx.dtype_name(model(x)) == "bfloat16"


def test_apply_before_build_reaches_sublayers_built_later():
    model = keras.Sequential([L.Dense(8, name="a"), L.MultiHeadAttention(2, 4, name="attn")])

    class Wrap(keras.Model):
        def __init__(self):
            super().__init__(name="wrap")
            self.a = L.Dense(8, name="a")
            self.attn = L.MultiHeadAttention(2, 4, name="attn")

        def call(self, x):
            h = self.a(x)
            return self.attn(h, h)

    del model
    model = Wrap()
    policy = MIXED.replace(keep_float32=("kind:softmax",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampbridge.UnmatchedRuleWarning)  # the softmax does not exist yet
        ak.apply(model, policy)
    y = model(np.zeros((2, 3, 5), "float32"))
    attn = model.attn
    assert attn._softmax.dtype_policy.name == "float32" and attn._query_dense.dtype_policy.name == "mixed_float16"
    assert keras.backend.standardize_dtype(y.dtype) == "float32"


def test_scope_builds_under_policy_and_restores():
    keras.config.set_dtype_policy("float32")
    policy = PINNED.replace(overrides=(ampbridge.Rule(("type:Dense",), compute_dtype="bfloat16"),))
    with ak.scope(policy):
        assert keras.config.dtype_policy().name == "mixed_float16"
        model = keras.Sequential([keras.Input((4,)), L.Dense(4, name="d"), L.LayerNormalization(name="n"),
                                  L.Activation("relu", name="act")])
    assert keras.config.dtype_policy().name == "float32"
    d, n, act = (model.get_layer(k) for k in ("d", "n", "act"))
    assert d.dtype_policy.compute_dtype == "bfloat16" and d.kernel.dtype == "float32"
    assert n.dtype_policy.name == "float32" and act.dtype_policy.name == "mixed_float16"
    with pytest.raises(RuntimeError, match="boom"):
        with ak.scope(MIXED):
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Layer.__init__.__name__ == "__init__" and not hasattr(keras.layers.Layer.__init__, "__wrapped__")


def test_matmul_precision():
    backend = keras.backend.backend()
    ak.apply(keras.Sequential([keras.Input((2,)), L.Dense(1)]), MIXED.replace(matmul_precision="high"))
    if backend == "tensorflow":
        import tensorflow as tf

        assert tf.config.experimental.tensor_float_32_execution_enabled()
        with pytest.raises(ampbridge.UnsupportedOptionError, match="matmul_precision='medium'"):
            ak.set_matmul_precision("medium")
    elif backend == "torch":
        import torch

        assert torch.get_float32_matmul_precision() == "high"
        ak.set_matmul_precision("medium")
        assert torch.get_float32_matmul_precision() == "medium"
    ak.set_matmul_precision("highest")
    if backend == "tensorflow":
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    with pytest.raises(ampbridge.PolicyError, match="accepted"):
        ak.set_matmul_precision("fast")


def test_dtype_policies_and_their_configs(tmp_path, kx):
    assert ak.dtype_policy("bfloat16", "float32").name == "mixed_bfloat16"
    assert ak.dtype_policy("float16", "float16").name == "float16"
    layer = L.Dense(2, dtype=ak.dtype_policy("float32", "bfloat16"))
    clone = L.Dense.from_config(layer.get_config())  # Keras keeps only a name: the storage dtype
    assert clone.variable_dtype == "bfloat16"
    with pytest.raises(ValueError, match="<compute>/<variable>"):
        ak.MixedDTypePolicy("float32/int8")
    policy = ampbridge.Policy(param_dtype="bfloat16")  # float32 compute, bfloat16 storage
    model = ak.apply(keras.Sequential([keras.Input((3,)), L.Dense(2, name="d")]), policy)
    model.compile(ak.optimizer("sgd", policy), "mse")
    model.save(tmp_path / "m.keras")
    plain = keras.saving.load_model(tmp_path / "m.keras")
    assert plain.get_layer("d").kernel.dtype == "bfloat16"
    kx.assert_bitwise(model.weights, plain.weights, "reloaded weights")
    restored = ak.load_model(tmp_path / "m.keras")
    assert restored.get_layer("d").dtype_policy.name == "float32/bfloat16"


def test_docstring_examples_run():
    import doctest
    import importlib
    import pkgutil

    import ampbridge.backends.keras as package

    # the backend's rooms (ampbridge.keras is their facade)
    modules = [package] + [importlib.import_module(f"{package.__name__}.{m.name}")
                           for m in pkgutil.iter_modules(package.__path__)]
    results = [doctest.testmod(module, optionflags=doctest.ELLIPSIS) for module in [ak, *modules]]
    result = doctest.TestResults(sum(r.failed for r in results), sum(r.attempted for r in results))
    assert result.attempted > 10 and result.failed == 0


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="checks the JAX backend process")
def test_no_tensorflow_import_under_jax():
    import subprocess
    import sys

    code = ("import os, sys; os.environ['AMPBRIDGE_NO_TORCH_FIRST'] = '1'; import keras, ampbridge, "
            "ampbridge.keras as ak; m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); "
            "p = ampbridge.preset('mixed_float16'); ak.apply(m, p); ak.optimizer('adam', p); ak.plan(m, p); "
            "print(sorted(k for k in ('tensorflow', 'torch') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "KERAS_BACKEND": "jax"})
    assert out.stdout.strip().splitlines()[-1] == "[]"
