"""The walk of a Keras model: nested layers by path, their portable kinds, and the neutral
``Layer`` descriptors the core plans from.

Names: ``walk`` (``(path, keras layer)`` pairs), ``layers`` (core ``Layer`` descriptors), ``kind_of``,
``kind_and_source``, ``register_kind``, ``owns``, ``author_dtypes``;
``children``, ``code_caller``, ``_own_params``, ``describe``. Kinds: ``ampbridge_kind``, ``register_kind``, Keras's classes, then
the core's inference from the class's and its bases' names (:mod:`ampbridge.core.kinds`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from ...core.kinds import KindRegistry
from ...core.plan import Layer
from ..common import keras_kind_table, kind_cascade, walk_tree


# --- kinds ------------------------------------------------------------------------------------

@functools.cache
def _kind_table() -> list[tuple[tuple[type, ...], str]]:
    return keras_kind_table(keras.layers)


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
    return kind_cascade(layer, _REGISTERED, _kind_table, "keras.",
                        lambda l: l._flatten_layers(include_self=False, recursive=False))


# Built-in composite layers create some sublayers with auto-generated, process-dependent names
# ("softmax_7"); their path segment is the role instead, so a Plan is stable across runs.
_ROLE_NAMES = {"_softmax": "softmax", "_dropout_layer": "dropout"}


def _snake_case(name: str) -> str:
    # Keras's to_snake_case (keras/src/utils/naming.py), the prefix of its automatic layer names
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


AUTO = "_ampbridge_automatic_name"  # in a layer's __dict__: the name Keras made up for it


def _record_automatic_names() -> None:
    # Keras keeps no trace of whether a layer's name was given or made up (the class in snake
    # case and a process-wide counter), so from the import of ampbridge.keras on, each Operation
    # made without a name notes the one it got. keras.Operation.__init__(self, name=None) is
    # public; Layer.__init__ calls it by name, so a wrapper on the class sees every layer.
    original = keras.Operation.__init__
    if getattr(original, "_ampbridge_records", False):
        return

    # the same signature as Keras's (Operation.__new__ reads it with getfullargspec)
    @functools.wraps(original)
    def __init__(self: Any, name: Any = None) -> None:
        original(self, name=name)
        if name is None:
            object.__setattr__(self, AUTO, self.name)

    __init__._ampbridge_records = True  # type: ignore[attr-defined]
    keras.Operation.__init__ = __init__


_record_automatic_names()


def mark_automatic(layer: Any) -> None:
    """Treat ``layer``'s name as one Keras made up (a file ampbridge saved says which were)."""
    object.__setattr__(layer, AUTO, layer.name)


def _auto_prefix(layer: Any) -> str | None:
    """The class's automatic-name prefix if ``layer.name`` is one Keras made up (``dense_7``: the
    prefix and a process-wide counter), else None (the user's name)."""
    if layer.__dict__.get(AUTO) != layer.name:  # given by hand, or renamed since
        return None
    prefix = _snake_case(type(layer).__name__)
    return prefix if re.fullmatch(re.escape(prefix) + r"(_\d+)?", layer.name) else None


def children(layer: Any) -> list[tuple[str, Any]]:
    """The layer's direct sublayers as (name in its path, layer), as :func:`walk` descends (no
    ``InputLayer``); empty for a leaf layer.

    Example:
        >>> import keras
        >>> [name for name, _ in children(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")]))]
        ['d']
    """
    out, auto = [], {}
    for child in layer._flatten_layers(include_self=False, recursive=False):
        if isinstance(child, keras.layers.InputLayer):
            continue
        name = child.name
        prefix = _auto_prefix(child)
        if prefix is not None:
            # numbered among its siblings, as in a fresh process: not by how many layers of
            # that class the process made before (which changes the name, not the model)
            n = auto[prefix] = auto.get(prefix, -1) + 1
            name = prefix if n == 0 else f"{prefix}_{n}"
        for attr, role in _ROLE_NAMES.items():
            if getattr(layer, attr, None) is child:  # torch keeps sublayers in _modules, not __dict__
                name = role
        out.append((name.replace("/", "."), child))
    return out


