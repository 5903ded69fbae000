"""Precision phases over training (``[[phase]]``): where an applied model stands in its schedule
(step, epoch, the phase in force) and when it crosses into another phase.

``TorchAmp`` owns one :class:`PhaseState`; the state calls back ``enter(index)`` (``TorchAmp``'s
re-realisation) when the position reaches another phase.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ...core.policy import Policy


class PhaseState:
    """A ``TorchAmp``'s position in its policy's schedule and the phase in force there.

    ``position``: the step and epoch told so far; ``index``: the phase in force (None without a
    schedule, or past a closed last phase); ``optimizers``: those whose state must follow a
    parameter-storage change. ``enter(index)`` runs a phase; it is called only on a change.

    Example:
        >>> import ampbridge
        >>> p = ampbridge.loads('[[phase]]\\nuntil_step = 2\\ncompute_dtype = "float32"')
        >>> entered = []
        >>> state = PhaseState(p, entered.append)
        >>> state.after_step(); state.after_step(); state.index, entered
        (None, [None])
    """

    def __init__(self, policy: Policy, enter: Callable[[int | None], None]):
        self.policy = policy
        self.unit = policy.phase_unit
        self.position = {"step": 0, "epoch": 0}
        self.index = policy.phase_index(step=0, epoch=0) if policy.phases else None
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._enter = enter

    def first_policy(self) -> Policy:
        """The policy of the phase in force at step 0, epoch 0 (the whole policy without a schedule)."""
        return self.policy.phase_policy(self.index)

    def set_position(self, unit: str, value: int, optimizers: Iterable[Any]) -> None:
        """``amp.set_epoch`` / ``amp.set_step``: record the position; for a schedule by ``unit``, switch."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{unit} must be an integer >= 0; received {value!r}")
        for opt in optimizers:
            self.optimizers.add(opt)
        self.position[unit] = value
        if self.unit == unit:
            self.switch_to(self.policy.phase_index(**{unit: value}))

    def after_step(self) -> None:
        """One optimizer step done (``amp.step``): count it; for a schedule by step, switch."""
        self.position["step"] += 1
        if self.unit == "step":
            self.switch_to(self.policy.phase_index(step=self.position["step"]))

    def restore(self, step: int, epoch: int) -> None:
        """``amp.load_state_dict``: the saved position, and the phase in force there."""
        self.position["step"] = step
        self.position["epoch"] = epoch
        if self.policy.phases:
            unit = self.unit or "step"
            self.switch_to(self.policy.phase_index(**{unit: self.position[unit]}))

    def switch_to(self, index: int | None) -> None:
        """Run phase ``index`` (None: past a closed last phase), if it is not the one in force."""
        if index == self.index or not self.policy.phases:
            return
        self._enter(index)
        self.index = index

    def resets_loss_scale(self, index: int | None) -> bool:
        """Whether entering phase ``index`` starts the loss scale afresh (its ``reset_loss_scale``)."""
        return index is not None and self.policy.phases[index].reset_loss_scale
