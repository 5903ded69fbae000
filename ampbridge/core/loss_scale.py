"""The reference loss-scale algorithm: the one every backend's scaler must reproduce.

Pure Python, on float32 values (every product is rounded to float32, as a float32 scale
tensor would be). For each optimizer step with ``found_inf`` (any gradient non-finite)::

    if found_inf:
        good_steps = restart              (growth_interval - first_growth_interval; 0 when absent)
        nonfinite_streak += 1             (when max_consecutive_skips is set)
        skipped += 1                      (when skip_nonfinite, unless nonfinite_streak > max_consecutive_skips)
        if hysteresis_left <= 1:
            if scale == min_scale: on_min_scale decides (clamp: stay; warn: warn once; error: raise)
            scale = max(scale * backoff_factor, min_scale)
        else:
            hysteresis_left -= 1
    else:
        good_steps += 1; nonfinite_streak = 0 (when max_consecutive_skips is set)
        if consecutive_hysteresis: hysteresis_left = hysteresis
        if good_steps == growth_interval:
            if not consecutive_hysteresis: hysteresis_left = hysteresis
            new = scale * growth_factor; if finite: scale = min(new, max_scale)
            good_steps = 0
    steps += 1

With ``hysteresis = 1`` this is torch's ``GradScaler`` (``_amp_update_scale_``) and jmp's
``DynamicLossScale`` (when ``backoff_factor == 1 / growth_factor``); with DeepSpeed's keys it is
DeepSpeed's ``DynamicLossScaler`` in the releases whose growth test is
``(cur_iter - last_overflow_iter) % scale_window == 0`` (see docs/loss_scaling.md for the
releases that grow one step later: ``first_growth_interval = growth_interval + 1`` is their
timing, exactly). ``max_consecutive_skips = N`` is optax's ``apply_if_finite(inner, N)``: after N
non-finite steps skipped in a row, non-finite steps are applied until a finite one. Static mode keeps the scale fixed; mode ``none`` keeps it
at 1. Both still count (and, with ``skip_nonfinite``, skip) non-finite steps.

The growth and backoff factors are applied as float32 values (``float32(scale * float32(f))``),
which is what Keras and JAX do natively; the torch backend hands torch the float32-rounded
factors so all three agree even for factors such as 1.1 that float32 cannot hold exactly.

Example:
    >>> from ampbridge import LossScaleConfig, LossScaler
    >>> s = LossScaler(LossScaleConfig(mode="dynamic", growth_interval=2))
    >>> [s.update(found_inf) for found_inf in (False, True, False, False)]
    [True, False, True, True]
    >>> s.scale
    65536.0
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import AmpBridgeWarning, LossScaleError
from .policy import LossScaleConfig

__all__ = ["LossScaleState", "LossScaler", "initial_state", "next_state", "trajectory", "enter_phase", "f32",
           "restart_count", "applies", "INT32_MAX"]

#: where the non-finite streak stops counting (an int32 counter in every backend)
INT32_MAX = 2**31 - 1


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (inf past float32's range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class LossScaleState:
    """The whole loss-scale state; every backend checkpoints all of it.

    ``skipped`` counts the non-finite steps whose optimizer update was skipped; ``steps`` counts
    every step the scaler has seen; ``nonfinite_streak`` the non-finite steps in a row up to the
    last, counted while ``max_consecutive_skips`` is set (which reads it; it stays as it is without). With ``first_growth_interval``, ``good_steps``
    restarts at ``growth_interval - first_growth_interval`` (negative when the first growth waits
    longer), so the growth test stays ``good_steps == growth_interval``.
    """

    scale: float
    good_steps: int = 0
    hysteresis_left: int = 1
    steps: int = 0
    skipped: int = 0
    nonfinite_streak: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LossScaleState":
        names = [f.name for f in dataclasses.fields(cls)]
        # a state saved before nonfinite_streak existed had no streak to keep
        missing = [n for n in names if n not in data and n != "nonfinite_streak"]
        unknown = [k for k in data if k not in names]
        if missing or unknown:
            raise ValueError(f"loss-scale state needs exactly the keys {names}; "
                             f"missing {missing}, unknown {unknown}")
        return cls(scale=float(data["scale"]), **{n: int(data[n]) for n in names if n != "scale" and n in data})


def _require_resolved(cfg: LossScaleConfig) -> None:
    if cfg.mode == "auto":
        raise ValueError("resolve mode='auto' first: config.resolve(compute_dtype)")


def initial_state(cfg: LossScaleConfig) -> LossScaleState:
    """The state before the first step. ``cfg.mode`` must be resolved (not ``auto``)."""
    _require_resolved(cfg)
    scale = 1.0 if cfg.mode == "none" else f32(cfg.initial_scale)
    return LossScaleState(scale=scale, good_steps=restart_count(cfg), hysteresis_left=cfg.hysteresis)


def restart_count(cfg: LossScaleConfig) -> int:
    """``good_steps`` at the start and after a non-finite step: ``first_growth_interval`` finite
    steps then reach ``growth_interval`` (0 without it, or outside dynamic mode)."""
    if cfg.mode != "dynamic" or cfg.first_growth_interval is None:
        return 0
    return cfg.growth_interval - cfg.first_growth_interval


def applies(cfg: LossScaleConfig, found_inf: bool, streak_before: int) -> bool:
    """Whether a step's optimizer update is applied, given the non-finite streak before it."""
    if not found_inf or not cfg.skip_nonfinite:
        return True
    limit = cfg.max_consecutive_skips
    return limit is not None and streak_before + 1 > limit


