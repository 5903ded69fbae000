"""Shared helpers for the Keras backend tests (run once per Keras backend: KERAS_BACKEND).

Tests cannot import each other (``--import-mode=importlib``), so the helpers are handed out
by the ``kx`` fixture.
"""

from __future__ import annotations

import functools
import re
import types

import numpy as np
import pytest

from ampbridge._testing import require


@pytest.fixture(autouse=True)
def _restore_keras_globals():
    keras = require("keras")
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


def _helpers():
    keras = require("keras")
    import ampbridge.keras as ak

    L = keras.layers

    def transformer(native: bool = False, *, vocab=32, seq=8, dim=16, heads=2, classes=4, dropout=0.0,
                    name="toy"):
        """Embedding, Dense, LayerNormalization, MultiHeadAttention, head. ``native``: the
        hand-written Keras mixed-precision version (float32 pins and output cast written out)."""
        pin = {"dtype": "float32"} if native else {}
        tokens = keras.Input((seq,), dtype="int32", name="tokens")
        x = L.Embedding(vocab, dim, name="embed", **pin)(tokens)
        x = L.Dense(dim, activation="relu", name="ffn")(x)
        x = L.LayerNormalization(name="norm", **pin)(x)
        x = L.Add(name="residual")([x, L.MultiHeadAttention(heads, dim // heads, dropout=dropout, seed=7,
                                                            name="attn")(x, x)])
        x = L.GlobalAveragePooling1D(name="pool")(x)
        logits = L.Dense(classes, name="head")(x)
        if native:
            logits = L.Activation("linear", dtype="float32", name="out_cast")(logits)
        return keras.Model(tokens, logits, name=name)

    def seed(n):
        """keras.utils.set_random_seed, minus its TensorFlow import (10 s) under JAX and torch."""
        if keras.backend.backend() == "tensorflow":
            keras.utils.set_random_seed(n)
            return
        import random

        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator

        random.seed(n)
        np.random.seed(n)
        global_state.set_global_attribute("global_random_seed", n)
        # the constant exists from keras 3.13; its value is the attribute name every release uses
        global_state.set_global_attribute(getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator"),
                                          None)
        if keras.backend.backend() == "torch":
            import torch

            torch.manual_seed(n)

    def tokens(n, *, seq=8, vocab=32, classes=4, seed=0):
        rng = np.random.RandomState(seed)
        return rng.randint(0, vocab, (n, seq)).astype("int32"), rng.randint(0, classes, (n,)).astype("int32")

    def numpy(x):
        return np.asarray(keras.ops.convert_to_numpy(x))

    def bits(x):
        """The exact bit pattern of an array (so NaNs compare too)."""
        a = np.ascontiguousarray(numpy(x))
        return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a

    def assert_bitwise(a_list, b_list, what="values"):
        assert len(a_list) == len(b_list), f"{what}: {len(a_list)} != {len(b_list)}"
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            a_bits, b_bits = bits(a), bits(b)
            assert a_bits.dtype == b_bits.dtype and np.array_equal(a_bits, b_bits), (
                f"{what}[{i}] differs: max |a-b| = {np.max(np.abs(numpy(a).astype('f8') - numpy(b).astype('f8')))}")

    def dtype_name(x):
        return keras.backend.standardize_dtype(x.dtype)

    def is_float(x):
        try:
            return hasattr(x, "dtype") and dtype_name(x) in ("float16", "bfloat16", "float32", "float64")
        except ValueError:
            return False

    def probe(model, records=None):
        """Record, per layer path, the float dtypes a layer's ``call`` receives and reads its own
        autocast variables in (a ``call`` wrapper: casts ampbridge adds around it do not change
        those), and what ``layer(...)`` returns (the instance's class is swapped for a subclass
        with the same name whose ``__call__`` records: outermost, whatever wraps ``call``).
        ``records[path] = {"inputs", "vars", "outputs"}``."""
        records = {} if records is None else records
        for path, layer in ak.walk(model):
            if getattr(type(layer), "_probed", False):
                continue
            inner = layer.call

            def call(*args, _inner=inner, _path=path, _layer=layer, **kwargs):
                rec = records.setdefault(_path, {"inputs": set(), "vars": set(), "outputs": set()})
                rec["inputs"] |= {dtype_name(t) for t in keras.tree.flatten((args, kwargs)) if is_float(t)}
                rec["vars"] |= {dtype_name(v.value) for v in _layer._trainable_variables if v._autocast}
                return _inner(*args, **kwargs)

            object.__setattr__(layer, "call", functools.wraps(inner)(call))

            def __call__(self, *args, _path=path, **kwargs):
                out = super(type(self), self).__call__(*args, **kwargs)
                rec = records.setdefault(_path, {"inputs": set(), "vars": set(), "outputs": set()})
                rec["outputs"] |= {dtype_name(t) for t in keras.tree.flatten(out) if is_float(t)}
                return out

            cls = type(layer)
            layer.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_probed": True,
                                                          "__module__": cls.__module__})
        return records

    def assert_runs_plan(model, plan, records):
        """Every layer's stored, computed and emitted dtypes are its Plan row's."""
        by_path = dict(ak.walk(model))
        for row in plan:
            layer = by_path[row.path]
            for v in layer._trainable_variables + layer._non_trainable_variables:
                assert keras.backend.standardize_dtype(v._dtype) == row.param_dtype, (row.path, v.path)
            rec = records.get(row.path)
            if rec is None:
                continue
            internal_f32 = row.note is not None and "float32 internally" in row.note
            if layer.autocast and not isinstance(layer, keras.Model) and not internal_f32:
                assert rec["inputs"] <= {row.compute_dtype}, (row.path, rec, row)
                assert rec["vars"] <= {row.compute_dtype}, (row.path, rec, row)
            if "output follows the data flow" in (row.note or ""):  # the static row names both dtypes it may return
                said = row.note.split("output follows the data flow")[1].split("; ak.trace")[0]
                assert rec["outputs"] <= {row.output_dtype} | set(re.findall(r"float\d+", said)), (row.path, rec, row)
                continue
            several = re.search(r"returns ((?:\w+ and )+\w+) \(", row.note or "")  # a dict of outputs, named
            assert rec["outputs"] <= ({row.output_dtype} | set(several.group(1).split(" and ") if several else ())), \
                (row.path, rec, row)

    class StateLog(keras.callbacks.Callback):
        """The optimizer's loss-scale state after every training batch."""

        def __init__(self):
            super().__init__()
            self.states = []

        def on_train_batch_end(self, batch, logs=None):
            if hasattr(self.model, "jax_state_sync"):
                self.model.jax_state_sync()
            self.states.append(self.model.optimizer.state)

    return types.SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("_")})


@pytest.fixture(scope="session")
def kx():
    return _helpers()
