"""Realising the Plan on the model: ``apply`` and the ``TorchAmp`` it returns.

What runs where:

- **compute**: ``torch.autocast(device_type, dtype=compute_dtype)`` around the model's forward
  (autocast's own per-op lists decide each op, exactly as in hand-written torch.amp);
- **pins and overrides** (``keep_float32``, ``[[override]]``): the module's forward runs in its
  own region (autocast disabled for float32, a nested ``torch.autocast`` for another dtype), its
  floating inputs cast to the rule's compute dtype, its outputs to the rule's output dtype;
- **parameter storage**: ``param_dtype`` casts the storage of the parameters in place (the same
  ``Parameter`` objects, so optimizers keep working); buffers (BatchNorm running statistics) stay
  float32; the model's floating outputs are cast to ``output_dtype``;
- **loss scaling**: :class:`GradScaler`, a ``torch.amp.GradScaler`` subclass that follows
  ampbridge's reference algorithm (``ampbridge.core.loss_scale``) exactly, with tensor ops only;
- **diagnostics**: ``amp.monitor(path, every=N)`` (:class:`Monitor`) writes the numerics log
  ``ampbridge report`` reads (per-layer gradient statistics, which layer overflowed first);
  ``AMPBRIDGE_DISABLE=1`` / ``AMPBRIDGE_POLICY=...`` replace the policy ``apply`` is given.

A policy without pins is bit-identical to plain ``torch.autocast`` + ``torch.amp.GradScaler``:
ampbridge adds casts only where a rule or a storage dtype needs them.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.loss_scale import LossScaleState
from ...core.plan import Plan
from ...core.policy import Policy
from ...errors import AmpBridgeError
from ..common import environment
from .environment import device_type_of, resolve_for_device
from . import fp8
from .forward import (MhaSlowPath, autocast_region, float32_matmul_precision, install_forward, installed,
                      keep_slow_path, uninstall_forward)
from .loss_scale import GradScaler, StepResult
from .monitor import Monitor
from .plan import Realisation, realise_plan
from .schedule import PhaseState
from .trace import trace_forward

log = logging.getLogger("ampbridge.torch")


class ModelNotSupportedError(AmpBridgeError, TypeError):
    """``apply`` was given something it cannot realise a policy on (scripted, compiled, applied)."""


# --- apply -------------------------------------------------------------------------------------

#: every module of an applied model -> (its path there, the applied model's class name); a module
#: whose own forward ampbridge left alone still belongs to the applied model, and a nested apply's
#: remove() would be undone by the outer one's
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()


def _check_model(model: Any) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelNotSupportedError(
            "apply() needs an eager nn.Module; this is a TorchScript module, whose forward cannot be given "
            "per-module autocast regions. Apply to the eager model, train with it, and script afterwards "
            "(ampbridge.plan works on scripted models)")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ModelNotSupportedError(
            "apply() was given a torch.compile'd module; apply to the eager module first, then compile: "
            "amp = ampbridge.torch.apply(model, policy); model = torch.compile(amp.model)")
    if not isinstance(model, nn.Module):
        raise ModelNotSupportedError(f"apply() needs a torch.nn.Module; received {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ModelNotSupportedError(
            f"apply() was given a {type(model).__name__}: applied outside it, the ranks would not agree on "
            "skipping an overflowed step and gradients would not reduce in reduce_dtype. Apply to the module "
            "first, then wrap: amp = ampbridge.torch.apply(model, policy); ddp = ampbridge.torch.wrap_ddp(amp)")
    owner = _APPLIED.get(model)
    if owner is not None and owner[0]:
        raise ModelNotSupportedError(
            f"this module is {owner[0]!r} of an applied {owner[1]}: apply the policy to the whole model (rules "
            f"by path reach it: match = \"{owner[0]}\"), or call that model's amp.remove() first")
    fwd = installed(model)
    if fwd is not None:
        raise ModelNotSupportedError(
            "this model is already applied (ampbridge.torch.apply was called on it); call amp.remove() first, "
            "or use amp.set_epoch/set_step for a schedule")
    for path, module in model.named_modules():
        if path and installed(module) is not None:
            raise ModelNotSupportedError(f"module {path!r} of this model is already part of an applied model; "
                                         "remove that first (amp.remove())")


def apply(model: nn.Module, policy: Policy | str | Path, *, device_type: str | None = None) -> "TorchAmp":
    """Realise a policy on a model in place; returns the :class:`TorchAmp` that drives training.

    ``policy``: a Policy, a preset name or a policy file path. ``device_type``: where autocast
    runs (default: the model's parameters' device type).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> amp = apply(model, "mixed_float16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> bool(amp.step(model(torch.ones(3, 4)).mean(), opt))  # |grads| * 65536 stays below float16's max
        True
    """
    _check_model(model)
    # the bisect switch; warns once, at the caller
    effective, notes = environment(policy, "torch")
    return TorchAmp(model, effective, device_type_of(model, device_type), notes=notes)


class TorchAmp:
    """A policy applied to a model: ``model``, ``scaler``, ``plan``, ``autocast()``, ``step()``.

    The native torch.amp loop keeps working::

        with amp.autocast():
            loss = loss_fn(amp.model(x), y)
        amp.scaler.scale(loss).backward(); amp.scaler.step(opt); amp.scaler.update()

    ``amp.step(loss, opt)`` does the same (and runs the backward with the policy's matmul
    precision). With a ``[[phase]]`` schedule, ``set_epoch``/``set_step`` (and ``step``, for a
    schedule by step) switch to the phase in force.
    """

    def __init__(self, model: nn.Module, policy: Policy, device_type: str, *, notes: Sequence[str] = ()):
        self.model = model
        self._env_notes = tuple(notes)
        self._monitor: Monitor | None = None
        self.policy = policy  # the whole policy, schedule included
        self.device_type = device_type
        self._phases = PhaseState(policy, self._enter_phase)
        self._last_optimizers: list[Any] = []
        self._micro_batches = 0  # backward passes since the last optimizer step (amp.step's accumulate)
        resolved, notes = resolve_for_device(self._phases.first_policy(), device_type)
        self._realisation = fp8.realise(model, resolved, realise_plan(model, resolved, device_type,
                                                                notes=self._env_notes + tuple(notes)), device_type)
        self._resolved = resolved
        self._cast_storage(self._realisation)
        self._install(self._realisation)
        for path, module in model.named_modules():
            _APPLIED[module] = (path, type(model).__name__)
        fp16_grads = any(d == torch.float16 for _, d in self._realisation.storage.values())
        self.scaler = GradScaler(resolved.loss_scale, device_type, compute_dtype=resolved.compute_dtype,
                                 allow_fp16_grads=fp16_grads)
        self._log_applied()

    # --- views

    @property
    def plan(self) -> Plan:
        """The Plan in force (the current phase's)."""
        return self._realisation.plan

    @property
    def realisation(self) -> Realisation:
        """How each module runs to make the Plan in force true (read-only record: its specs, the rows
        whose own code promotes the stream, ...), for the trace and the demo."""
        return self._realisation

    @property
    def active_policy(self) -> Policy:
        """The resolved policy in force (the current phase's, ``auto`` resolved for the device)."""
        return self._resolved

    @property
    def phase(self) -> int | None:
        """Index of the phase in force (None without a schedule, or past a closed last phase)."""
        return self._phases.index

    def __repr__(self) -> str:
        p = self._resolved
        return (f"TorchAmp({type(self.model).__name__} on {self.device_type}: compute {p.compute_dtype}, "
                f"params {p.param_dtype}, loss scale {self.scaler.config.mode})")

    # --- realisation

    def _cast_storage(self, realisation: Realisation) -> None:
        changed = []
        with torch.no_grad():
            for p, dtype in realisation.storage.values():
                if p.dtype != dtype:
                    changed.append((p, p.dtype, dtype))
                    p.data = p.data.to(dtype)
                    if p.grad is not None:
                        p.grad = p.grad.to(dtype)
        self._recast_optimizer_state(changed)

    def _recast_optimizer_state(self, changed: list[tuple[nn.Parameter, torch.dtype, torch.dtype]]) -> None:
        # torch's optimizers need their per-parameter moments in the parameter's dtype; the values are
        # kept (exactly when widening to float32)
        if not changed:
            return
        for opt in list(self._phases.optimizers):
            for p, _, dtype in changed:
                state = opt.state.get(p)
                if not state:
                    continue
                for key, value in state.items():
                    if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape
                            and value.dtype != dtype):
                        state[key] = value.to(dtype)

    def _install(self, realisation: Realisation) -> None:
        modules = dict(self.model.named_modules())
        for path, spec in realisation.specs.items():
            install_forward(modules[path], spec)
        # the fused fast path bypasses the children's forwards (their rules) and ignores CPU autocast
        # (it checks CUDA's only): a layer whose row computes below float32 would run in float32
        self._hooks = [module.register_forward_pre_hook(keep_slow_path)
                       for path, module in modules.items() if isinstance(module, nn.TransformerEncoderLayer)
                       and (realisation.plan[path].compute_dtype != "float32"
                            or any(p != path and (not path or p.startswith(path + ".")) for p in realisation.specs))]
        # MultiheadAttention's own fused eval path ignores CPU autocast too, and torch.compile never takes it
        if self.device_type == "cpu":
            for path, module in modules.items():
                if isinstance(module, nn.MultiheadAttention) and realisation.plan[path].compute_dtype != "float32":
                    slow = MhaSlowPath()
                    self._hooks.append(module.register_forward_pre_hook(slow.before))
                    self._hooks.append(module.register_forward_hook(slow.after, always_call=True))

    def _uninstall(self) -> None:
        for _, module in self.model.named_modules():
            uninstall_forward(module)
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []

    def _enter_phase(self, index: int | None) -> None:
        """Run phase ``index`` (None: past a closed last phase): re-realised, storage recast, the
        scaler moved by the core's ``enter_phase`` (``PhaseState`` calls this on a change)."""
        before = self._resolved
        resolved, notes = resolve_for_device(self.policy.phase_policy(index), self.device_type)
        realisation = realise_plan(self.model, resolved, self.device_type, notes=self._env_notes + tuple(notes))
        self._uninstall()
        realisation = fp8.realise(self.model, resolved, realisation, self.device_type)
        self._cast_storage(realisation)
        self._install(realisation)
        reset = self._phases.resets_loss_scale(index)
        self.scaler.reconfigure(resolved.loss_scale, compute_dtype=resolved.compute_dtype, reset=reset,
                                allow_fp16_grads=any(d == torch.float16 for _, d in realisation.storage.values()))
        self._realisation, self._resolved = realisation, resolved
        unit = self.policy.phase_unit
        log.info("%s %d: phase %s in force (compute %s -> %s, loss scale %s%s)", unit, self._phases.position[unit],
                 index if index is not None else "after the schedule", before.compute_dtype,
                 resolved.compute_dtype, self.scaler.config.mode, ", reset" if reset else "")

    def _log_applied(self) -> None:
        p = self._resolved
        pins = sum(1 for r in self.plan.rows if r.rule != "default")
        log.info("applied %s on %s: compute %s, params %s, output %s, loss scale %s; %d of %d rows ruled%s",
                 p.source or "policy", self.device_type, p.compute_dtype, p.param_dtype, p.output_dtype,
                 self.scaler.config.mode, pins, len(self.plan.rows),
                 f"; matmul precision {p.matmul_precision} inside the applied scope" if p.matmul_precision != "highest"
                 else "")

    def remove(self) -> None:
        """Undo ``apply``: the original forwards come back, parameters are stored in float32 again
        (values kept; a float16/bfloat16 storage has already rounded them); closes a monitor."""
        if self._monitor is not None:
            self._monitor.close()
        self._uninstall()
        for _, module in self.model.named_modules():
            _APPLIED.pop(module, None)
        changed = []
        with torch.no_grad():
            for p, _ in self._realisation.storage.values():
                if p.dtype != torch.float32:
                    changed.append((p, p.dtype, torch.float32))
                    p.data = p.data.float()
                    if p.grad is not None:
                        p.grad = p.grad.float()
        self._recast_optimizer_state(changed)

    # --- running

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The model-wide region (autocast in the compute dtype, the matmul precision), for the loss."""
        root = self._realisation.specs[""]
        with float32_matmul_precision(root.matmul_precision), autocast_region(self.device_type, root.region):
            yield

    def step(self, loss: torch.Tensor, optimizer: Any | Sequence[Any], *, clip_grad_norm: float | None = None,
             accumulate: int = 1) -> StepResult:
        """Scale, backward, unscale, (clip,) skip or step, update; truthy when the step was applied.

        ``optimizer`` may be a sequence of optimizers sharing one loss. Gradients are not zeroed.
        ``clip_grad_norm``: ``scaler.unscale_`` each optimizer, then ``clip_grad_norm_`` over all
        their parameters together (the norm is ``result.grad_norm``, a tensor: no sync).
        ``accumulate = N``: the loss is divided by N and only every N-th call steps; the others
        only run the backward (``result.accumulating``). Both are bit-identical to the torch.amp
        loop written by hand (``loss / N`` before ``scaler.scale``). Zero the gradients after a call
        that was not accumulating:

        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> amp = apply(model, "mixed_float16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for i in range(4):
        ...     with amp.autocast():
        ...         loss = model(torch.ones(3, 4)).float().pow(2).mean()
        ...     result = amp.step(loss, opt, clip_grad_norm=1.0, accumulate=2)
        ...     if not result.accumulating:
        ...         opt.zero_grad()
        >>> amp.scaler.loss_scale_state().steps, float(result.grad_norm) > 0
        (2, True)
        """
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1 (micro-batches per optimizer step); "
                             f"received {accumulate!r}")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float))
                                               and not isinstance(clip_grad_norm, bool) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a number > 0 (the max norm) or None; received {clip_grad_norm!r}")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if optimizers != self._last_optimizers:
            self._phases.optimizers.update(optimizers)
            self._last_optimizers = optimizers
        if accumulate > 1:
            loss = loss / accumulate
        self._micro_batches += 1
        with float32_matmul_precision(self._resolved.matmul_precision):
            self.scaler.scale(loss).backward()
            if self._micro_batches < accumulate:
                return StepResult(False, accumulating=True)
            self._micro_batches = 0
            norm = None
            if clip_grad_norm is not None:
                for opt in optimizers:
                    self.scaler.unscale_(opt)
                params = list({id(p): p for opt in optimizers for group in opt.param_groups
                               for p in group["params"]}.values())
                norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            for opt in optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        result = self.scaler.last_step_result
        if norm is not None:
            result = result.with_grad_norm(norm)
        self._phases.after_step()
        return result

    def monitor(self, path: str | Path, every: int = 1, *, attribution: bool = True) -> Monitor:
        """Log loss, scale, skips, overflow origins and (every N-th step) per-layer gradient
        statistics to ``path`` (JSON Lines, read by ``ampbridge report``); see :class:`Monitor`.

        Use it as a context manager, or call ``.close()``; ``amp.remove()`` closes it too.
        """
        if self._monitor is not None and not self._monitor.closed:
            raise AmpBridgeError(f"this model already has a monitor writing {str(self._monitor.path)!r}; close it "
                                 "first (monitor.close())")
        self._monitor = Monitor(path, self, every=every, attribution=attribution)
        return self._monitor

    def trace(self, *args: Any, **kwargs: Any) -> Plan:
        """The Plan as observed in one forward on these inputs (no gradients; buffers and RNG restored).

        Every row that ran says what it really computed in; rows that follow their input's dtype
        get the observed dtype, rows that did not run say so.
        """
        return trace_forward(self, args, kwargs)

    # --- schedules

    def set_epoch(self, epoch: int, optimizers: Iterable[Any] = ()) -> None:
        """Tell amp the epoch (for a schedule by epoch: switch to the phase in force).

        ``optimizers``: optimizers whose state must follow a parameter-storage change (those used
        with ``amp.step`` are known already).
        """
        self._phases.set_position("epoch", epoch, optimizers)

    def set_step(self, step: int, optimizers: Iterable[Any] = ()) -> None:
        """Tell amp the global step (for a schedule by step: switch to the phase in force)."""
        self._phases.set_position("step", step, optimizers)

    # --- state

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state (five reference fields) and the schedule position, for checkpoints."""
        position = self._phases.position
        return {"loss_scale": self.scaler.loss_scale_state().to_dict(), "step": position["step"],
                "epoch": position["epoch"], "phase": self._phases.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the phase in force follows the saved position)."""
        unknown = set(state) - {"loss_scale", "step", "epoch", "phase"}
        if "loss_scale" not in state or unknown:
            raise ValueError(f"not an ampbridge.torch state dict: needs 'loss_scale' (and step, epoch, phase); "
                             f"unknown keys {sorted(unknown)}")
        self._phases.restore(int(state.get("step", 0)), int(state.get("epoch", 0)))
        self.scaler.load_loss_scale_state(LossScaleState.from_dict(state["loss_scale"]))
