"""Which backend owns a model: framework names as strings, adapters imported on demand.

Following einops, a framework is only considered when it is already in ``sys.modules`` (a
model of it cannot exist otherwise), so ``ampbridge.plan(model, policy)`` never imports a
framework the caller has not imported. The answer is cached per type.

Example:
    >>> detect_backend([1, 2]) is None
    True
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType
from typing import Any

# backend name -> (modules whose presence makes it a candidate, adapter module)
# Keras comes first: under the torch Keras backend a Keras layer is also a torch.nn.Module.
BACKENDS: dict[str, tuple[tuple[str, ...], str]] = {
    "keras": (("keras",), "ampbridge.keras"),
    # tf.keras 2 (the tf_keras package): its own classes, not Keras 3's; owns() reads the class's module
    "tf_keras": (("tf_keras",), "ampbridge.tf_keras"),
    "jax": (("flax", "jax"), "ampbridge.jax"),
    "torch": (("torch",), "ampbridge.torch"),
}
ALIASES = {"pt": "torch", "pytorch": "torch", "tf": "keras", "tensorflow": "keras",
           "tf.keras": "keras", "flax": "jax", "nnx": "jax",
           "tf-keras": "tf_keras", "keras2": "tf_keras"}

_cache: dict[type, str | None] = {}
_lock = threading.Lock()


def backend_module(name: str) -> ModuleType:
    """Import an adapter by backend name or alias (``"pt"``, ``"flax"``, ...)."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        from ..errors import UnknownBackendError

        raise UnknownBackendError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)} "
                                  f"(aliases: {', '.join(ALIASES)})")
    return importlib.import_module(BACKENDS[name][1])


def detect_backend(obj: Any) -> str | None:
    """The name of the backend whose framework owns ``obj``, or None."""
    kind = type(obj)
    with _lock:
        if kind in _cache:
            return _cache[kind]
    found = None
    for name, (modules, _) in BACKENDS.items():
        if not any(m in sys.modules for m in modules):
            continue
        if backend_module(name).owns(obj):
            found = name
            break
    with _lock:
        _cache[kind] = found
    return found
