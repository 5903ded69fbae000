"""tf_keras's Plan (the demo model's is Keras 3's, row for row), detection, what ``apply`` realises
(actual dtypes of variables and outputs) and what it refuses by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ampbridge._testing import require

tf_keras = require("tf_keras")

import tensorflow as tf  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.tf_keras as atk  # noqa: E402
from ampbridge import UnsupportedOptionError  # noqa: E402

L = tf_keras.layers
POLICIES = {
    "pins": ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm", "kind:embedding")),
    "override": ampbridge.loads("""
        compute_dtype = "bfloat16"
        keep_float32 = ["kind:norm"]
        [[override]]
        match = "block.attn"
        compute_dtype = "float32"
        [[override]]
        match = "head"
        compute_dtype = "float16"
        """),
    "bf16_params": ampbridge.preset("bfloat16"),
}


def _rows_of(r):
    return _rows_of_plan_row(r)


def _rows(plan):
    return [_rows_of_plan_row(r) for r in plan.rows]


def _rows_of_plan_row(r):
    return (r.path, r.kind, r.kind_source, r.class_name, r.param_count, r.compute_dtype, r.param_dtype,
             r.output_dtype, r.rule, r.pattern, r.inherited_from, r.note)


@pytest.mark.parametrize("name", list(POLICIES))
def test_demo_plan_is_keras3s_row_for_row(name):
    require("keras")
    from ampbridge.cli.demo import keras_model, tf_keras_model

    policy = POLICIES[name]
    k3, k2 = keras_model.build(), tf_keras_model.build()
    want, got = ampbridge.plan(k3, policy), ampbridge.plan(k2, policy)
    assert got.framework == "tf_keras" and want.framework.startswith("keras")
    assert [r.path for r in got.rows] == [r.path for r in want.rows]
    # a stream row (a pinned layer's output meeting its caller's stream) adds what tf_keras does there
    suffix = "; " + atk.STREAM_REFUSED
    streams = [r.path for r in want.rows if (r.note or "").startswith("called from")]
    assert [r.path for r in got.rows if (r.note or "").endswith(suffix)] == streams  # none with bfloat16 everywhere
    # Keras 3 returns a composite's stream uncast (its row says the output follows the data flow); in
    # Keras 2 such a caller mixing dtypes in its own code raises (the suffix above), so the row has no note
    flows = {r.path for r in want.rows if (r.note or "").startswith("output follows the data flow")}
    assert all(got[p].note is None for p in flows)
    same = [_rows_of(r)[:-1] + ((r.note or "").removesuffix(suffix) or None,) for r in got.rows]
    expected = [_rows_of(r)[:-1] + (None,) if r.path in flows else _rows_of(r) for r in want.rows]
    differ = [(a[0], a[5], b[5]) for a, b in zip(same, expected) if a != b]
    if name != "bf16_params":
        assert differ == []
    else:  # Keras 2's LayerNormalization with bfloat16 variables normalises in bfloat16 (Keras 3: float32)
        assert differ == [(p, "bfloat16", "float32") for p in ("block.norm1", "block.norm2", "norm")]
    if name == "override":  # block.attn's float32 output meets block's bfloat16 stream (x + attn): TF raises
        with pytest.raises(tf.errors.InvalidArgumentError, match="AddV2"):
            tf_keras_model.build(policy=policy)


def test_demo_model_applied_before_build_runs_its_rows():
    from ampbridge.cli.demo import tf_keras_model

    # block's own code adds its pinned attention's output to its stream: the block is pinned too
    policy = POLICIES["override"].replace(overrides=POLICIES["override"].overrides + (
        ampbridge.Rule(match=("block",), compute_dtype="float32"),))
    model = tf_keras_model.build(policy=policy)
    want = {r.path: (r.compute_dtype, r.param_dtype) for r in ampbridge.plan(model, policy).rows}
    for path, layer in atk.walk(model):
        if path and layer.weights:
            assert all(v.dtype.name == want[path][1] for v in layer.weights), path
    assert model.get_layer("block").attn.query.compute_dtype == "float32"
    assert model.get_layer("embed").compute_dtype == "bfloat16"
    assert model.get_layer("head").compute_dtype == "float16"
    assert model(np.zeros((2, 8), "int32")).dtype.name == "float32"  # output_dtype


def functional():
    x = L.Input((4,))
    h = L.Dense(8, name="dense")(x)
    inner = tf_keras.Sequential([L.Input((8,)), L.LayerNormalization(name="ln"), L.Dense(8, name="proj")], name="inner")
    return tf_keras.Model(x, L.Dense(2, name="head")(inner(h)), name="outer")


def test_apply_rebuilds_nested_graphs_with_every_row_and_the_same_weights():
    model = functional()
    policy = ampbridge.preset("mixed_bfloat16").replace(keep_float32=("kind:norm", "head"))
    out = atk.apply(model, policy)
    assert out is not model and model.get_layer("dense").dtype_policy.name == "float32"  # untouched
    got = {p: (l.dtype_policy.name, [v.dtype.name for v in l.weights]) for p, l in atk.walk(out) if p}
    assert got == {"dense": ("mixed_bfloat16", ["float32", "float32"]), "inner": ("mixed_bfloat16", ["float32"] * 4),
                   "inner.ln": ("float32", ["float32", "float32"]), "inner.proj": ("mixed_bfloat16", ["float32"] * 2),
                   "head": ("float32", ["float32", "float32"])}
    for a, b in zip(model.get_weights(), out.get_weights(), strict=True):
        assert np.array_equal(a, b)
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    assert out(x).dtype.name == "float32"
    traced = atk.plan(model, policy, x)
    assert traced["dense"].output_dtype == "bfloat16" and traced[""].output_dtype == "float32"
    assert "traced: dtypes observed in one forward" in traced.notes


def test_output_cast_is_keras2s_float32_activation_and_bfloat16_params_are_stored_so():
    model = tf_keras.Sequential([L.Input((3,)), L.Dense(2, name="d")])
    out = atk.apply(model, ampbridge.preset("bfloat16").replace(output_dtype="float32"))
    assert out.layers[-1].name == atk.OUTPUT_CAST and out(np.ones((1, 3), "float32")).dtype.name == "float32"
    assert [v.dtype.name for v in out.get_layer("d").weights] == ["bfloat16", "bfloat16"]
    unbuilt = atk.apply(tf_keras.Sequential([L.Dense(2, name="d")]), "mixed_float16")  # changed in place
    assert [l.name for l in unbuilt.layers] == ["d", atk.OUTPUT_CAST]
    assert unbuilt(np.ones((1, 3), "float32")).dtype.name == "float32" and unbuilt.get_layer("d").compute_dtype == "float16"


def test_refused_by_name():
    class Sub(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.d = L.Dense(2)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.ones((1, 2), "float32"))
    with pytest.raises(UnsupportedOptionError, match="built Sub"):
        atk.apply(sub, "mixed_float16")
    compiled = functional()
    compiled.compile("sgd", "mse")
    with pytest.raises(UnsupportedOptionError, match="compiled"):
        atk.apply(compiled, "mixed_float16")
    with pytest.raises(UnsupportedOptionError, match="param_dtype=bfloat16"):
        atk.apply(functional(), ampbridge.preset("float32").replace(param_dtype="bfloat16"))
    with pytest.raises(UnsupportedOptionError, match="matmul_precision='medium'"):
        atk.apply(functional(), ampbridge.preset("mixed_float16").replace(matmul_precision="medium"))
    from ampbridge.core.policy import Fp8Config

    # Keras 2 has no float8: an [fp8] table was trained in bfloat16 without a word (found by the FP8 demo)
    with pytest.raises(UnsupportedOptionError, match=r"\[fp8\] is not realised on tf.keras 2"):
        atk.apply(functional(), ampbridge.preset("mixed_bfloat16").replace(fp8=Fp8Config(match=("kind:linear",))))


def test_detection_and_no_tensorflow_import_when_unused():
    assert ampbridge.plan(functional(), "mixed_float16").framework == "tf_keras"
    assert atk.owns(functional()) and not atk.owns(object()) and not atk.owns(np.ones(2))
    from ampbridge.core.registry import backend_module

    assert backend_module("keras2") is atk.__dict__.get("__spec__") and False or backend_module("keras2").__name__ == "ampbridge.tf_keras"
    code = ("import sys, ampbridge\n"
            "from ampbridge.core.registry import detect_backend\n"
            "assert detect_backend([1]) is None and detect_backend(object()) is None\n"
            "assert not {'tensorflow', 'tf_keras', 'keras'} & set(sys.modules), sorted(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-1500:]


def test_docstring_examples_run():
    import doctest
    import importlib
    import pkgutil

    import ampbridge.backends.tf_keras as package

    modules = [package] + [importlib.import_module(f"{package.__name__}.{m.name}")
                           for m in pkgutil.iter_modules(package.__path__)]
    results = [doctest.testmod(module, optionflags=doctest.ELLIPSIS) for module in modules]
    result = doctest.TestResults(sum(r.failed for r in results), sum(r.attempted for r in results))
    assert result.attempted > 10 and result.failed == 0


def test_verbs_follow_the_backend_contract():
    import inspect

    P = inspect.Parameter
    want = {  # verb: (room, its parameters as (name, kind))
        "plan": ("plan", [("model", P.POSITIONAL_OR_KEYWORD), ("policy", P.POSITIONAL_OR_KEYWORD),
                          ("example_inputs", P.VAR_POSITIONAL), ("warn", P.KEYWORD_ONLY)]),
        "trace": ("trace", [("model", P.POSITIONAL_OR_KEYWORD), ("policy", P.POSITIONAL_OR_KEYWORD),
                            ("example_inputs", P.VAR_POSITIONAL), ("warn", P.KEYWORD_ONLY)]),
        "apply": ("apply", [("model", P.POSITIONAL_OR_KEYWORD), ("policy", P.POSITIONAL_OR_KEYWORD),
                            ("warn", P.KEYWORD_ONLY)]),
        "optimizer": ("loss_scale", [("inner", P.POSITIONAL_OR_KEYWORD), ("policy", P.POSITIONAL_OR_KEYWORD)]),
        "layers": ("layers", [("model", P.POSITIONAL_OR_KEYWORD)]),
        "owns": ("layers", [("obj", P.POSITIONAL_OR_KEYWORD)]),
        "register_kind": ("layers", [("cls", P.POSITIONAL_OR_KEYWORD), ("kind", P.POSITIONAL_OR_KEYWORD)]),
    }
    for verb, (room, params) in want.items():
        fn = getattr(atk, verb)
        assert fn.__module__ == f"ampbridge.backends.tf_keras.{room}", verb
        assert [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()] == params, verb
    described = atk.layers(functional())
    assert all(isinstance(l, ampbridge.Layer) for l in described) and [l.path for l in described][:2] == ["", "dense"]
    with pytest.raises(TypeError, match="example inputs"):
        atk.trace(functional(), "mixed_float16")
