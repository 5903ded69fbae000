"""Precision phases over training (``[[phase]]``): the position (step, epoch) an applied model has
reached, and switching it to the phase in force there (re-realised, storage recast, scaler moved
by the core's ``enter_phase``).

Holds ``set_position``, ``after_step``, ``restore_position`` and ``switch_to``; ``TorchAmp``'s
``set_epoch``, ``set_step``, ``step`` and ``load_state_dict`` call them (``amp``: a ``TorchAmp``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from .environment import _resolve_for_device
from .fp8 import realise as realise_fp8
from .plan import _realise

log = logging.getLogger("ampbridge.torch")


def set_position(amp: Any, unit: str, value: int, optimizers: Iterable[Any]) -> None:
    """``amp.set_epoch`` / ``amp.set_step``: record the position; for a schedule by ``unit``, switch."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{unit} must be an integer >= 0; received {value!r}")
    for opt in optimizers:
        amp._optimizers.add(opt)
    amp._position[unit] = value
    if amp.policy.phase_unit == unit:
        switch_to(amp, amp.policy.phase_index(**{unit: value}))


def after_step(amp: Any) -> None:
    """One optimizer step done (``amp.step``): count it; for a schedule by step, switch."""
    amp._position["step"] += 1
    if amp._unit == "step":
        switch_to(amp, amp.policy.phase_index(step=amp._position["step"]))


def restore_position(amp: Any, step: int, epoch: int) -> None:
    """``amp.load_state_dict``: the saved position, and the phase in force there."""
    amp._position["step"] = step
    amp._position["epoch"] = epoch
    if amp.policy.phases:
        unit = amp.policy.phase_unit or "step"
        switch_to(amp, amp.policy.phase_index(**{unit: amp._position[unit]}))


def switch_to(amp: Any, index: int | None) -> None:
    """Run phase ``index`` (None: past a closed last phase) on ``amp``'s model, if not already."""
    if index == amp._phase_index or not amp.policy.phases:
        return
    before = amp._resolved
    phase_policy = amp.policy.phases[index].policy if index is not None else amp.policy.replace(phases=())
    resolved, notes = _resolve_for_device(phase_policy, amp.device_type)
    realisation = _realise(amp.model, resolved, amp.device_type, notes=amp._env_notes + tuple(notes))
    amp._uninstall()
    realisation = realise_fp8(amp.model, resolved, realisation, amp.device_type)
    amp._cast_storage(realisation)
    amp._install(realisation)
    reset = index is not None and amp.policy.phases[index].reset_loss_scale
    amp.scaler._allow_fp16_grads = any(d == torch.float16 for _, d in realisation.storage.values())
    amp.scaler.reconfigure(resolved.loss_scale, compute_dtype=resolved.compute_dtype, reset=reset)
    amp._realisation, amp._resolved, amp._phase_index = realisation, resolved, index
    unit = amp.policy.phase_unit
    log.info("%s %d: phase %s in force (compute %s -> %s, loss scale %s%s)", unit, amp._position[unit],
             index if index is not None else "after the schedule", before.compute_dtype,
             resolved.compute_dtype, amp.scaler.config.mode, ", reset" if reset else "")
