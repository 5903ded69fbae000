"""FP8 current scaling on Keras: ampbridge's own, where Keras's float8 has only delayed scaling.

A matched ``Dense``/``EinsumDense`` gets a :class:`CurrentScalingCall` as its ``call`` (an instance
attribute: the layer's class, config, variables, saving and optimizer are untouched; removing the
attribute restores Keras's own ``call``). It does what torchao's ``Float8Linear`` (tensorwise
dynamic casts, ``emulate=True``) and the Flax op (:mod:`ampbridge.backends.jax.fp8_current`) do,
in ``keras.ops`` on every Keras backend:

- forward: the input and the kernel (as the layer's call sees them, in its compute dtype) are each
  widened to float32 and quantized with their own scale of this call, ``scale = fp8_max /
  max(amax, 1e-12)`` (torchao's ``amax_to_scale``), ``/ 2**margin``; ``clip(x * scale, ±fp8_max)``
  is cast to the ``forward`` format and dequantized by ``/ scale``; the matmul (einsum) runs in
  float32 and its result is cast to the compute dtype, then the bias and activation as Keras's own;
- backward (``keras.ops.custom_gradient``): the output gradient is quantized the same way to the
  ``backward`` format with its own scale; the operands' gradients go straight through their
  quantization.

No state: nothing is stored between steps, nothing to checkpoint. Always emulated.

Example:
    >>> import keras
    >>> float(qdq(keras.ops.convert_to_tensor([1.0, 0.3]), "e4m3")[1])  # 0.3 * 448 = 134.4 -> 128, / 448
    0.2857142984867096
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from ...core.fp8 import FP8_MAX, TORCHAO_EPS

_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# the smallest float32 >= 1e-12: torchao clamps a float64 amax at 1e-12 (not a float32 itself)
_FLOOR = np.nextafter(np.float32(TORCHAO_EPS), np.float32(1))


def scale_of(x: Any, fmt: str, margin: int = 0) -> Any:
    """The float32 current scale of ``x`` (torchao's ``tensor_to_scale``, then ``/ 2**margin``)."""
    amax = ops.cast(ops.max(ops.abs(x)), "float32")
    # float32 top / amax is the float64 quotient rounded once; below the floor torchao divides by 1e-12
    scale = ops.where(ops.less(amax, _FLOOR), np.float32(FP8_MAX[fmt] / TORCHAO_EPS),
                      ops.divide(np.float32(FP8_MAX[fmt]), amax))
    return ops.divide(scale, np.float32(2.0 ** margin))


def quantize(x: Any, scale: Any, fmt: str) -> Any:
    """``x`` in float8: ``clip(float32(x) * scale, ±fp8_max)`` cast (torchao's ``to_fp8_saturated``)."""
    top = np.float32(FP8_MAX[fmt])
    return ops.cast(ops.clip(ops.multiply(ops.cast(x, "float32"), scale), -top, top), _DTYPES[fmt])


def qdq(x: Any, fmt: str, margin: int = 0) -> Any:
    """``x`` quantized with its current scale and dequantized to float32 (``data.float() / scale``)."""
    scale = scale_of(x, fmt, margin)
    q = ops.cast(quantize(x, scale, fmt), "float32")
    if keras.backend.backend() == "jax":
        from jax import lax

        # XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal
        # (1 ulp off torchao's division); the barrier keeps the division (as the Flax op)
        scale = lax.optimization_barrier(ops.broadcast_to(scale, ops.shape(q)))
    return ops.divide(q, scale)


def _upstream(args: tuple, upstream: Any) -> Any:
    return args[0] if upstream is None else upstream  # TF/JAX pass it positionally, torch by keyword


def operand(x: Any, fmt: str, margin: int) -> Any:
    """``qdq(x)`` in the forward pass; the gradient passes straight through (torchao's cast)."""
    @ops.custom_gradient
    def f(x):
        return qdq(x, fmt, margin), lambda *args, upstream=None: _upstream(args, upstream)

    return f(x)


def grad_point(y: Any, fmt: str, margin: int) -> Any:
    """``y`` unchanged in the forward pass; its gradient quantized (qdq) to ``fmt`` in the backward."""
    @ops.custom_gradient
    def f(y):
        return ops.copy(y), lambda *args, upstream=None: qdq(_upstream(args, upstream), fmt, margin)

    return f(y)


class CurrentScalingCall:
    """The ``call`` of a float8 ``Dense``/``EinsumDense`` with current scaling (set on the instance)."""

    def __init__(self, layer: Any, forward: str = "e4m3", backward: str = "e5m2", margin: int = 0):
        for fmt in (forward, backward):
            if fmt not in _DTYPES:
                raise ValueError(f"unknown float8 format {fmt!r}; accepted: {', '.join(_DTYPES)}")
        self.layer, self.forward, self.backward, self.margin = layer, forward, backward, int(margin)

    @property
    def settings(self) -> tuple[str, str, int]:
        return self.forward, self.backward, self.margin

    def __call__(self, inputs: Any, training: Any = None) -> Any:
        layer = self.layer
        a = operand(ops.cast(inputs, "float32"), self.forward, self.margin)
        b = operand(ops.cast(layer.kernel, "float32"), self.forward, self.margin)
        equation = getattr(layer, "equation", None)
        y = ops.einsum(equation, a, b) if equation is not None else ops.matmul(a, b)
        # the gradient is quantized in float32, before the narrowing's transpose (as torchao)
        x = ops.cast(grad_point(y, self.backward, self.margin), layer.compute_dtype)
        if layer.bias is not None:
            x = ops.add(x, layer.bias)
        if layer.activation is not None:
            x = layer.activation(x)
        return x

    def __repr__(self) -> str:
        return (f"CurrentScalingCall({self.layer.name!r}, {self.forward!r}, {self.backward!r}, "
                f"margin={self.margin})")
