"""The Keras model zoo: ``keras.applications`` (MobileNetV2, ResNet50, EfficientNetB0, weights=None,
32x32 inputs) and keras-hub's BERT, GPT-2 and Llama backbones built tiny from arguments (random
init, no downloads) under ``keep_float32 = ["kind:norm", "kind:embedding"]``.

For every model and float16/bfloat16 compute: every norm and embedding layer, counted here by class
(lists written for each model, independent of ampbridge's kinds), is pinned to float32 in the Plan;
what each layer really ran in (a probe on every layer: the float inputs its ``call`` receives, the
autocast variables it reads, what ``layer(...)`` returns) equals the Plan row by row, compute and
output; ``kind:attention`` matches every attention layer of the three transformers.

``KERAS_BACKEND=tensorflow pytest -s -k table tests/backend_keras/test_zoo.py`` prints the closing
table (layers, recognised kinds, pinned layers, Plan-vs-observed mismatches per model).
"""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np
import pytest

from ampbridge._testing import ZOO_HEADER, require, zoo_line
from ampbridge.core.table import render_table

keras = require("keras")
keras_hub = pytest.importorskip("keras_hub")  # installed --no-deps by the Makefile (constraints.txt pins it)

import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

pytestmark = pytest.mark.slow

POLICY = {"keep_float32": ["kind:norm", "kind:embedding"]}
SIZE = 32  # the smallest input keras.applications accepts


def _build(name):
    keras.utils.set_random_seed(0)
    apps, hub = keras.applications, keras_hub.models
    image = (np.random.default_rng(0).random((1, SIZE, SIZE, 3)) * 255).astype("float32")
    if name == "mobilenetv2":
        return apps.MobileNetV2(input_shape=(SIZE, SIZE, 3), alpha=0.35, weights=None, classes=4), image
    if name == "resnet50":
        return apps.ResNet50(input_shape=(SIZE, SIZE, 3), weights=None, classes=4), image
    if name == "efficientnetb0":
        return apps.EfficientNetB0(input_shape=(SIZE, SIZE, 3), weights=None, classes=4), image
    ids = {"token_ids": (np.arange(16).reshape(2, 8) % 64).astype("int32"), "padding_mask": np.ones((2, 8), "int32")}
    small = dict(vocabulary_size=64, num_layers=2, hidden_dim=16, intermediate_dim=32)
    if name == "bert":
        model = hub.BertBackbone(**small, num_heads=2, max_sequence_length=16)
        return model, {**ids, "segment_ids": np.zeros((2, 8), "int32")}
    if name == "gpt2":
        return hub.GPT2Backbone(**small, num_heads=2, max_sequence_length=16), ids
    if name == "llama":
        return hub.LlamaBackbone(**small, num_query_heads=2, num_key_value_heads=1), ids
    raise KeyError(name)


#: per model, written by hand from its code: the classes of its norm, embedding and attention layers
EXPECTED = {
    "mobilenetv2": ({"BatchNormalization"}, set(), set()),
    "resnet50": ({"BatchNormalization"}, set(), set()),
    # its input standardisation (keras.layers.Normalization: adapted mean and variance) is a norm too
    "efficientnetb0": ({"BatchNormalization", "Normalization"}, set(), set()),
    "bert": ({"LayerNormalization"}, {"ReversibleEmbedding", "PositionEmbedding", "Embedding"}, {"MultiHeadAttention"}),
    "gpt2": ({"LayerNormalization"}, {"ReversibleEmbedding", "PositionEmbedding"}, {"CachedMultiHeadAttention"}),
    "llama": ({"LlamaLayerNorm"}, {"ReversibleEmbedding"}, {"LlamaAttention"}),
}
MODELS = list(EXPECTED)
DTYPES = ["float16", "bfloat16"]
RESULTS: dict = {}


def _name(x):
    return keras.backend.standardize_dtype(x.dtype)


def _is_float(x):
    try:
        return hasattr(x, "dtype") and _name(x) in ("float16", "bfloat16", "float32", "float64")
    except ValueError:
        return False


