"""The device the active Keras backend computes on, and the policy that actually runs there (the
bisect switch, ``compute_dtype = "auto"``, TensorFlow's bfloat16 truncation), and matmul precision.
"""

from __future__ import annotations

from typing import Any

import keras

from ...core.policy import Policy
from ...errors import AmpBridgeWarning, PolicyError, UnsupportedOptionError, warn_once
from ..common import resolve_policy as resolve_common


def active_backend() -> str:
    """The active Keras backend's name, what every room branches on (``"tensorflow"``, ``"jax"``, ``"torch"``).

    Example:
        >>> active_backend() in ("tensorflow", "jax", "torch", "numpy", "openvino")
        True
    """
    return keras.backend.backend()


# --- the policy that actually runs: environment switch, "auto" ----------------------------------

def device() -> Any:
    """The device the active Keras backend computes on, as the core's ``ampbridge.diagnostics.hardware.Device``
    (what ``compute_dtype = "auto"`` is decided on).

    TensorFlow: its first GPU (name and compute capability from ``tf.config``), else a TPU, else
    the CPU; JAX: ``jax.devices()[0]``; torch: the CUDA device Keras uses, else the CPU. CPU
    flags come from ``/proc/cpuinfo`` (``_hardware.cpu_flags()``).

    Example:
        >>> device().platform in ("cpu", "cuda", "tpu", "mps", "rocm")
        True
    """
    from ...diagnostics import hardware as _hardware
    from ...diagnostics.hardware import Device

    backend = active_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0]) or {}
            capability = details.get("compute_capability")
            return Device("cuda", str(details.get("device_name", gpus[0].name)),
                          tuple(int(c) for c in capability) if capability else None)
        if tf.config.list_physical_devices("TPU"):
            return Device("tpu")
    elif backend == "jax":
        import jax

        dev = jax.devices()[0]
        platform = {"gpu": "cuda"}.get(dev.platform, dev.platform)
        if platform != "cpu":
            capability = None
            cc = getattr(dev, "compute_capability", None)
            if cc:
                try:
                    capability = tuple(int(c) for c in str(cc).split(".")[:2])
                except ValueError:
                    capability = None
            return Device(platform, str(getattr(dev, "device_kind", "")), capability)  # type: ignore[arg-type]
    elif backend == "torch":
        import torch

        where = str(keras.src.backend.torch.core.get_device())
        if where.startswith("cuda") and torch.cuda.is_available():
            index = torch.cuda.current_device()
            return Device("cuda", torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
        if where.startswith("mps"):
            return Device("mps")
    return Device("cpu", cpu_flags=_hardware.cpu_flags())


def resolve_policy(policy: Policy | str, *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy :func:`apply`, :func:`scope`, :func:`optimizer` and :func:`plan` use, and why it
    differs from the one given (the Plan keeps these notes).

    ``AMPBRIDGE_DISABLE=1`` swaps in the ``float32`` preset and ``AMPBRIDGE_POLICY=NAME_OR_FILE``
    another policy (``ampbridge.diagnostics.environment``; each says so once per process); ``compute_dtype = "auto"``
    becomes the :func:`device`'s choice (``ampbridge.diagnostics.hardware.resolve_auto``).

    Example:
        >>> import ampbridge
        >>> resolve_policy(ampbridge.preset("mixed_bfloat16"))[0].compute_dtype
        'bfloat16'
    """
    found: list[Any] = []

    def where() -> Any:  # detected once per call, and only when needed
        if not found:
            found.append(device())
        return found[0]

    policy, notes = resolve_common(policy, f"keras ({active_backend()})", where, warn=warn)
    if _uses_bfloat16(policy) and where().platform == "cpu" and bfloat16_rounding() == "toward zero":
        notes += (_TRUNCATION_NOTE,)
        if warn:  # once per process, like the bisect switch
            warn_once(_TRUNCATION_NOTE, AmpBridgeWarning)
    return policy, notes


_TRUNCATION_NOTE = (
    "TensorFlow's CPU kernels for bfloat16 round toward zero on this machine (measured), where "
    "torch, JAX and TensorFlow's own XLA round to nearest; bfloat16 training "
    "drifts from theirs by about an ulp per matmul. Compile the model with jit_compile=True "
    "(XLA rounds to nearest) to match them, or use float32 (what compute_dtype='auto' picks here)")


def _uses_bfloat16(policy: Policy) -> bool:
    return "bfloat16" in {policy.compute_dtype, policy.param_dtype} | {
        getattr(rule, name) for rule in policy.overrides for name in ("compute_dtype", "param_dtype")} | {
        dtype for phase in policy.phases for dtype in (phase.policy.compute_dtype, phase.policy.param_dtype)}


def bfloat16_rounding() -> str | None:
    """How the TensorFlow backend's own (non-XLA) CPU kernels round to bfloat16: ``"nearest"`` or
    ``"toward zero"`` (measured by ``ampbridge.diagnostics.hardware.tensorflow_bfloat16_rounding``); None on
    the JAX and torch Keras backends, which round to nearest everywhere.

    Example:
        >>> bfloat16_rounding() in ("nearest", "toward zero", None)
        True
    """
    if active_backend() != "tensorflow":
        return None
    from ...diagnostics.hardware import tensorflow_bfloat16_rounding

    return tensorflow_bfloat16_rounding()


# --- matmul precision -------------------------------------------------------------------------

def set_matmul_precision(precision: str) -> None:
    """Set float32 matmul precision for the active Keras backend (process-wide).

    ``highest``: full float32; ``high``: TF32 allowed (TensorFlow's TF32 switch, JAX
    ``"high"``, torch ``"high"``); ``medium``: bfloat16 passes allowed (JAX ``"bfloat16"``, torch
    ``"medium"``; TensorFlow has no such mode, so it is an error there).
    """
    accepted = ("highest", "high", "medium")
    if precision not in accepted:
        raise PolicyError(f"matmul_precision: received {precision!r}; accepted: {', '.join(accepted)}")
    backend = active_backend()
    if backend == "tensorflow":
        if precision == "medium":
            raise UnsupportedOptionError(
                "matmul_precision='medium' (bfloat16 passes for float32 matmuls) has no TensorFlow "
                "equivalent; accepted on the TensorFlow backend: 'highest' (TF32 off) or 'high' (TF32 on)")
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(precision == "high")
    elif backend == "jax":
        import jax

        # XLA:CPU always multiplies float32 in float32 (and rejects a "highest" precision on
        # float16 dots), so the setting only reaches GPUs and TPUs
        if jax.default_backend() != "cpu":
            jax.config.update("jax_default_matmul_precision",
                              {"highest": "highest", "high": "high", "medium": "bfloat16"}[precision])
    elif backend == "torch":
        import torch

        torch.set_float32_matmul_precision(precision)
    elif precision != "highest":
        raise UnsupportedOptionError(f"matmul_precision={precision!r} is not supported on the Keras "
                                     f"{backend!r} backend; accepted there: 'highest'")
