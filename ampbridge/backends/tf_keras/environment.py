"""The device TensorFlow computes on for Keras 2, the policy that actually runs there (the bisect
switch, ``compute_dtype = "auto"``) and matmul precision (TensorFlow's TF32 switch).

Names: ``device``, ``resolve_policy``, ``set_matmul_precision`` (the policy at step 0 is the core's
``Policy.at(step=0, epoch=0)``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.policy import Policy
from ...errors import PolicyError, UnsupportedOptionError
from ..common import resolve_policy as resolve_common

FRAMEWORK = "tf_keras"


def device() -> Any:
    """TensorFlow's first GPU (name and compute capability), else a TPU, else the CPU, as the
    core's ``Device`` (what ``compute_dtype = "auto"`` is decided on).

    Example:
        >>> device().platform in ("cpu", "cuda", "tpu")
        True
    """
    from ...diagnostics import hardware
    from ...diagnostics.hardware import Device

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0]) or {}
        capability = details.get("compute_capability")
        return Device("cuda", str(details.get("device_name", gpus[0].name)),
                      tuple(int(c) for c in capability) if capability else None)
    if tf.config.list_physical_devices("TPU"):
        return Device("tpu")
    return Device("cpu", cpu_flags=hardware.cpu_flags())


def resolve_policy(policy: Policy | str, *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy the tf_keras verbs use (bisect switch, ``auto`` for :func:`device`) and why it
    differs from the one given (:func:`ampbridge.backends.common.resolve_policy`).

    Example:
        >>> import ampbridge
        >>> resolve_policy(ampbridge.preset("mixed_float16"))[0].compute_dtype
        'float16'
    """
    return resolve_common(policy, FRAMEWORK, device, warn=warn)  # it asks the device only for "auto", once


def set_matmul_precision(precision: str) -> None:
    """``highest``: TF32 off; ``high``: TF32 on (process-wide); ``medium`` has no TensorFlow
    equivalent and is refused by name."""
    accepted = ("highest", "high", "medium")
    if precision not in accepted:
        raise PolicyError(f"matmul_precision: received {precision!r}; accepted: {', '.join(accepted)}")
    if precision == "medium":
        raise UnsupportedOptionError(
            "matmul_precision='medium' (bfloat16 passes for float32 matmuls) has no TensorFlow "
            "equivalent; accepted with tf_keras: 'highest' (TF32 off) or 'high' (TF32 on)")
    tf.config.experimental.enable_tensor_float_32_execution(precision == "high")
