"""Loss scaling as an optax transformation: the core's reference algorithm in float32/int32
``jnp`` (jit- and scan-safe, no host sync), and the helpers that find its state in any optax state.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...core.loss_scale import LossScaleState as ReferenceState
from ...core.loss_scale import INT32_MAX, restart_count
from ...core.loss_scale import initial_state as _reference_initial_state
from ...core.policy import LossScaleConfig, Policy
from ...errors import AmpBridgeWarning, LossScaleError, UnsupportedOptionError, warn_once
from ..private_hooks import tested_range
from .environment import optax_module, phase_policy, resolve_policy


#: the int32 counters of :class:`PackedLossScale`, in the order they sit in ``counters``
COUNTERS = ("good_steps", "hysteresis_left", "steps", "skipped", "min_scale_hits", "nonfinite_streak")


class PackedLossScale(NamedTuple):
    """The loss-scale state as two JAX arrays: ``scale`` (float32) and ``counters`` (int32, last axis
    :data:`COUNTERS`), so jit, tree_map, ``lax.scan`` and checkpoints (orbax, flax.serialization)
    keep all of it, and a jitted step passes two buffers, as jmp's ``DynamicLossScale`` does (each
    buffer costs host dispatch on every call).

    The fields read by name: ``scale``, ``good_steps``, ``hysteresis_left``, ``steps``, ``skipped``,
    ``nonfinite_streak`` (the reference algorithm's ``ampbridge.LossScaleState``) and ``min_scale_hits`` (overflows at
    ``min_scale``, the event ``on_min_scale`` acts on, read on the host by :func:`check`); stacked
    states (``lax.scan`` outputs) read the same way. Build one with :meth:`from_fields`, change
    fields with :meth:`replace`.

    Example:
        >>> s = PackedLossScale.from_fields(8.0, good_steps=3, hysteresis_left=1)
        >>> float(s.scale), int(s.good_steps), s.counters.shape, int(s.replace(steps=4).steps)
        (8.0, 3, (6,), 4)
    """

    scale: jax.Array  # float32
    counters: jax.Array  # int32[..., 6], COUNTERS

    COUNTERS = COUNTERS  # the names of the counters, in order (a class attribute, not a field)

    @property
    def good_steps(self) -> jax.Array:
        return self.counters[..., 0]

    @property
    def hysteresis_left(self) -> jax.Array:
        return self.counters[..., 1]

    @property
    def steps(self) -> jax.Array:
        return self.counters[..., 2]

    @property
    def skipped(self) -> jax.Array:
        return self.counters[..., 3]

    @property
    def min_scale_hits(self) -> jax.Array:
        return self.counters[..., 4]

    @property
    def nonfinite_streak(self) -> jax.Array:
        return self.counters[..., 5]

    @classmethod
    def from_fields(cls, scale: Any, good_steps: Any = 0, hysteresis_left: Any = 1, steps: Any = 0,
                    skipped: Any = 0, min_scale_hits: Any = 0, nonfinite_streak: Any = 0) -> "PackedLossScale":
        """The state from its seven fields (arrays or numbers; equal shapes)."""
        counters = (good_steps, hysteresis_left, steps, skipped, min_scale_hits, nonfinite_streak)
        if all(isinstance(c, (int, np.integer, np.ndarray)) for c in counters):  # host values: one transfer
            return cls(jnp.asarray(scale, jnp.float32), jnp.asarray(np.stack(
                [np.asarray(c, np.int32) for c in counters], axis=-1)))
        return cls(jnp.asarray(scale, jnp.float32),
                   jnp.stack([jnp.asarray(c, jnp.int32) for c in counters], axis=-1))

    def replace(self, **fields: Any) -> "PackedLossScale":
        """The state with the named fields (any of ``scale`` and :data:`COUNTERS`) replaced."""
        unknown = sorted(set(fields) - {"scale", *COUNTERS})
        if unknown:
            raise TypeError(f"PackedLossScale.replace: unknown field(s) {', '.join(unknown)}; accepted: "
                            f"scale, {', '.join(COUNTERS)}")
        scale = fields.get("scale", self.scale)
        if not set(fields) & set(COUNTERS):
            return PackedLossScale(scale, self.counters)
        return PackedLossScale.from_fields(scale, *(fields[n] if n in fields else getattr(self, n)
                                                   for n in COUNTERS))

    def to_reference(self) -> ReferenceState:
        """The core's ``PackedLossScale`` (host values; this reads the device once)."""
        good, hyst, steps, skipped, _, streak = (int(c) for c in np.asarray(self.counters))
        return ReferenceState(scale=float(self.scale), good_steps=good, hysteresis_left=hyst, steps=steps,
                              skipped=skipped, nonfinite_streak=streak)

    @classmethod
    def from_reference(cls, state: ReferenceState, min_scale_hits: int = 0) -> "PackedLossScale":
        return cls.from_fields(state.scale, state.good_steps, state.hysteresis_left, state.steps,
                               state.skipped, min_scale_hits, state.nonfinite_streak)


