"""Flax ``DynamicScale`` arguments in and out (plain data: no Flax import).

Holds from_flax and to_flax (Flax's growth_interval N is ampbridge's N + 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..core.loss_scale import LossScaleState, f32
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem
from .convert import (
    Conversion,
    _construct,
    _get_int,
    _get_number,
    _policy_of,
    _Reader,
    _Writer,
    loss_scale_view,
)

_TINY32 = math.ldexp(1.0, -126)  # float32's smallest normal number (Flax's default minimum_scale)


# --- Flax DynamicScale ------------------------------------------------------------------------------

_FLAX_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale", "minimum_scale")
_FLAX_NOTE_CAP = ("Flax caps a growth at float32 max (min(scale * growth_factor, float32 max)); ampbridge skips a "
                  "growth that would overflow float32. They differ only once the scale passes float32 max / "
                  "growth_factor (3.4e38 / 2)")


def from_flax(kwargs: Mapping[str, Any]) -> Conversion:
    """``flax.training.dynamic_scale.DynamicScale`` arguments -> LossScaleConfig (+ state).

    Flax grows when ``fin_steps == growth_interval`` *before* counting the current step, so its
    scale grows on the (N+1)-th finite step: Flax ``growth_interval`` N is ampbridge's N + 1, and
    ``fin_steps`` is ``good_steps``. ``minimum_scale`` defaults to float32's smallest normal
    (None: no floor); ``growth_factor = backoff_factor = 1`` is a static scale.

    Example:
        >>> c = from_flax({"growth_interval": 2000, "scale": 2.0**15, "fin_steps": 5})
        >>> c.result.growth_interval, c.result.initial_scale, c.state.good_steps
        (2001, 32768.0, 5)
    """
    r = _Reader("flax")
    if not isinstance(kwargs, Mapping):
        raise PolicyError([Problem("DynamicScale arguments must be a mapping", value=kwargs)])
    r.check_keys(kwargs, _FLAX_KEYS, (), "Flax DynamicScale's arguments")
    growth = _get_number(r, kwargs, "growth_factor", (), 2.0, what="a number >= 1")
    backoff = _get_number(r, kwargs, "backoff_factor", (), 0.5, what="a number in (0, 1), or 1 with growth_factor 1")
    interval = _get_int(r, kwargs, "growth_interval", (), 2000, low=0, what="an integer >= 0")
    fin = _get_int(r, kwargs, "fin_steps", (), 0, low=0, what="an integer >= 0")
    scale = _get_number(r, kwargs, "scale", (), 65536.0)
    minimum = _TINY32
    if "minimum_scale" in kwargs:
        minimum = None if kwargs["minimum_scale"] is None else _get_number(r, kwargs, "minimum_scale", (), _TINY32)
    else:
        r.note("minimum_scale absent: Flax's default is float32's smallest normal number (1.1754944e-38)")
    r.origins.update({"loss_scale.growth_interval": "growth_interval", "loss_scale.initial_scale": "scale",
                      "loss_scale.min_scale": "minimum_scale", "loss_scale.growth_factor": "growth_factor",
                      "loss_scale.backoff_factor": "backoff_factor"})
    r.raise_if_any()
    r.note("Flax returns is_fin and leaves skipping to the caller (jnp.where(is_fin, new, old), as its docstring "
           "does); read as skip_nonfinite=True")
    if growth == 1.0 and backoff == 1.0:
        r.note("growth_factor = backoff_factor = 1: the scale never moves, a static scale")
        cfg = _construct(r, lambda: LossScaleConfig(mode="static", initial_scale=scale))
        return r.done(cfg, ("loss_scale",), LossScaleState(scale=f32(scale)))
    r.note(f"Flax grows on the (growth_interval + 1)-th finite step: growth_interval {interval} is ampbridge's "
           f"{interval + 1}")
    r.note(_FLAX_NOTE_CAP)
    cfg = _construct(r, lambda: LossScaleConfig(
        mode="dynamic", initial_scale=scale, growth_factor=growth, backoff_factor=backoff,
        growth_interval=interval + 1, min_scale=minimum))
    return r.done(cfg, ("loss_scale",), LossScaleState(scale=f32(scale), good_steps=fin))


def to_flax(policy: Policy | LossScaleConfig) -> Conversion:
    """Policy (or a resolved LossScaleConfig) -> ``DynamicScale(**kwargs)`` arguments, or None (no scaling).

    Example:
        >>> to_flax(LossScaleConfig(mode="dynamic", growth_interval=2000)).result
        {'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 1999, 'scale': 65536.0, 'minimum_scale': None}
    """
    p = _policy_of(policy, "to_flax")
    w = _Writer("flax", p)
    w.loss_scale_only(policy, "Flax DynamicScale")
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    skip = "skip it (jnp.where(is_fin, new, old))" if ls.skip_nonfinite else "apply it anyway"
    if view["mode"] == "none":
        w.note("no loss scaling: no DynamicScale")
        if ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", True, "without a DynamicScale nothing reports is_fin; check the "
                   "gradients yourself (optax.apply_if_finite, or ampbridge.jax.optimizer)")
        return w.done(None)
    w.note(f"on a step whose gradients are not finite the caller should {skip}")
    if not ls.skip_nonfinite:
        w.loss("loss_scale.skip_nonfinite", False, "DynamicScale's arguments do not say whether to skip: its "
               "documented use (jnp.where(is_fin, new, old)) skips; applying non-finite steps is your loop's choice")
    if view["mode"] == "static":
        return w.done({"growth_factor": 1.0, "backoff_factor": 1.0, "growth_interval": 2000,
                       "scale": f32(ls.initial_scale), "minimum_scale": None})
    if ls.hysteresis > 1:
        w.loss("loss_scale.hysteresis", ls.hysteresis, "Flax's DynamicScale backs off on every overflow")
    if ls.max_scale is not None:
        w.loss("loss_scale.max_scale", ls.max_scale, "Flax's only ceiling is float32 max")
    if ls.min_scale is not None and ls.on_min_scale != "clamp":
        w.loss("loss_scale.on_min_scale", ls.on_min_scale, "Flax clamps at minimum_scale")
    w.note(_FLAX_NOTE_CAP)
    return w.done({"growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
                   "growth_interval": ls.growth_interval - 1, "scale": f32(ls.initial_scale),
                   "minimum_scale": ls.min_scale})
