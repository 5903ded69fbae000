"""Numerics diagnostics: per-layer gradient statistics and overflow attribution computed inside the
jitted step (:func:`numerics`), and the :class:`Monitor` that writes them to the shared run log.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core import io as _io
from ...core.plan import Plan
from .apply import Applied
from .environment import FRAMEWORK
from .loss_scale import loss_scale, scale_loss, skip_decision, value_and_grad
from .nnx import nnx_key, nnx_path
from .sampling import Window
from .stats import attribute, layer_statistics, leaves_of, owned_leaves
from .watch import Watch, boundary_origin, first_boundary, watch_scope

if TYPE_CHECKING:
    from ...diagnostics.runlog import RunLogWriter


_WHERE = (None, "output", "gradient", "loss", "unreproduced", "input")  # unreproduced: the replay saw nothing non-finite
_STAT_COUNTS = ("zero", "nonfinite", "underflow", "overflow")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["step", "loss", "loss_scale", "found_inf", "skipped", "sampled", "counts",
                                "magnitudes", "output_nonfinite", "gradient_nonfinite", "where", "origin"],
                   meta_fields=["layers", "sizes", "compute_dtypes", "paths", "leaves", "watched", "order"])
@dataclasses.dataclass(frozen=True)
class Numerics:
    """What :func:`numerics` returns from inside the jitted step: arrays, and static path names.

    Arrays: ``step`` (the optimizer step this is, ``loss_scale(opt_state).steps``), ``loss``
    (unscaled), ``loss_scale`` (the scale used), ``found_inf``, ``skipped``, ``sampled`` (per-layer
    statistics computed this step), ``counts`` (int32, one row per layer: zero, non-finite,
    underflow, overflow element counts), ``magnitudes`` (float32 rows: max-abs and RMS of the
    finite unscaled gradients), ``output_nonfinite`` / ``gradient_nonfinite`` (one flag per leaf
    module: its forward output; the gradient with respect to its inputs, or its outputs when
    ``watched == "outputs"``), and the attribution ``where`` (0 none, 1 output, 2 gradient,
    3 loss, 4 unreproduced, 5 input) with ``origin`` (an index into ``paths``). Static: ``layers``
    (the parameter-owning Plan paths the rows stand for), their ``sizes`` (elements) and
    ``compute_dtypes``; ``paths`` (leaves, layers and the containers attribution can name, forward
    order), ``leaves``, ``watched`` (``"inputs"``, ``"outputs"``, ``"none"``).

    Attribution, on a non-finite step: ``output`` names where the first non-finite forward value
    appeared, every module's inputs (as its caller made them) and output checked in call order: a
    module's output whose inputs were finite, or, for inputs made non-finite by the code around
    it, the innermost module around it (``input``: the model's inputs or the root's own code); otherwise a non-finite loss is ``loss``; otherwise ``gradient`` names
    the first leaf in backward order (the last in forward order) whose input gradient went
    non-finite, else whose own parameter gradient did, then a non-leaf layer's own parameters;
    ``loss`` when nothing else explains it (the order torch's monitor uses too).

    On the host, :meth:`layer_stats` and :meth:`first_nonfinite` give the log's values.
    """

    step: Any
    loss: Any
    loss_scale: Any
    found_inf: Any
    skipped: Any
    sampled: Any
    counts: Any
    magnitudes: Any
    output_nonfinite: Any
    gradient_nonfinite: Any
    where: Any
    origin: Any
    layers: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    compute_dtypes: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()
    watched: str = "inputs"
    order: tuple[str, ...] = ()  # every module path the step called, in call (forward) order

    def layer_stats(self) -> dict[str, dict[str, float]]:
        """Per layer, the statistics of ``ampbridge.diagnostics.runlog.layer_stats`` (reads the device)."""
        if not bool(self.sampled):
            return {}
        counts, magnitudes = np.asarray(self.counts), np.asarray(self.magnitudes)
        out = {}
        for i, path in enumerate(self.layers):
            n = max(self.sizes[i], 1)
            entry = {"grad_max_abs": float(magnitudes[i, 0]), "grad_rms": float(magnitudes[i, 1])}
            entry.update({k: int(counts[i, j]) / n for j, k in enumerate(_STAT_COUNTS)})
            out[path] = entry
        return out

    def first_nonfinite(self) -> dict[str, str] | None:
        """``{"path": ..., "where": "output" | "gradient" | "loss" | "unreproduced"}`` on a non-finite
        step, else None (``unreproduced``: the replay found every output, the loss and every gradient finite)."""
        where = _WHERE[int(self.where)]
        if where is None:
            return None
        return {"path": "" if where in ("loss", "unreproduced", "input") else self.paths[int(self.origin)],
                "where": where}


def numerics(model: Applied | Any, loss_fn: Callable[..., Any], opt_state: Any, *, has_aux: bool = False,
             every: int | None = 1, attribution: bool | str = True, sample: bool = True
             ) -> Callable[..., tuple[Any, Any, Numerics | None]]:
    """``jax.value_and_grad`` for a loss-scaled step, plus the step's numerics, all on the device.

    ``numerics(amp, loss_fn, opt_state)(params, *args)`` returns ``(loss, grads, stats)``:
    ``loss_fn(params, *args)`` returns the plain loss (or ``(loss, aux)`` with ``has_aux``;
    then the first result is ``(loss, aux)``); it is scaled by the ``opt_state``'s loss scale
    (:func:`scale_loss`) and differentiated, so ``grads`` are what ``tx.update`` expects. For
    NNX, ``numerics(model, loss_fn, optimizer)(model, *args)`` with ``loss_fn(model, *args)`` is
    ``nnx.value_and_grad`` the same way (``grads``: the ``nnx.Param`` state, for
    ``optimizer.update(model, grads)``).
    ``stats`` is a :class:`Numerics` of arrays: per layer owning parameters, the counts and
    magnitudes of ``ampbridge.diagnostics.runlog.layer_stats`` (every ``every``-th optimizer step
    and every non-finite one; None: non-finite steps only); with ``attribution`` (``True`` or
    ``"inputs"``: input gradients watched, as torch's full backward hooks; ``"outputs"``: output
    gradients only, ``grads`` bit-identical to the step without it; ``False``: none), per leaf
    module flags and the first non-finite place. ``sample=False`` (a static bool) is
    :func:`value_and_grad` exactly and ``stats`` None (what :meth:`Monitor.wrap` drives). Nothing
    syncs with the host. docs/jax.md ("Monitor") says how each is computed and what it costs.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ampbridge
        >>> policy = ampbridge.preset("mixed_float16")
        >>> amp = apply(nn.Sequential([nn.Dense(4), nn.Dense(1)]), policy)
        >>> x = jnp.ones((2, 3))
        >>> params = amp.init(jax.random.key(0), x)["params"]
        >>> tx = optimizer(optax.sgd(0.1), policy)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... def step(params, opt_state, x):
        ...     loss_fn = lambda p, x: jnp.mean(amp.apply({"params": p}, x) ** 2)
        ...     loss, grads, stats = numerics(amp, loss_fn, opt_state)(params, x)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, stats
        >>> params, opt_state, stats = step(params, opt_state, x)  # the first scale, 2**16, overflows here
        >>> stats.layers, bool(stats.skipped), stats.first_nonfinite()
        (('layers_0', 'layers_1'), True, {'path': 'layers_1', 'where': 'gradient'})
        >>> sorted(stats.layer_stats()["layers_0"])
        ['grad_max_abs', 'grad_rms', 'nonfinite', 'overflow', 'underflow', 'zero']
    """
    owner, policy, key = _numerics_target(model)
    _check_numerics_args(every, attribution, sample)
    if not sample:  # the program without a monitor, op for op
        plain = value_and_grad(loss_fn, opt_state, has_aux=has_aux)
        return lambda *args: (*plain(*args), None)
    watching = bool(attribution)
    return functools.partial(_numerics_run, model, owner, key, loss_fn, opt_state, has_aux, every, watching,
                             attribution in (True, "inputs"), policy.resolved_loss_scale)


def _numerics_run(model: Applied | Any, owner: Any, key: Any, loss_fn: Callable[..., Any], opt_state: Any,
                  has_aux: bool, every: int | None, watching: bool, watch_inputs: bool, cfg: Any,
                  target: Any, *args: Any) -> tuple[Any, Any, Numerics]:
    """One call of :func:`numerics`' step: the scaled value and gradients, then the statistics."""

    def call(p: Any, watch: Watch | None) -> Any:
        with watch_scope(watch):
            return loss_fn(p, *args)

    order, leaves, events = _discover(owner, key, call, target) if watching else ([], [], [])
    probes = {path: jnp.zeros((2,), jnp.float32) for path in leaves}
    edges = {path: jnp.zeros((2,), jnp.float32) for path in order}
    ls = loss_scale(opt_state)

    def scaled(p: Any, both: Any) -> tuple[jax.Array, tuple]:
        probes, edges = both
        out = call(p, Watch(owner, probes, inputs=watch_inputs, edges=edges) if watching else None)
        loss, aux = out if has_aux else (out, None)
        value = scale_loss(loss, opt_state)
        return value, (loss, aux, value)

    grad = jax.value_and_grad if key is None else sys.modules["flax.nnx"].value_and_grad
    (_, (loss, aux, value)), (grads, (probe_grads, edge_grads)) = grad(scaled, argnums=(0, 1), has_aux=True)(
        target, (probes, edges))
    position, owned, compute = _owned_by_layer(model, key, grads, order)
    layers = list(owned)
    finite, skipped, bad_layer = skip_decision(cfg, ls, owned)
    sampled, counts, magnitudes = _sampled_statistics(every, finite, ls, owned, compute)
    paths, (where, origin, out_flags, grad_flags) = _attribution(
        finite, ~jnp.isfinite(value), order, leaves, events, layers, position, probe_grads, edge_grads,
        bad_layer, watch_inputs)
    stats = Numerics(step=ls.steps, loss=jnp.asarray(loss, jnp.float32), loss_scale=ls.scale,
                     found_inf=~finite, skipped=skipped, sampled=sampled, counts=counts,
                     magnitudes=magnitudes, output_nonfinite=out_flags, gradient_nonfinite=grad_flags,
                     where=where, origin=origin, layers=tuple(layers),
                     sizes=tuple(sum(int(np.prod(g.shape)) for g in owned[p]) for p in layers),
                     compute_dtypes=tuple(compute[p] for p in layers), paths=paths, leaves=tuple(leaves),
                     watched=("inputs" if watch_inputs else "outputs") if watching else "none",
                     order=tuple(order))
    return ((loss, aux) if has_aux else loss), grads, stats


def _numerics_target(model: Any) -> tuple[Any, Any, Any]:
    """The path resolver, the policy in force and (NNX) the model's key, of an applied model."""
    nnx = sys.modules.get("flax.nnx")
    key = nnx_key(model) if nnx is not None and isinstance(model, nnx.Module) else None
    if isinstance(model, Applied):
        return model.resolver, model.policy, None
    if key is not None:
        return key, key.plan.policy, key
    raise TypeError("ampbridge.jax.numerics needs the model ampbridge.jax.apply returned (the Applied "
                    f"linen model, or the NNX copy); received {type(model).__name__}")


def _check_numerics_args(every: Any, attribution: Any, sample: Any) -> None:
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"ampbridge.jax.numerics: every={every!r}; accepted: a positive int (1: every step) "
                         "or None (no per-layer statistics)")
    if attribution not in (True, False, None, "inputs", "outputs"):
        raise ValueError(f"ampbridge.jax.numerics: attribution={attribution!r}; accepted: True (= 'inputs'), "
                         "'outputs', False")
    if not isinstance(sample, bool):
        raise ValueError(f"ampbridge.jax.numerics: sample={sample!r}; accepted: True or False (a static "
                         "Python bool: False is the step without a monitor)")


