"""The Plan of a Keras model (the core's rules, plus the rows where Keras itself does otherwise),
and the Keras dtype policy each row becomes.

Names: ``plan``, ``dtype_policy``, ``MixedDTypePolicy``; ``static_plan``,
``_adjuster``, ``stream_meetings``, ``same_policy``, ``FLOATS``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import keras

from ...core.plan import Plan, PlanRow, build_plan, stream_notes, with_note
from ...core.policy import Policy
from ..common import room_above
from .environment import active_backend, resolve_policy
from .layers import code_caller, describe

FLOATS = ("float16", "bfloat16", "float32", "float64")


def is_float(x: Any) -> bool:
    """Whether ``x`` is a tensor (or variable) of one of the :data:`FLOATS` dtypes: what output
    casts, the monitor's probes and the traced dtypes look at.

    Example:
        >>> import keras
        >>> is_float(keras.ops.ones((1,), "float16")), is_float(keras.ops.ones((1,), "int32")), is_float(1.0)
        (True, False, False)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        return keras.backend.standardize_dtype(dtype) in FLOATS
    except ValueError:
        return False


# --- dtype policies ---------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="ampbridge")
class MixedDTypePolicy(keras.DTypePolicy):
    """A Keras dtype policy for the (compute, variable) pairs Keras has no name for.

    Keras names ``mixed_float16`` (float16 compute, float32 variables), ``mixed_bfloat16`` and
    single dtypes; ampbridge uses those whenever they fit (so a saved model needs nothing from
    ampbridge to reload), and this class for the rest, e.g. float32 compute with bfloat16
    storage. Its name is ``"<compute>/<variable>"``.

    Keras's ``Layer.from_config`` turns every non-quantized policy into its name and parses it
    with ``DTypePolicy``, which knows no such pair; so a layer config records the variable dtype
    only (weights reload exactly, in their storage dtype) and :func:`load_model` re-applies the
    compute dtype from the policy.

    Example:
        >>> MixedDTypePolicy("float32/bfloat16").variable_dtype
        'bfloat16'
    """

    def _parse_name(self, name: str) -> tuple[str, str]:
        compute, sep, variable = str(name).partition("/")
        if not sep:
            variable = compute
        if compute not in FLOATS or variable not in FLOATS:
            raise ValueError(f"MixedDTypePolicy name must be '<compute>/<variable>' (or one dtype) with float "
                             f"dtypes ({', '.join(FLOATS)}); received name={name!r}")
        return compute, variable

    def get_config(self) -> dict[str, Any]:
        return {"name": self.variable_dtype}


def dtype_policy(compute_dtype: str, param_dtype: str) -> keras.DTypePolicy:
    """The Keras dtype policy computing in ``compute_dtype`` with variables in ``param_dtype``.

    Example:
        >>> dtype_policy("float16", "float32").name
        'mixed_float16'
    """
    if compute_dtype == param_dtype:
        return keras.DTypePolicy(compute_dtype)
    if param_dtype == "float32" and compute_dtype in ("float16", "bfloat16"):
        return keras.DTypePolicy(f"mixed_{compute_dtype}")
    return MixedDTypePolicy(f"{compute_dtype}/{param_dtype}")


def same_policy(a: Any, b: Any) -> bool:
    return (getattr(a, "compute_dtype", None), getattr(a, "variable_dtype", None)) == (
        getattr(b, "compute_dtype", None), getattr(b, "variable_dtype", None))


# --- the Plan: what Keras really does per layer ---------------------------------------------------

_INTERNAL_FLOAT32 = ("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization")