def _probe(model):
    """Per layer path: the float dtypes its ``call`` receives, the autocast variables it reads there,
    and what ``layer(...)`` returns (its class swapped for a recording subclass: outermost, whatever
    wraps ``call``). Independent of ampbridge's own call wrapper and monitor."""
    records = {}
    for path, layer in ak.walk(model):
        inner = layer.call

        def call(*args, _inner=inner, _path=path, _layer=layer, **kwargs):
            rec = records.setdefault(_path, {"inputs": set(), "vars": set(), "outputs": set()})
            rec["inputs"] |= {_name(t) for t in keras.tree.flatten((args, kwargs)) if _is_float(t)}
            rec["vars"] |= {_name(v.value) for v in _layer._trainable_variables if v._autocast}
            return _inner(*args, **kwargs)

        object.__setattr__(layer, "call", functools.wraps(inner)(call))

        def __call__(self, *args, _path=path, **kwargs):
            out = super(type(self), self).__call__(*args, **kwargs)
            rec = records.setdefault(_path, {"inputs": set(), "vars": set(), "outputs": set()})
            rec["outputs"] |= {_name(t) for t in keras.tree.flatten(out) if _is_float(t)}
            return out

        cls = type(layer)
        layer.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return records


def _mismatches(model, plan, records):
    """Rows whose stored, computed or emitted dtypes are not what ran (one line each)."""
    by_path = dict(ak.walk(model))
    problems, checked = [], 0
    for row in plan.rows:
        layer = by_path[row.path]
        label = f"{row.path or '(model)'} ({row.class_name})"
        stored = {keras.backend.standardize_dtype(v._dtype) for v in layer._trainable_variables
                  if v._autocast and keras.backend.standardize_dtype(v._dtype).startswith(("float", "bfloat"))}
        if stored - {row.param_dtype}:
            problems.append(f"{label}: plan param {row.param_dtype}, stored {sorted(stored)}")
        rec = records.get(row.path)
        if rec is None:
            continue
        checked += 1
        # Keras's norm ops upcast internally: the row says so and its compute column is that float32
        fed = row.compute_dtype
        if row.note and "float32 internally" in row.note:
            # Keras's norm ops upcast inside (the row says so, its compute column is that float32): the
            # layer is fed, and reads its variables, in its own dtype policy's compute dtype
            fed = layer.compute_dtype
        # a layer with autocast off (Keras's norms and embeddings) takes its inputs as fed and reads its
        # variables as stored: what it computes in is its own code's (the row's note says which)
        inputs = rec["inputs"] if layer.autocast else set()
        if not isinstance(layer, keras.Model):  # a Functional model's call is its graph, not a layer's maths
            if inputs - {fed} or rec["vars"] - {fed}:
                problems.append(f"{label}: plan compute {row.compute_dtype}, ran on inputs {sorted(rec['inputs'])}"
                                f" and variables {sorted(rec['vars'])}")
        # a composite returns what its own code computes; its row names every dtype it may return
        said = (row.note or "").split("output follows the data flow")[-1] if "output follows the data flow" in (
            row.note or "") else (re.search(r"returns ((?:\w+ and )+\w+) \(", row.note or "") or [""])[0]
        if rec["outputs"] - {row.output_dtype} - set(re.findall(r"float\d+", said)):
            problems.append(f"{label}: plan output {row.output_dtype}, delivered {sorted(rec['outputs'])}")
    return checked, problems


