"""``ampbridge doctor``: per installed framework, its devices, the dtypes they run natively,
what ``compute_dtype = "auto"`` chooses and why, whether float8 matmuls run natively or emulated,
and the float32 matmul (TF32) state.

Frameworks are imported here on purpose (this command is about them), each only if installed.

Example:
    >>> native_dtypes(Device("cuda", capability=(7, 5)))
    ['float32', 'float16']
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..core.table import render_table
from .hardware import BF16_CPU_FLAGS, Device, auto_dtype, cpu_flags

FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def native_dtypes(device: Device) -> list[str]:
    """The floating dtypes the device computes in natively (not emulated)."""
    if device.platform == "cuda" and device.capability:
        major, _ = device.capability
        return ["float32"] + (["float16"] if major >= 6 else []) + (["bfloat16"] if major >= 8 else [])
    if device.platform == "tpu":
        return ["float32", "bfloat16"]
    if device.platform == "cpu":
        return ["float32"] + (["bfloat16"] if BF16_CPU_FLAGS & device.cpu_flags else []) + (
            ["float16"] if FP16_CPU_FLAGS & device.cpu_flags else [])
    return ["float32"]


#: the first CUDA compute capability with float8 tensor cores (Ada 8.9; Hopper is 9.0)
FP8_CAPABILITY = (8, 9)
#: how each framework's float8 path multiplies where the hardware has float8 units
_FP8_NATIVE = {"torch": "native (torchao: torch._scaled_mm)",
               "jax": "native (XLA rewrites the float8 dot into a float8 GEMM)",
               "tensorflow": "native where XLA compiles the step (jit_compile=True), else emulated"}


def float8_support(device: Device, framework: str = "torch") -> str:
    """Whether ``framework``'s float8 matmuls run natively on ``device`` or are emulated (real float8
    casts, the product in a wider dtype), as the ``[fp8]`` Plan rows say.

    Example:
        >>> float8_support(Device("cuda", capability=(9, 0))), float8_support(Device("cpu"))
        ('native (torchao: torch._scaled_mm)', 'emulated')
    """
    if device.platform == "cuda" and device.capability and tuple(device.capability) >= FP8_CAPABILITY:
        return _FP8_NATIVE[framework]
    if device.platform == "cuda":
        return "emulated (float8 tensor cores need compute capability 8.9)"
    if device.platform in ("cpu", "mps"):
        return "emulated"
    return "unknown (ampbridge does not know this platform's float8 units)"


def emulation_note(device: Device, framework: str) -> str:
    """What a float8 Plan row's ``fp8_by`` adds on ``device``: " (emulated)" where its float8 matmuls
    are not native there (:func:`float8_support`), else nothing.

    Example:
        >>> emulation_note(Device("cpu"), "jax"), emulation_note(Device("cuda", capability=(9, 0)), "jax")
        (' (emulated)', '')
    """
    return "" if float8_support(device, framework).startswith("native") else " (emulated)"


def _torch() -> dict[str, Any]:
    import torch

    devices = [Device("cpu", torch.backends.cpu.get_cpu_capability(), cpu_flags=cpu_flags())]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            devices.append(Device("cuda", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)))
    matmul = (f"float32 matmul precision {torch.get_float32_matmul_precision()!r}; "
              f"cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
              f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}")
    current = ("torchao Float8Linear" if importlib.util.find_spec("torchao") else
               "refused (torchao is not installed: pip install ampbridge[torch-fp8])")
    fp8 = f"[fp8]: {current} for current scaling; ampbridge delayed scaling (emulated) for delayed"
    return {"version": torch.__version__, "devices": devices, "matmul": matmul, "float8": ("torch", fp8)}


def _tensorflow() -> dict[str, Any]:
    import tensorflow as tf

    devices = []
    for d in tf.config.list_physical_devices():
        if d.device_type == "CPU":
            devices.append(Device("cpu", d.name, cpu_flags=cpu_flags()))
        elif d.device_type == "GPU":
            details = tf.config.experimental.get_device_details(d)
            devices.append(Device("cuda", details.get("device_name", d.name), details.get("compute_capability")))
        elif d.device_type == "TPU":
            devices.append(Device("tpu", d.name))
    from .hardware import tensorflow_bfloat16_rounding

    rounding = tensorflow_bfloat16_rounding()
    matmul = (f"TF32 execution enabled={tf.config.experimental.tensor_float_32_execution_enabled()}; "
              f"CPU bfloat16 kernels (no XLA) round {rounding}")
    if rounding != "nearest":
        matmul += " (torch, JAX and jit_compile=True round to nearest: bfloat16 results drift from theirs)"
    import keras

    fp8 = ("tensorflow", "[fp8]: Keras's model.quantize('float8') (delayed; on the JAX backend XLA compiles it: "
                         "see jax), ampbridge current scaling (current)")
    return {"version": f"{tf.__version__} (keras {keras.__version__}, backend {keras.backend.backend()})",
            "devices": devices, "matmul": matmul, "float8": fp8}


def _jax() -> dict[str, Any]:
    import jax

    devices = []
    for d in jax.devices():
        if d.platform == "cpu":
            devices.append(Device("cpu", getattr(d, "device_kind", "cpu"), cpu_flags=cpu_flags()))
        elif d.platform == "gpu":
            cc = getattr(d, "compute_capability", None)
            cap = tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None
            devices.append(Device("cuda", d.device_kind, cap))
        else:
            devices.append(Device(d.platform, d.device_kind))
    matmul = f"jax_default_matmul_precision={jax.config.jax_default_matmul_precision!r}"
    fp8 = ("jax", "[fp8]: Flax fp8_ops (delayed), ampbridge current scaling (current); Keras float8 on the "
                  "JAX backend compiles the same way")
    return {"version": jax.__version__, "devices": devices, "matmul": matmul, "float8": fp8}


PROBES = (("torch", "torch", _torch), ("tensorflow/keras", "tensorflow", _tensorflow), ("jax", "jax", _jax))
#: the names ``doctor --frameworks`` accepts
FRAMEWORK_NAMES = ("torch", "tensorflow", "keras", "jax")


def doctor(frameworks: list[str] | None = None) -> str:
    """The report ``ampbridge doctor`` prints."""
    lines = []
    flags = cpu_flags()
    lines.append("cpu flags relevant to mixed precision: "
                 + (", ".join(sorted((BF16_CPU_FLAGS | FP16_CPU_FLAGS | {"avx2", "avx512f", "f16c"}) & flags)) or "none found"))
    for label, module, probe in PROBES:
        if frameworks and not set(label.split("/")) & set(frameworks):
            continue
        if importlib.util.find_spec(module) is None:
            lines.append(f"\n{label}: not installed")
            continue
        try:
            info = probe()
        except Exception as e:  # a broken install is a finding, not a crash
            lines.append(f"\n{label}: installed but could not be probed: {type(e).__name__}: {e}")
            continue
        lines.append(f"\n{label} {info['version']}")
        rows = []
        fw, fp8_by = info.get("float8", ("torch", None))
        for d in info["devices"]:
            choice, reason = auto_dtype(d)
            rows.append((d.describe(), ", ".join(native_dtypes(d)), choice, reason.split(": ", 1)[-1],
                         float8_support(d, fw)))
        lines.append(render_table(("device", "native dtypes", "auto", "why", "float8 matmul"), rows))
        lines.append(info["matmul"])
        if fp8_by:
            lines.append(fp8_by)
    return "\n".join(lines)
