"""Dtypes the model's author fixed in code are part of the Plan: kept by default (the row says
"set by the model"), overridden by a rule that names the layer."""

from __future__ import annotations

import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.keras as ak  # noqa: E402

L = keras.layers
MIXED = ampbridge.preset("mixed_float16")


def _guide_model():
    """The Keras mixed-precision guide's model: a float32 softmax head, and a DTypePolicyMap entry."""
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["dense_2"] = keras.DTypePolicy("float32")
    inputs = keras.Input((4,))
    x = L.Dense(8, activation="relu", name="dense_1")(inputs)
    x = L.Dense(3, name="dense_2", dtype=policy_map)(x)
    outputs = L.Activation("softmax", dtype="float32", name="predictions")(x)
    return keras.Model(inputs, outputs)


def test_author_float32_layers_are_kept_and_say_so():
    model = ak.apply(_guide_model(), MIXED)
    plan = ak.plan(model, MIXED)
    for path in ("predictions", "dense_2"):
        assert (plan[path].compute_dtype, plan[path].rule, plan[path].decided_by) == (
            "float32", "set by the model", "set by the model")
        assert model.get_layer(path).compute_dtype == "float32"
    assert plan["dense_1"].rule == "default" and model.get_layer("dense_1").compute_dtype == "float16"
    y = model(keras.ops.ones((2, 4)))
    assert keras.backend.standardize_dtype(y.dtype) == "float32"


def test_a_rule_naming_the_layer_overrides_the_author():
    policy = MIXED.replace(overrides=({"match": ("predictions", "dense_2"), "compute_dtype": "float16"},))
    model = ak.apply(_guide_model(), policy)
    plan = ak.plan(model, policy)
    assert plan["predictions"].rule == "override[0]" and model.get_layer("predictions").compute_dtype == "float16"
    assert model.get_layer("dense_2").dtype_policy["dense_2"].name == "mixed_float16"
    # the author's choice is remembered: a policy without the rule gives it back
    ak.apply(model, MIXED)
    assert model.get_layer("predictions").compute_dtype == "float32"
    assert ak.plan(model, MIXED)["predictions"].rule == "set by the model"


class _Backbone(keras.Model):
    """A keras-hub-style model: the ``dtype`` given to the model goes to every layer it makes."""

    def __init__(self, dtype=None, **kwargs):
        inputs = keras.Input((4,))
        x = L.Dense(4, name="inner", dtype=dtype)(inputs)
        outputs = L.Activation("softmax", dtype="float32", name="softmax")(x)
        super().__init__(inputs, outputs, **kwargs)
        if dtype is not None:
            self.dtype_policy = dtype  # as keras-hub's Backbone does (Functional drops dtype=)


def test_a_dtype_passed_down_from_the_model_is_not_a_pin():
    plan = ak.plan(_Backbone(dtype="bfloat16"), MIXED)
    assert plan["inner"].rule == "default" and plan["inner"].compute_dtype == "float16"
    assert plan["softmax"].rule == "set by the model"  # differs from what the model passed down
    # a layer made from a saved config (dtype by name, as from_config passes it) is not a pin
    # (ampbridge.keras.load_model reads the pins from the file); a DTypePolicyMap entry still is
    plan = ak.plan(keras.Model.from_config(_guide_model().get_config()), MIXED)
    assert (plan["predictions"].rule, plan["dense_2"].rule) == ("default", "set by the model")


def _object_model(given):
    """A float32 head made with ``dtype=given`` (a name or a DTypePolicy object), and a Dense whose
    initializer object keeps Keras from recording its arguments (not a pin)."""
    inputs = keras.Input((4,))
    x = L.Dense(8, name="body", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
    return keras.Model(inputs, L.Dense(2, name="head", dtype=given)(x))


def test_a_dtype_policy_object_is_the_authors_as_a_name_is():
    """issue 37: ``dtype=keras.DTypePolicy("float32")`` was lost under apply (a string was kept)."""
    for given in ("float32", keras.DTypePolicy("float32")):
        model = ak.apply(_object_model(given), MIXED)
        plan = ak.plan(model, MIXED)
        assert (plan["head"].rule, plan["head"].compute_dtype) == ("set by the model", "float32"), given
        assert model.get_layer("head").dtype_policy.name == "float32"
        assert (plan["body"].rule, model.get_layer("body").dtype_policy.name) == ("default", "mixed_float16")
    # the model's own policy object passed down (keras-hub style) is not a pin
    plan = ak.plan(_Backbone(dtype=keras.DTypePolicy("bfloat16")), MIXED)
    assert plan["inner"].rule == "default" and plan["softmax"].rule == "set by the model"


def test_applying_to_a_layer_of_an_applied_model_is_refused_by_name():
    """issue 37: a layer of an applied model follows that model's Plan; the model itself re-applies."""
    model = ak.apply(_object_model("float32"), MIXED)
    with pytest.raises(ampbridge.UnsupportedOptionError, match="this layer is 'body' of an applied Functional"):
        ak.apply(model.get_layer("body"), MIXED)
    ak.apply(model, ampbridge.preset("mixed_bfloat16"))  # the model again: fine
    assert model.get_layer("body").dtype_policy.name == "mixed_bfloat16"
    ak.apply(_object_model("float32").get_layer("body"), MIXED)  # a layer of a model never applied: fine
