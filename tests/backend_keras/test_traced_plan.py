"""plan(model, policy, *inputs): one forward on an applied clone, each row says the compute and
output dtype that ran (a probe on every layer's call, independent of the static rules)."""

from __future__ import annotations

import numpy as np

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
MIXED = ampbridge.preset("mixed_float16")
PINNED = MIXED.replace(keep_float32=("kind:norm",))


class Upcast(L.Layer):
    """A custom layer whose own code upcasts: the static row says float16, float32 runs."""

    def call(self, x):
        return keras.ops.cast(x, "float32") * 2.0


def _model(custom: bool):
    x = keras.Input((4,))
    h = L.LayerNormalization(name="ln")(L.Dense(8, name="dense")(x))
    if custom:
        h = Upcast(name="up")(h)
    return keras.Model(x, L.Dense(2, name="head")(h))


def _dtypes(plan):
    return {r.path: (r.compute_dtype, r.output_dtype) for r in plan.rows}


def test_traced_rows_equal_static_rows_where_the_static_row_is_right():
    model = _model(custom=False)
    inputs = np.ones((2, 4), "float32")
    for policy in (MIXED, PINNED):
        static, traced = ak.plan(model, policy), ak.plan(model, policy, inputs)
        assert _dtypes(traced) == _dtypes(static), policy.keep_float32
        assert not any("traced" in (r.note or "") for r in traced.rows)
    pinned = ak.plan(model, PINNED, inputs)
    assert pinned["ln"].compute_dtype == pinned["ln"].output_dtype == "float32"
    # the LayerNormalization row already says float32 compute under mixed_float16; the trace keeps it
    assert ak.plan(model, MIXED, inputs)["ln"].compute_dtype == "float32"
    assert ak.plan(model, MIXED, inputs)["ln"].output_dtype == "float16"
    assert model.get_layer("dense").dtype_policy.name == "float32"  # the model itself is untouched


def test_traced_row_shows_what_a_custom_layer_ran():
    model = _model(custom=True)
    static, traced = ak.plan(model, MIXED), ak.plan(model, MIXED, np.ones((2, 4), "float32"))
    assert _dtypes(static)["up"] == ("float16", "float16")
    assert _dtypes(traced)["up"] == ("float32", "float32")
    assert "traced: ran compute float32, output float32" in traced["up"].note
    others = {p: d for p, d in _dtypes(traced).items() if p != "up"}
    assert others == {p: d for p, d in _dtypes(static).items() if p != "up"}
    assert any(n.startswith("traced") for n in traced.notes)


def test_an_inference_dropout_keeps_its_static_row_and_says_so():
    from ampbridge.core.plan import NO_OP

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc"),
                              keras.layers.Dropout(0.5, name="drop")])
    policy = ampbridge.Policy(compute_dtype="bfloat16")
    traced = ak.plan(model, policy, np.ones((2, 4), "float32"))
    assert traced["drop"].note.endswith(NO_OP)  # Dropout at inference returns its input: no op ran
    assert traced["drop"].compute_dtype == ak.plan(model, policy)["drop"].compute_dtype
    assert NO_OP not in (traced["fc"].note or "")
