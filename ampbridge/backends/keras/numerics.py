"""The numerics kernels the monitor's record is made of, in ``keras.ops`` inside the train step
(the statistics of a layer's scaled gradients, counts as exact float32 pairs) and read on the host.

The optimizer (loss_scale.py) and the monitor share three things from here: the record's
:data:`LAYOUT`, the :class:`MonitorSpec` the monitor attaches to the optimizer, and :func:`fetch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
from keras import ops

from .environment import active_backend

@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The layout of the monitor's record, shared by the optimizer that writes it in the train step
    and the monitor that reads it on the host.

    ``head``: its head's length (step as (hi, lo), scale used, found_inf, skipped, last leaf with
    non-finite own grads, sampled); ``row``: a layer's row's length (max|g|, rms(g) of the scaled
    finite values, then (hi, lo) counts: zero, nonfinite, underflow, overflow, elements); ``split``:
    counts travel as float32 pairs ``hi * split + lo``, exact up to 2**36.

    Example:
        >>> LAYOUT.head, LAYOUT.row, LAYOUT.join(1.0, 5.0)
        (7, 12, 4101)
    """

    head: int = 7
    row: int = 12
    split: int = 4096

    def join(self, hi: Any, lo: Any) -> int:
        """A count from its (hi, lo) pair as read on the host."""
        return int(hi) * self.split + int(lo)


LAYOUT = RecordLayout()


def finite_flags(tensors: list[Any]) -> list[Any]:
    """Per tensor, whether every element is finite (None for a None gradient): each leaf reduced on
    its own, whatever its shape (a scalar, size 1, size 0: all finite) or dtype."""
    return [ops.all(ops.isfinite(t)) if t is not None else None for t in tensors]


def _all(flags: list[Any]) -> Any:
    present = [f for f in flags if f is not None]
    return ops.all(ops.stack(present)) if present else ops.convert_to_tensor(True)


def all_finite(tensors: list[Any], flags: list[Any] | None = None) -> Any:
    """The backend's one "all finite" check (a boolean scalar tensor): the loss-scaling optimizer's
    skip decision, the monitor's non-finite marks and Keras's ``check_finite`` hook all call it.
    ``flags``: :func:`finite_flags` of ``tensors``, when the caller already has them."""
    if flags is None and active_backend() == "torch":  # eager: one in-place chain instead of Keras dispatches
        import torch

        with torch.no_grad():
            finite = None
            for t in tensors:
                if t is not None:
                    leaf = torch.isfinite(t).all()
                    finite = leaf if finite is None else finite & leaf
            return torch.tensor(True) if finite is None else finite
    return _all(finite_flags(tensors) if flags is None else flags)


def split_count(count: Any) -> tuple[Any, Any]:
    count = ops.cast(count, "int32")
    hi = ops.floor_divide(count, LAYOUT.split)
    return ops.cast(hi, "float32"), ops.cast(ops.subtract(count, ops.multiply(hi, LAYOUT.split)), "float32")


def _dense(g: Any) -> Any:
    if active_backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(g, tf.IndexedSlices):  # embedding gradients
            return tf.convert_to_tensor(g)
    return g