def _adjuster(policy: Policy, by_path: dict[str, Any]):
    backend = active_backend()
    norms = tuple(getattr(keras.layers, n) for n in _INTERNAL_FLOAT32 if hasattr(keras.layers, n))

    streams = stream_meetings(policy, by_path)

    def adjust(row: PlanRow) -> PlanRow:
        layer, notes, changes = by_path[row.path], [], {}
        stream = streams(row)
        if stream is not None:
            notes.append(stream)
        half = row.compute_dtype in ("float16", "bfloat16")
        if row.path == "" and row.output_dtype != policy.output_dtype:
            notes.append(f"model outputs cast to output_dtype {policy.output_dtype}")
            changes["output_dtype"] = policy.output_dtype
        if half and isinstance(layer, norms):
            # ops.layer_normalization / batch_normalization / rms_normalization upcast to float32
            notes.append(f"Keras normalises in float32 internally, output {row.output_dtype}")
            changes["compute_dtype"] = "float32"
            changes["float32_inside"] = True
        if half and isinstance(layer, keras.layers.Embedding) and row.param_dtype != row.compute_dtype:
            # Embedding turns autocast off: the lookup reads the table as stored, then casts the rows
            notes.append(f"Keras looks embeddings up in their stored dtype {row.param_dtype}, "
                         f"output cast to {row.compute_dtype}")
            changes["compute_dtype"] = row.param_dtype
        if row.compute_dtype == "float16" and isinstance(layer, keras.layers.Softmax) and backend == "torch":
            if str(keras.src.backend.torch.core.get_device()) == "cpu":
                notes.append("Keras-on-torch computes float16 softmax in float32 internally on CPU")
                changes["compute_dtype"] = "float32"
                changes["float32_inside"] = True
        parent = by_path.get(row.path.rsplit(".", 1)[0]) if "." in row.path else None
        if row.path.endswith((".softmax", ".dropout")) and isinstance(parent, keras.layers.MultiHeadAttention):
            notes.append("runs only when MultiHeadAttention takes its explicit path (dropout > 0, attention "
                         "scores returned, or inputs not 3-D); otherwise ops.dot_product_attention "
                         "computes the softmax itself")
        if half and isinstance(layer, keras.layers.MultiHeadAttention) and backend in ("tensorflow", "jax"):
            notes.append("ops.dot_product_attention computes logits and softmax in float32")
        return with_note(row, "; ".join(notes), **changes) if notes else row

    return adjust


def stream_meetings(policy: Policy, by_path: dict[str, Any]):
    """``note(row) -> str | None``, fed the requested rows parents first: the core's
    :func:`~ampbridge.core.plan.stream_notes` with Keras's callers (:func:`code_caller`): a layer
    called from another layer's own code (keras-hub's ``TransformerEncoder`` calling its norm)
    whose output dtype differs from its caller's compute dtype. The caller's code mixes what it
    returns with its own tensors (``x + residual``): JAX and torch promote, and on TensorFlow
    ``apply`` turns on TensorFlow's numpy-style promotion while the caller runs, so the stream
    becomes the same dtype on every backend. A layer called by a Functional graph or a Sequential
    is not flagged: Keras casts each layer's inputs to that layer's compute dtype.
    """
    return stream_notes(policy, lambda path: code_caller(path, by_path))


def plan(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True) -> Plan:
    """The Plan of a Keras model under a policy: one row per layer, what will actually run; with
    example inputs it is :func:`~ampbridge.backends.keras.trace.trace`'s (one forward on a clone).

    Rows where Keras itself overrides the request say so in their ``note`` (norm layers
    normalise in float32 whatever their compute dtype; see docs/keras.md).

    Example:
        >>> import keras, ampbridge
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> plan(m, ampbridge.preset("mixed_bfloat16"))["head"].compute_dtype
        'bfloat16'
    """
    if example_inputs:
        return room_above(__package__, "trace").trace(model, policy, *example_inputs, warn=warn)
    return static_plan(model, policy, warn=warn)


def static_plan(model: Any, policy: Policy | str, *, warn: bool = True) -> Plan:
    """The Plan from the model's structure alone (no forward runs)."""
    policy, notes = resolve_policy(policy, warn=warn)
    described, by_path = describe(model)
    from .fp8 import mark_rows

    active = policy.at(step=0, epoch=0)
    built = build_plan(described, policy, framework=f"keras ({active_backend()})",
                       adjust=_adjuster(active, by_path), warn=warn, notes=notes)
    rows, following = _composite_outputs(list(built.rows), by_path, active)
    if following:
        notes = built.notes + (f"{following} composite row(s) follow the data flow (Keras casts nothing at a "
                               "layer's output); ampbridge.keras.trace(model, policy, *example_inputs) traces "
                               "the exact dtypes",)
        built = replace(built, rows=tuple(rows), notes=notes)
    return mark_rows(built)