class AmpState(NamedTuple):
    """The state of :func:`optimizer`: the loss-scale state and the inner optimizer's state."""

    loss_scale: PackedLossScale
    inner_state: Any


def _config(policy: Policy | LossScaleConfig | str) -> tuple[LossScaleConfig, str]:
    if isinstance(policy, LossScaleConfig):
        cfg = policy.resolve("float16")
        return cfg, "float16"
    resolved, _ = resolve_policy(policy, warn=False)
    resolved = phase_policy(resolved)
    return resolved.resolved_loss_scale, resolved.compute_dtype


def _initial(cfg: LossScaleConfig) -> PackedLossScale:
    return PackedLossScale.from_reference(_reference_initial_state(cfg))


F32_INF_BITS = 0x7F800000  # float32 +inf's bit pattern: a finite float32's |bits| are below it


def f32_bits(x: float) -> int:
    """``x`` rounded to float32, as its int32 bit pattern (the exact scale arithmetic and the
    statistics compare magnitudes as bits).

    Example:
        >>> f32_bits(1.0) == 0x3F800000, f32_bits(float("inf")) == F32_INF_BITS
        (True, True)
    """
    return int(np.asarray(x, np.float32).view(np.int32))


def _mul_exact(x: jax.Array, factor: float) -> jax.Array:
    """``float32(x * float32(factor))`` for a finite ``x >= 0``, correctly rounded, subnormals included.

    XLA flushes subnormal float32 values to zero at run time (and constant folding does not), so a
    scale that decays past 2^-126 would leave the reference trajectory. The product is formed
    exactly (Dekker's two-product on 12-bit halves of the integer significands), then placed with
    integer exponent arithmetic, rounding half to even into the subnormal range.
    """
    i32, f32 = jnp.int32, jnp.float32
    c = np.float32(factor)
    cbits = f32_bits(c)
    c_exp, c_man = (cbits >> 23) & 0xFF, cbits & 0x7FFFFF
    mc, ec = (c_man, -149) if c_exp == 0 else (c_man | 0x800000, c_exp - 150)
    bits = jax.lax.bitcast_convert_type(x, i32)
    x_exp, x_man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    mx = jnp.where(x_exp == 0, x_man, x_man | 0x800000)
    e = jnp.where(x_exp == 0, -149, x_exp - 150) + ec  # x * c == mx * mc * 2^e exactly
    hi = mx.astype(f32) * f32(mc)  # round-to-nearest-even of the exact product (an integer < 2^48)
    xh, xl = (mx >> 12).astype(f32), (mx & 0xFFF).astype(f32)
    ch, cl = f32(mc >> 12), f32(mc & 0xFFF)
    err = (((xh * ch * f32(2.0 ** 24) - hi) + xh * cl * f32(2.0 ** 12)) + xl * ch * f32(2.0 ** 12)) + xl * cl
    hbits = jax.lax.bitcast_convert_type(hi, i32)
    h_exp, h_man = (hbits >> 23) & 0xFF, hbits & 0x7FFFFF
    r_exp = h_exp + e  # the result's biased exponent when it is normal
    normal = (jnp.clip(r_exp, 0, 255) << 23) | h_man
    # subnormal result: round hi * 2^(e + 149) (< 2^23) to an integer; err breaks exact ties
    y_exp = h_exp + e + 149
    y = jnp.where(y_exp >= 1, jax.lax.bitcast_convert_type((jnp.clip(y_exp, 0, 255) << 23) | h_man, f32),
                  f32(0.0))
    low = jnp.floor(y)
    tie = (y - low) == f32(0.5)
    rounded = jnp.where(tie & (err > 0), low + 1, jnp.where(tie & (err < 0), low, jnp.round(y)))
    out = jnp.where(hi == 0, 0, jnp.where(r_exp >= 255, F32_INF_BITS,
                                          jnp.where(r_exp >= 1, normal, rounded.astype(i32))))
    return jax.lax.bitcast_convert_type(out.astype(i32), f32)