def next_state(cfg: LossScaleConfig, state: LossScaleState, found_inf: bool,
               *, warned: list[bool] | None = None) -> LossScaleState:
    """One step of the reference algorithm (pure: returns a new state).

    ``warned`` is a one-element list the ``warn`` mode of ``on_min_scale`` uses to warn once.
    Raises :class:`LossScaleError` on an overflow at ``min_scale`` with ``on_min_scale = "error"``.
    """
    _require_resolved(cfg)
    scale, good, hyst = state.scale, state.good_steps, state.hysteresis_left
    skipped = state.skipped + (0 if applies(cfg, found_inf, state.nonfinite_streak) else 1)
    # optax's safe_increment: the streak stops at int32's maximum; counted only where a limit reads
    # it (no bookkeeping on every step of every other run)
    streak = state.nonfinite_streak
    if cfg.max_consecutive_skips is not None:
        streak = min(streak + 1, INT32_MAX) if found_inf else 0
    if cfg.mode == "dynamic":
        if found_inf:
            good = restart_count(cfg)
            if hyst <= 1:
                lo = f32(cfg.min_scale) if cfg.min_scale is not None else None
                if lo is not None and scale == lo:
                    if cfg.on_min_scale == "error":
                        raise LossScaleError(
                            f"loss scale overflowed at min_scale={cfg.min_scale} "
                            f"(step {state.steps}); on_min_scale='error' stops the run")
                    if cfg.on_min_scale == "warn" and not (warned and warned[0]):
                        warnings.warn(f"loss scale is stuck at min_scale={cfg.min_scale} and "
                                      f"gradients still overflow (step {state.steps})",
                                      AmpBridgeWarning, stacklevel=3)
                        if warned is not None:
                            warned[0] = True
                scale = f32(scale * f32(cfg.backoff_factor))
                if lo is not None:
                    scale = max(scale, lo)
            else:
                hyst -= 1
        else:
            good += 1
            if cfg.consecutive_hysteresis:
                hyst = cfg.hysteresis
            if good == cfg.growth_interval:
                if not cfg.consecutive_hysteresis:
                    hyst = cfg.hysteresis
                new = f32(scale * f32(cfg.growth_factor))
                if math.isfinite(new):
                    scale = min(new, f32(cfg.max_scale)) if cfg.max_scale is not None else new
                good = 0
    return LossScaleState(scale=scale, good_steps=good, hysteresis_left=hyst,
                          steps=state.steps + 1, skipped=skipped, nonfinite_streak=streak)


