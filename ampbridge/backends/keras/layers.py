"""The walk of a Keras model: nested layers by path, their portable kinds, and the neutral
``Layer`` descriptors the core plans from.

Names: ``layers``, ``kind_of``, ``owns``; ``_children``, ``_own_params``, ``_describe``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from ...core.plan import Layer


# --- kinds ------------------------------------------------------------------------------------

def _kind_table() -> list[tuple[tuple[type, ...], str]]:
    L = keras.layers
    norm = tuple(getattr(L, n) for n in ("BatchNormalization", "LayerNormalization", "GroupNormalization",
                                          "UnitNormalization", "RMSNormalization") if hasattr(L, n))
    conv = tuple(getattr(L, n) for n in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D") if hasattr(L, n))
    attention = tuple(getattr(L, n) for n in ("MultiHeadAttention", "GroupedQueryAttention",
                                               "Attention", "AdditiveAttention") if hasattr(L, n))
    recurrent = tuple(getattr(L, n) for n in ("RNN", "Bidirectional", "LSTMCell", "GRUCell",
                                               "SimpleRNNCell", "StackedRNNCells") if hasattr(L, n))
    # most specific first: ConvLSTM subclasses RNN, so it stays recurrent
    return [(norm, "norm"), ((L.Embedding,), "embedding"), ((L.Softmax,), "softmax"),
            ((L.Dense, L.EinsumDense), "linear"), (attention, "attention"), (recurrent, "recurrent"),
            (conv, "conv")]


_KINDS: list[tuple[tuple[type, ...], str]] | None = None


def kind_of(layer: Any) -> str | None:
    """The portable kind of a Keras layer: its ``ampbridge_kind`` attribute, else its class."""
    declared = getattr(layer, "ampbridge_kind", None)
    if declared is not None:
        return declared
    global _KINDS
    if _KINDS is None:
        _KINDS = _kind_table()
    for classes, kind in _KINDS:
        if isinstance(layer, classes):
            return kind
    return None


# Built-in composite layers create some sublayers with auto-generated, process-dependent names
# ("softmax_7"); their path segment is the role instead, so a Plan is stable across runs.
_ROLE_NAMES = {"_softmax": "softmax", "_dropout_layer": "dropout"}


def _children(layer: Any) -> list[tuple[str, Any]]:
    out = []
    for child in layer._flatten_layers(include_self=False, recursive=False):
        if isinstance(child, keras.layers.InputLayer):
            continue
        name = child.name
        for attr, role in _ROLE_NAMES.items():
            if getattr(layer, attr, None) is child:  # torch keeps sublayers in _modules, not __dict__
                name = role
        out.append((name.replace("/", "."), child))
    return out


def layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` for the model (path ``""``) and every nested layer, depth first.

    Paths join the layers' names with ``.``; a layer reached twice (shared) is listed once, at
    its first path; sublayers of Keras's attention layers that Keras names automatically are
    named by role (``mha.softmax``, ``mha.dropout``).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> [path for path, _ in layers(m)]
        ['', 'head']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"expected a Keras layer or model; received {type(model).__qualname__}")
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", model)]
    while stack:
        path, layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield path, layer
        kids, used = [], set()
        for name, child in _children(layer):
            segment, n = name, 1
            while segment in used:  # siblings with one name (possible in subclassed models)
                n += 1
                segment = f"{name}_{n}"
            used.add(segment)
            kids.append((f"{path}.{segment}" if path else segment, child))
        stack.extend(reversed(kids))


def _own_params(layer: Any) -> int:
    return sum(int(np.prod(v.shape)) for v in layer._trainable_variables + layer._non_trainable_variables)


def _describe(model: Any) -> tuple[list[Layer], dict[str, Any]]:
    described, by_path = [], {}
    for path, layer in layers(model):
        described.append(Layer(path, kind_of(layer), type(layer).__name__, _own_params(layer)))
        by_path[path] = layer
    return described, by_path


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model (what this backend plans and applies to)."""
    return isinstance(obj, keras.layers.Layer)