def _advance(cfg: LossScaleConfig, s: PackedLossScale, found_inf: jax.Array,
             finite: jax.Array | None = None) -> tuple[PackedLossScale, jax.Array]:
    """One step of the reference algorithm in float32/int32 ``jnp``; returns (state, halted).

    ``halted`` is True when ``on_min_scale = "error"`` stops the run: the reference raises before
    backing off, so the state stays as it was (except ``min_scale_hits``) from then on.
    """
    i32, f32 = jnp.int32, np.float32
    found_inf = jnp.asarray(found_inf, bool)
    if finite is None:
        finite = ~found_inf
    counters = s.counters
    streak = counters[..., 5]
    skip = _skips(cfg, found_inf, streak)
    skips = skip.astype(i32)
    # the non-finite streak saturates at int32's maximum (optax's safe_increment)
    new_streak = (_select(found_inf, streak + (streak < INT32_MAX).astype(i32), jnp.zeros_like(streak))
                  if cfg.max_consecutive_skips is not None else streak)
    if cfg.mode != "dynamic":  # steps, skipped and the streak count, nothing else moves
        moved = counters + _pack(0, 0, 1, skips, 0, 0, like=skips)
        return PackedLossScale(s.scale, moved.at[..., 5].set(new_streak)), jnp.zeros((), bool)
    scale, good, hyst = s.scale, counters[..., 0], counters[..., 1]
    # Plain float32 products are exact while the scale stays normal, which a normal min_scale
    # guarantees (a flushed backoff product loses to the floor either way); otherwise go exact.
    floor_is_normal = cfg.min_scale is not None and np.float32(cfg.min_scale) >= np.finfo(np.float32).tiny
    if floor_is_normal:
        def mul(factor: float) -> jax.Array:
            return scale * f32(factor)
    else:
        def mul(factor: float) -> jax.Array:
            return _mul_exact(scale, factor)
    exhausted = hyst <= 1
    backoff = found_inf & exhausted
    backed, event = _backed_off(cfg, scale, mul(cfg.backoff_factor), backoff, floor_is_normal)
    good_next = good + 1
    grow = finite & (good_next == cfg.growth_interval)
    grown, grown_ok = _grown(cfg, mul(cfg.growth_factor), grow)
    new_scale = _select(backoff, backed, _select(grown_ok, grown, scale))
    restart = jnp.full_like(good_next, restart_count(cfg))
    new_good = _select(found_inf, restart, _select(grow, jnp.zeros_like(good_next), good_next))
    full = jnp.full_like(hyst, cfg.hysteresis)
    hyst_finite = full if cfg.consecutive_hysteresis else _select(grow, full, hyst)
    new_hyst = _select(found_inf, _select(exhausted, hyst, hyst - 1), hyst_finite)
    # steps, skipped and min_scale_hits count up: one add on the last three counters
    tail = counters[..., 2:5] + _pack(1, skips, event.astype(i32), like=skips)
    new = PackedLossScale(new_scale, jnp.concatenate([new_good[..., None], new_hyst[..., None], tail,
                                                     new_streak[..., None]], axis=-1))
    if cfg.on_min_scale != "error" or cfg.min_scale is None:
        return new, jnp.zeros((), bool)
    hits = counters[..., 4]
    halted = (hits > 0) | event
    frozen = s.replace(min_scale_hits=jnp.maximum(hits, 1))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(halted, a, b), frozen, new), halted


def _unscaled_and_finite(cfg: LossScaleConfig, ls: PackedLossScale, updates: Any, axis_name: Any
                         ) -> tuple[Any, jax.Array]:
    """The gradients unscaled in float32, and whether all are finite (agreed over ``axis_name``)."""
    checks_finite = cfg.skip_nonfinite or cfg.mode == "dynamic"
    if cfg.mode in ("dynamic", "static"):
        inv = jnp.ones((), jnp.float32) / ls.scale
        grads = jax.tree_util.tree_map(lambda g: _unscale_leaf(g, inv), updates)
    else:
        grads = updates
    finite = all_finite(grads) if checks_finite else jnp.ones((), bool)
    if axis_name is not None and checks_finite:  # data parallel: every device skips together
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    return grads, finite


def _take_update(cfg: LossScaleConfig, finite: jax.Array, halted: jax.Array, ls: PackedLossScale
                 ) -> jax.Array | None:
    """Whether the inner update is taken (None: always); all conditions must hold (no double
    negation in the program)."""
    keep_conditions = []
    if cfg.skip_nonfinite:
        keep_conditions.append(~_skips(cfg, ~finite, ls.nonfinite_streak) if
                               cfg.max_consecutive_skips is not None else finite)
    if cfg.on_min_scale == "error" and cfg.min_scale is not None:
        keep_conditions.append(~halted)
    return functools.reduce(jnp.logical_and, keep_conditions) if keep_conditions else None