def enter_phase(cfg: LossScaleConfig, state: LossScaleState, *, previous: LossScaleConfig | None = None,
                reset: bool = False) -> LossScaleState:
    """The state a precision phase (``[[phase]]``) starts from, given the state the last one left.

    Every backend uses this rule, so a schedule gives the same trajectory everywhere:

    - ``reset`` (``[phase.loss_scale] reset = true``): the phase's initial state;
    - the mode changes (``previous.mode != cfg.mode``, both resolved; e.g. ``none`` -> ``dynamic``
      when float32 gives way to float16): the phase's initial state too, since one mode's scale
      means nothing in another (a float32 phase's 1.0 is not a learned scale);
    - static -> static: the phase's own scale (a static scale is a setting, not a state);
    - dynamic -> dynamic: everything carries over, kept inside the new phase's bounds (scale
      clamped to its min/max, ``good_steps`` below its ``growth_interval``, ``hysteresis_left`` at
      most its ``hysteresis``).

    The run counters ``steps``, ``skipped`` and ``nonfinite_streak`` always carry over.

    Example:
        >>> none, dyn = LossScaleConfig(mode="none"), LossScaleConfig(mode="dynamic")
        >>> s = trajectory(none, [False, True])[-1]
        >>> enter_phase(dyn, s, previous=none)
        LossScaleState(scale=65536.0, good_steps=0, hysteresis_left=1, steps=2, skipped=1, nonfinite_streak=0)
    """
    _require_resolved(cfg)
    if previous is not None:
        _require_resolved(previous)
    fresh = reset or previous is None or previous.mode != cfg.mode or cfg.mode != "dynamic"
    if fresh:
        start = initial_state(cfg)
        return dataclasses.replace(start, steps=state.steps, skipped=state.skipped,
                                   nonfinite_streak=state.nonfinite_streak)
    # dynamic -> dynamic: carry, but inside the new phase's bounds; a good_steps count at or
    # past the new growth_interval could never equal it again, and growth would stop for good
    scale = state.scale
    if cfg.min_scale is not None:
        scale = max(scale, f32(cfg.min_scale))
    if cfg.max_scale is not None:
        scale = min(scale, f32(cfg.max_scale))
    return dataclasses.replace(state, scale=scale, good_steps=min(state.good_steps, cfg.growth_interval - 1),
                               hysteresis_left=min(state.hysteresis_left, cfg.hysteresis))


def trajectory(cfg: LossScaleConfig, found_infs: Iterable[bool],
               state: LossScaleState | None = None) -> list[LossScaleState]:
    """The states after each step of a finite/non-finite sequence (the conformance oracle)."""
    warned = [True]  # conformance runs should not spam warnings
    state = state or initial_state(cfg)
    out = []
    for found_inf in found_infs:
        state = next_state(cfg, state, bool(found_inf), warned=warned)
        out.append(state)
    return out


class LossScaler:
    """A mutable loss scaler over the reference algorithm, for framework-free use and tests.

    ``update(found_inf)`` returns True when the optimizer step should be applied.
    """

    def __init__(self, config: LossScaleConfig, compute_dtype: str = "float16"):
        self.config = config.resolve(compute_dtype)
        self.state = initial_state(self.config)
        self._warned = [False]

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, found_inf: bool) -> bool:
        applied = applies(self.config, bool(found_inf), self.state.nonfinite_streak)
        self.state = next_state(self.config, self.state, bool(found_inf), warned=self._warned)
        return applied

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        self.state = LossScaleState.from_dict(data)
