"""Realising the Plan on a tf_keras model: every layer rebuilt from its config with its row's
``tf_keras.mixed_precision.Policy``, the weights copied over, and the model's outputs cast to
``output_dtype`` by Keras 2's own idiom (a float32 ``linear`` Activation).

Keras 2 fixes a layer's dtype policy when the layer is made (its variables are ``AutoCastVariable``
only when created under a mixed policy), so a built model cannot change dtypes in place: the public
way is ``tf_keras.models.clone_model`` with a ``clone_function``, which is what :func:`apply` uses.

A ``[[phase]]`` schedule: each layer is made under the policy of a phase that needs
``AutoCastVariable``s (a mixed one) and switched to the first phase's policy once its variables
exist; ``PhaseCallback`` (``schedule``) switches them at the phase boundaries.

Names: ``apply``; ``_rebuild``, ``_copy_weights``, ``_cast_outputs``, ``_made_rows``, ``switch_policies``,
``attach_asset``, ``OUTPUT_CAST``, ``ASSET``.
"""

from __future__ import annotations

import functools
import json
import os
import types
import weakref
from typing import Any

import tensorflow as tf
import tf_keras

from ...core.plan import PlanRow, build_plan
from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from ..common import room_above
from .environment import FRAMEWORK, resolve_policy, set_matmul_precision
from .layers import AUTHOR, describe, is_graph, dtype_policy, walk

#: the name of the layer :func:`apply` appends to cast the model's outputs to ``output_dtype``
OUTPUT_CAST = "ampbridge_output_cast"


def _rebuild(model: Any, rows: dict[str, PlanRow], prefix: str = "") -> Any:
    """A clone of a Functional or Sequential ``model`` whose every layer has its row's dtype policy
    (nested graph models are rebuilt the same way, one level further down the paths)."""
    paths = {id(layer): path for path, layer in walk(model)}

    def clone(layer: Any) -> Any:
        path = paths[id(layer)]
        full = f"{prefix}.{path}" if prefix else path
        if is_graph(layer):
            new = _rebuild(layer, rows, full)
        else:
            row = rows[full]
            config = layer.get_config()
            config["dtype"] = dtype_policy(row.compute_dtype, row.param_dtype, where=full).name
            new = type(layer).from_config(config)
        object.__setattr__(new, AUTHOR, layer.__dict__.get(AUTHOR))  # the author's, not ampbridge's
        return new

    row = rows[prefix]
    outer = tf_keras.mixed_precision.Policy(dtype_policy(row.compute_dtype, row.param_dtype, where=prefix).name)
    # the container's own policy: clone_model makes it from the model's config (its layers are ours)
    previous = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(outer)
    try:
        new = tf_keras.models.clone_model(model, clone_function=clone)
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)
    return new


def _copy_weights(source: Any, target: Any) -> None:
    """Each layer's weights into the rebuilt layer at the same path, cast to its variables' dtype."""
    by_path = dict(walk(target))
    for path, layer in walk(source):
        own = layer._trainable_weights + layer._non_trainable_weights
        if not own or is_graph(layer):
            continue
        twin = by_path[path]
        for mine, theirs in zip(twin._trainable_weights + twin._non_trainable_weights, own, strict=True):
            mine.assign(tf_keras.backend.cast(theirs, mine.dtype))


def _cast_outputs(model: Any, output_dtype: str) -> Any:
    """``model`` with float outputs cast to ``output_dtype`` by a ``linear`` Activation in that dtype
    (the Keras 2 mixed-precision guide's idiom), or ``model`` itself when they already are."""
    outputs = list(model.outputs)
    wrong = [o.dtype.is_floating and o.dtype.name != output_dtype for o in outputs]
    if not any(wrong):
        return model
    cast = tf_keras.layers.Activation("linear", dtype=output_dtype, name=OUTPUT_CAST)
    if isinstance(model, tf_keras.Sequential) and len(outputs) == 1:
        model.add(cast)
        return model
    new = [cast(o) if w else o for o, w in zip(outputs, wrong)]
    return tf_keras.Model(model.inputs, new if len(new) > 1 else new[0], name=model.name)


