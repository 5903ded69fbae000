"""The walk of a tf_keras (Keras 2) model: nested layers by path, their portable kinds, the
dtypes the model's author fixed, and the neutral ``Layer`` descriptors the core plans from.

Names: ``layers``, ``walk``, ``dtype_policy``, ``kind_of``, ``kind_and_source``, ``register_kind``, ``owns``, ``author_dtypes``;
``describe``, ``AUTHOR``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import tf_keras

from ...core.kinds import KindRegistry
from ...core.plan import Layer
from ...errors import UnsupportedOptionError
from ..common import keras_kind_table, kind_cascade, walk_tree


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a tf_keras layer or model. Reads the module names of the object's classes
    (a user's model subclasses ``tf_keras.Model`` in its own module) before anything else, so an
    object of another framework is answered without looking further.

    Example:
        >>> owns([1, 2])
        False
    """
    if not any(c.__module__.startswith("tf_keras.") for c in type(obj).__mro__):
        return False
    module = sys.modules.get("tf_keras")
    return module is not None and isinstance(obj, module.layers.Layer)


# --- kinds ------------------------------------------------------------------------------------

@functools.cache
def _kind_table() -> list[tuple[tuple[type, ...], str]]:
    return keras_kind_table(tf_keras.layers)  # the same classes as Keras 3's (those Keras 2 has)


_REGISTERED = KindRegistry()


def register_kind(cls: type, kind: str | None) -> None:
    """Give a tf_keras layer class (and its subclasses) a portable kind in code; ``None``: no kind."""
    if not (isinstance(cls, type) and issubclass(cls, tf_keras.layers.Layer)):
        raise TypeError(f"ampbridge.tf_keras.register_kind needs a tf_keras.layers.Layer subclass; received {cls!r}")
    _REGISTERED.register(cls, kind)


def kind_of(layer: Any) -> str | None:
    """The portable kind of a tf_keras layer (see :func:`kind_and_source`)."""
    return kind_and_source(layer)[0]


def kind_and_source(layer: Any) -> tuple[str | None, str | None]:
    """``(kind, how it was decided)``: the ``ampbridge_kind`` attribute, :func:`register_kind`,
    tf_keras's classes, then the core's inference from the class's and its bases' names."""
    return kind_cascade(layer, _REGISTERED, _kind_table, "tf_keras.",
                        lambda l: l._flatten_layers(include_self=False, recursive=False))


# --- the walk ---------------------------------------------------------------------------------

def _children(layer: Any) -> list[tuple[str, Any]]:
    return [(child.name.replace("/", "."), child)
            for child in layer._flatten_layers(include_self=False, recursive=False)
            if not isinstance(child, tf_keras.layers.InputLayer)]


def walk(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` for the model (path ``""``) and every nested layer, depth first; paths join
    the layers' names with ``.``; a shared layer is listed once, at its first path.

    Example:
        >>> import tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, name="head")])
        >>> [path for path, _ in walk(m)]
        ['', 'head']
    """
    if not owns(model):
        raise TypeError(f"expected a tf_keras layer or model; received {type(model).__qualname__}")
    yield from walk_tree(model, _children)


def _own_params(layer: Any) -> int:
    own = layer._trainable_weights + layer._non_trainable_weights
    return sum(int(np.prod(v.shape)) for v in own)


AUTHOR = "_ampbridge_author_dtypes"  # in the layer's __dict__: read before ampbridge rebuilds it
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _pair(layer: Any) -> tuple[str, str]:
    policy = layer.dtype_policy
    return policy.compute_dtype, policy.variable_dtype


def author_dtypes(layer: Any, model: Any) -> tuple[str, str] | None:
    """The (compute, variable) dtypes the model's code fixed for ``layer``, or None.

    Keras 2 keeps no record of a constructor's ``dtype`` argument, so a layer counts as fixed by its
    author when its dtype policy differs from the model's (``Dense(..., dtype="float32")`` in a model
    built under ``mixed_float16``). A layer ampbridge rebuilt carries its original's answer.

    Example:
        >>> import tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, dtype="float16")])
        >>> author_dtypes(m.layers[0], m)
        ('float16', 'float16')
    """
    if AUTHOR in layer.__dict__:
        return layer.__dict__[AUTHOR]
    fixed = _pair(layer) if _pair(layer) != _pair(model) else None
    if fixed is not None and not (fixed[0] in _FLOATS and fixed[1] in _FLOATS):
        fixed = None
    object.__setattr__(layer, AUTHOR, fixed)
    return fixed


def layers(model: Any) -> list[Layer]:
    """The model's neutral ``ampbridge.Layer`` descriptors, in :func:`walk` order (what the Plan is built from).

    Example:
        >>> import tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, name="head")])
        >>> [(l.path, l.kind, l.param_count) for l in layers(m)]
        [('', None, 0), ('head', 'linear', 3)]
    """
    return describe(model)[0]


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


def describe(model: Any) -> tuple[list[Layer], dict[str, Any]]:
    """The model's core ``Layer`` descriptors and its layers by path (what planning and applying read)."""
    described, by_path = [], {}
    for path, layer in walk(model):
        kind, source = kind_and_source(layer)
        fixed = author_dtypes(layer, model) if path else None  # the model's own dtype is the user's
        described.append(Layer(path, kind, type(layer).__name__, _own_params(layer), source, fixed))
        by_path[path] = layer
    return described, by_path


def is_graph(layer: Any) -> bool:
    """Whether ``layer`` is a Functional or Sequential model (its graph calls its layers)."""
    return isinstance(layer, tf_keras.Model) and bool(getattr(layer, "_is_graph_network", False))