def _discover(owner: Any, key: Any, call: Callable[[Any, Any], Any], target: Any
              ) -> tuple[list[str], list[str], list]:
    """One abstract trace of the loss: the modules in forward order, the leaf modules, and the
    boundary events (the root's output excluded: a non-finite one is the loss's business)."""
    discovery = Watch(owner)
    if key is None:
        jax.eval_shape(lambda p: call(p, discovery), target)
    else:  # on a throwaway copy: the model's own state is left alone
        nnx = sys.modules["flax.nnx"]
        graphdef, state = nnx.split(target)
        jax.eval_shape(lambda s: call(nnx.merge(graphdef, s), discovery), state)
    order = list(discovery.seen)
    return order, leaves_of(order), [e for e in discovery.events if e != ("", 1)]


def _owned_by_layer(model: Any, key: Any, grads: Any, order: list[str]
                    ) -> tuple[dict[str, int], dict[str, list], dict[str, str]]:
    """The forward-order position of each known path, each parameter-owning layer's gradient
    leaves (in that order) and the compute dtype of its Plan row."""
    if key is None:
        owned = owned_leaves(grads)
        known = order or model.known_paths()
    else:
        owned = {}
        for keypath, var in sys.modules["flax.nnx"].to_flat_state(grads):
            g = var.get_value() if hasattr(var, "get_value") else var.value
            if jnp.issubdtype(jnp.result_type(g), jnp.floating):
                path = nnx_path(keypath)
                owned.setdefault(key.owners.get(path, nnx_path(keypath[:-1])), []).append(g)
        known = order or [r.path for r in key.plan]
    position = {p: i for i, p in enumerate(known)}
    layers = sorted(owned, key=lambda p: (position.get(p, len(position)), p))
    owned = {p: owned[p] for p in layers}
    if key is None:
        rows = model.rows_for_paths(layers)
        compute = {p: rows[p].compute_dtype for p in layers}
    else:
        compute = {p: (key.plan[p] if p in key.plan else key.plan[""]).compute_dtype for p in layers}
    return position, owned, compute


