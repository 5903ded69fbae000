"""The JAX backend's environment: the dtype map, the device, and the policy that runs there
(the bisect switch and ``compute_dtype = "auto"``, through ``backends.common``); Flax and optax
imported on first use.

Holds: FRAMEWORK, MATMUL_PRECISION, dtype, resolve_policy, DTYPES, _require, linen_module, nnx_module,
optax_module, is_floating, is_float_array, device, phase_policy.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.policy import Policy
from ...errors import BackendUnavailableError
from .. import common as _common

FRAMEWORK = "jax"

#: the one place canonical dtype names become JAX dtypes
DTYPES: dict[str, np.dtype] = {
    "float32": jnp.dtype("float32"),
    "float16": jnp.dtype("float16"),
    "bfloat16": jnp.dtype("bfloat16"),
    "float64": jnp.dtype("float64"),
}

#: ampbridge's matmul_precision (torch's names) -> jax.default_matmul_precision
MATMUL_PRECISION = {"highest": "highest", "high": "high", "medium": "default"}


def _require(module: str, what: str) -> Any:
    imported = sys.modules.get(module)
    if imported is not None:  # the common case, per module call while planning: no import machinery
        _common.checked_release(module.split(".")[0])
        return imported
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(
            f"ampbridge.jax.{what} requires {module.split('.')[0]!r} ({e}). "
            "Install with: pip install 'ampbridge[jax]'") from e
    _common.checked_release(module.split(".")[0])  # flax, optax: within the tested releases
    return imported


def linen_module() -> Any:
    return _require("flax.linen", "apply")


def nnx_module() -> Any:
    return _require("flax.nnx", "apply")


def optax_module() -> Any:
    return _require("optax", "optimizer")


def dtype(name: str | Any) -> np.dtype:
    """The JAX dtype of a canonical dtype name (aliases accepted), or a dtype passed through.

    Example:
        >>> dtype("bf16")
        dtype(bfloat16)
    """
    if isinstance(name, str):
        from ...core.dtypes import canonical_dtype

        try:
            return DTYPES[canonical_dtype(name)]
        except ValueError:
            if name in DTYPES:
                return DTYPES[name]
            raise ValueError(f"unknown dtype {name!r}; accepted: {', '.join(DTYPES)} "
                             "(aliases: fp16 half f16 bf16 fp32 f32 float single)") from None
    return jnp.dtype(name)


# --- dtypes -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def is_floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_float_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and is_floating(x.dtype)


# --- policies -----------------------------------------------------------------------------------

def device() -> Any:
    """The default JAX device as ``ampbridge.diagnostics.hardware.Device`` (what ``compute_dtype =
    "auto"`` and the float8 emulation note are decided on).

    Example:
        >>> device().platform in ("cpu", "cuda", "tpu", "rocm", "mps")
        True
    """
    from ...diagnostics.hardware import Device, cpu_flags

    dev = jax.devices()[0]
    platform = {"gpu": "cuda"}.get(dev.platform, dev.platform)
    capability = None
    cc = getattr(dev, "compute_capability", None)
    if cc:
        try:
            major, minor = str(cc).split(".")[:2]
            capability = (int(major), int(minor))
        except ValueError:
            capability = None
    return Device(platform, getattr(dev, "device_kind", ""), capability,
                  cpu_flags() if platform == "cpu" else frozenset())


def resolve_policy(policy: Policy | str, *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy this backend applies, and notes saying why it differs from the one given.

    Accepts a Policy, a preset name or a policy file path. The environment's bisect switch
    (``AMPBRIDGE_DISABLE``/``AMPBRIDGE_POLICY``) applies, and ``compute_dtype = "auto"`` is
    resolved for the default JAX device (``ampbridge.diagnostics.hardware``).

    Example:
        >>> resolve_policy("mixed_bfloat16")[0].compute_dtype
        'bfloat16'
    """
    resolved, notes = _common.resolve_policy(policy, FRAMEWORK, device, warn=warn)
    wire = {p.reduce_dtype for p in [resolved] + [ph.policy for ph in resolved.phases] if p.reduce_dtype != p.param_dtype}
    if wire:  # nothing in a model decides the all-reduce: say where reduce_dtype is realised
        notes += (f"reduce_dtype {'/'.join(sorted(wire))} (not param_dtype) is realised where gradients are "
                  "all-reduced with ampbridge.jax.distributed.pmean_grads or .data_parallel_value_and_grad; "
                  "a bare "
                  "lax.pmean or a sharded jit's own all-reduce runs in the gradients' dtype",)
    return resolved, notes


def phase_policy(policy: Policy, step: int | None = None, epoch: int | None = None) -> Policy:
    if not policy.phases:
        return policy
    if step is None and epoch is None:
        step, epoch = 0, 0
    return policy.at(step=step, epoch=epoch)