#: the note of a composite layer whose own code meets a sublayer's output of another dtype
_FOLLOWS = ("output follows the data flow: Keras casts nothing at a layer's output, so it returns what its own code "
            "computes, as in the hand-pinned model: {compute} where a sublayer casts {what} back first (a pre-norm "
            "block), {dtype} where it reaches the output uncast (a post-norm block); ak.trace shows which")


def _composite_outputs(rows: "list[PlanRow]", by_path: dict[str, Any], policy: Policy) -> "tuple[list[PlanRow], int]":
    """Each composite layer's output dtype, as native Keras runs it: nothing casts a layer's output
    (only the model's, to ``output_dtype``, and a rule's ``output_dtype``), so a Functional model or a
    Sequential returns its output layers' dtypes, and a layer whose own code calls a sublayer of
    another output dtype returns the two promoted where that output reaches it (keras-hub BERT's
    post-norm encoder: its pinned norm's float32), or its compute dtype where a sublayer casts it back
    (a pre-norm block): the row keeps its compute dtype and its note says both. Rows are filled
    children first; returns the rows and how many follow the data flow."""
    index = {row.path: i for i, row in enumerate(rows)}
    explicit = {label for label, rule in policy.rules if rule.output_dtype}
    ids = {id(sub): p for p, sub in by_path.items()}
    called: dict[str, list[int]] = {}  # caller -> the rows its own code calls (one pass: 10,000 layers)
    for j, r in enumerate(rows):
        caller = code_caller(r.path, by_path)
        if caller is not None:
            called.setdefault(caller, []).append(j)
    following, maybe = 0, {}  # maybe: the dtypes a data-flow row may return
    for i in range(len(rows) - 1, 0, -1):  # the root (row 0) is cast to output_dtype
        row, layer = rows[i], by_path[rows[i].path]
        if not layer._layers or row.rule in explicit:
            continue
        graph = _graph_outputs(layer, ids)
        if graph is not None:
            outs = set().union(*({rows[index[p]].output_dtype} | maybe.get(p, set()) for p in graph if p in index))
            what = "its output layers' output"
            if isinstance(layer, keras.layers.MultiHeadAttention):
                what = "its output projection's output"
        else:
            outs = set().union(*({rows[j].output_dtype} | maybe.get(rows[j].path, set())
                                 for j in called.get(row.path, ()))) - {row.compute_dtype}
            what = "a sublayer's " + "/".join(sorted(outs)) + " output"  # a pinned norm's float32
            outs |= {row.compute_dtype} if outs else set()
        if not outs:
            continue
        several = " and ".join(sorted(outs))
        out = outs.pop() if len(outs) == 1 else ("float64" if "float64" in outs else "float32")
        if graph is not None and " and " in several:  # a dict of outputs (a backbone's sequence and pooled)
            said = f"returns {several} ({what}s: Keras casts nothing at a layer's output); the column shows the widest"
        elif graph is None and out != row.compute_dtype:  # the column keeps the compute dtype: a guess
            maybe[row.path] = {row.compute_dtype, out}
            said, out = _FOLLOWS.format(compute=row.compute_dtype, dtype=out, what=what), row.output_dtype
        elif out != row.output_dtype:
            said = f"returns {what} ({out})"
        else:
            continue
        following += graph is None
        rows[i] = with_note(row, "; ".join(n for n in (row.note, said) if n), output_dtype=out)
    return rows, following


def _graph_outputs(layer: Any, paths: dict[int, str]) -> "list[str] | None":
    """The paths of the layers whose outputs a Functional model or a Sequential returns (and
    MultiHeadAttention: its output projection's); None: the layer's own code decides. ``paths``:
    ``id(layer) -> path``."""
    if isinstance(layer, keras.layers.MultiHeadAttention):  # its call returns its output projection's output
        dense = getattr(layer, "_output_dense", None)
        return [paths[id(dense)]] if id(dense) in paths else None
    if isinstance(layer, keras.Sequential):
        return [paths[id(layer.layers[-1])]] if layer.layers and id(layer.layers[-1]) in paths else []
    outputs = getattr(layer, "outputs", None) if isinstance(layer, keras.Model) else None
    if outputs is None:
        return None
    made = [getattr(t, "_keras_history", None) for t in keras.tree.flatten(outputs)]
    return [paths[id(h[0])] for h in made if h is not None and id(h[0]) in paths]