def _as_int(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _as_f32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.float32)


def _backed_off(cfg: LossScaleConfig, scale: jax.Array, backed: jax.Array, backoff: jax.Array,
                floor_is_normal: bool) -> tuple[jax.Array, jax.Array]:
    """The backed-off scale held at ``min_scale``, and whether this backoff hit the floor."""
    f32 = np.float32
    if cfg.min_scale is not None and floor_is_normal:
        # a normal floor: float compare and max are exact (a flushed product loses to the floor either way)
        event = backoff & (scale == f32(cfg.min_scale))
        return jnp.maximum(backed, f32(cfg.min_scale)), event
    if cfg.min_scale is not None:
        # non-negative float32 values order like their bit patterns: compare those (no flushing)
        floor_bits = f32_bits(cfg.min_scale)
        event = backoff & (_as_int(scale) == floor_bits)
        return _as_f32(jnp.maximum(_as_int(backed), floor_bits)), event
    return backed, jnp.zeros((), bool)


def _grown(cfg: LossScaleConfig, grown: jax.Array, grow: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The grown scale held at ``max_scale``, and whether growing happens (a finite product only)."""
    grown_ok = grow & jnp.isfinite(grown)  # isfinite reads the exponent: flushing cannot change it
    if cfg.max_scale is not None and np.float32(cfg.max_scale) >= np.finfo(np.float32).tiny:
        grown = jnp.minimum(grown, np.float32(cfg.max_scale))
    elif cfg.max_scale is not None:
        grown = _as_f32(jnp.minimum(_as_int(grown), f32_bits(cfg.max_scale)))
    return grown, grown_ok


def _skips(cfg: LossScaleConfig, found_inf: jax.Array, streak_before: jax.Array) -> jax.Array:
    """Whether this step's update is skipped: non-finite, skip_nonfinite, and (with
    ``max_consecutive_skips``) fewer than that many skipped in a row before it."""
    if not cfg.skip_nonfinite:
        return jnp.zeros_like(found_inf)
    if cfg.max_consecutive_skips is None:
        return found_inf
    return found_inf & (streak_before < cfg.max_consecutive_skips)


def _pack(*counters: Any, like: jax.Array) -> jax.Array:
    """Counters (int32 arrays shaped like ``like``, or numbers) stacked on a new last axis."""
    return jnp.stack([c if isinstance(c, jax.Array) else jnp.full_like(like, c) for c in counters], axis=-1)


def _select(pred: jax.Array, on_true: jax.Array, on_false: jax.Array) -> jax.Array:
    """``jnp.where`` as one ``select`` (no wrapper function in the lowered program) where the
    operands already agree in shape and dtype, which the step's own values do."""
    if (jnp.shape(on_true) == jnp.shape(on_false) and jnp.shape(pred) in ((), jnp.shape(on_true))
            and jnp.result_type(on_true) == jnp.result_type(on_false)):
        return jax.lax.select(pred, on_true, on_false)
    return jnp.where(pred, on_true, on_false)


def next_loss_scale(config: Policy | LossScaleConfig | str, state: PackedLossScale,
                    found_inf: Any) -> PackedLossScale:
    """One step of the reference loss-scale algorithm on JAX arrays (jit- and scan-safe).

    This is what :func:`optimizer` runs each step; ``found_inf`` is a boolean scalar.

    Example:
        >>> import ampbridge
        >>> cfg = ampbridge.LossScaleConfig(mode="dynamic", initial_scale=8.0)
        >>> s = next_loss_scale(cfg, initial_loss_scale(cfg), True)
        >>> float(s.scale), int(s.skipped)
        (4.0, 1)
    """
    cfg, _ = _config(config)
    return _advance(cfg, state, found_inf)[0]