def _set_in_place(model: Any, rows: dict[str, PlanRow], by_path: dict[str, Any], output_dtype: str) -> Any:
    """An unbuilt model: each layer's policy set before its variables exist (as if made with ``dtype=``),
    and the model's float outputs cast to ``output_dtype``: a Sequential gets the cast layer, a subclassed
    model a wrapper on its ``call`` (traced into a SavedModel with it)."""
    for path, layer in by_path.items():
        row = rows[path]
        # private: Layer._set_dtype_policy (tf-keras 2.21), what the constructor's dtype= calls
        layer._set_dtype_policy(dtype_policy(row.compute_dtype, row.param_dtype, where=path))
    own = type(model).call

    @functools.wraps(own)  # Keras 2's saving reads the call's signature (inputs, training, mask)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = own(self, *args, **kwargs)
        return tf.nest.map_structure(
            lambda t: tf.cast(t, output_dtype) if getattr(t, "dtype", None) is not None and t.dtype.is_floating
            and t.dtype.name != output_dtype else t, out)

    if rows[""].compute_dtype == output_dtype:
        return model
    if isinstance(model, tf_keras.Sequential):  # a layer of its config: saved, and reloaded without ampbridge
        model.add(tf_keras.layers.Activation("linear", dtype=output_dtype, name=OUTPUT_CAST))
    else:
        object.__setattr__(model, "call", types.MethodType(call, model))
    return model


def _made_rows(described: list[Any], policy: Policy, active: dict[str, PlanRow]) -> dict[str, PlanRow]:
    """For a ``[[phase]]`` schedule, the row each layer is *made* with, so that every phase runs by
    switching the layer's policy in place (Keras 2 makes ``AutoCastVariable``s only under a mixed
    policy): the first phase's row computing in another dtype than its parameters, else the active
    row. Parameter dtypes that differ between phases are refused by name (the variables are made once)."""
    policies = [phase.policy for phase in policy.phases] + [policy.replace(phases=())]
    plans = [{r.path: r for r in build_plan(described, p, framework=FRAMEWORK, warn=False)} for p in policies]
    made = {}
    for path, row in active.items():
        rows = [plan_rows[path] for plan_rows in plans]
        params = sorted({r.param_dtype for r in rows})
        if len(params) > 1:
            raise UnsupportedOptionError(
                f"[[phase]] param_dtype {' / '.join(params)} for layer {path or '(model)'!r}: Keras 2 makes a layer's "
                "variables once, in one dtype; accepted with tf_keras: one param_dtype per layer over the schedule")
        made[path] = next((r for r in rows if r.compute_dtype != r.param_dtype), row)
    return made


def switch_policies(by_path: dict[str, Any], rows: dict[str, PlanRow], *, after_build: bool = False) -> None:
    """Each layer's policy set to its row's (the phase in force). ``after_build``: a layer not built
    yet keeps the policy it is made with until its ``build`` has made its variables, then switches."""
    for path, layer in by_path.items():
        if path not in rows:
            continue
        new = dtype_policy(rows[path].compute_dtype, rows[path].param_dtype, where=path)
        if after_build and not layer.built and not hasattr(layer.build, "_is_default"):
            def build(input_shape: Any, _layer: Any = layer, _own: Any = layer.build, _new: Any = new) -> None:
                _own(input_shape)
                _layer.__dict__.pop("build", None)  # the class's own again
                _layer._set_dtype_policy(_new)

            object.__setattr__(layer, "build", build)
        else:
            # private: Layer._set_dtype_policy (tf-keras 2.21); its variables' dtype stays what it was made with
            layer._set_dtype_policy(new)


#: the file a ``.keras`` archive saved after :func:`apply` holds in ``assets/`` (plain Keras 2 ignores it)
ASSET = "ampbridge_tf_keras.json"


