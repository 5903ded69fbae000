"""FP8 current scaling on Flax linen: ampbridge's own, where Flax's ``fp8_ops`` have only delayed scaling.

:class:`CurrentScalingDotGeneral` is a ``dot_general_cls`` for ``nn.Dense``/``nn.DenseGeneral`` that
does what torchao's ``Float8Linear`` (``Float8LinearConfig`` tensorwise dynamic casts) does with
``emulate=True``, on JAX's float8 dtypes:

- forward: lhs and rhs (input and kernel) each widened to float32 and quantized with their own
  scale of this call, ``scale = fp8_max / max(amax, 1e-12)`` (torchao's ``amax_to_scale``:
  :func:`ampbridge.core.fp8.current_scale`), divided by ``2**margin``; the float8 value is
  ``saturate(x * scale)`` cast to the ``forward`` format (``to_fp8_saturated``), dequantized to
  float32 by ``/ scale``; the dot runs in float32 and its result is cast to the operands' dtype;
- backward: the output gradient quantized the same way to the ``backward`` format with its own
  scale, for both the input gradient and the kernel gradient (torchao's ``grad_output`` casts:
  one tensorwise scale, so the same values); the operands' gradients flow straight through their
  quantization (torchao's ``_ToFloat8ConstrFunc``) onto the quantized other operand.

No state: nothing is stored between steps (no collection, nothing to checkpoint). Always emulated:
the dot runs in float32 on the dequantised values on every device (torchao's ``emulate=True``), so
the Plan row says ``(emulated)`` on a float8 GPU too.

Example:
    >>> import jax.numpy as jnp, flax.linen as nn
    >>> layer = nn.Dense(4, dot_general_cls=lambda: CurrentScalingDotGeneral("e4m3", "e5m2"))
    >>> float(qdq(jnp.float32([1.0, 0.3]), "e4m3")[1])  # 0.3 * 448 = 134.4: 128 in e4m3, / 448
    0.2857142984867096
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...core.fp8 import FP8_MAX, TORCHAO_EPS

_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _eps_floor() -> np.float32:
    """The smallest float32 >= 1e-12: torchao clamps a float64 amax at 1e-12, so a float32 amax is
    clamped exactly when it is below this (1e-12 itself is not a float32)."""
    t = np.float32(TORCHAO_EPS)
    return t if float(t) >= TORCHAO_EPS else np.nextafter(t, np.float32(np.inf))


def scale_of(x: Any, fmt: str, margin: int = 0) -> Any:
    """The float32 current scale of ``x`` (torchao's ``tensor_to_scale``, then ``/ 2**margin``)."""
    import jax.numpy as jnp

    top = FP8_MAX[fmt]
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)  # NaN propagates, as torch.max
    # float32 top / amax is the float64 quotient rounded once (53 >= 2 * 24 + 2: double rounding is
    # innocuous for a division); below the floor torchao divides by the float64 1e-12
    scale = jnp.where(amax < _eps_floor(), np.float32(top / TORCHAO_EPS), jnp.float32(top) / amax)
    return scale / np.float32(2.0 ** margin)


def quantize(x: Any, scale: Any, fmt: str) -> Any:
    """``x`` in float8: ``saturate(float32(x) * scale)`` cast (torchao's ``to_fp8_saturated``)."""
    import jax.numpy as jnp

    top = np.float32(FP8_MAX[fmt])
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(getattr(jnp, _DTYPES[fmt]))


def qdq(x: Any, fmt: str, margin: int = 0) -> Any:
    """``x`` quantized with its current scale and dequantized to float32 (``data.float() / scale``)."""
    import jax.numpy as jnp

    from jax import lax

    scale = scale_of(x, fmt, margin)
    q = quantize(x, scale, fmt).astype(jnp.float32)
    # XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal (1 ulp
    # off torchao's division in a third of the values); the barrier keeps the division
    return q / lax.optimization_barrier(jnp.broadcast_to(scale, q.shape))


@functools.lru_cache(maxsize=None)
def _ops(forward: str, backward: str, margin: int) -> tuple[Any, Any]:
    """The two custom-gradient functions of one setting: operand qdq and output-gradient qdq."""
    import jax

    @jax.custom_vjp
    def operand(x):
        return qdq(x, forward, margin)

    operand.defvjp(lambda x: (qdq(x, forward, margin), None), lambda _, g: (g,))

    @jax.custom_vjp
    def grad_point(y):
        return y

    grad_point.defvjp(lambda y: (y, None), lambda _, g: (qdq(g, backward, margin),))
    return operand, grad_point


class CurrentScalingDotGeneral:
    """A stateless ``dot_general`` with float8 current scaling (a linen layer's ``dot_general_cls``)."""

    def __init__(self, forward: str = "e4m3", backward: str = "e5m2", margin: int = 0):
        for fmt in (forward, backward):
            if fmt not in _DTYPES:
                raise ValueError(f"unknown float8 format {fmt!r}; accepted: {', '.join(_DTYPES)}")
        self.forward, self.backward, self.margin = forward, backward, int(margin)

    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None) -> Any:
        import jax.numpy as jnp
        from jax import lax

        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        operand, grad_point = _ops(self.forward, self.backward, self.margin)
        # widen first: the operand's gradient then arrives in float32 and is cast back to its dtype
        a, b = operand(lhs.astype(jnp.float32)), operand(rhs.astype(jnp.float32))
        y = lax.dot_general(a, b, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)
        # the gradient is quantized before the narrowing's transpose widens it back: in float32, as torchao
        return grad_point(y).astype(out_dtype)

    def __repr__(self) -> str:
        return f"CurrentScalingDotGeneral({self.forward!r}, {self.backward!r}, margin={self.margin})"