def initial_loss_scale(config: Policy | LossScaleConfig | str) -> PackedLossScale:
    """The loss-scale state before the first step (the reference ``initial_state``)."""
    cfg, _ = _config(config)
    return _initial(cfg)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite, as one boolean.

    The one finite check of this backend: the optimizer, ``value_and_grad`` and the monitor all call
    it. Each leaf is reduced on its own and the flags are joined with ``&``. (A running flag passed as
    ``lax.reduce``'s start value is not a fold: XLA may drop the start value of a reduction over one
    element or none, which let a scalar, size-1 or empty last leaf decide alone.)

    >>> bool(all_finite({"w": jnp.array([1.0, jnp.inf]), "b": jnp.ones(())}))
    False
    """
    finite = jnp.ones((), bool)
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            finite = finite & jnp.all(jnp.isfinite(leaf))
    return finite


def _unscale_leaf(g: Any, inv: jax.Array) -> Any:
    if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
        return g
    if g.dtype == jnp.float32:
        return g * inv
    if g.dtype == jnp.float64:
        return g * inv.astype(jnp.float64)
    return (g.astype(jnp.float32) * inv).astype(g.dtype)  # half grads: unscale in float32


def skip_decision(cfg: Any, ls: Any, owned: Mapping[str, list]) -> tuple[jax.Array, jax.Array, dict]:
    """found_inf and skipped exactly as the optimizer decides them (the same ops: XLA shares them
    when the monitor's step also runs the optimizer), and whether each layer's unscaled gradients
    are non-finite: what ``ampbridge.jax.numerics`` records. ``owned``: layer path -> its gradient leaves.

    Example:
        >>> import ampbridge
        >>> cfg = ampbridge.preset("mixed_float16").resolved_loss_scale
        >>> grads = {"a": [jnp.ones(2)], "b": [jnp.array([jnp.inf])]}
        >>> finite, skipped, bad = skip_decision(cfg, initial_loss_scale(cfg), grads)
        >>> bool(finite), bool(skipped), {p: bool(v) for p, v in bad.items()}
        (False, True, {'a': False, 'b': True})
    """
    scaled_mode = cfg.mode in ("dynamic", "static")
    checks_finite = cfg.skip_nonfinite or cfg.mode == "dynamic"
    inv = jnp.ones((), jnp.float32) / ls.scale
    bad_layer = {path: ~all_finite([_unscale_leaf(g, inv) if scaled_mode else g for g in leaves_])
                 for path, leaves_ in owned.items()}
    finite = (~functools.reduce(jnp.logical_or, bad_layer.values(), jnp.zeros((), bool))
              if checks_finite else jnp.ones((), bool))
    _, halted = _advance(cfg, ls, ~finite)
    skipped = jnp.zeros((), bool)
    if cfg.skip_nonfinite:
        skipped = skipped | ~finite
    if cfg.on_min_scale == "error" and cfg.min_scale is not None:
        skipped = skipped | halted
    return finite, skipped, bad_layer


def _host_report(kind: str, limit: float | None) -> Callable:
    warned = [False]

    def report(event: Any, steps: Any) -> None:
        if not bool(event):
            return
        text = (f"loss scale overflowed at min_scale={limit} (step {int(steps)})")
        if kind == "error":
            raise LossScaleError(text + "; on_min_scale='error' stops the run")
        if not warned[0]:
            warned[0] = True
            warnings.warn(text + ": the scale is stuck and gradients still overflow", AmpBridgeWarning,
                          stacklevel=2)

    return report


def optimizer(inner: Any, policy: Policy | LossScaleConfig | str, *, host_callback: bool = False,
              axis_name: Any = None) -> Any:
    """Wrap an optax transformation with the policy's loss scaling (the reference algorithm).

    ``update(grads, state, params)`` takes the gradients of :func:`scale_loss`'s scaled loss,
    unscales them (in float32), checks that all are finite and, when one is not and
    ``skip_nonfinite`` holds, returns updates of ``-0.0`` (``p + -0.0`` is ``p`` bit for bit, even
    for ``-0.0``) and keeps the inner state as it was. The scale then follows
    ``ampbridge.core.loss_scale`` exactly (float32 arithmetic). Settings are closed over (static); the
    state is an :class:`AmpState` pytree. Put it outermost: ``optimizer(optax.chain(clip, adam), p)``,
    so every inner transformation sees unscaled gradients.

    ``on_min_scale`` ``"warn"``/``"error"`` count hits in ``min_scale_hits`` for :func:`check` (host
    side; ``"error"`` then skips every later step, state frozen); ``host_callback=True`` also reports
    from inside the step (one ``jax.debug.callback``). ``axis_name`` (``shard_map``/``pmap``): all
    devices skip a step any of them found non-finite. ``[[phase]]`` tables: the first phase's
    scaling (:class:`Schedule` builds one optimizer per phase).

    Example:
        >>> import jax.numpy as jnp, optax, ampbridge
        >>> tx = optimizer(optax.sgd(1.0), ampbridge.preset("mixed_float16"))
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state)
        >>> updates["w"], float(loss_scale(state).scale), int(loss_scale(state).skipped)
        (Array([-0., -0.], dtype=float32), 32768.0, 1)
    """
    optax = optax_module()
    cfg, compute = _config(policy)
    inner = optax.with_extra_args_support(inner)
    if host_callback and cfg.on_min_scale == "clamp":
        raise UnsupportedOptionError("ampbridge.jax.optimizer: host_callback=True reports on_min_scale "
                                     "'warn'/'error'; this policy's on_min_scale is 'clamp'")
    report = _host_report(cfg.on_min_scale, cfg.min_scale) if host_callback else None

    verified = [False]  # the first-step guard (_verify_first_update) has passed

    def init_fn(params: Any) -> AmpState:
        return AmpState(_initial(cfg), inner.init(params))

    def update_fn(updates: Any, state: AmpState, params: Any = None, **extra: Any) -> tuple[Any, AmpState]:
        if not isinstance(state, AmpState):
            raise TypeError(f"ampbridge.jax.optimizer: expected the AmpState from this transformation's "
                            f"init; received {type(state).__name__}")
        ls = state.loss_scale
        grads, finite = _unscaled_and_finite(cfg, ls, updates, axis_name)
        new_ls, halted = _advance(cfg, ls, ~finite, finite)
        if report is not None:
            event = new_ls.min_scale_hits > ls.min_scale_hits
            jax.debug.callback(report, event, ls.steps)
        inner_updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        proposed = inner_updates
        take = _take_update(cfg, finite, halted, ls)
        if take is not None:
            inner_updates, inner_state = _keep_or_skip(take, inner_updates, inner_state, state.inner_state)
        if not verified[0]:
            verified[0] = _verify_first_update(finite & ~halted, ls, new_ls, proposed, inner_updates)
        return inner_updates, AmpState(new_ls, inner_state)

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return tx


def _keep_or_skip(take: jax.Array, updates: Any, inner_state: Any, old_inner_state: Any) -> tuple[Any, Any]:
    """The inner transformation's updates and state where ``take``, else no update and the old state."""
    # -0.0, not 0.0: p + -0.0 == p bit for bit for every p (p + 0.0 turns -0.0 into +0.0); one
    # array of -0.0 per shape and dtype
    negative_zeros: dict = {}

    def keep(u: Any) -> Any:
        key = (jnp.shape(u), jnp.result_type(u))
        if key not in negative_zeros:
            negative_zeros[key] = jnp.full_like(u, -0.0)
        return _select(take, u, negative_zeros[key])

    updates = jax.tree_util.tree_map(keep, updates)
    return updates, jax.tree_util.tree_map(lambda a, b: _select(take, a, b), inner_state, old_inner_state)


