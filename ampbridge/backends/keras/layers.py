"""The walk of a Keras model: nested layers by path, their portable kinds, and the neutral
``Layer`` descriptors the core plans from.

Names: ``layers``, ``kind_of``, ``kind_and_source``, ``register_kind``, ``owns``; ``_children``,
``_own_params``, ``_describe``. Kinds: ``ampbridge_kind``, ``register_kind``, Keras's classes, then
the core's inference from the class's and its bases' names (:mod:`ampbridge.core.kinds`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from ...core.kinds import KindRegistry, infer_kind
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


_REGISTERED = KindRegistry()


def register_kind(cls: type, kind: str | None) -> None:
    """Give a Keras layer class (and its subclasses) a portable kind in code; ``None``: no kind.

    Beats Keras's classes and the inference from names; the policy's ``[kinds]`` table beats it.
    """
    if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
        raise TypeError(f"ampbridge.keras.register_kind needs a keras.layers.Layer subclass; received {cls!r}")
    _REGISTERED.register(cls, kind)


def kind_of(layer: Any) -> str | None:
    """The portable kind of a Keras layer (see :func:`kind_and_source`)."""
    return kind_and_source(layer)[0]


def kind_and_source(layer: Any) -> tuple[str | None, str | None]:
    """``(kind, how it was decided)``: the ``ampbridge_kind`` attribute, :func:`register_kind`,
    Keras's classes, then the core's inference from the class's and its bases' names."""
    declared = getattr(layer, "ampbridge_kind", None)
    if declared is not None:
        return declared, "ampbridge_kind attribute"
    registered = _REGISTERED.lookup(type(layer))
    if _REGISTERED.found(registered):
        return registered, "registered"
    global _KINDS
    if _KINDS is None:
        _KINDS = _kind_table()
    for classes, kind in _KINDS:
        if isinstance(layer, classes):
            return kind, "framework class"
    names = [c.__name__ for c in type(layer).__mro__ if not c.__module__.startswith(("keras.", "builtins"))]
    leaf = not layer._flatten_layers(include_self=False, recursive=False)
    return infer_kind(names, leaf=leaf)


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
        kind, source = kind_and_source(layer)
        described.append(Layer(path, kind, type(layer).__name__, _own_params(layer), source))
        by_path[path] = layer
    return described, by_path


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model (what this backend plans and applies to)."""
    return isinstance(obj, keras.layers.Layer)
