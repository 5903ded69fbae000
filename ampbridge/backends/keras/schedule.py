"""Precision phases over training: a ``fit`` callback that switches the model's policy and the
optimizer's loss-scale settings at each phase boundary.

Names: ``PhaseCallback``.
"""

from __future__ import annotations

from typing import Any

from keras import ops

from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from ..common import PhaseClock
from .apply import refresh_compiled, apply
from .environment import resolve_policy
from .loss_scale import LossScaleCallback

class PhaseCallback(PhaseClock, LossScaleCallback):
    """Runs a policy's ``[[phase]]`` schedule during ``fit``.

    At each epoch (or step, for an ``until_step`` schedule) boundary it re-applies the phase's
    policy to the model (layer dtype policies, pins, output casts; variables re-cast only
    where the param dtype changes), switches the optimizer's loss-scale settings (state carried
    over, or restarted when the phase says ``reset = true`` or the mode changes) and rebuilds
    the traced train function. The inner optimizer's moments are never touched.

    Example:
        >>> import ampbridge
        >>> cb = PhaseCallback(ampbridge.loads('compute_dtype = "float16"\\n[[phase]]\\nuntil_epoch = 1\\n'
        ...                                    'compute_dtype = "float32"'))
        >>> cb.policy.phase_unit
        'epoch'
    """

    def __init__(self, policy: Policy | str):
        super().__init__()
        self._start_clock(resolve_policy(policy)[0])  # the environment's switch and "auto" included

    def on_train_begin(self, logs: Any = None) -> None:
        super().on_train_begin(logs)
        opt = self._optimizer()
        modes = {p.policy.resolved_loss_scale.mode for p in self.policy.phases} | {
            self.policy.replace(phases=()).resolved_loss_scale.mode}
        if opt is None and modes != {"none"}:
            raise UnsupportedOptionError(
                f"this schedule needs loss scaling ({', '.join(sorted(modes - {'none'}))}) but the model's "
                f"optimizer is a {type(getattr(self.model, 'optimizer', None)).__name__}; compile with "
                "ampbridge.keras.optimizer(inner, policy)")
        if opt is not None:
            self._step = opt.state.steps  # every step seen, skipped ones included
        elif getattr(self.model, "optimizer", None) is not None:
            self._step = int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def _switch(self, index: int | None, first: bool, **where: int) -> None:
        if getattr(self.model, "_jax_state", None) and not getattr(self.model, "_jax_state_synced", True):
            self.model.jax_state_sync()  # mid-epoch on JAX: put the traced state back first
        active = self.policy.at(**where)
        apply(self.model, active, warn=False)
        opt = self._optimizer()
        if opt is not None:
            reset = index is not None and self.policy.phases[index].reset_loss_scale and not first
            opt.set_loss_scale_config(active.resolved_loss_scale, reset=reset)
        refresh_compiled(self.model)  # again: the loss-scale settings are baked in too