def _verify_first_update(finite: jax.Array, before: PackedLossScale, after: PackedLossScale, proposed: Any,
                         returned: Any) -> bool:
    """The first-step guard (docs/versions.md), run on the host once, on the first update called with
    values (inside ``jit`` nothing can be read: it waits for an eager call, and costs nothing).
    A finite step must advance ``steps`` by one and return the inner transformation's updates;
    else raises :class:`ampbridge.errors.UnsupportedOptionError` naming the jax and optax versions.
    Returns whether the check was made (False: traced, or a skipped step, which proves nothing)."""
    values = [finite, before.counters, after.counters, *jax.tree_util.tree_leaves((proposed, returned))]
    if any(isinstance(v, jax.core.Tracer) for v in values):
        return False  # traced (jit, scan, grad, an eager vmap): no values to look at
    if not bool(finite):
        return False
    same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(jax.tree_util.tree_leaves(proposed),
                                                            jax.tree_util.tree_leaves(returned)))
    if same and int(after.steps) == int(before.steps) + 1:
        return True
    optax = optax_module()
    raise UnsupportedOptionError(
        f"ampbridge.jax.optimizer: a finite step did not apply the inner transformation's updates on jax "
        f"{jax.__version__}, optax {optax.__version__}, so training would not update the weights; "
        f"ampbridge supports {tested_range('jax')}, {tested_range('optax')}")


def _unwrap_variables(tree: Any) -> Any:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree
    if isinstance(tree, getattr(nnx, "Optimizer", ())):
        tree = tree.opt_state

    def value(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            return v.get_value() if hasattr(v, "get_value") else v.value
        return v

    return jax.tree_util.tree_map(value, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def find_states(tree: Any) -> list[PackedLossScale]:
    """Every ampbridge loss-scale state in ``tree`` (an optimizer state, a training state), in leaf order."""
    tree = _unwrap_variables(tree)
    if isinstance(tree, PackedLossScale):
        return [tree]
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (AmpState, PackedLossScale)))
    return [x.loss_scale if isinstance(x, AmpState) else x for x in leaves
            if isinstance(x, (AmpState, PackedLossScale))]


