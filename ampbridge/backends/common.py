"""What every backend shares, framework-free: the policy a backend runs (a Policy, a preset name
or a file; the bisect switch; ``compute_dtype = "auto"``) and the clear error for a missing extra.

Example:
    >>> import ampbridge
    >>> policy, notes = resolve_policy("mixed_bfloat16", "jax", device=lambda: None)
    >>> policy.compute_dtype, notes
    ('bfloat16', ())
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any, NamedTuple, Protocol

from ..core.io import as_policy
from ..core.policy import Policy
from ..core.risks import lossy_settings
from ..diagnostics.environment import effective_policy
from ..diagnostics.hardware import Device, resolve_auto
from ..errors import BackendUnavailableError, LossyPolicyWarning, warn_once

class StepRecord(NamedTuple):
    """One optimizer step as the loss scaler saw it, told to a :class:`StepObserver` before the
    scale moves (so the log holds the scale the step used).

    Fields: ``step`` (the scaler's step count), ``found`` (the overflow flag on the device, > 0 when
    non-finite; None where nothing was checked), ``known`` (the flag as the host already read it,
    None when it did not), ``scale`` (the scale the step used; None at scale 1 without checking),
    ``skip`` (whether a non-finite step is skipped).
    """

    step: int
    found: Any
    known: bool | None
    scale: Any
    skip: bool


class StepObserver(Protocol):
    """What a loss scaler tells the monitor watching it, in this order within one step: the loss it
    scaled, the gradients before the first unscale, a fused optimizer whose gradients stay scaled,
    then the step. A scaler holds at most one observer (``scaler.observer``)."""

    def on_loss(self, outputs: Any) -> None: ...

    def on_grads(self, scale: Any, step: int) -> None: ...

    def on_kept_scaled(self, optimizer: Any) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...


#: the extra that installs each backend's framework
EXTRAS = {"torch": "torch", "keras": "keras", "jax": "jax", "flax": "jax", "optax": "jax", "tensorflow": "tensorflow",
          "tf_keras": "tf-keras"}


def environment(policy: Policy | str | os.PathLike[str], framework: str, *,
                warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy after the bisect switch (``AMPBRIDGE_DISABLE`` / ``AMPBRIDGE_POLICY``), and the
    Plan note saying it replaced the one given (warned once per process, at the user's line)."""
    given = as_policy(policy)
    effective = effective_policy(given, framework, warn=warn)
    if warn:
        warn_lossy(effective)
    if effective is given:
        return given, ()
    return effective, (f"the environment replaced the policy given ({given.source or 'in code'}) with "
                       f"{effective.source or 'another'} (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY)",)


def warn_lossy(policy: Policy) -> None:
    """Warn once per process for each lossy combination of ``policy`` (``ampbridge.core.risks``)."""
    for risk in lossy_settings(policy):
        warn_once(f"{policy.source or 'policy'}: {risk}", LossyPolicyWarning)


def resolve_policy(policy: Policy | str | os.PathLike[str], framework: str, device: Callable[[], Device | Any],
                   *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy a backend applies and the notes saying why it differs from the one given: the
    bisect switch, then ``compute_dtype = "auto"`` decided for ``device()`` (asked only then)."""
    policy, notes = environment(policy, framework, warn=warn)
    uses_auto = policy.compute_dtype == "auto" or any(p.policy.compute_dtype == "auto" for p in policy.phases)
    if not uses_auto:
        return policy, notes
    policy, why = resolve_auto(policy, device(), warn=warn)
    return policy, notes + ((why,) if why else ())


_C_TYPES = {"float32": ctypes.c_float, "int32": ctypes.c_int32}


def read_host_scalar(address: int, dtype: str) -> float | int:
    """The scalar of ``dtype`` ("float32", "int32") at ``address`` in host memory (a CPU tensor's
    ``data_ptr()``), read without the framework: torch's ``.item()`` and ``.numpy()`` dispatch an
    aten op each time (``_local_scalar_dense``, ``detach``), which the monitors keep off the
    per-step path of a step that logs nothing.

    Example:
        >>> seven = ctypes.c_int32(7)
        >>> read_host_scalar(ctypes.addressof(seven), "int32")
        7
    """
    return _C_TYPES[dtype].from_address(address).value


def room_above(package: str, name: str) -> ModuleType:
    """A room of ``package`` that sits above the caller (already imported by the package's
    ``__init__``). Rooms import downwards only; a verb that hands over to a room above it (``plan``
    with example inputs to ``trace``) looks that room up here instead of importing it.

    Example:
        >>> room_above("ampbridge.backends", "common").__name__
        'ampbridge.backends.common'
    """
    return sys.modules[f"{package}.{name}"]


def import_framework(module: str, backend: str) -> ModuleType:
    """Import a backend's framework, or raise the ``BackendUnavailableError`` naming its extra."""
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(module.split(".")[0], backend)
        raise BackendUnavailableError(
            f"ampbridge.{backend} needs {module.split('.')[0]!r}, which is not installed ({e}). "
            f"Install with: pip install 'ampbridge[{extra}]'") from None  # the chained import trace says no more
    checked_release(module.split(".")[0])
    if module == "keras":  # and the framework Keras computes with
        checked_release({"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(
            imported.backend.backend(), "keras"))
    return imported


@functools.lru_cache(maxsize=None)
def checked_release(name: str) -> None:
    """Once per process: refuse ``name`` older than its tested floor, warn when newer than tested
    (:func:`ampbridge.backends.private_hooks.check_release`). ``name`` must be imported already."""
    from .private_hooks import TESTED, check_release

    version = getattr(sys.modules.get(name), "__version__", None)
    if name in TESTED and isinstance(version, str):
        check_release(name, version)


def doctests(namespace: dict[str, Any]) -> dict[str, Any]:
    """A backend package's ``__test__``: ``doctest.testmod`` looks only at names defined in the module
    itself, so this hands it the package docstring and the rooms' public functions and classes."""
    public = set(namespace["__all__"])
    return {"overview": namespace["__doc__"]} | {
        name: obj for name, obj in namespace.items() if name in public and isinstance(obj, type | FunctionType)}
