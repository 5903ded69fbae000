"""The device and the dtypes that run there: the dtype map, the model's device type, the compute
dtypes torch autocast really runs on it, ``compute_dtype = "auto"`` decided for it, and what
oneDNN's CPU LSTM accepts.

Holds ``DTYPES``, ``native_dtype``, ``cpu_lstm_takes_float32_inputs``, ``device_type_of``,
``_supported_compute_dtypes``, ``_device`` and ``resolve_for_device``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

from ...core.policy import Policy
from ...errors import AmpBridgeError, UnsupportedOptionError

#: ampbridge dtype names -> torch dtypes (the one place they are mapped)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
LOW_DTYPES = (torch.float16, torch.bfloat16)


def native_dtype(name: str) -> torch.dtype:
    """The torch dtype of an ampbridge dtype name: ``native_dtype("bf16")`` is ``torch.bfloat16``."""
    from ...core.dtypes import canonical_dtype

    return DTYPES[canonical_dtype(name)]


# --- devices and dtypes ------------------------------------------------------------------------

def device_type_of(model: nn.Module, device_type: str | None) -> str:
    found = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    found.discard("meta")
    if device_type is None:
        if len(found) > 1:
            raise AmpBridgeError(f"the model's tensors are on several device types ({', '.join(sorted(found))}); "
                                 "pass device_type= to say which one autocast should run on")
        device_type = found.pop() if found else "cpu"
    if not isinstance(device_type, str) or not device_type:
        raise AmpBridgeError(f"device_type must be a torch device type such as 'cuda' or 'cpu'; "
                             f"received {device_type!r}")
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:
        available = False
    if not available:
        raise UnsupportedOptionError(f"device_type={device_type!r}: torch autocast is not available on this "
                                     "device type; accepted: cpu, cuda, and the accelerators torch supports")
    if found and found != {device_type}:
        raise AmpBridgeError(f"device_type={device_type!r} but the model's tensors are on "
                             f"{', '.join(sorted(found))}; move the model first or pass the matching device_type")
    return device_type


@functools.lru_cache(maxsize=None)
def _supported_compute_dtypes(device_type: str) -> frozenset[str]:
    """The compute dtypes torch autocast really runs on this device type (it only warns otherwise)."""
    ok = {"float32"}
    for name in ("bfloat16", "float16"):
        dtype = DTYPES[name]
        if device_type == "cuda":
            if torch.cuda.is_available() and (name != "bfloat16" or torch.cuda.is_bf16_supported()):
                ok.add(name)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.autocast(device_type, dtype=dtype):
                    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype:
                        ok.add(name)
            except RuntimeError:
                pass
    return frozenset(ok)


def _device(device_type: str) -> Any:
    """This device as the core's ``Device`` (what ``compute_dtype = "auto"`` is decided on)."""
    from ...diagnostics.hardware import Device, cpu_flags

    if device_type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        return Device("cuda", torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
    if device_type == "cpu":
        return Device("cpu", cpu_flags=cpu_flags())
    return Device(device_type)


def resolve_for_device(policy: Policy, device_type: str) -> tuple[Policy, list[str]]:
    """Resolve ``compute_dtype = "auto"`` (the core's rule) and refuse dtypes the device cannot run."""
    from ...diagnostics.hardware import resolve_auto

    notes = []
    supported = _supported_compute_dtypes(device_type)
    if policy.compute_dtype == "auto":
        policy, reason = resolve_auto(policy, _device(device_type))
        notes.append(reason)
    wanted = [("compute_dtype", policy.compute_dtype)] + [
        (f"{label}.compute_dtype", rule.compute_dtype) for label, rule in policy.rules
        if label.startswith("override") and rule.compute_dtype]
    for key, name in wanted:
        if name not in supported:
            raise UnsupportedOptionError(
                f"{key}={name!r}: torch autocast cannot run {name} on this {device_type} device; "
                f"accepted here: {', '.join(sorted(supported))}")
    return policy, notes


def _dtype_name(dtype: "str | torch.dtype") -> str:
    """``"float16"`` for ``torch.float16`` or ``"float16"`` (the functions below take either)."""
    return str(dtype).removeprefix("torch.")


def cpu_lstm_takes_float32_inputs(compute_dtype: "str | torch.dtype") -> bool:
    """Whether ``nn.LSTM`` runs on float32 inputs inside ``torch.autocast("cpu", dtype=compute_dtype)``.

    autocast sends the LSTM to oneDNN in the lower precision, and oneDNN refuses the mixed
    float32-input primitive for float16 everywhere and for bfloat16 on CPUs without native
    bfloat16 (seen on an AVX2-only CPU; it ran on an AVX512_BF16 one), so it is measured, on a
    one-unit LSTM. ``compute_dtype`` is a name or a ``torch.dtype``.

    Example:
        >>> import torch
        >>> cpu_lstm_takes_float32_inputs("float32"), cpu_lstm_takes_float32_inputs(torch.float32)
        (True, True)
    """
    return cpu_lstm_runs(_dtype_name(compute_dtype), "float32")


def cpu_lstm_runs(compute_dtype: "str | torch.dtype", inputs_dtype: "str | torch.dtype") -> bool:
    """Whether ``nn.LSTM`` runs on ``inputs_dtype`` inputs inside ``torch.autocast("cpu", dtype=compute_dtype)``,
    measured once per pair on a one-unit LSTM (oneDNN's support depends on the CPU: a float16 LSTM
    failed even on float16 inputs on an AVX512_FP16/AMX CPU).

    Example:
        >>> cpu_lstm_runs("float32", "float32")
        True
    """
    return _cpu_lstm_runs(_dtype_name(compute_dtype), _dtype_name(inputs_dtype))


@functools.lru_cache(maxsize=None)
def _cpu_lstm_runs(compute_dtype: str, inputs_dtype: str) -> bool:
    if compute_dtype == "float32":
        return True
    lstm = nn.LSTM(1, 1)
    try:  # with gradients on, as in training: oneDNN picks another primitive for inference
        with torch.autocast("cpu", dtype=getattr(torch, compute_dtype)), torch.enable_grad():
            lstm(torch.zeros(1, 1, 1, dtype=getattr(torch, inputs_dtype)))
    except RuntimeError:
        return False
    return True
