"""Hardware awareness: what ``compute_dtype = "auto"`` means on a device, and why.

A backend describes its device as a :class:`Device` (platform, CUDA capability, CPU flags) and
asks :func:`auto_dtype` for the choice and the reason, which the Plan keeps. The rules:

======================  ==========  ==========================================================
device                  choice      why
======================  ==========  ==========================================================
CUDA capability >= 8.0  bfloat16    Ampere and newer run bfloat16 natively on tensor cores
CUDA capability 7.x     float16     tensor cores run float16; bfloat16 is emulated before 8.0
older CUDA              float32     no tensor cores; half precision saves memory only
TPU                     bfloat16    the TPU's native matmul input type
CPU with AVX512_BF16    bfloat16    native bfloat16 dot products (AVX512_BF16 or AMX-BF16)
  or AMX-BF16
other CPU               float32     bfloat16 would be emulated and slower (a warning says so)
======================  ==========  ==========================================================

Detection is separate from the decision, so tests fake capabilities with a ``Device``.

Example:
    >>> auto_dtype(Device("cuda", capability=(8, 0)))[0]
    'bfloat16'
    >>> auto_dtype(Device("cpu", cpu_flags=frozenset({"avx2"})))[0]
    'float32'
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import AmpBridgeWarning, outside_stacklevel

__all__ = ["Device", "auto_dtype", "cpu_flags", "resolve_auto", "BF16_CPU_FLAGS"]

#: CPU flags (as /proc/cpuinfo spells them) that mean native bfloat16 arithmetic.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Device:
    """What a backend knows about the device it will compute on."""

    platform: str  # "cpu" | "cuda" | "tpu" | "rocm" | "mps" | other
    name: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_flags: frozenset[str] = frozenset()

    def describe(self) -> str:
        text = self.platform + (f" {self.name}" if self.name else "")
        if self.capability:
            text += f" (capability {self.capability[0]}.{self.capability[1]})"
        return text


def cpu_flags(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def auto_dtype(device: Device) -> tuple[str, str]:
    """The compute dtype ``auto`` stands for on ``device``, and the reason in words."""
    where = device.describe()
    if device.platform == "cuda" and device.capability is not None:
        major, minor = device.capability
        if major >= 8:
            return "bfloat16", f"{where}: capability 8.0+ runs bfloat16 natively"
        if major == 7:
            return "float16", f"{where}: capability 7.x has float16 tensor cores; bfloat16 would be emulated"
        return "float32", f"{where}: capability below 7.0 has no tensor cores"
    if device.platform == "tpu":
        return "bfloat16", f"{where}: bfloat16 is the TPU's native matmul type"
    if device.platform == "cpu":
        native = sorted(BF16_CPU_FLAGS & device.cpu_flags)
        if native:
            return "bfloat16", f"{where}: native bfloat16 ({', '.join(native)})"
        return "float32", (f"{where}: no native bfloat16 (AVX512_BF16 or AMX-BF16); bfloat16 would be "
                           "emulated and slower")
    if device.platform in ("mps", "rocm"):
        return "float16", f"{where}: float16 is the safe native half type"
    return "float32", f"{where}: unknown platform; float32 is the safe choice"


def resolve_auto(policy, device: Device, *, warn: bool = True):  # -> tuple[Policy, str | None]
    """Replace ``auto`` compute dtypes (top level, overrides and phases) with the device's choice.

    Returns the resolved policy and the reason (None when nothing was ``auto``). Warns when the
    choice is float32 on a CPU because bfloat16 would be emulated.
    """

    uses_auto = policy.compute_dtype == "auto" or any(p.policy.compute_dtype == "auto" for p in policy.phases)
    if not uses_auto:
        return policy, None
    choice, reason = auto_dtype(device)
    if warn and choice == "float32" and device.platform == "cpu":
        warnings.warn(f"compute_dtype='auto' chose float32: {reason}", AmpBridgeWarning, stacklevel=outside_stacklevel())

    def fix(p):
        return p.replace(compute_dtype=choice) if p.compute_dtype == "auto" else p

    phases = tuple(dataclasses.replace(ph, policy=fix(ph.policy)) for ph in policy.phases)
    return fix(policy).replace(phases=phases), f"compute_dtype auto -> {choice}: {reason}"


@functools.lru_cache(maxsize=1)
def tensorflow_bfloat16_rounding() -> str:
    """How TensorFlow's own (non-XLA) CPU kernels round a float32 result to bfloat16:
    ``"nearest"`` or ``"toward zero"``. Imports TensorFlow.

    TensorFlow's CPU MatMul computes bfloat16 in float32 and converts the result with
    ``FloatToBFloat16``, which truncates, unless oneDNN's bfloat16 kernels take the op (seen here
    on a CPU with AVX512_BF16; not on an AVX2-only one), so the answer depends on the machine and
    is measured: a 1x2 by 2x1 product whose exact value, 1 + 3/512, lies three quarters of a
    bfloat16 ulp above 1 (round to nearest gives 1 + 1/128, truncation 1). XLA
    (``jit_compile=True``) rounds to nearest on every CPU.
    """
    import tensorflow as tf

    with tf.device("/CPU:0"):
        a = tf.constant([[1.0, 3.0 / 512]], tf.bfloat16)
        b = tf.constant([[1.0], [1.0]], tf.bfloat16)
        value = float(tf.cast(tf.matmul(a, b), tf.float32)[0, 0])
    return "toward zero" if value == 1.0 else "nearest"
