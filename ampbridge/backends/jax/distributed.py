"""Data-parallel training under a policy: the gradient all-reduce in ``reduce_dtype``, the
loss-scale state replicated, the non-finite flag agreed across devices.

- :func:`pmean_grads` replaces a bare ``lax.pmean(grads, axis)`` inside ``jax.shard_map`` or
  ``pmap``: each floating leaf is cast to the policy's ``reduce_dtype``, averaged over ``axis``
  (the all-reduce XLA emits carries that element type) and cast back to its own dtype.
- :func:`data_parallel_value_and_grad` is the sharded-``jit`` form: XLA places the all-reduce
  of a plain sharded ``jit`` itself, in the dtype of the partial gradients where it puts it (the
  compute dtype of the last matmul, not a setting); this runs the per-shard gradient in a
  ``shard_map`` over the batch axis and reduces it with :func:`pmean_grads`.
- :func:`replicate` puts a pytree (the optimizer state, loss-scale state included) on every
  device of a mesh. ``ampbridge.jax.optimizer(..., axis_name=axis)`` agrees on the non-finite
  flag over ``axis`` (one scalar ``pmin``), so every device skips together even when a gradient
  turns non-finite on one device after the reduction.

Holds: pmean_grads, data_parallel_value_and_grad, replicate.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from .environment import DTYPES, phase_policy, resolve_policy
from .loss_scale import loss_scale


def _reduce_dtype(policy: Policy | str) -> Any:
    resolved, _ = resolve_policy(policy, warn=False)
    return DTYPES[phase_policy(resolved).reduce_dtype]


def pmean_grads(grads: Any, axis_name: Hashable | tuple[Hashable, ...], policy: Policy | str) -> Any:
    """``lax.pmean(grads, axis_name)`` with the all-reduce in the policy's ``reduce_dtype``.

    Floating leaves are cast to ``reduce_dtype``, averaged over ``axis_name`` and cast back to
    their own dtype; other leaves pass through. Call it inside ``jax.shard_map``/``pmap`` where
    ``axis_name`` is bound. A policy with ``[[phase]]`` tables gives its first phase's dtype:
    pass ``policy.at(step=...)`` for another. Non-finite values survive the sum, so an overflow
    on one device's shard reaches every device (and every device's optimizer skips).

    Under ``shard_map`` (which checks varying axes by default) differentiate device-local copies
    of the replicated parameters, ``jax.lax.pcast(params, axis_name, to="varying")``: otherwise
    JAX's own all-reduce has already summed the gradients in their dtype, and this raises
    :class:`ampbridge.errors.UnsupportedOptionError` rather than reduce twice.

    Example:
        >>> import jax, jax.numpy as jnp, ampbridge
        >>> mean = jax.vmap(lambda g: pmean_grads(g, "d", ampbridge.Policy(reduce_dtype="bfloat16")),
        ...                 axis_name="d")
        >>> mean({"w": jnp.array([1.0, 2.0])})["w"]
        Array([1.5, 1.5], dtype=float32)
    """
    wire = _reduce_dtype(policy)
    tracked = _varying(jax.lax.axis_index(axis_name))  # empty unless shard_map checks vma

    def reduce(path: Any, g: Any) -> Any:
        if not (hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating)):
            return g
        if tracked and not tracked <= _varying(g):
            raise UnsupportedOptionError(
                f"ampbridge.jax.distributed.pmean_grads: the gradient {jax.tree_util.keystr(path) or 'leaf'} "
                f"is already "
                f"reduced over {axis_name!r}: shard_map differentiates replicated parameters with an all-reduce "
                f"of its own, in the gradients' dtype ({g.dtype}), not reduce_dtype ({wire.name}); differentiate "
                f"device-local copies, params = jax.lax.pcast(params, {axis_name!r}, to='varying'), or use "
                "check_vma=False, or ampbridge.jax.distributed.data_parallel_value_and_grad")
        return jax.lax.pmean(g.astype(wire), axis_name).astype(g.dtype)

    return jax.tree_util.tree_map_with_path(reduce, grads)


def _varying(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty when vma is not checked)."""
    # private: jax.typeof(x).manual_axis_type.varying (jax 0.10.2); older releases call it .vma
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())


def data_parallel_value_and_grad(fun: Callable[..., Any], opt_state: Any, mesh: Any, policy: Policy | str, *,
                                 axis_name: str = "data") -> Callable[..., tuple[Any, Any]]:
    """``ampbridge.jax.value_and_grad`` for a sharded ``jit``: the batch split over ``axis_name``,
    the gradients all-reduced in ``reduce_dtype``.

    ``fun(params, *batch)`` returns a scalar loss (the mean over its batch). The returned function
    takes ``(params, *batch)``: ``params`` replicated, every ``batch`` array split along its first
    axis over ``axis_name`` of ``mesh`` (equal shards). Each device differentiates its shard's
    loss times the loss scale read from ``opt_state``; the loss (float32) and gradients are
    averaged with :func:`pmean_grads`. It returns ``(loss, grads)``, replicated: the mean loss of
    the global batch and the scaled gradients ``tx.update`` of ``ampbridge.jax.optimizer`` takes.
    ``params`` is a pytree of arrays (for NNX: ``nnx.split`` first).

    Example:
        >>> import jax, jax.numpy as jnp, optax, ampbridge
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> policy = ampbridge.Policy(loss_scale={"mode": "static", "initial_scale": 4.0})
        >>> opt_state = ampbridge.jax.optimizer(optax.sgd(0.1), policy).init({"w": jnp.ones(2)})
        >>> grad_fn = data_parallel_value_and_grad(lambda p, x: jnp.mean(x @ p["w"]), opt_state, mesh, policy)
        >>> loss, grads = jax.jit(grad_fn)({"w": jnp.ones(2)}, jnp.ones((4, 2)))
        >>> float(loss), grads["w"]
        (2.0, Array([4., 4.], dtype=float32))
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def local(params: Any, scale: jax.Array, *batch: Any) -> tuple[jax.Array, Any]:
        def scaled(p: Any) -> tuple[jax.Array, jax.Array]:
            loss = jnp.asarray(fun(p, *batch))
            wide = jnp.promote_types(loss.dtype, jnp.float32)
            return loss.astype(wide) * scale.astype(wide), loss

        # differentiate this device's copy: the reduction is pmean_grads', not shard_map's own
        local_params = jax.tree_util.tree_map(lambda p: jax.lax.pcast(p, axis_name, to="varying"), params)
        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(local_params)
        loss = jax.lax.pmean(loss.astype(jnp.promote_types(loss.dtype, jnp.float32)), axis_name)
        return loss, pmean_grads(grads, axis_name, policy)

    def run(params: Any, *batch: Any) -> tuple[Any, Any]:
        scale = loss_scale(opt_state).scale
        specs = (P(), P()) + (P(axis_name),) * len(batch)
        # lay the arguments out as the specs say (a no-op when they already are)
        args = [jax.device_put(a, NamedSharding(mesh, spec))
                for a, spec in zip((params, scale, *batch), specs)]
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P()))(*args)

    return run


def replicate(tree: Any, mesh: Any) -> Any:
    """``tree`` (an optimizer state, parameters) placed whole on every device of ``mesh``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> replicate({"scale": jnp.float32(2.0)}, jax.make_mesh((1,), ("data",)))["scale"].sharding.is_fully_replicated
        True
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.device_put(tree, NamedSharding(mesh, P()))
