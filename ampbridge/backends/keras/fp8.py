"""FP8 on Keras: the ``[fp8]`` table realised with Keras's own float8 training (delayed scaling)
and with ampbridge's own current scaling (:mod:`.fp8_current`: Keras has none).

Under ``scaling = "delayed"`` the layers the Plan marks float8 are quantized by
``model.quantize("float8", filters=...)`` (Keras's ``Dense``/``EinsumDense`` float8 path: delayed
scaling with per-tensor float32 scales and
amax histories kept as model variables that the optimizer overwrites with their "gradients").
That is the reference's *delayed* scaling (:mod:`ampbridge.core.fp8`) with ``amax_compute = "max"``
and ``margin = 0``; ``amax_history`` is carried by a ``QuantizedFloat8DTypePolicy`` with that
``amax_history_length``. Keras quantizes each step with the previous step's scale. The float8
casts are real on every backend; the matmul runs in the compute dtype on dequantised values.

Under ``scaling = "current"`` each float8 ``Dense``/``EinsumDense`` gets a stateless
:class:`.fp8_current.CurrentScalingCall` as its ``call`` (any formats, any margin; a phase can turn
it on and off). Refused by name under delayed scaling: ``amax_compute = "most_recent"``, ``margin`` other
than 0, formats other than e4m3 forward / e5m2 backward (Keras hard-codes them), a matched
layer that is not a ``Dense``/``EinsumDense``, a layer not built yet, and a phase that turns FP8
on after the optimizer is built or off again (Keras cannot undo a quantization).

Holds ``REALISED_BY``, ``mark_rows``, ``check`` and ``realise``.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import keras

from ...core.plan import Plan
from ...core.policy import Policy
from ...errors import UnsupportedOptionError

REALISED_BY = "Keras float8 quantize"
REALISED_BY_CURRENT = "ampbridge current scaling"
_FLOAT8_CLASSES = ("Dense", "EinsumDense")


def mark_rows(plan: Plan) -> Plan:
    """``plan`` with each float8 row's ``fp8_by`` filled in."""
    if not any(r.fp8 for r in plan.rows):
        return plan
    from ...diagnostics.doctor import emulation_note
    from ...diagnostics.hardware import Device
    from .environment import device

    # current scaling's call multiplies float32 dequantised values on every device: emulated everywhere
    by = {"delayed": REALISED_BY + emulation_note(device(), keras.backend.backend()),
          "current": REALISED_BY_CURRENT + emulation_note(Device("cpu"), keras.backend.backend())}
    return replace(plan, rows=tuple(replace(r, fp8_by=by[r.fp8_scaling]) if r.fp8 else r for r in plan.rows))


def _is_float8(layer: Any) -> bool:
    return getattr(layer.dtype_policy, "quantization_mode", None) == "float8"


def _own_call(layer: Any) -> bool:
    """Whether ``layer`` runs Keras's own ``Dense``/``EinsumDense`` call (what current scaling replaces)."""
    return any(type(layer).call is cls.call for cls in (keras.layers.Dense, keras.layers.EinsumDense)
               if isinstance(layer, cls))


def check(policy: Policy, plan: Plan, by_path: dict[str, Any]) -> None:
    """Refuse, by name, what Keras's float8 cannot carry (before anything is changed)."""
    fp8 = policy.fp8
    for row in plan.rows:
        layer = by_path[row.path]
        if _is_float8(layer) and not row.fp8:
            raise UnsupportedOptionError(
                f"layer {row.path or '(model)'!r} is float8-quantized and this policy does not put it in float8; "
                f"Keras cannot undo a quantization (an [fp8] phase can turn FP8 on, not off)")
    if not fp8.enabled:
        return
    if fp8.scaling == "current":
        return _check_layers(plan, by_path, "current")  # ampbridge's own: any format, any margin
    refused = {"amax_compute": ("most_recent", 'Keras takes the history\'s max (amax_compute = "max")'),
               "forward": ("e5m2", "Keras casts inputs and kernels to float8_e4m3fn (forward = \"e4m3\")"),
               "backward": ("e4m3", "Keras casts output gradients to float8_e5m2 (backward = \"e5m2\")")}
    for key, (bad, why) in refused.items():
        if getattr(fp8, key) == bad:
            raise UnsupportedOptionError(f"fp8.{key} = {bad!r} is not realised on Keras: {why}")
    if fp8.margin != 0:
        raise UnsupportedOptionError(f"fp8.margin = {fp8.margin} is not realised on Keras: its float8 layers "
                                     f"compute the scale with margin 0; write margin = 0")
    _check_layers(plan, by_path, fp8.scaling)