def _forward(model, inputs):
    """One forward; on JAX traced only (``jax.eval_shape``: the dtypes of every op, nothing computed,
    one trace instead of compiling each eager op for each dtype)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.eval_shape(model, inputs)
    return model(inputs)


def _run(name, compute, pins=True):
    model, inputs = _build(name)
    norms, embeddings, attentions = EXPECTED[name]
    policy = ampbridge.Policy(compute_dtype=compute, **(POLICY if pins else {}))
    if pins and name == "bert" and keras.backend.backend() == "tensorflow":
        # keras-hub's post-norm encoder adds its pinned norm's float32 output to the float16 stream with
        # a raw `+`, which TensorFlow refuses (JAX and torch promote); the Plan's note names this override
        policy = policy.replace(overrides=({"match": ("kind:norm", "kind:embedding"), "compute_dtype": "float32",
                                            "output_dtype": compute},))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ak.apply(model, policy)
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.UnmatchedRuleWarning)]
    # the one warning a CNN deserves: it has no embedding
    allowed = [] if embeddings or not pins else ["keep_float32[1] (kind:embedding) matches no layer of the model (a typo?)"]
    plan = ak.plan(model, policy, warn=False)
    by_class = {p: type(layer).__name__ for p, layer in ak.walk(model)}
    expected_pinned = {p for p, c in by_class.items() if c in norms | embeddings}
    pinned = {r.path for r in plan.rows if r.rule.startswith(("keep_float32", "override"))}
    # pinned: decided by a rule, computing and storing in float32 (its output is checked against what ran:
    # a layer whose caller's own code adds it to a float16 stream returns to that stream's dtype)
    unpinned = sorted(p for p in expected_pinned if plan[p].rule == "default" or plan[p].param_dtype != "float32"
                      or plan[p].compute_dtype != "float32")
    records = _probe(model)
    _forward(model, inputs)
    checked, mismatches = _mismatches(model, plan, records)
    attention_plan = ak.plan(model, ampbridge.Policy(compute_dtype=compute, keep_float32=("kind:attention",)),
                             warn=False)
    attention_paths = {p for p, c in by_class.items() if c in attentions}
    matched_attention = {r.path for r in attention_plan.rows
                         if r.pattern == "kind:attention" and r.inherited_from is None}
    kinds: dict = {}
    for r in plan.rows:
        if r.kind:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return dict(layers=len(plan.rows), kinds=kinds, pinned=len(pinned), expected_pinned=expected_pinned,
                unpinned=unpinned, mismatches=mismatches, checked=checked, said=said, allowed=allowed,
                attention_paths=attention_paths, matched_attention=matched_attention)


def _result(name, compute, pins=True):
    key = (name, compute, pins)
    if key not in RESULTS:
        RESULTS[key] = _run(name, compute, pins)
    return RESULTS[key]


CNNS = ("mobilenetv2", "resnet50", "efficientnetb0")


def _skip_where_too_slow(name):
    if keras.backend.backend() == "jax" and name in CNNS:
        # Keras-on-JAX initialises each random weight eagerly, one XLA compile per shape: 10-50 s per
        # CNN here. The Plan and apply code they exercise is backend-independent (TensorFlow and torch
        # run them); the transformers below run on JAX.
        pytest.skip("keras.applications CNNs are built on TensorFlow and torch only (JAX init compiles)")


@pytest.mark.parametrize("compute", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_zoo_plan_pins_and_runs(name, compute):
    _skip_where_too_slow(name)
    got = _result(name, compute)
    assert got["said"] == got["allowed"], got["said"]
    assert got["expected_pinned"], f"{name}: the hand-written class lists found no norm or embedding"
    assert not got["unpinned"], f"{name}: norm/embedding layers not pinned: {got['unpinned']}"
    assert not got["mismatches"], "\n".join(got["mismatches"])
    assert got["checked"] > 0.8 * got["layers"], (got["checked"], got["layers"])  # the probe saw the model run
    assert got["matched_attention"] == got["attention_paths"], (
        f"kind:attention matched {sorted(got['matched_attention'] ^ got['attention_paths'])} wrongly")


@pytest.mark.parametrize("name", MODELS)
def test_zoo_unpinned_rows_say_what_runs(name):
    """With no rule at all, the static rows still match what ran (Keras's norms upcasting inside)."""
    _skip_where_too_slow(name)
    got = _result(name, "float16", pins=False)
    assert not got["mismatches"], "\n".join(got["mismatches"])


def test_zoo_table():
    """The closing table (run with -s to see it): every model, float16 and bfloat16."""
    lines = []
    for name in MODELS:
        if keras.backend.backend() == "jax" and name in CNNS:
            continue  # see _skip_where_too_slow
        for compute in DTYPES:
            got, bare = _result(name, compute), _result(name, "float16", pins=False)
            lines.append(zoo_line(name, compute, got, bare))
            assert not got["mismatches"] and not got["unpinned"] and not bare["mismatches"]
    print(f"\nkeras backend: {keras.backend.backend()}")
    print(render_table(ZOO_HEADER, lines))