def walk(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` for the model (path ``""``) and every nested layer, depth first.

    Paths join the layers' names with ``.``, relative to ``model``; a layer reached twice (shared)
    is listed once, at its first path; sublayers of Keras's attention layers that Keras names
    automatically are named by role (``mha.softmax``, ``mha.dropout``). A name Keras made up
    (the class in snake case plus a process-wide counter: ``dense_7``, ``bert_backbone_1``) is
    numbered among its siblings instead (``dense``, ``dense_1``...), so paths do not depend on
    what the process built before (layers made before ``ampbridge.keras`` was imported keep
    Keras's names); names given by hand are kept.

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> [path for path, _ in walk(m)]
        ['', 'head']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"expected a Keras layer or model; received {type(model).__qualname__}")
    yield from walk_tree(model, children)


def _own_params(layer: Any) -> int:
    return sum(int(np.prod(v.shape)) for v in layer._trainable_variables + layer._non_trainable_variables)


AUTHOR = "_ampbridge_author_dtypes"  # kept in the layer's __dict__: read before ampbridge changes it
_ORIGINAL = "_ampbridge_original_policy"  # the layer's policy name when first seen
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _explicit_dtype(layer: Any) -> Any:
    # Keras records the constructor's arguments (simple values only) for its automatic config;
    # a dtype there is one the code passed, unless the layer was made from a saved config
    # (from_config passes every key of get_config, "trainable" included, and the dtype by name)
    config = getattr(getattr(layer, "_auto_config", None), "config", None) or {}
    return None if "trainable" in config else config.get("dtype")


def _policy_object_given(layer: Any, parent: Any) -> Any:
    """The dtype of a ``DTypePolicy`` object passed to the layer's constructor, or None.

    Keras records no constructor arguments when one is an object (``_auto_config`` is None), so
    the object is told by identity: a layer made with ``dtype=None`` holds the global policy of its
    time, and keras-hub passes ``dtype=self.dtype_policy`` (its parent's object) down.
    """
    policy = layer.dtype_policy
    if getattr(layer, "_auto_config", True) is not None or not isinstance(policy, keras.DTypePolicy):
        return None
    if policy is keras.config.dtype_policy() or (parent is not None and policy is parent.dtype_policy):
        return None
    return policy.name


def _given_dtype(parent: Any) -> Any:
    """The dtype a parent was given, which it passes down to the layers it makes."""
    given = _explicit_dtype(parent)
    if given is None and isinstance(parent, keras.Model) and not type(parent).__module__.startswith("keras."):
        # Keras does not record a Model subclass's constructor arguments (keras.Model(inputs,
        # outputs) and Sequential pass no dtype down): the subclass's first-seen policy
        given = parent.__dict__.get(_ORIGINAL)
    return given


def author_dtypes(layer: Any, parent: Any = None) -> tuple[str, str] | None:
    """The (compute, variable) dtypes the model's code fixed for ``layer``, or None.

    Fixed: a float dtype passed by name or as a ``DTypePolicy`` to the layer's constructor
    (``Activation("softmax", dtype="float32")``, keras-hub Llama's ``attention_softmax``) that differs from the one its
    ``parent`` was given (a model built with ``dtype=`` passes it to every layer: not a pin), or an
    entry for the layer's path in a ``DTypePolicyMap``. Read once per layer, before ampbridge
    changes its policy.

    Example:
        >>> import keras
        >>> author_dtypes(keras.layers.Activation("softmax", dtype="float32"))
        ('float32', 'float32')
        >>> author_dtypes(keras.layers.Activation("softmax")) is None
        True
    """
    if AUTHOR in layer.__dict__:
        return layer.__dict__[AUTHOR]
    object.__setattr__(layer, _ORIGINAL, getattr(layer.dtype_policy, "name", None))
    fixed = None
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        if layer.path and layer.path in list(policy.keys()):
            policy = policy[layer.path]
            fixed = (policy.compute_dtype, policy.variable_dtype)
    else:
        dtype = _explicit_dtype(layer)
        if dtype is None:  # a DTypePolicy object (keras.DTypePolicy("float32")) is the author's as a name is
            dtype = _policy_object_given(layer, parent)
        if isinstance(dtype, str) and (parent is None or dtype != _given_dtype(parent)):
            try:
                named = keras.DTypePolicy(dtype)
                fixed = (named.compute_dtype, named.variable_dtype)
            except ValueError:
                fixed = None
    if fixed is not None and not (fixed[0] in _FLOAT_DTYPES and fixed[1] in _FLOAT_DTYPES):
        fixed = None
    object.__setattr__(layer, AUTHOR, fixed)
    return fixed


def layers(model: Any) -> list[Layer]:
    """The model's layers as core :class:`~ampbridge.Layer` descriptors (path, kind, class, own
    parameter count), in :func:`walk`'s order: what the Plan is built from.

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> [(layer.path, layer.kind, layer.param_count) for layer in layers(m)]
        [('', None, 0), ('head', 'linear', 3)]
    """
    return describe(model)[0]


def describe(model: Any) -> tuple[list[Layer], dict[str, Any]]:
    described, by_path = [], {}
    for path, layer in walk(model):
        kind, source = kind_and_source(layer)
        parent = by_path.get(path.rsplit(".", 1)[0] if "." in path else "") if path else None
        fixed = author_dtypes(layer, parent) if path else None  # the model's own dtype is the user's
        if not path and _ORIGINAL not in layer.__dict__:
            object.__setattr__(layer, _ORIGINAL, getattr(layer.dtype_policy, "name", None))
        described.append(Layer(path, kind, type(layer).__name__, _own_params(layer), source, fixed))
        by_path[path] = layer
    return described, by_path


def code_caller(path: str, by_path: dict[str, Any]) -> str | None:
    """The path of the layer whose own code calls the layer at ``path``, or None where a graph
    calls it (a layer of a Functional model or a Sequential, or the model itself).

    Example:
        >>> import keras
        >>> x = keras.Input((3, 4))
        >>> m = keras.Model(x, keras.layers.MultiHeadAttention(2, 2, name="mha")(x, x))
        >>> by_path = dict(walk(m))
        >>> code_caller("mha", by_path), code_caller("mha.query", by_path)
        (None, 'mha')
    """
    if not path:
        return None
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    layer = by_path.get(parent)
    # a Functional model (keras-hub's backbones and tasks too) has graph inputs; a model
    # subclassed with its own call() has none (Keras has no public name for Functional)
    graph = isinstance(layer, keras.Sequential) or (
        isinstance(layer, keras.Model) and getattr(layer, "inputs", None) is not None)
    if layer is None or graph:
        return None
    return parent


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model (what this backend plans and applies to)."""
    return isinstance(obj, keras.layers.Layer)
