"""Precision phases over training in tf.keras 2: a ``fit`` callback that switches each layer's
policy and the optimizer's loss-scale settings at each phase boundary.

Names: ``PhaseCallback``; ``_state`` / ``_set_state`` (the reference state as the core's).
"""

from __future__ import annotations

from typing import Any

import tf_keras

from ...core.loss_scale import LossScaleState, enter_phase
from ...core.plan import build_plan
from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from ..common import PhaseClock
from .apply import switch_policies
from .environment import FRAMEWORK, resolve_policy, set_matmul_precision
from .layers import describe
from .loss_scale import ReferenceState


def _state(ref: ReferenceState) -> LossScaleState:
    return LossScaleState(float(ref.current_loss_scale.numpy()), int(ref.counter.numpy()),
                          int(ref.hysteresis_left.numpy()), int(ref.steps.numpy()), int(ref.skipped.numpy()))


def _set_state(ref: ReferenceState, state: LossScaleState) -> None:
    ref.current_loss_scale.assign(state.scale)
    ref.counter.assign(state.good_steps)
    ref.hysteresis_left.assign(state.hysteresis_left)


class PhaseCallback(PhaseClock, tf_keras.callbacks.Callback):
    """Runs a policy's ``[[phase]]`` schedule during ``fit``.

    At each epoch (or step, for an ``until_step`` schedule) boundary it sets every layer's
    ``tf_keras.mixed_precision.Policy`` to the phase's row (the variables stay as ``apply`` made
    them: float32 ``AutoCastVariable``s wherever a phase computes in 16 bits), switches the
    optimizer's loss-scale settings (state carried over by the core's ``enter_phase``: restarted
    when the phase says ``reset = true`` or the mode changes) and retraces the train step. The
    model must be ``apply``-ed with the same schedule and compiled with
    ``ampbridge.tf_keras.optimizer(inner, policy)``; the inner optimizer's moments are not touched.

    Example:
        >>> import ampbridge
        >>> cb = PhaseCallback(ampbridge.loads('compute_dtype = "float16"\\n[[phase]]\\nuntil_epoch = 1\\n'
        ...                                    'compute_dtype = "float32"'))
        >>> cb.policy.phase_unit
        'epoch'
    """

    def __init__(self, policy: Policy | str, *, optimizer: Any = None):
        super().__init__()
        self._start_clock(resolve_policy(policy)[0])
        self._opt = optimizer  # a custom loop's, when the model is not compiled with it

    def on_train_begin(self, logs: Any = None) -> None:
        applied = getattr(self.model, "_ampbridge_policy", None)
        if applied is None or applied.phases != self.policy.phases:
            raise UnsupportedOptionError(
                "PhaseCallback: apply the model with this same schedule first (model = ampbridge.tf_keras.apply(model, "
                "policy)): Keras 2 makes each layer's variables for the dtypes every phase runs in")
        opt = self._opt if self._opt is not None else getattr(self.model, "optimizer", None)
        self._opt = opt
        self._ref = getattr(opt, "_loss_scale", None)
        if not isinstance(self._ref, ReferenceState):
            raise UnsupportedOptionError(
                "PhaseCallback: compile the model with ampbridge.tf_keras.optimizer(inner, policy) made with this "
                f"schedule (its loss-scale settings change by phase); received {type(opt).__name__}")
        self._described, self._by_path = describe(self.model)
        self._step = int(self._ref.steps.numpy())  # every step seen, skipped ones included

    def _switch(self, index: int | None, first: bool, **where: int) -> None:
        active = self.policy.at(**where)
        set_matmul_precision(active.matmul_precision)
        rows = build_plan(self._described, active, framework=FRAMEWORK, warn=False)
        switch_policies(self._by_path, {r.path: r for r in rows})
        cfg = active.resolved_loss_scale
        reset = index is not None and self.policy.phases[index].reset_loss_scale and not first
        if cfg != self._ref.config or reset:
            _set_state(self._ref, enter_phase(cfg, _state(self._ref), previous=self._ref.config, reset=reset))
            self._ref.config = cfg
        if getattr(self.model, "optimizer", None) is not None:
            # fit calls model.train_function each step: the new one traces the phase's policies and settings
            self.model.train_function = self.model.make_train_function(force=True)

    def enter(self, *, step: int | None = None, epoch: int | None = None) -> bool:
        """A custom loop's boundary check, before each step (``step``) or epoch (``epoch``, for an
        ``until_epoch`` schedule): sets the phase in force there, as in ``fit``. True when a phase
        began: trace the loop's ``tf.function`` again (a traced step keeps the dtypes it was traced
        with). Call ``set_model(model)`` first; the optimizer is the model's, or ``optimizer=``.

        Example:
            >>> # cb = PhaseCallback(policy, optimizer=opt); cb.set_model(model)
            >>> # for step, batch in enumerate(data):
            >>> #     if cb.enter(step=step): train_step = tf.function(one_step)
        """
        unit = self.policy.phase_unit or "step"
        at = step if unit == "step" else epoch
        if at is None:
            raise ValueError(f"PhaseCallback.enter: this schedule changes phase by {unit}; pass {unit}=N")
        if self.phase == -1:
            self.on_train_begin()
        before = self.phase
        self._enter(self.policy.phase_index(**{unit: at}) if self.policy.phases else None, at, **{unit: at})
        return self.phase != before