def attach_asset(model: Any) -> None:
    """Make ``model.save("….keras")`` write the policy and the compiled optimizer's loss-scale state into
    the archive's ``assets/`` (``save_assets`` is the hook Keras 2's ``.keras`` saving calls on every
    object that has one; an instance attribute here): Keras 2's own ``.keras`` file keeps the inner
    optimizer's variables but not the loss scale."""
    own = getattr(type(model), "save_assets", None)
    ref = weakref.ref(model)

    def save_assets(dir_path: Any) -> None:
        owner = ref()
        if own is not None:
            own(owner, dir_path)
        opt = getattr(owner, "optimizer", None)
        state = None
        if isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer):
            state = room_above(__package__, "loss_scale").state_of(opt)
        with open(os.path.join(str(dir_path), ASSET), "w", encoding="utf-8") as f:
            json.dump({"format": 1, "policy": owner._ampbridge_policy.to_dict(), "loss_scale": state}, f)

    object.__setattr__(model, "save_assets", save_assets)


def apply(model: Any, policy: Policy | str, *, warn: bool = True) -> Any:
    """The model made to run its Plan: each layer with its row's ``tf_keras.mixed_precision.Policy``
    (``keep_float32`` and pins give ``"float32"``), the same weights, outputs in ``output_dtype``.

    Keras 2 fixes a layer's dtype when its variables are made, so a built Functional or Sequential
    model is rebuilt (``clone_model``, weights copied) and the new model is returned: write
    ``model = ampbridge.tf_keras.apply(model, policy)``, then compile. A model not built yet (a
    subclassed one before its first call) is changed in place and returned. Refused by name: a built
    subclassed model, a compiled model (its optimizer holds the old variables), a parameter dtype
    pair Keras 2 has no policy for, a per-layer ``output_dtype``, and an ``[fp8]`` table (no float8).

    Example:
        >>> import ampbridge, tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, name="head")])
        >>> m = apply(m, ampbridge.preset("mixed_float16"))
        >>> m.get_layer("head").dtype_policy.name, m(tf_keras.backend.ones((1, 2))).dtype.name
        ('mixed_float16', 'float32')
    """
    built = any(layer.built for _, layer in walk(model))
    if built and not is_graph(model):
        raise UnsupportedOptionError(
            f"ampbridge.tf_keras.apply on a built {type(model).__name__}: Keras 2 fixes a layer's dtype when its "
            "variables are made, and only a Functional or Sequential model can be rebuilt from its config; apply "
            "the policy before the model's first call (or pass dtype= to each layer)")
    if getattr(model, "optimizer", None) is not None:
        raise UnsupportedOptionError("ampbridge.tf_keras.apply on a compiled model: its optimizer holds the "
                                     "old variables; apply the policy first, then compile the model it returns")
    policy, _ = resolve_policy(policy, warn=warn)
    if policy.uses_fp8:
        raise UnsupportedOptionError(
            "[fp8] is not realised on tf.keras 2: Keras 2 has no float8 training (Keras 3's quantize(\"float8\") "
            "does: ampbridge.keras); remove the [fp8] table for tf.keras 2")
    active = policy.at(step=0, epoch=0)
    set_matmul_precision(active.matmul_precision)
    described, by_path = describe(model)
    rows = {row.path: row for row in build_plan(described, active, framework=FRAMEWORK, warn=warn)}
    for row in rows.values():
        if row.path and row.output_dtype != row.compute_dtype:
            raise UnsupportedOptionError(
                f"output_dtype={row.output_dtype} for layer {row.path!r} (compute {row.compute_dtype}): Keras 2 "
                "layers return their compute dtype; accepted: output_dtype on the model only")
    made = _made_rows(described, policy, rows) if policy.phases else rows
    if not built:
        applied = _set_in_place(model, made, by_path, policy.output_dtype)
    else:
        applied = _rebuild(model, made)
        _copy_weights(model, applied)
        applied = _cast_outputs(applied, policy.output_dtype)
    if made is not rows:  # a schedule: the first phase runs, in layers made for every phase
        switch_policies(describe(applied)[1], rows, after_build=not built)
    object.__setattr__(applied, "_ampbridge_policy", policy)
    attach_asset(applied)
    return applied