def loss_scale(opt_state: Any) -> PackedLossScale:
    """The :class:`PackedLossScale` inside an optimizer state (any optax chain, ``MultiSteps``,
    ``inject_hyperparams``, or an ``nnx.Optimizer``)."""
    found = find_states(opt_state)
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"no ampbridge loss-scale state in this optimizer state (of type "
                         f"{type(opt_state).__name__}); build the optimizer with "
                         "ampbridge.jax.optimizer(inner, policy) and pass its state")
    raise ValueError(f"{len(found)} ampbridge loss-scale states in this optimizer state; wrap the whole "
                     "optimizer once: ampbridge.jax.optimizer(optax.chain(...), policy)")


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss * scale`` in (at least) float32, inside the function you differentiate.

    A float16 loss is computed on in float32 here, but its own gradient is the scale itself,
    which float16 cannot hold above 65504: compute the loss in float32 (``output_dtype``).
    """
    scale = loss_scale(opt_state).scale
    loss = jnp.asarray(loss)
    if loss.dtype == jnp.float16:
        warnings.warn("scale_loss got a float16 loss: its gradient (the loss scale) overflows float16 "
                      "above 65504; compute the loss in float32 (output_dtype = 'float32')",
                      AmpBridgeWarning, stacklevel=2)
    wide = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(wide) * scale.astype(wide)


def unscale(tree: Any, opt_state: Any) -> Any:
    """Gradients divided by the current scale (float32 arithmetic), e.g. to log their norm."""
    inv = jnp.ones((), jnp.float32) / loss_scale(opt_state).scale
    return jax.tree_util.tree_map(lambda g: _unscale_leaf(g, inv), tree)


def check(opt_state: Any, policy: Policy | LossScaleConfig | str) -> ReferenceState:
    """Read the loss-scale state on the host and act on ``on_min_scale`` (this syncs).

    ``"error"`` raises :class:`ampbridge.LossScaleError` once the scale has overflowed at
    ``min_scale`` (the optimizer has skipped every step since); ``"warn"`` warns once per policy;
    ``"clamp"`` does nothing. Returns the state as the core's ``PackedLossScale``, for logging.
    """
    cfg, _ = _config(policy)
    state = loss_scale(opt_state)
    hits = int(state.min_scale_hits)
    reference = state.to_reference()
    if hits and cfg.on_min_scale == "error":
        raise LossScaleError(f"loss scale overflowed at min_scale={cfg.min_scale} (step {reference.steps}); "
                             "on_min_scale='error' stops the run (the optimizer has skipped every step since)")
    if hits and cfg.on_min_scale == "warn":
        warn_once(f"loss scale is stuck at min_scale={cfg.min_scale} and gradients still overflow "
                  f"({hits} times by step {reference.steps})", AmpBridgeWarning,
                  key=f"ampbridge.jax.check: {cfg!r}", stacklevel=2)
    return reference


def reset_loss_scale(opt_state: Any, policy: Policy | LossScaleConfig | str) -> Any:
    """The optimizer state with its loss-scale state restarted for ``policy`` (counters kept)."""
    cfg, _ = _config(policy)
    fresh = _initial(cfg)

    def swap(x: Any) -> Any:
        if isinstance(x, AmpState):
            ls = x.loss_scale
            return x._replace(loss_scale=fresh.replace(steps=ls.steps, skipped=ls.skipped,
                                                       nonfinite_streak=ls.nonfinite_streak))
        return x

    return jax.tree_util.tree_map(swap, opt_state, is_leaf=lambda x: isinstance(x, AmpState))


def enter_phase(opt_state: Any, config: LossScaleConfig, previous: LossScaleConfig | None = None, *,
                reset: bool = False) -> Any:
    """The optimizer state with its loss-scale state moved into a new phase (the core's rule,
    ``ampbridge.core.loss_scale.enter_phase``: carry, or start fresh on ``reset`` or a mode change).

    Runs on the host (it reads the state once); the inner optimizer state is left as it is.
    """
    from ...core.loss_scale import enter_phase as reference_enter_phase

    def move(x: Any) -> Any:
        if not isinstance(x, AmpState):
            return x
        ls = x.loss_scale
        before = ls.to_reference()
        after = reference_enter_phase(config, before, previous=previous, reset=reset)
        hits = int(ls.min_scale_hits) if after is before else 0
        return x._replace(loss_scale=PackedLossScale.from_reference(after, hits))

    return jax.tree_util.tree_map(move, opt_state, is_leaf=lambda x: isinstance(x, AmpState))


def value_and_grad(fun: Callable[..., Any], opt_state: Any, *, argnums: int | tuple[int, ...] = 0,
                   has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad`` of a loss-scaled ``fun``, the loss-scale state read from ``opt_state``.

    ``value_and_grad(loss_fn, opt_state)(params, *args)`` returns ``(loss, grads)`` as
    ``jax.value_and_grad(loss_fn)`` does, but differentiates ``loss * scale`` (:func:`scale_loss`,
    float32) and hands back the plain ``loss`` (and ``aux`` with ``has_aux``), so ``loss_fn`` needs
    no ``opt_state``. ``grads`` are those of the scaled loss: what ``tx.update`` of
    :func:`optimizer` takes (it unscales them in float32, checks them and skips or steps; one place
    unscales). ``unscale(grads, opt_state)`` gives the true gradients for logging. ``opt_state``
    is any optimizer state holding the loss-scale state (a chain, ``MultiSteps``, an
    ``nnx.Optimizer``); when the differentiated argument is an ``nnx.Module`` this is
    ``nnx.value_and_grad``. The existing ``scale_loss`` inside your own ``jax.grad`` stays.

    Example:
        >>> import jax, jax.numpy as jnp, optax, ampbridge
        >>> tx = optimizer(optax.sgd(0.5), ampbridge.Policy(loss_scale={"mode": "static", "initial_scale": 8.0}))
        >>> params = {"w": jnp.ones(2)}
        >>> opt_state = tx.init(params)
        >>> loss, grads = value_and_grad(lambda p, x: jnp.sum(p["w"] * x), opt_state)(params, jnp.ones(2))
        >>> float(loss), grads["w"]          # the loss as computed; gradients of loss * 8
        (2.0, Array([8., 8.], dtype=float32))
        >>> updates, opt_state = tx.update(grads, opt_state, params)
        >>> updates["w"]
        Array([-0.5, -0.5], dtype=float32)
    """
    def scaled(*args: Any) -> tuple[jax.Array, Any]:
        out = fun(*args)
        loss, aux = out if has_aux else (out, None)
        return scale_loss(loss, opt_state), (loss, aux)

    def run(*args: Any) -> tuple[Any, Any]:
        nnx = sys.modules.get("flax.nnx")
        first = args[argnums if isinstance(argnums, int) else argnums[0]] if args else None
        grad = nnx.value_and_grad if nnx is not None and isinstance(first, nnx.Module) else jax.value_and_grad
        (_, (loss, aux)), grads = grad(scaled, argnums=argnums, has_aux=True)(*args)
        return ((loss, aux) if has_aux else loss), grads

    return run


