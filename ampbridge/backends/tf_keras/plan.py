"""The Plan of a tf_keras model (the core's rules, plus the rows where Keras 2 itself does
otherwise), static or observed in one forward of the applied copy (``traced``; ``trace`` is its verb).

Names: ``plan``, ``STREAM_REFUSED``; ``_static``, ``traced``, ``_adjuster``, ``_code_caller``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

from ...core.plan import Plan, PlanRow, build_plan, stream_notes, traced_plan, traced_row, with_note
from ...core.policy import Policy
from .apply import apply
from .environment import FRAMEWORK, resolve_policy
from .layers import describe, is_graph, walk


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
    return None if layer is None or is_graph(layer) else parent


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
        return traced(model, policy, example_inputs, warn=warn)
    return _static(model, policy, warn=warn)


def _static(model: Any, policy: Policy | str, *, warn: bool = True) -> Plan:
    policy, notes = resolve_policy(policy, warn=warn)
    described, by_path = describe(model)
    return build_plan(described, policy, framework=FRAMEWORK,
                      adjust=_adjuster(policy.at(step=0, epoch=0), by_path), warn=warn, notes=notes)


def traced(model: Any, policy: Policy | str, example_inputs: tuple[Any, ...], *, warn: bool = True) -> Plan:
    """The static Plan with the output dtypes one forward of the applied copy observed: the model's, and
    those of the layers of its own graph called once (a nested graph's tensors are its own)."""
    static = _static(model, policy, warn=warn)
    twin = apply(model, static.policy, warn=False)  # a rebuilt copy: the model given is not changed
    by_path = dict(walk(twin))
    probed = [p for p, layer in by_path.items() if p and "." not in p and not is_graph(layer)
              and len(getattr(layer, "_inbound_nodes", ())) == 1]
    taps = tf_keras.Model(twin.inputs, [by_path[p].output for p in probed] + [twin.output])
    seen = taps(*example_inputs)
    observed = {p: {t.dtype.name} for p, t in zip(probed, seen)}
    observed[""] = {t.dtype.name for t in tf.nest.flatten(seen[-1])}
    rows = [traced_row(row, None, observed[row.path]) if row.path in observed else row for row in static.rows]
    return traced_plan(static, rows)
