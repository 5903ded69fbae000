"""Issue 41: ``report`` attribution at block boundaries in Keras (TensorFlow, JAX and torch backends).
A residual model with ``kind:norm`` pinned whose overflow comes from a block's own code (its learned
skip projection, run in float16): no leaf goes non-finite first, the block does. The log names where
the value first became non-finite (checked against the block recording its own sublayers' inputs and
outputs), never a layer whose inputs were already non-finite, and the advice never repeats a pin."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge.diagnostics.report import format_summary, summarize  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402

L, ops = keras.layers, keras.ops
D = 8
RECORD: list[tuple[str, bool, bool]] = []  # (path, inputs finite, output finite), in the order calls finish


def _finite(t):
    return bool(np.all(np.isfinite(ops.convert_to_numpy(ops.cast(t, "float32")))))


class Block(L.Layer):
    """x @ skip + fc(norm(x)): the skip projection is the block's own code (no sublayer runs it);
    on eager calls it records each sublayer's and its own inputs' and output's finiteness."""

    def __init__(self, inner=False, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner  # the skip projection feeds fc (inside the block) instead of the sum
        self.norm = L.LayerNormalization(name="norm")
        self.fc = L.Dense(D, name="fc")

    def build(self, shape):
        self.skip = self.add_weight(shape=(D, D), initializer="identity", name="skip")
        self.norm.build(shape)
        self.fc.build(shape)

    def call(self, x):
        h = self.norm(x)
        skip = ops.matmul(x, self.skip)
        y = self.fc(skip if self.inner else h)
        out = (h if self.inner else skip) + y
        if not keras.backend.is_keras_tensor(x) and _eager(x):
            path = "encoder." + self.name
            RECORD.extend([(path + ".norm", _finite(x), _finite(h)),
                           (path + ".fc", _finite(skip if self.inner else h), _finite(y)),
                           (path, _finite(x), _finite(out))])
        return out


def _eager(t):
    try:
        np.asarray(ops.convert_to_numpy(t))
        return True
    except Exception:  # a traced value
        return False


def _model(inner):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3, D)), keras.Sequential([Block(inner, name="b0"), Block(inner, name="b1")],
                                                                     name="encoder"),
                              L.Dense(1, name="head")], name="net")
    b0 = model.get_layer("encoder").get_layer("b0")
    b0.skip.assign(100.0 * np.eye(D, dtype="float32"))  # 1e3 inputs: 1e5 in float16, past its 65504
    return model


def _data():
    x = np.ones((2, 3, D), "float32")
    x[0, 1] = 1000.0  # one position of the data large; finite in float16
    return x, np.zeros((2, 3, 1), "float32")


@pytest.mark.parametrize("inner", [False, True], ids=["skip-into-sum", "skip-into-fc"])
def test_report_names_the_block_where_the_value_first_went_nonfinite(tmp_path, inner):
    """skip-into-sum: the block's residual sum overflows; skip-into-fc: its skip projection
    overflows and feeds its fc (fed non-finite inputs, never named: the block is)."""
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    model = ak.apply(_model(inner), policy)
    x, y = _data()
    RECORD.clear()
    out = model(x)  # the ground truth: the blocks record eagerly, the head is checked here
    encoded = model.get_layer("encoder")(x)
    seen = RECORD + [("encoder", True, _finite(encoded)), ("head", _finite(encoded), _finite(out))]
    RECORD.clear()
    expected = next(p for p, finite_in, finite_out in seen if finite_in and not finite_out)
    assert expected == "encoder.b0"  # the block's own code; every leaf in it stayed finite
    # what leaf-only attribution named: a leaf fed non-finite inputs (the next block's pinned norm, or fc)
    assert ("encoder.b0.fc" if inner else "encoder.b1.norm", False, False) in seen

    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), policy), "mse")
    path = tmp_path / "run.jsonl"
    callback = ak.MonitorCallback(path, every=1)
    model.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[callback])
    callback.close()
    log = read_log(path)
    assert [s["first_nonfinite"] for s in log.steps] == [{"path": expected, "where": "output"}] * 3
    assert log.header["pinned"] == {"encoder.b0.norm": "keep_float32[0]", "encoder.b1.norm": "keep_float32[0]"}
    summary = summarize(log)
    assert list(summary.overflow_origins) == [expected]
    assert 'keep_float32 = ["encoder.b0"]' in format_summary(summary)
    assert not any(f'"{p}"' in a for a in summary.advice for p in log.header["pinned"])


def test_nonfinite_model_inputs_are_named_as_such(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, name="a"), L.Dense(1, name="b")], name="net")
    policy = ampbridge.preset("mixed_float16")
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), policy), "mse")
    x = np.ones((2, 4), "float32")
    x[0, 0] = np.inf
    path = tmp_path / "run.jsonl"
    with ak.Monitor(path, model) as monitor:
        model.fit(x, np.zeros((2, 1), "float32"), batch_size=2, verbose=0)
        monitor.record()
    log = read_log(path)
    assert log.steps[0]["first_nonfinite"] == {"path": "", "where": "input"}
    assert any("the model's inputs" in a for a in summarize(log).advice)


class Scale(L.Layer):
    def call(self, x):
        return x * 1e6


def test_a_cast_at_a_layers_entry_is_the_layers_own(tmp_path):
    """A pinned layer's float32 output beyond float16's range: Keras casts it to float16 at the next
    layer's entry (before its ``call``), so that layer's inputs look non-finite there; a graph
    (Sequential) called it with a finite value, so the layer itself is named, not the model's inputs."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, name="first"), Scale(name="scale"),
                              L.Dense(1, name="shrink")], name="net")
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("scale",))
    ak.apply(model, policy)
    model.compile(ak.optimizer(keras.optimizers.SGD(1e-3), policy), "mse")
    x = np.ones((2, 4), "float32")
    RECORD.clear()
    scaled = model.get_layer("scale")(model.get_layer("first")(x))
    assert _finite(scaled) and not _finite(ops.cast(scaled, "float16"))  # finite until the cast
    path = tmp_path / "run.jsonl"
    with ak.Monitor(path, model) as monitor:
        model.fit(x, np.zeros((2, 1), "float32"), batch_size=2, verbose=0)
        monitor.record()
    assert read_log(path).steps[0]["first_nonfinite"] == {"path": "shrink", "where": "output"}
