"""What one forward really ran in: ``trace(model, policy, *example_inputs)`` applies the policy to a
clone of the model, runs one forward with a probe on every layer and writes the observed dtypes onto
the static Plan's rows.

Holds ``trace``.
"""

from __future__ import annotations

from typing import Any

import keras

from ...core.plan import NO_OP, Plan, join_notes, not_run, traced_plan, traced_row, with_note
from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from .apply import apply
from .environment import active_backend
from .layers import walk
from .plan import is_float, static_plan


def trace(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True) -> Plan:
    """The Plan of a Keras model under a policy; with example inputs, one forward runs (on a clone,
    applied; the model itself is untouched) and each row's compute and output dtype are what ran.

    The probe sees each layer's ``call``: compute is the dtype its call returns, output what
    ``layer(...)`` returns. Ops inside a call are not seen, so a row whose static note already says
    Keras computes in float32 internally (norm layers) keeps that compute dtype. Rows changed by
    the trace say ``traced: ...``; layers that did not run say so.

    Example:
        >>> import keras, ampbridge
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> trace(m, "mixed_bfloat16", keras.ops.ones((1, 2)))["head"].output_dtype
        'bfloat16'
    """
    if not example_inputs:
        raise TypeError("trace(model, policy, *example_inputs) needs example inputs; plan(model, policy) is "
                        "the static Plan")
    static = static_plan(model, policy, warn=warn)
    try:
        twin = keras.models.clone_model(model)
        twin.set_weights(model.get_weights())
    except Exception as e:  # clone_model needs a Functional/Sequential model or a get_config
        raise UnsupportedOptionError(f"trace(model, policy, *example_inputs) traces a clone of the model; "
                                     f"keras.models.clone_model refused {type(model).__name__}: {e}") from e
    restore = _matmul_precision_restorer()  # apply sets it process-wide; a Plan changes nothing
    try:
        apply(twin, static.policy, warn=False)
        records = _probe(twin)
        twin(*example_inputs)
    finally:
        restore()
    composite = {p: isinstance(layer, keras.Model) for p, layer in walk(twin)}  # its call is its graph
    rows = []
    for row in static.rows:
        rec = records.get(row.path)
        if rec is None:  # not in the clone (a layer built lazily): nothing observed
            rows.append(row)
            continue
        if not (rec["returns"] or rec["outputs"]):
            rows.append(not_run(row))
            continue
        if rec["returns"] and not rec["acted"]:  # its call ran no op: the static row stays
            rows.append(with_note(row, join_notes(row.note, NO_OP)))
            continue
        internal = row.float32_inside  # Keras upcasts inside the call: the probe cannot see it
        compute = None if internal or composite.get(row.path) else rec["returns"]
        rows.append(traced_row(row, compute, rec["outputs"]))
    ran = {path for path, rec in records.items() if rec["returns"] or rec["outputs"]}
    return traced_plan(static, rows, ran=ran)


def _probe(model: Any) -> dict[str, dict[str, set[str]]]:
    """Per layer path: the float dtypes its ``call`` returns and ``layer(...)`` returns (outermost:
    the clone's class is swapped for a recording subclass, whatever wraps ``call``)."""
    records: dict[str, dict[str, set[str]]] = {}
    for path, layer in walk(model):
        rec = records.setdefault(path, {"returns": set(), "outputs": set(), "acted": set()})
        inner = layer.call

        def call(*args: Any, _inner: Any = inner, _rec: Any = rec, **kwargs: Any) -> Any:
            out = _inner(*args, **kwargs)
            _rec["returns"] |= _floats(out)
            if not (args and out is args[0]):  # Dropout at inference returns its input: no op ran
                _rec["acted"] = {"yes"}
            return out

        object.__setattr__(layer, "call", call)

        def __call__(self: Any, *args: Any, _rec: Any = rec, **kwargs: Any) -> Any:
            out = super(type(self), self).__call__(*args, **kwargs)
            _rec["outputs"] |= _floats(out)
            return out

        cls = type(layer)
        layer.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return records


def _matmul_precision_restorer() -> Any:
    backend = active_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
        return lambda: tf.config.experimental.enable_tensor_float_32_execution(tf32)
    if backend == "jax":
        import jax

        precision = jax.config.jax_default_matmul_precision
        return lambda: jax.config.update("jax_default_matmul_precision", precision)
    if backend == "torch":
        import torch

        precision = torch.get_float32_matmul_precision()
        return lambda: torch.set_float32_matmul_precision(precision)
    return lambda: None


def _floats(tree: Any) -> set[str]:
    return {keras.backend.standardize_dtype(t.dtype) for t in keras.tree.flatten(tree) if is_float(t)}


