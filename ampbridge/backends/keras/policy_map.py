"""Per-layer dtypes in saved configs: a layer that rebuilds its sublayers from its constructor
arguments (a keras-hub backbone, a ``TransformerEncoder``, ``MultiHeadAttention``) saves one
``dtype``, so plain Keras would rebuild every sublayer in it and lose the pins inside. :func:`apply`
gives such layers a ``get_config`` that writes a ``keras.dtype_policies.DTypePolicyMap`` instead:
the layer's own policy as the default, plus one entry per sublayer path whose policy differs.
Keras hands ``dtype=`` down to those sublayers and each looks its own path up in the map, so plain
Keras restores the pins with no ampbridge code.

What a map cannot carry (each named by a warning when the file is saved; all of it comes back
with ``ampbridge.keras.load_model``): a sublayer without a Keras ``path`` (layers without a
``build``: Softmax, Dropout, Activation), and a pinned sublayer whose output ampbridge casts to
another dtype for its caller's own code (an ``[[override]]`` with ``output_dtype``, e.g. a float32
norm returning float16 to a block's ``x + residual``): plain Keras would return the pinned dtype
there (TensorFlow then refuses the ``+``), so the map leaves it in its parent's dtype; and, in a
file saved on TensorFlow, a pinned sublayer whose output meets its caller's stream of another
dtype (``apply`` turns TensorFlow's promotion on while the caller runs; plain Keras cannot).

Names: ``policy_map``, ``carry_pins``; ``_resolved``, ``_portable``, ``_uncarried``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import keras

from ...errors import warn_once
from .layers import AUTHOR, code_caller, walk
from .plan import MixedDTypePolicy

_CARRIER = "_ampbridge_carries_pins"  # in a layer's __dict__: its get_config writes the map


def _resolved(layer: Any) -> Any:
    """The dtype policy ``layer`` really runs (its own entry where its policy is a map)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def _portable(policy: Any) -> Any:
    # plain Keras cannot deserialize ampbridge's MixedDTypePolicy: its storage dtype, as a
    # layer's own config records it (ampbridge.keras.load_model re-applies the compute dtype)
    return keras.DTypePolicy(policy.variable_dtype) if isinstance(policy, MixedDTypePolicy) else policy


def _pair(policy: Any) -> tuple[str, str]:
    return (policy.compute_dtype, policy.variable_dtype)


def _recast_output(layer: Any) -> bool:
    # apply's call wrapper (the instance's `call`, see apply._call_wrapper) casting the outputs
    cast = getattr(layer.__dict__.get("call"), "cast", None)
    return cast is not None and cast != layer.compute_dtype


def _uncarried(layer: Any) -> dict[str, list[str]]:
    """Sublayers whose policy differs from ``layer``'s that the map leaves out, by reason (paths
    as ``ampbridge.keras.walk`` writes them): ``"no Keras path"`` (Keras gives a layer its
    ``path`` when it builds; layers without a ``build`` never get one and take the map's default,
    unless their code fixes a dtype), an output ampbridge casts for its caller's code, and (saved on
    TensorFlow) an output that meets its caller's stream of another dtype."""
    own = _pair(_resolved(layer))
    by_path = dict(walk(layer))
    out: dict[str, list[str]] = {}
    for path, sub in by_path.items():
        policy = _pair(_resolved(sub))
        if not path or policy == own:
            continue
        if sub.path is None:
            if sub.__dict__.get(AUTHOR) != policy:
                out.setdefault("no Keras path", []).append(path)
            continue
        caller = code_caller(path, by_path)
        if caller is None:
            continue  # called by a graph, which casts each layer's inputs: carried exactly
        if _recast_output(sub):
            out.setdefault("output cast for its caller's code", []).append(path)
        elif keras.backend.backend() == "tensorflow" and sub.compute_dtype != by_path[caller].compute_dtype:
            # apply turns TensorFlow's promotion on in the caller; plain Keras does not
            out.setdefault(f"its {sub.compute_dtype} output meets {caller}'s {by_path[caller].compute_dtype} "
                           "code, which TensorFlow does not promote", []).append(path)
    return out


def policy_map(layer: Any) -> Any:
    """A ``DTypePolicyMap`` of ``layer``'s sublayers whose dtype policy differs from its own
    (keyed by Keras's ``layer.path``; the default is ``layer``'s policy), or None if none differs.

    Example:
        >>> import keras
        >>> mha = keras.layers.MultiHeadAttention(2, 4, name="mha", dtype="mixed_float16")
        >>> _ = mha(keras.ops.ones((1, 3, 4)), keras.ops.ones((1, 3, 4)))
        >>> mha.query_dense.dtype_policy = "float16"  # float16 variables: same compute dtype on every backend
        >>> {path: p.name for path, p in policy_map(mha).items()}
        {'mha/query': 'float16'}
    """
    own = _resolved(layer)
    left_out = {path for paths in _uncarried(layer).values() for path in paths}
    entries = {}
    for path, sub in walk(layer):
        if sub is layer or sub.path is None or path in left_out:
            continue
        policy = _resolved(sub)
        if _pair(policy) != _pair(own) or policy.quantization_mode != own.quantization_mode:
            entries[sub.path] = _portable(policy)
    if not entries:
        return None
    return keras.dtype_policies.DTypePolicyMap(default_policy=_portable(own), policy_map=entries)


def carry_pins(model: Any) -> None:
    """Give every composite layer of ``model`` whose config stores one ``dtype`` for all its
    sublayers (no ``layers`` list of their own configs) a ``get_config`` that writes
    :func:`policy_map` in its place when a sublayer's policy differs. An instance attribute that
    calls the class's own ``get_config`` first; idempotent.

    Example:
        >>> import keras
        >>> mha = keras.layers.MultiHeadAttention(2, 4, name="mha", dtype="mixed_float16")
        >>> _ = mha(keras.ops.ones((1, 3, 4)), keras.ops.ones((1, 3, 4)))
        >>> mha.key_dense.dtype_policy = "float16"
        >>> carry_pins(mha)
        >>> keras.layers.MultiHeadAttention.from_config(mha.get_config()).dtype_policy["mha/key"].name
        'float16'
    """
    for _, layer in walk(model):
        if not layer._layers or layer.__dict__.get(_CARRIER):
            continue
        _carry(layer)


def _carry(layer: Any) -> None:
    own = layer.get_config
    ref = weakref.ref(layer)

    @functools.wraps(own)  # copies Keras's `_is_default` mark: its automatic config still applies
    def get_config() -> Any:
        config = own()
        owner = ref()
        if owner is None or not isinstance(config, dict) or "dtype" not in config or "layers" in config:
            return config
        mapped = policy_map(owner)
        if mapped is None:
            return config
        lost = _uncarried(owner)
        if lost:
            said = "; ".join(f"{', '.join(paths)} ({reason})" for reason, paths in lost.items())
            warn_once(f"{owner.name}'s saved config leaves {said} in {_resolved(owner).name} for plain "
                      "Keras; ampbridge.keras.load_model restores them", key=f"uncarried:{id(owner)}:{said}")
        return {**config, "dtype": keras.dtype_policies.serialize(mapped)}

    object.__setattr__(layer, "get_config", get_config)
    object.__setattr__(layer, _CARRIER, True)
