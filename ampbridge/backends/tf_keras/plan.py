"""The Plan of a tf_keras model (the core's rules, plus the rows where Keras 2 itself does
otherwise), and the Keras 2 dtype policy each row becomes.

Names: ``plan``, ``dtype_policy``, ``STREAM_REFUSED``; ``_static``, ``_adjuster``, ``_code_caller``.
"""

from __future__ import annotations

from typing import Any

import tf_keras

from ...core.plan import Plan, PlanRow, build_plan, stream_notes, with_note
from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from .environment import FRAMEWORK, _phase0, resolve_policy
from .layers import _describe, _graph


def dtype_policy(compute_dtype: str, param_dtype: str, *, where: str = "") -> Any:
    """The ``tf_keras.mixed_precision.Policy`` computing in ``compute_dtype`` with variables in
    ``param_dtype``. Keras 2 names only single dtypes and ``mixed_float16`` / ``mixed_bfloat16``
    (float32 variables); any other pair is refused by name.

    Example:
        >>> dtype_policy("float16", "float32").name
        'mixed_float16'
    """
    if compute_dtype == param_dtype:
        return tf_keras.mixed_precision.Policy(compute_dtype)
    if param_dtype == "float32" and compute_dtype in ("float16", "bfloat16"):
        return tf_keras.mixed_precision.Policy(f"mixed_{compute_dtype}")
    raise UnsupportedOptionError(
        f"compute_dtype={compute_dtype} with param_dtype={param_dtype}{' for layer ' + repr(where) if where else ''}: "
        "Keras 2 has no dtype policy for this pair; accepted: one dtype for both, or float16/bfloat16 "
        "compute with float32 parameters (mixed_float16, mixed_bfloat16)")


#: what a stream row's note adds on tf_keras: ampbridge turns TensorFlow's promotion on for Keras 3 only
STREAM_REFUSED = ("not on tf_keras: there TensorFlow raises where the caller's own code mixes the two dtypes "
                  "(x + residual), as Keras 2 does natively; a layer the caller just calls casts its inputs itself. "
                  "Pin the caller too, or give the row output_dtype = the caller's dtype")


def _code_caller(path: str, by_path: dict[str, Any]) -> str | None:
    """The path of the layer whose own code calls the layer at ``path``; None where a Functional or
    Sequential graph calls it (Keras 2 casts each layer's inputs to its compute dtype there)."""
    if not path:
        return None
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    layer = by_path.get(parent)
    return None if layer is None or _graph(layer) else parent


def _adjuster(policy: Policy, by_path: dict[str, Any]):
    streams = stream_notes(policy, lambda path: _code_caller(path, by_path))

    def adjust(row: PlanRow) -> PlanRow:
        layer, notes, changes = by_path[row.path], [], {}
        stream = streams(row)
        if stream is not None:
            notes.append(f"{stream}; {STREAM_REFUSED}")
        half = row.compute_dtype in ("float16", "bfloat16")
        if row.path == "" and row.output_dtype != policy.output_dtype:
            notes.append(f"model outputs cast to output_dtype {policy.output_dtype}")
            changes["output_dtype"] = policy.output_dtype
        # tf_keras's BatchNormalization always normalises 16-bit inputs in float32; its LayerNormalization
        # only with float32 variables (fused kernel or a cast): with bfloat16 ones it computes in bfloat16,
        # where Keras 3 upcasts (layer_normalization.py, tf-keras 2.21)
        if half and (isinstance(layer, tf_keras.layers.BatchNormalization) or (
                isinstance(layer, tf_keras.layers.LayerNormalization) and row.param_dtype == "float32")):
            notes.append(f"Keras normalises in float32 internally, output {row.output_dtype}")
            changes["compute_dtype"] = "float32"
        if half and isinstance(layer, tf_keras.layers.Embedding) and row.param_dtype != row.compute_dtype:
            # Keras 2's Embedding turns autocast off: it looks the stored table up, then casts the rows
            notes.append(f"Keras looks embeddings up in their stored dtype {row.param_dtype}, "
                         f"output cast to {row.compute_dtype}")
            changes["compute_dtype"] = row.param_dtype
        return with_note(row, "; ".join(notes), **changes) if notes else row

    return adjust


def plan(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True) -> Plan:
    """The Plan of a tf_keras model under a policy: one row per layer, what will run; with example
    inputs, the rows one forward observed (:func:`ampbridge.backends.tf_keras.trace.trace`).

    Example:
        >>> import ampbridge, tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, name="head")])
        >>> plan(m, ampbridge.preset("mixed_bfloat16"))["head"].compute_dtype
        'bfloat16'
    """
    if example_inputs:
        from .trace import trace

        return trace(model, policy, *example_inputs, warn=warn)
    return _static(model, policy, warn=warn)


def _static(model: Any, policy: Policy | str, *, warn: bool = True) -> Plan:
    policy, notes = resolve_policy(policy, warn=warn)
    described, by_path = _describe(model)
    return build_plan(described, policy, framework=FRAMEWORK,
                      adjust=_adjuster(_phase0(policy), by_path), warn=warn, notes=notes)
