"""The monitor's float8 reader on Keras: per float8 layer, this step's amax, the scale it used and
saturation, from the variables Keras's ``quantize("float8")`` keeps (``inputs_scale``,
``inputs_amax_history``, ``kernel_*``, ``outputs_grad_*``).

Keras quantizes step t with the divisor stored after step t-1 (its forward reads the variable; the
optimizer overwrites it with the step's new value afterwards), and the history's first entry after
step t is step t's amax (``roll(h, -1)`` with entry 0 replaced). So a step's record needs the
divisors as they were *before* it: the monitor reads them before a sampled step (``fit``), or with
the read of the step before it (a custom loop's :meth:`Monitor.record`: the same transfer, no
extra sync), and the histories' first entries after it. Saturation is ``amax / divisor > fp8_max``
(Keras clips ``x / divisor``, computed in the layer's compute dtype, to the format's max); the fraction clipped is not counted (it would
need the tensor itself).

Example:
    >>> stats = tensor_stats([900.0, 1.0, 2.0], [1.0, 1.0, 1.0])
    >>> stats["input"].saturated, stats["weight"].saturated
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.fp8 import FP8_MAX
from ...diagnostics.runlog import Fp8TensorStats

#: (the log's tensor name, Keras's variable prefix, the format Keras casts it to)
TENSORS = (("input", "inputs", "e4m3"), ("weight", "kernel", "e4m3"), ("grad_output", "outputs_grad", "e5m2"))


def float8_layers(layers: Sequence[str], by_path: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (path, layer) of each float8-quantized layer, in the log's layer order."""
    return [(p, by_path[p]) for p in layers
            if getattr(getattr(by_path[p], "dtype_policy", None), "quantization_mode", None) == "float8"
            and hasattr(by_path[p], "inputs_amax_history")]


def scale_variables(layer: Any) -> list[Any]:
    """The layer's three divisor variables (input, weight, output gradient)."""
    return [getattr(layer, f"{prefix}_scale") for _, prefix, _ in TENSORS]


def history_variables(layer: Any) -> list[Any]:
    """The layer's three amax-history variables (input, weight, output gradient)."""
    return [getattr(layer, f"{prefix}_amax_history") for _, prefix, _ in TENSORS]


def tensor_stats(newest_amax: Sequence[float], divisors: Sequence[float],
                 compute_dtype: str = "float32") -> dict[str, Fp8TensorStats]:
    """One layer's record: this step's amaxes (the histories' first entries after the step) and the
    divisors the step quantized with (those stored before it); Keras divides in the layer's
    ``compute_dtype``."""
    return {name: Fp8TensorStats(amax=float(a), scale=float(d), scale_op="divide", fp8_max=FP8_MAX[fmt],
                                 compute_dtype=compute_dtype)
            for (name, _, fmt), a, d in zip(TENSORS, newest_amax, divisors)}
