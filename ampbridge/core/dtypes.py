"""Dtype names and floating-point format facts.

ampbridge speaks in canonical dtype strings (``"float16"``, ``"bfloat16"``, ``"float32"``);
each backend maps them to its own dtype objects in one place. The format facts below are
computed from the bit layout (sign, exponent bits, mantissa bits, how the top exponent is
used), never typed in, and a test checks them against ``ml_dtypes.finfo``.

Example:
    >>> from ampbridge import formats
    >>> formats()["float16"].max
    65504.0
    >>> canonical_dtype("bf16")
    'bfloat16'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FloatFormat",
    "formats",
    "canonical_dtype",
    "DTYPE_ALIASES",
    "STORAGE_DTYPES",
    "COMPUTE_DTYPES",
]

#: dtypes a policy may store parameters, outputs and reductions in.
STORAGE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: dtypes a policy may compute in; ``auto`` is resolved per backend and device.
COMPUTE_DTYPES: tuple[str, ...] = STORAGE_DTYPES + ("auto",)

#: accepted spellings on input; output always uses the canonical name.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "single": "float32",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def canonical_dtype(value: str, *, allow_auto: bool = False) -> str:
    """Return the canonical name of a dtype spelling, or raise ``ValueError``.

    Example:
        >>> canonical_dtype("FP16")
        'float16'
    """
    if not isinstance(value, str):
        raise ValueError(f"expected a dtype name string, got {type(value).__name__}")
    key = value.strip().lower()
    if allow_auto and key == "auto":
        return "auto"
    try:
        return DTYPE_ALIASES[key]
    except KeyError:
        names = COMPUTE_DTYPES if allow_auto else STORAGE_DTYPES
        raise ValueError(f"unknown dtype {value!r}; accepted: {', '.join(names)}") from None


@dataclass(frozen=True)
class FloatFormat:
    """The layout of a binary floating-point format and the limits that follow from it.

    ``finite_only`` formats (the ``fn`` float8 variants) have no infinities and use the top
    exponent for normal numbers, reserving only the all-ones mantissa there for NaN.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    storage_bits: int
    finite_only: bool = False
    note: str = ""

    @property
    def bits(self) -> int:
        """Bits that carry information: sign + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_exponent(self) -> int:
        top = 2**self.exponent_bits - 1  # all-ones exponent field
        return (top if self.finite_only else top - 1) - self.bias

    @property
    def max(self) -> float:
        # finite_only formats lose the all-ones mantissa at the top exponent to NaN.
        lost = 1 if self.finite_only else 0
        fraction = 2.0 - math.ldexp(1.0, -(self.mantissa_bits - lost))
        return math.ldexp(fraction, self.max_exponent)

    @property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1.0 and the next representable number."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        return not self.finite_only

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "bits": self.bits,
            "storage_bits": self.storage_bits,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "max": self.max,
            "smallest_normal": self.smallest_normal,
            "smallest_subnormal": self.smallest_subnormal,
            "eps": self.eps,
            "has_inf": self.has_inf,
            "note": self.note,
        }


_FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("float32", 8, 23, 32, note="IEEE binary32"),
        FloatFormat("tfloat32", 8, 10, 32, note="matmul inputs on NVIDIA tensor cores; stored as float32"),
        FloatFormat("bfloat16", 8, 7, 16, note="float32 range, 8 significant bits"),
        FloatFormat("float16", 5, 10, 16, note="IEEE binary16; needs loss scaling for gradients"),
        FloatFormat("float8_e4m3fn", 4, 3, 8, finite_only=True, note="no inf; NaN only at S.1111.111"),
        FloatFormat("float8_e5m2", 5, 2, 8, note="IEEE-like; for gradients"),
    )
}


def formats() -> dict[str, FloatFormat]:
    """The format facts of every dtype ampbridge knows, by canonical name."""
    return dict(_FORMATS)


def format_table() -> str:
    """The dtype facts as a plain text table (what ``ampbridge formats`` prints)."""
    header = ("dtype", "bits", "exp", "mant", "max", "smallest normal", "smallest subnormal", "eps")
    rows = [
        (
            f.name,
            str(f.bits),
            str(f.exponent_bits),
            str(f.mantissa_bits),
            f"{f.max:.6g}",
            f"{f.smallest_normal:.6g}",
            f"{f.smallest_subnormal:.6g}",
            f"{f.eps:.6g}",
        )
        for f in _FORMATS.values()
    ]
    from .table import render_table

    return render_table(header, rows)