def grad_stats(grads: list[Any], scale: Any, compute_dtype: str, sizes: list[int] | None = None) -> Any:
    """One layer's row of statistics of its scaled gradients (``_runlog.layer_stats``'s definitions).

    Max and RMS are of the finite scaled values (the host divides by the scale, in float64, as
    the reference does); the RMS is taken relative to (about) the max, so it neither overflows
    nor underflows in float32. "Below the smallest subnormal once unscaled" is tested as
    ``|g| * 2**k < (subnormal * 2**k) * scale``, exact in float32 (powers of two) where the
    bfloat16 and float32 subnormals themselves would be flushed to zero.
    """
    import math

    from ...core.dtypes import formats

    if not grads:
        return ops.zeros((LAYOUT.row,), "float32")
    fmt = formats()[compute_dtype]
    k = max(0, -60 - int(math.log2(fmt.smallest_subnormal)))
    lift, threshold = np.float32(2.0 ** k), ops.multiply(np.float32(fmt.smallest_subnormal * 2.0 ** k), scale)
    top = np.float32(fmt.max)
    flat = [ops.reshape(ops.cast(_dense(g), "float32"), (-1,)) for g in grads]
    absolute = [ops.abs(g) for g in flat]
    finite = [ops.isfinite(g) for g in flat]
    largest = ops.max(ops.stack([ops.max(ops.where(f, a, 0.0)) for a, f in zip(absolute, finite)]))
    # XLA turns a division by a scalar into a multiplication by its reciprocal, which must stay a
    # normal float32 (CPUs flush subnormals): the unit is the max, kept within 2**+-100 (the squares
    # of a / unit then stay below 2**56)
    unit = ops.clip(largest, np.float32(2.0 ** -100), np.float32(2.0 ** 100))

    def total(parts: list[Any]) -> Any:
        return ops.sum(ops.stack(parts))

    def count(masks: list[Any]) -> Any:
        return total([ops.sum(ops.cast(m, "int32")) for m in masks])

    n_finite = count(finite)
    squares = total([ops.sum(ops.where(f, ops.square(ops.divide(a, unit)), 0.0)) for a, f in zip(absolute, finite)])
    rms = ops.multiply(unit, ops.sqrt(ops.divide(squares, ops.cast(ops.maximum(n_finite, 1), "float32"))))
    # the variables' sizes: a densified IndexedSlices has no static shape
    size = sum(sizes) if sizes is not None else sum(int(np.prod(g.shape)) for g in flat)
    zero = count([ops.equal(g, 0.0) for g in flat])
    under = count([ops.logical_and(ops.logical_and(f, ops.not_equal(g, 0.0)),
                                   ops.less(ops.multiply(a, lift), threshold))
                   for g, a, f in zip(flat, absolute, finite)])
    over = count([ops.logical_and(f, ops.greater(a, top)) for a, f in zip(absolute, finite)])
    parts = [largest, rms]
    for c in (zero, ops.subtract(size, n_finite), under, over, size):
        parts.extend(split_count(c))
    return ops.stack([ops.cast(p, "float32") for p in parts])


# --- reading on the host ---------------------------------------------------------------------

def host_value(x: Any) -> np.ndarray:
    """A tensor or variable's value on the host (a sync)."""
    if isinstance(x, keras.Variable):
        x = x.value
    if active_backend() == "tensorflow":  # np.array(tf.Variable) warns under numpy 2
        import tensorflow as tf

        return np.asarray(tf.convert_to_tensor(x).numpy())
    if active_backend() == "torch":  # as is np.array(torch.Tensor)
        return x.detach().cpu().numpy()
    return np.asarray(ops.convert_to_numpy(x))


def fetch(parts: list[Any]) -> np.ndarray:
    """Tensors (and variables' values) to one flat float64 host array, in one transfer."""
    backend = active_backend()
    if backend == "jax":
        import jax

        host = jax.device_get([p.value if isinstance(p, keras.Variable) else p for p in parts])
        return np.concatenate([np.asarray(h, np.float64).ravel() for h in host])
    if backend == "torch":
        import torch

        flat = torch.cat([ops.convert_to_tensor(p).detach().reshape(-1).float() for p in parts])
        return flat.cpu().numpy().astype(np.float64)
    return host_value(ops.concatenate([ops.reshape(ops.cast(p, "float32"), (-1,)) for p in parts])).astype(np.float64)


# --- what the optimizer computes the record from -----------------------------------------------

class MonitorSpec:
    """What the optimizer needs to compute the record: per stats layer (path, compute dtype,
    ids of its trainable variables), per variable of a leaf layer its index in the log's layer
    list, the sampling period, and (torch, eager) the host's step counter."""

    def __init__(self, every: int, stats: list[tuple[str, str, tuple[int, ...]]], leaf_of: dict[int, int],
                 host_step: int):
        self.every, self.stats, self.leaf_of, self.host_step = every, stats, leaf_of, host_step