def skipped(opt_state: Any, previous: Any) -> jax.Array:
    """Whether the optimizer update that turned ``previous`` into ``opt_state`` was skipped (a bool
    array; jit-safe, no host sync).

    Read from the loss-scale states: a skipped non-finite step counts in ``skipped``; a step
    ``on_min_scale = "error"`` stopped leaves the state frozen (``steps`` unchanged). Either may
    be an optimizer state, an ``nnx.Optimizer`` or a :class:`PackedLossScale` (for an
    ``nnx.Optimizer``, which changes in place, keep ``loss_scale(optimizer)`` from before).
    """
    after, before = loss_scale(opt_state), loss_scale(previous)
    return (after.skipped != before.skipped) | (after.steps == before.steps)


def rollback(new: Any, old: Any, opt_state: Any, previous: Any) -> Any:
    """``old`` where the update from ``previous`` to ``opt_state`` was skipped, else ``new``: one line
    to keep any state (``batch_stats``, an EMA, a step counter, the params themselves) as it was
    on a skipped step, bit for bit (a select, ``jnp.where``; no host sync).

    ``new`` and ``old`` are pytrees of the same structure (``nnx.State`` included).

    Example:
        >>> import jax.numpy as jnp, optax, ampbridge
        >>> tx = optimizer(optax.sgd(0.1), ampbridge.preset("mixed_float16"))
        >>> opt_state = tx.init({"w": jnp.ones(1)})
        >>> _, after = tx.update({"w": jnp.array([jnp.inf])}, opt_state)
        >>> stats = rollback({"mean": jnp.ones(1)}, {"mean": jnp.zeros(1)}, after, opt_state)
        >>> bool(skipped(after, opt_state)), stats["mean"]
        (True, Array([0.], dtype=float32))
    """
    take_old = skipped(opt_state, previous)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(take_old, b, a), new, old)
