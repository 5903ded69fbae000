"""The device side of one step's numerics, inside the jitted step: per-layer gradient statistics
(counts and magnitudes, exact against the compute dtype's limits) and the attribution of a
non-finite step to the leaf module where it started.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.matching import join_path
from .layers import key_name
from .loss_scale import F32_INF_BITS, f32_bits

_F32_ABS = 0x7FFFFFFF


def _underflow_limit_bits(scale: jax.Array, e: int) -> jax.Array:
    """The bits of the smallest float32 >= ``scale * 2**-e`` (exact, from integer arithmetic).

    Non-negative float32 values order like their bit patterns, so ``|g| < scale * 2**-e`` is
    ``bits(|g|) < this`` for every float32 ``g``: no float comparison, which XLA's CPU would make
    with subnormals flushed to zero (bfloat16's limit, 2**-133 times the scale, is subnormal).
    """
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32) & _F32_ABS
    exp, man = bits >> 23, bits & 0x7FFFFF
    normal = bits - (e << 23)  # the exponent field drops by e, the significand stays
    significand = jnp.where(exp == 0, man, man | 0x800000)
    shift = jnp.clip(e + 1 - jnp.maximum(exp, 1), 0, 25)  # to subnormal units of 2**-149
    subnormal = (significand + (1 << shift) - 1) >> shift  # rounded up: a strict limit stays strict
    return jnp.where(exp - e >= 1, normal, jnp.where(bits == 0, 0, subnormal))


def _leaf_statistics(g: jax.Array, limit_bits: jax.Array, max_bits: int) -> tuple[jax.Array, ...]:
    """(zero, non-finite, underflow, overflow) counts and the bits of the finite max |g| of one leaf.

    All from the bit pattern of ``|g|`` (float16/bfloat16 gradients widen to float32 exactly).
    """
    x = g.astype(jnp.float32) if g.dtype != jnp.float32 else g
    bits = jax.lax.bitcast_convert_type(x, jnp.int32) & _F32_ABS
    finite = bits < F32_INF_BITS
    i32 = jnp.int32
    # one variadic reduce: one pass over the gradient (five separate ones cost ~20% more here)
    operands = ((bits == 0).astype(i32), (~finite).astype(i32),
                ((bits != 0) & (bits < limit_bits)).astype(i32), (finite & (bits > max_bits)).astype(i32),
                jnp.where(finite, bits, 0))
    zero = jnp.zeros((), i32)

    def combine(a: tuple, b: tuple) -> tuple:
        return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], jnp.maximum(a[4], b[4]))

    return jax.lax.reduce(operands, (zero,) * 5, combine, tuple(range(x.ndim)))


def layer_statistics(owned: Mapping[str, list], compute: Mapping[str, str], scale: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """``counts`` (L, 4) int32 and ``magnitudes`` (L, 2) float32 for the layers in ``owned``."""
    from ...core.dtypes import formats

    counts, magnitudes = [], []
    limits: dict[str, jax.Array] = {}
    for path, leaves in owned.items():
        fmt = formats()[compute[path]]
        if fmt.name not in limits:
            e = int(round(-np.log2(fmt.smallest_subnormal)))  # a power of two in every format
            limits[fmt.name] = _underflow_limit_bits(scale, e)
        parts = [_leaf_statistics(g, limits[fmt.name], f32_bits(fmt.max)) for g in leaves]
        layer_counts = [functools.reduce(jnp.add, [p[k] for p in parts]) for k in range(4)]
        counts.append(jnp.stack(layer_counts))
        top_bits = functools.reduce(jnp.maximum, [p[4] for p in parts])
        top = jax.lax.bitcast_convert_type(top_bits, jnp.float32)
        # squares relative to a power of two near the maximum: no float32 overflow, exact scaling
        unit = jax.lax.bitcast_convert_type(jnp.clip(254 - (top_bits >> 23), 1, 254) << 23, jnp.float32)
        squares = functools.reduce(jnp.add, [
            jnp.sum(jnp.where(jnp.isfinite(x), jnp.square(x * unit), 0.0))
            for x in (g.astype(jnp.float32) for g in leaves)])
        n_finite = sum(int(np.prod(g.shape)) for g in leaves) - layer_counts[1]
        rms = jnp.sqrt(squares / jnp.maximum(n_finite, 1).astype(jnp.float32)) / unit
        some = n_finite > 0
        magnitudes.append(jnp.stack([jnp.where(some, top / scale, jnp.nan),
                                     jnp.where(some, rms / scale, jnp.nan)]))
    if not counts:
        return jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 2), jnp.float32)
    return jnp.stack(counts), jnp.stack(magnitudes).astype(jnp.float32)


def owned_leaves(grads: Any) -> dict[str, list]:
    """The floating gradient leaves by the path of the module that owns them."""
    owned: dict[str, list] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            continue
        owner = join_path(*[key_name(k) for k in keypath[:-1]])
        owned.setdefault(owner, []).append(leaf)
    return owned


def leaves_of(paths: Sequence[str]) -> list[str]:
    """The paths with no other path below them (the model itself only when it is alone)."""
    def has_child(p: str) -> bool:
        return any(q != p and (p == "" or q.startswith(p + ".")) for q in paths)

    return [p for p in paths if not has_child(p)]


def attribute(finite: jax.Array, loss_bad: jax.Array, probes: list, leaf_index: list[int],
               leaf_params_bad: list, other_params_bad: list[tuple[int, jax.Array]], *,
               inputs: bool) -> tuple[jax.Array, ...]:
    """(where, origin, forward flags, gradient flags) from the probes' gradients, on the device.

    Leaves are in forward order. ``output``: the first leaf whose forward output was non-finite.
    ``gradient``: the first leaf in backward order, i.e. the last in forward order, whose input
    gradient went non-finite (watching output gradients instead: the leaf after the last one whose
    output gradient did, as its input gradient fed that one); else whose own parameter gradient
    did; then a non-leaf layer's own parameters; ``loss`` when nothing else explains it.
    """
    i32 = jnp.int32
    k = len(probes)
    forward = jnp.stack([p[0] > 0 for p in probes]) if k else jnp.zeros((0,), bool)
    backward = jnp.stack([p[1] > 0 for p in probes]) if k else jnp.zeros((0,), bool)
    params_bad = jnp.stack(leaf_params_bad) if k else jnp.zeros((0,), bool)
    order = jnp.arange(k, dtype=i32)

    def last(mask: jax.Array) -> jax.Array:
        return jnp.max(jnp.where(mask, order, -1), initial=-1)

    first_output = jnp.min(jnp.where(forward, order, k), initial=k)
    first_output = jnp.where(first_output < k, first_output, -1)
    if inputs:
        by_gradient = last(backward)
    else:
        fed = last(backward)
        by_gradient = jnp.where((fed >= 0) & (fed + 1 < k), fed + 1, -1)
    # then the leaves' own parameter gradients (torch's monitor decides in the same order)
    by_gradient = jnp.where(by_gradient >= 0, by_gradient, last(params_bad))
    by_params = i32(-1)
    for idx, bad in other_params_bad:  # forward order: the last flagged is the first in backward order
        by_params = jnp.where(bad, i32(idx), by_params)
    paths_of = jnp.asarray(leaf_index + [-1], i32)  # index -1 picks the trailing -1
    where = jnp.where(finite, i32(0), jnp.where(first_output >= 0, i32(1), jnp.where(
        loss_bad, i32(3), jnp.where((by_gradient >= 0) | (by_params >= 0), i32(2), i32(4)))))
    origin = jnp.where(where == 1, paths_of[first_output], jnp.where(
        where == 2, jnp.where(by_gradient >= 0, paths_of[by_gradient], by_params), i32(-1)))
    return where, origin, forward, backward