def _sampled_statistics(every: int | None, finite: jax.Array, ls: Any, owned: Mapping[str, list],
                        compute: Mapping[str, str]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-layer statistics on a sampled step. A non-finite step is always sampled (its statistics
    name every bad layer); a finite unsampled step pays the predicate only."""
    n = len(owned)

    def compute_stats(_: Any) -> tuple[jax.Array, jax.Array]:
        return layer_statistics(owned, compute, ls.scale)

    def no_stats(_: Any) -> tuple[jax.Array, jax.Array]:
        return (jnp.zeros((n, 4), jnp.int32), jnp.full((n, 2), jnp.nan, jnp.float32))

    if every == 1:
        return jnp.ones((), bool), *compute_stats(None)
    sampled = ~finite if every is None else (ls.steps % every == 0) | ~finite
    return sampled, *jax.lax.cond(sampled, compute_stats, no_stats, None)


def _attribution(finite: jax.Array, loss_bad: jax.Array, order: list[str], leaves: list[str], events: list,
                 layers: list[str], position: Mapping[str, int], probe_grads: Mapping, edge_grads: Mapping,
                 bad_layer: Mapping[str, jax.Array], watch_inputs: bool) -> tuple[tuple[str, ...], tuple]:
    """The candidates (the leaf modules, then any other layer owning parameters) and the
    attribution: where, origin, and the per-candidate output and gradient flags."""
    named = [boundary_origin(e, order) for e in events]
    paths = tuple(sorted(set(leaves) | set(layers) | {p for p, _ in named if p},
                         key=lambda p: (position.get(p, len(position)), p)))
    index = {p: i for i, p in enumerate(paths)}
    where, origin, out_flags, grad_flags = attribute(
        finite, loss_bad, [probe_grads[p] for p in leaves], [index[p] for p in leaves],
        [bad_layer.get(p, jnp.zeros((), bool)) for p in leaves],
        [(index[p], bad_layer[p]) for p in layers if p not in set(leaves)], inputs=watch_inputs)
    if events:  # the first non-finite forward value, at any module boundary, decides first
        where, origin = first_boundary(finite, where, origin, [edge_grads[p][k] > 0 for p, k in events],
                                        [(_WHERE.index(w), index.get(p, -1)) for p, w in named])
    return paths, (where, origin, out_flags, grad_flags)


def _check_wrap_args(step: Any, carry: Any, start: Any) -> None:
    if not callable(step):
        raise TypeError(f"Monitor.wrap needs the jitted train step; received {type(step).__name__}")
    if not isinstance(carry, int) or isinstance(carry, bool) or carry < 0:
        raise ValueError(f"Monitor.wrap: carry={carry!r}; accepted: an int >= 0 (the step's first outputs "
                         "that are its next call's first arguments)")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"Monitor.wrap: start={start!r}; accepted: an int >= 0 (the first call's step)")


def _numerics_in(out: Any) -> Numerics | None:
    found = [x for x in jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, Numerics))
             if isinstance(x, Numerics)]
    return found[0] if found else None


def _fp8_collection(carry: tuple) -> Any:
    """The ``_overwrite_with_gradient`` collection in a linen carry (a variables dict, or a
    ``TrainState``'s ``params`` holding it), or None."""
    from .fp8_stats import OVERWRITE_WITH_GRADIENT

    for part in carry:
        for tree in (part, getattr(part, "params", None)):
            if isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree:
                return tree[OVERWRITE_WITH_GRADIENT]
    return None


def _arrived(arrays: Sequence[Any]) -> bool:
    return all(a.is_ready() for a in arrays if hasattr(a, "is_ready"))


class Monitor:
    """Writes the shared numerics log (``ampbridge report`` reads it) from :func:`numerics` results.

    ``Monitor(path, amp, *example_inputs, every=N)`` (an NNX model needs no inputs; or
    ``Monitor(path, plan, every=N)``) writes the header from the Plan (with the first record:
    its layers in the order the step called them); ``record(step, stats)`` after each step (``step=None``: the
    optimizer's own counter, ``stats.step``). Per-layer statistics are written every ``every``-th
    step (step 0 included) when the step computed them (give :func:`numerics` the same
    ``every``); a step whose gradients were non-finite is always written, with its attribution.

    Reading costs no stall: ``record`` starts an asynchronous copy of what it needs (the whole
    ``stats`` on a sampled step, ``found_inf`` otherwise) and writes the queued steps whose values
    have arrived; it waits only when more than ``max_lag`` steps are still on their way (reading
    every step's ``found_inf`` at once would keep the host from running ahead of the device, about
    10% of a small CPU step here). ``flush()`` / ``close()`` write the rest. Usable as a context
    manager.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, tempfile, os, ampbridge
        >>> policy = ampbridge.preset("mixed_float16")
        >>> amp = apply(nn.Dense(1), policy)
        >>> x = jnp.ones((2, 3))
        >>> params = amp.init(jax.random.key(0), x)["params"]
        >>> tx = optimizer(optax.sgd(0.1), policy)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... def step(params, opt_state, x):
        ...     loss, grads, stats = numerics(amp, lambda p: jnp.mean(amp.apply({"params": p}, x) ** 2),
        ...                                   opt_state)(params)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, stats
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with Monitor(path, amp, x, every=1) as monitor:
        ...     for i in range(3):
        ...         params, opt_state, stats = step(params, opt_state, x)
        ...         monitor.record(i, stats)
        >>> [s["step"] for s in ampbridge.diagnostics.runlog.read_log(path).steps]
        [0, 1, 2]
    """

    def __init__(self, path: Any, model: Applied | Plan | Any, *example_inputs: Any, every: int = 1,
                 max_lag: int = 8, **plan_kwargs: Any):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"ampbridge.jax.Monitor: every={every!r}; accepted: a positive int "
                             "(1: every step)")
        if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0:
            raise ValueError(f"ampbridge.jax.Monitor: max_lag={max_lag!r}; accepted: an int >= 0 (steps a "
                             "record may wait for its values; 0: write each step at once)")
        nnx = sys.modules.get("flax.nnx")
        key = nnx_key(model) if nnx is not None and isinstance(model, nnx.Module) else None
        if isinstance(model, Plan):
            plan_ = model
        elif isinstance(model, Applied):
            plan_ = model.plan(*example_inputs, warn=False, **plan_kwargs)
        elif key is not None:
            plan_ = key.plan
        else:
            raise TypeError("ampbridge.jax.Monitor needs the model ampbridge.jax.apply returned (a linen "
                            "model with example inputs, or the NNX copy) or its Plan; received "
                            f"{type(model).__name__}")
        self.plan = plan_
        self.path = path
        self.every = every
        self.max_lag = max_lag
        self._writer: RunLogWriter | None = None
        self._pending: list[tuple[int | None, list, Numerics]] = []
        self._seen: tuple[int, int, int] = (0, -1, -1)  # steps written or passed, the first and last (the closing record)
        self._calls = 0  # steps run through wrap(): the host's own counter
        self._window: Window | None = None  # the unsampled steps since the last sampled one
        self._closing: Window | None = None  # the window before it: its counters on their way to the host
        self._fp8: dict[int, Any] = {}  # id(queued stats) -> the float8 collection after that step

    def _open(self, order: Sequence[str] = ()) -> Any:
        """Write the header: the Plan's paths in forward order (the order the step called them)."""
        if self._writer is None:
            from ...diagnostics.runlog import RunLogWriter

            position = {p: i for i, p in enumerate(order)}
            rows = [r.path for r in self.plan if r.path]
            layers = sorted(rows, key=lambda p: (position.get(p, len(position)), rows.index(p)))
            policy = self.plan.policy
            self._writer = RunLogWriter(self.path, framework=FRAMEWORK, compute_dtype=policy.compute_dtype,
                                        layers=layers, policy=_io.policy_to_dict(policy),
                                        min_scale=policy.resolved_loss_scale.min_scale,
                                        # what the policy already pins: report's advice never repeats it
                                        extra={"pinned": {r.path: r.rule for r in self.plan if r.path
                                                          and r.rule != "default" and r.compute_dtype
                                                          == "float32" != policy.compute_dtype}})
        return self._writer

    def due(self, step: int) -> bool:
        """Whether ``step`` is one with per-layer statistics (``step % every == 0``)."""
        return int(step) % self.every == 0

    def record(self, step: int | None, stats: Numerics, *, fp8: Any = None) -> None:
        """Queue one step's :class:`Numerics`; writes the previous one (no wait for this step).

        ``fp8``: the step's new ``_overwrite_with_gradient`` collection (or the variables holding it)
        where the model has float8 layers: a sampled step's record then has each float8 layer's
        amaxes, the scales the step used and saturation (:mod:`.fp8_stats`; :meth:`wrap` finds it in
        the carry itself). Read only on the steps written with statistics."""
        if not isinstance(stats, Numerics):
            raise TypeError(f"Monitor.record needs the Numerics from ampbridge.jax.numerics; received "
                            f"{type(stats).__name__}")
        wanted = jax.tree_util.tree_leaves(stats) if step is None or self.due(step) else [stats.found_inf]
        if fp8 is not None and (step is None or self.due(step)):
            self._fp8[id(stats)] = fp8
        for leaf in wanted:
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()
        self._pending.append((step, wanted, stats))
        # write what has arrived; wait only when more than max_lag steps are still on their way
        while self._pending and self._in_order(self._pending[0][0]) and (
                len(self._pending) > self.max_lag or _arrived(self._pending[0][1])):
            self._write(*self._pending.pop(0))

    def _in_order(self, step: int | None) -> bool:
        """Whether ``step`` may be written now: not while earlier steps' replays are still to come."""
        return self._closing is None or step is None or step < self._closing.first

    def _count(self, step: int) -> None:
        seen, first, last = self._seen
        self._seen = (seen + 1, step if not seen else min(first, step), step if not seen else max(last, step))

    def _write(self, step: int | None, _: Any, stats: Numerics, counted: bool = False) -> None:
        writer = self._open(stats.order)
        if step is None:
            step = int(stats.step)
        if not counted:
            self._count(step)
        found_inf = bool(stats.found_inf)
        due = self.due(step) or counted  # a replayed step: its statistics are why it was run
        fp8 = self._fp8.pop(id(stats), None)
        if not (due or found_inf):
            return
        host = jax.device_get(stats)  # one transfer of the small arrays (already on their way)
        loss = float(host.loss)
        if fp8 is not None and self.due(step):
            from .fp8_stats import fp8_stats

            fp8 = fp8_stats(fp8, {r.path: r.compute_dtype for r in self.plan if r.fp8})
        writer.step(step, loss=loss if np.isfinite(loss) else None, loss_scale=float(host.loss_scale),
                          found_inf=found_inf, skipped=bool(host.skipped),
                          layers=host.layer_stats() if due else (host.layer_stats() or None),
                          first_nonfinite=host.first_nonfinite() if found_inf else None,
                          fp8=fp8 if self.due(step) else None)

    def flush(self) -> None:
        """Write every queued step (with :meth:`wrap`: also the unsampled steps since the last sampled
        one that were skipped, replayed; this reads their loss-scale counters)."""
        if self._closing is not None:
            closing, self._closing = self._closing, None
            self._settle(closing)
        if self._window is not None:
            self._window = self._settle(self._window)
        while self._pending:
            self._write(*self._pending.pop(0))

    def wrap(self, step: Callable[..., Any], *, carry: int = 2, start: int = 0) -> Callable[..., Any]:
        """The train step, run with statistics on sampled steps and as the step without a monitor
        on the others, chosen on the host by its own step counter (no device read).

        ``step(*args, sample=...)`` is your jitted step with ``sample`` a static argument passed
        to :func:`numerics` (``sample=False``: no numerics at all, the program without a monitor).
        ``monitor.wrap(step)(*args)`` calls it with ``sample=self.due(n)`` for the n-th call
        (from ``start``: give a resumed run its step, ``int(loss_scale(opt_state).steps)``) and logs a sampled step's :class:`Numerics` (found in its outputs).
        Linen: the step's first ``carry`` outputs are its next call's first ``carry`` arguments
        (``params, opt_state``); NNX: the model and optimizer arguments (changed in place).

        An unsampled step reads nothing from the device; a skipped one is found one sample later
        and replayed from the state after the sampled step before it (docs/jax.md, "Monitor":
        what stays alive, how late a skip is logged). Do not donate the ``carry``.

        Example:
            >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, optax, tempfile, os, ampbridge
            >>> policy = ampbridge.preset("mixed_float16")
            >>> amp = apply(nn.Dense(1), policy)
            >>> x = jnp.ones((2, 3))
            >>> params = amp.init(jax.random.key(0), x)["params"]
            >>> tx = optimizer(optax.sgd(0.1), policy)
            >>> opt_state = tx.init(params)
            >>> @functools.partial(jax.jit, static_argnames="sample")
            ... def step(params, opt_state, x, sample=False):
            ...     loss, grads, stats = numerics(amp, lambda p: jnp.mean(amp.apply({"params": p}, x) ** 2),
            ...                                   opt_state, sample=sample)(params)
            ...     updates, opt_state = tx.update(grads, opt_state, params)
            ...     return optax.apply_updates(params, updates), opt_state, stats
            >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
            >>> with Monitor(path, amp, x, every=2) as monitor:
            ...     train = monitor.wrap(step)
            ...     for i in range(5):
            ...         params, opt_state, stats = train(params, opt_state, x)
            >>> [(s["step"], s["skipped"]) for s in ampbridge.diagnostics.runlog.read_log(path).steps]
            [(0, True), (1, True), (2, False), (4, False)]
        """
        _check_wrap_args(step, carry, start)
        self._calls = start
        held_for: dict[tuple[type, ...], list[int]] = {}  # by argument types: no isinstance walk per step
        return functools.partial(self._run_wrapped, step, carry, held_for)

    def _run_wrapped(self, step: Callable[..., Any], carry: int, held_for: dict[tuple[type, ...], list[int]],
                     /, *args: Any, **kwargs: Any) -> Any:
        """One call of :meth:`wrap`'s step: sampled or not by the call count, its state kept for a replay."""
        kinds = tuple(map(type, args))
        held = held_for.get(kinds)
        if held is None:
            nnx = sys.modules.get("flax.nnx")
            held = held_for[kinds] = [k for k, a in enumerate(args) if nnx is not None and isinstance(a, nnx.Pytree)]
        n = self._calls
        self._calls = n + 1
        sample = n % self.every == 0
        self._before_call(step, carry, held, args, n, sample)
        out = step(*args, sample=sample, **kwargs)
        if held:
            state_now = tuple(args[k] for k in held)
        else:
            if not isinstance(out, (tuple, list)) or len(out) < carry:
                raise ValueError(f"Monitor.wrap: the step returned {type(out).__name__}; with carry={carry} "
                                 f"its first {carry} outputs are the next call's first arguments")
            state_now = tuple(out[:carry])
        if sample:
            self._after_sampled(step, carry, held, n, out, state_now)
        else:
            rest = tuple(a for k, a in enumerate(args) if k not in held) if held else args[carry:]
            self._window.add(rest, kwargs, state_now)
            self._count(n)
        return out

    def _before_call(self, step: Callable[..., Any], carry: int, held: list[int], args: tuple, n: int,
                     sample: bool) -> None:
        """Check the call's carry, and start a window where none is open on an unsampled step."""
        if not held and len(args) < carry:
            raise ValueError(f"Monitor.wrap: {len(args)} positional argument(s); with carry={carry} the "
                             f"first {carry} are the training state")
        window = self._window
        if window is not None and not held and any(a is not b for a, b in zip(args[:carry], window.latest)):
            # the carried state is not the last step's output (a checkpoint restored, a run
            # rewound): the steps since the last sample are settled now, from their own states
            # (one read), and the window starts again from this state
            self.flush()
            self._window = None
        if self._window is None and not sample:  # a resumed run between samples: start from here
            before = tuple(args[k] for k in held) if held else tuple(args[:carry])
            self._window = Window.open(step, carry, held, before, n)

    def _after_sampled(self, step: Callable[..., Any], carry: int, held: list[int], n: int, out: Any,
                       state_now: tuple) -> None:
        """Log a sampled step, send the closing window's counters to the host, open the next window."""
        stats = _numerics_in(out if held else out[carry:])
        if stats is None:
            raise ValueError("Monitor.wrap: a sampled step returned no Numerics; pass sample to "
                             "ampbridge.jax.numerics(..., sample=sample) and return its stats")
        # the window before the last one: its counters were sent one sample ago (no wait)
        if self._closing is not None:
            closing, self._closing = self._closing, None
            self._settle(closing)
        scale_at = None
        if self._window is not None and self._window.inputs:  # sent now, read next sample
            for leaf in jax.tree_util.tree_leaves((self._window.before, self._window.states[-1])):
                if hasattr(leaf, "copy_to_host_async") and not leaf.is_deleted():
                    leaf.copy_to_host_async()  # (a donated one is said by name when read)
            self._closing = self._window
            scale_at = self._window.scale_at  # where the loss-scale state was: no walk
        self.record(n, stats, fp8=_fp8_collection(state_now))
        self._window = Window.open(step, carry, held, state_now, n + 1, scale_at)

    def _settle(self, window: "Window") -> "Window":
        """Log the skipped steps of ``window``, replayed with statistics (reads its counters); the
        window that starts after its last step."""
        if not window.inputs:
            return window

        def refuse_donated(*parts: Any) -> None:
            if any(getattr(a, "is_deleted", lambda: False)() for a in jax.tree_util.tree_leaves(parts)):
                raise ValueError(f"Monitor.wrap: the state of steps {window.first - 1}-"
                                 f"{window.first + len(window.inputs) - 2} was donated (donate_argnums), so skipped "
                                 "steps can be neither found nor replayed: do not donate the carried arguments "
                                 "of a wrapped step")

        refuse_donated(window.before)  # a donated carry deletes it first; the rest is looked at before a replay
        after = window.following()
        def counters(states: list) -> list[tuple[int, int]]:  # one read; the fields taken on the host
            return [(int(s.skipped), int(s.steps)) for s in jax.device_get(states)]

        start, end = counters([window.before, window.states[-1]])
        if end[0] == start[0] and end[1] - start[1] == len(window.inputs):
            return after  # no step skipped (each advanced the counter, none counted a skip)
        refuse_donated(window.start, window.states[:-1])
        counters = counters(window.states)
        bad, previous = [], start
        for k, now in enumerate(counters):
            if now[0] != previous[0] or now[1] == previous[1]:
                bad.append(k)
            previous = now
        while self._pending and (self._pending[0][0] is None or self._pending[0][0] < window.first):
            self._write(*self._pending.pop(0))  # the sampled steps before this window come first
        state = window.restored()
        for k in range(bad[-1] + 1):
            if k in bad:
                stats = _numerics_in(window.call(window.copied(state), k, True))
                if stats is None or not bool(stats.found_inf) or int(stats.step) != int(counters[k - 1][1] if k
                                                                                        else start[1]):
                    raise RuntimeError(f"Monitor: replaying skipped step {window.first + k} did not reproduce it "
                                       "(finite, or another loss-scale step): the step is not deterministic "
                                       "on its inputs, or a carried argument was donated")
                self._write(window.first + k, None, stats, counted=True)
            out = window.call(state, k, False)
            if not window.held:
                state = tuple(out[:window.carry])
        return after

    def close(self) -> None:
        """Write every queued step, the closing record, and close the log."""
        self.flush()
        writer = self._open()
        if not writer.closed:
            seen, first, last = self._seen
            writer.end(seen, first_step=first if seen else None, last_step=last if seen else None)
            writer.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
