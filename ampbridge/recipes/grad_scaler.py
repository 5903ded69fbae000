"""torch ``GradScaler`` arguments and state dicts in and out (plain data: no torch import).

Holds from_grad_scaler and to_grad_scaler; the argument helpers they share with Accelerate and
Lightning live in convert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.loss_scale import LossScaleState, f32
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem
from .convert import (
    _GRAD_SCALER_STATE,
    Conversion,
    _construct,
    _get_int,
    _policy_of,
    _read_grad_scaler_args,
    _Reader,
    _write_grad_scaler_args,
    _Writer,
)

# --- torch GradScaler -------------------------------------------------------------------------------

def from_grad_scaler(settings: Mapping[str, Any] | None = None, *,
                     state_dict: Mapping[str, Any] | None = None) -> Conversion:
    """torch ``GradScaler`` constructor arguments and/or ``state_dict()`` -> LossScaleConfig (+ state).

    Arguments: ``init_scale`` (2**16), ``growth_factor`` (2), ``backoff_factor`` (0.5),
    ``growth_interval`` (2000), ``enabled``. A state dict (``scale``, the factors,
    ``growth_interval``, ``_growth_tracker``) gives the config with ``initial_scale`` = the saved
    scale, and ``Conversion.state`` with ``good_steps = _growth_tracker`` (resume from it). A
    positional dict with ``scale`` or ``_growth_tracker`` is read as a state dict; an empty state
    dict is a disabled scaler's.

    Example:
        >>> c = from_grad_scaler(state_dict={"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        ...                                  "growth_interval": 100, "_growth_tracker": 7})
        >>> c.result.initial_scale, c.result.growth_interval, c.state.good_steps
        (1024.0, 100, 7)
    """
    if settings is not None and state_dict is None and isinstance(settings, Mapping) and (
            "scale" in settings or "_growth_tracker" in settings):
        settings, state_dict = None, settings
    r = _Reader("grad-scaler")
    args = dict(settings or {})
    if settings is not None and not isinstance(settings, Mapping):
        raise PolicyError([Problem("GradScaler arguments must be a mapping", value=settings)])
    fields = _read_grad_scaler_args(r, args, (), "torch GradScaler's arguments")
    state = None
    if state_dict is not None:
        if not isinstance(state_dict, Mapping):
            raise PolicyError([Problem("a GradScaler state dict must be a mapping", value=state_dict)])
        if not state_dict:
            r.note("an empty state dict is a disabled GradScaler's")
            fields = {"mode": "none", "skip_nonfinite": False}
        else:
            path = ("state_dict",)
            r.check_keys(state_dict, _GRAD_SCALER_STATE, path, "a GradScaler state dict")
            missing = [k for k in _GRAD_SCALER_STATE if k not in state_dict]
            if missing:
                r.problem(path, f"a GradScaler state dict has all of {', '.join(_GRAD_SCALER_STATE)}; missing "
                          f"{', '.join(missing)}")
            as_args = {"init_scale": state_dict.get("scale", 65536.0),
                       **{k: state_dict[k] for k in ("growth_factor", "backoff_factor", "growth_interval")
                          if k in state_dict}}
            fields = _read_grad_scaler_args(r, as_args, path, "a GradScaler state dict")
            tracker = _get_int(r, state_dict, "_growth_tracker", path, 0, low=0, what="an integer >= 0")
            r.origins.update({"loss_scale.initial_scale": "state_dict.scale"})
            r.raise_if_any()
            state = LossScaleState(scale=f32(fields["initial_scale"]), good_steps=tracker, hysteresis_left=1)
            r.note("the state dict's scale is the current scale: it becomes initial_scale, and the state "
                   "(Conversion.state) has good_steps = _growth_tracker; steps and skipped are not in a GradScaler "
                   "state dict and start at 0")
    cfg = _construct(r, lambda: LossScaleConfig(**fields))
    return r.done(cfg, ("loss_scale",), state)


def to_grad_scaler(policy: Policy | LossScaleConfig) -> Conversion:
    """Policy (or a resolved LossScaleConfig) -> torch ``GradScaler(**kwargs)`` arguments.

    Factors are written as their float32 values, which is what ampbridge applies, so the
    trajectory is the same step for step.

    Example:
        >>> to_grad_scaler(LossScaleConfig(mode="dynamic", growth_interval=100)).result
        {'init_scale': 65536.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 100, 'enabled': True}
    """
    p = _policy_of(policy, "to_grad_scaler")
    w = _Writer("grad-scaler", p)
    w.loss_scale_only(policy, "GradScaler")
    args = _write_grad_scaler_args(w, p, "torch")
    return w.done(args)