def _check_layers(plan: Plan, by_path: dict[str, Any], scaling: str) -> None:
    for row in plan.rows:
        if not row.fp8:
            continue
        layer = by_path[row.path]
        mode = getattr(layer.dtype_policy, "quantization_mode", None)
        if scaling == "current" and mode is not None:  # a quantized layer runs quantized_call, not call
            raise UnsupportedOptionError(
                f"fp8.scaling = 'current' for {row.path or '(model)'!r}, which is {mode}-quantized; Keras "
                f"cannot undo a quantization: apply current scaling to an unquantized model")
        if scaling == "current" and not _own_call(layer):
            raise UnsupportedOptionError(
                f"fp8.match puts {row.path or '(model)'!r} ({row.class_name}) in float8 with current "
                f"scaling, but ampbridge's current scaling replaces the call of Keras's own Dense and "
                f"EinsumDense only (not a subclass with its own call); match those (kind:linear or their paths)")
        if type(layer).__name__ not in _FLOAT8_CLASSES or not hasattr(layer, "_float8_build"):
            raise UnsupportedOptionError(
                f"fp8.match puts {row.path or '(model)'!r} ({row.class_name}) in float8, but Keras trains "
                f"Dense and EinsumDense layers in float8 only; match those (kind:linear or their paths)")
        if scaling == "delayed" and not layer.built:  # current scaling swaps the call, built or not
            raise UnsupportedOptionError(f"fp8.match puts {row.path!r} in float8, but it is not built yet; "
                                         f"build the model (call it once, or keras.Input) before apply")


def realise(model: Any, policy: Policy, plan: Plan, by_path: dict[str, Any]) -> bool:
    """Quantize the Plan's float8 rows with Keras's own float8 (the others are left alone); True if any was."""
    check(policy, plan, by_path)
    _set_current_calls(plan, by_path, policy.fp8)
    if policy.fp8.scaling == "current":
        return False
    todo = {id(by_path[r.path]): by_path[r.path] for r in plan.rows if r.fp8 and not _is_float8(by_path[r.path])}
    if not todo:
        return False
    if getattr(getattr(model, "optimizer", None), "built", False):
        raise UnsupportedOptionError(
            "[fp8] turns float8 on for layers of a model whose optimizer is already built; Keras's float8 "
            "scales and amax histories are new variables the optimizer would not know: apply the FP8 policy "
            "before compiling/training")
    history = policy.fp8.amax_history
    if history != keras.dtype_policies.QuantizedFloat8DTypePolicy.default_amax_history_length:
        # a float8 dtype policy given to a built layer quantizes it with that policy's history length
        for layer in todo.values():
            layer.dtype_policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
                "float8", source_name=layer.dtype_policy.name, amax_history_length=history)
    elif "" in plan and id(by_path[""]) in todo:
        by_path[""].quantize("float8")
    elif "filters" in inspect.signature(model.quantize).parameters:
        model.quantize("float8", filters=lambda layer: id(layer) in todo)
    else:
        quantize_layers(model, list(todo.values()))
    return True


def _set_current_calls(plan: Plan, by_path: dict[str, Any], fp8: Any) -> None:
    """Give each current-scaling float8 row's layer a :class:`.fp8_current.CurrentScalingCall` and
    take it from every other layer (its class's own call again): no variables change."""
    from .fp8_current import CurrentScalingCall

    for row in plan.rows:
        layer = by_path[row.path]
        want = row.fp8 and fp8.scaling == "current"
        had = layer.__dict__.get("call")
        same = isinstance(had, CurrentScalingCall) and had.settings == (fp8.forward, fp8.backward, fp8.margin)
        if want and not same:
            layer.call = CurrentScalingCall(layer, fp8.forward, fp8.backward, fp8.margin)
        elif not want and isinstance(had, CurrentScalingCall):
            del layer.call


def quantize_layers(model: Any, chosen: list[Any]) -> None:
    """``model.quantize("float8")`` for the chosen layers only, as Keras before ``filters`` (3.12)
    does it for every layer: each layer's own ``quantize``, then the model's step functions rebuilt
    (and, on torch, the variables re-tracked)."""
    for layer in chosen:
        layer.quantize("float8")
    model.train_function = model.test_function = model.predict_function = None
    if keras.backend.backend() == "torch":
        for layer in model._flatten_layers():
            layer._track_variables()
