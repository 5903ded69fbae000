"""What :func:`~ampbridge.jax.numerics` places inside module calls: the watch in force while it
traces a model, and the identities whose backward passes report a module's non-finite output or
gradient through the gradient of a dummy probe. Used by the linen interceptor and the NNX calls.

Holds: Watch, _WATCH, watch_scope, watched, edge_of, finished, watch_tree, watch_outputs,
watch_output_gradients, watch_inputs, _watch_values, nonfinite_inputs, watch_edge, boundary_origin,
first_boundary.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .environment import is_float_array
from .loss_scale import all_finite


class Watch:
    """What :func:`numerics` is tracing: module paths seen (discovery) or the probes to place."""

    def __init__(self, owner: Any, probes: Mapping[str, jax.Array] | None = None, *, inputs: bool = True,
                 edges: Mapping[str, jax.Array] | None = None):
        self.owner = owner  # the linen model's resolver, or the NNX model's key
        self.probes = probes
        self.inputs = inputs  # watch input cotangents (else output cotangents)
        # every module's forward boundary (containers too): a (2,) probe, [0] its inputs were
        # non-finite, [1] its output was (a block's own code, e.g. a residual add, shows there)
        self.edges = edges
        self.seen: dict[str, None] = {}  # call order, each path once
        self.events: dict[tuple[str, int], None] = {}  # (path, 0) calls start, (path, 1) finish: first call's order


_WATCH: "contextvars.ContextVar[Watch | None]" = contextvars.ContextVar("ampbridge_jax_watch", default=None)


@contextlib.contextmanager
def watch_scope(watch: Watch | None) -> Iterator[None]:
    """``watch`` is the watch in force while the block runs (None: none), the previous one after it,
    even on error: :func:`~ampbridge.jax.numerics` traces the model's calls inside it.

    Example:
        >>> w = Watch(owner="model")
        >>> with watch_scope(w):
        ...     watched("model", "dense"), watched("other", "dense")
        (None, None)
        >>> list(w.seen), watched("model", "head")
        (['dense'], None)
    """
    token = _WATCH.set(watch)
    try:
        yield
    finally:
        _WATCH.reset(token)


def watched(owner: Any, path: str) -> tuple[jax.Array, bool] | None:
    """(probe, watch inputs) for the module at ``path`` while :func:`numerics` traces this model."""
    watch = _WATCH.get()
    if watch is None or watch.owner is not owner:
        return None
    if watch.probes is None:
        watch.seen.setdefault(path, None)
        watch.events.setdefault((path, 0), None)
        return None
    probe = watch.probes.get(path)
    return None if probe is None else (probe, watch.inputs)


def edge_of(owner: Any, path: str) -> jax.Array | None:
    """The boundary probe of the module at ``path`` while :func:`numerics` traces this model."""
    watch = _WATCH.get()
    if watch is None or watch.owner is not owner or watch.edges is None:
        return None
    return watch.edges.get(path)


def finished(owner: Any, path: str) -> None:
    """Discovery: the module at ``path`` returned (its output's place in the order of events)."""
    watch = _WATCH.get()
    if watch is not None and watch.owner is owner and watch.probes is None:
        watch.events.setdefault((path, 1), None)


def _any_nonfinite(xs: Sequence[jax.Array]) -> jax.Array:
    return ~all_finite(list(xs))  # the backend's one finite check (loss_scale.all_finite)


def _flags(forward: Any, backward: Any) -> jax.Array:
    return jnp.stack([jnp.asarray(forward, jnp.float32), jnp.asarray(backward, jnp.float32)])


# Identities whose backward passes report through the gradient of a dummy ``probe`` (2,):
# [0] counts calls whose forward output was non-finite (a residual of the forward pass, so it
# crosses scan/remat boundaries like any gradient); [1] calls whose input cotangent was
# (``watch_inputs``) or, with ``watch_output_gradients``, whose output cotangent was.
@jax.custom_vjp
def watch_outputs(xs: tuple, probe: jax.Array) -> tuple:
    return xs


watch_outputs.defvjp(lambda xs, probe: (xs, _any_nonfinite(xs)), lambda bad, ct: (ct, _flags(bad, 0)))


@jax.custom_vjp
def watch_output_gradients(xs: tuple, probe: jax.Array) -> tuple:
    return xs


watch_output_gradients.defvjp(lambda xs, probe: (xs, _any_nonfinite(xs)),
                               lambda bad, ct: (ct, _flags(bad, _any_nonfinite(ct))))


@jax.custom_vjp
def watch_inputs(xs: tuple, probe: jax.Array) -> tuple:
    return xs


watch_inputs.defvjp(lambda xs, probe: (xs, None), lambda _, ct: (ct, _flags(0, _any_nonfinite(ct))))


@jax.custom_vjp
def _watch_values(xs: tuple, probe: jax.Array, inputs_bad: jax.Array) -> tuple:
    """Identity on a module's output whose backward reports, in ``probe``'s gradient, that the
    module's inputs (``inputs_bad``, found as its call began) and its output were non-finite. Only
    the output carries it: an identity on each input would split a shared input's gradient sum
    (float16 rounding), while the output's is one sum before it fans out."""
    return xs


def _watch_values_fwd(xs: tuple, probe: jax.Array, inputs_bad: jax.Array) -> tuple:
    return xs, (jnp.stack([inputs_bad, jnp.asarray(_any_nonfinite(xs), jnp.float32)]), inputs_bad)


def _watch_values_bwd(res: tuple, ct: tuple) -> tuple:
    flags, inputs_bad = res
    return ct, flags, jnp.zeros_like(inputs_bad)


_watch_values.defvjp(_watch_values_fwd, _watch_values_bwd)


def nonfinite_inputs(tree: Any, probe: jax.Array | None) -> jax.Array | None:
    """Whether a module's float inputs hold a non-finite value (0./1.), where it has a boundary probe."""
    if probe is None:
        return None
    floats = [x for x in jax.tree_util.tree_leaves(tree) if is_float_array(x)]
    return jnp.asarray(_any_nonfinite(floats), jnp.float32) if floats else jnp.zeros((), jnp.float32)


def watch_edge(tree: Any, probe: jax.Array | None, inputs_bad: jax.Array | None) -> Any:
    """A module's output with its boundary flags attached (see :func:`_watch_values`)."""
    if probe is None:
        return tree
    return watch_tree(lambda xs, p: _watch_values(xs, p, jax.lax.stop_gradient(inputs_bad)), tree, probe)


def watch_tree(fn: Callable, tree: Any, probe: jax.Array) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, x in enumerate(leaves) if is_float_array(x)]
    if not picked:
        return tree
    for i, x in zip(picked, fn(tuple(leaves[i] for i in picked), probe)):
        leaves[i] = x
    return treedef.unflatten(leaves)


def boundary_origin(event: tuple[str, int], order: Sequence[str]) -> tuple[str, str]:
    """(path, where) an event names: a module's output (its inputs were finite, checked when its
    call began), or a module's inputs, made by the code of the innermost module around it (the
    model's inputs, or its root's own code: ``("", "input")``)."""
    path, kind = event
    if kind == 1:
        return path, "output"
    known = set(order)
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        if path and path in known:
            return path, "output"
    return "", "input"


def first_boundary(finite: jax.Array, where: jax.Array, origin: jax.Array, flags: list,
                    named: list[tuple[int, int]]) -> tuple[jax.Array, jax.Array]:
    """(where, origin) of the first flagged boundary event in forward order, else as given."""
    n = len(flags)
    first = jnp.min(jnp.where(jnp.stack(flags), jnp.arange(n, dtype=jnp.int32), n), initial=n)
    codes = jnp.asarray([w for w, _ in named] + [0], jnp.int32)
    at = jnp.asarray([o for _, o in named] + [-1], jnp.int32)
    hit = ~finite & (first < n)
    return jnp.where(hit, codes[first], where), jnp.where(hit, at[first], origin)
