"""The loss scaler: ``GradScaler``, a ``torch.amp.GradScaler`` that follows ampbridge's reference
algorithm (``ampbridge.core.loss_scale``) exactly, with tensor ops only; ``StepResult``.

Host syncs (the CPU waiting for the device) per optimizer step, as native ``GradScaler``:
one ``.item()`` per device in ``scaler.step`` for an ordinary optimizer, none for a fused one
(``_step_supports_amp_scaling``: the optimizer reads ``found_inf`` on the device). Settings that
need the host to know about an overflow add a sync: ``on_min_scale = "error"`` (and ``"warn"``
until it has warned) reads one flag in ``update()``, but folds it into the ``scaler.step`` read
where there is one, so only the fused path pays it. ``amp.step()``'s result reads the flag only
when it is used (``bool(result)``). Mode ``none`` with ``skip_nonfinite = true`` still checks
gradients (one sync, as a GradScaler would); ``skip_nonfinite = false`` disables the check.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from ...core.loss_scale import INT32_MAX, LossScaleState, enter_phase, f32, initial_state, restart_count
from ...core.policy import LossScaleConfig
from ...errors import AmpBridgeWarning, LossScaleError, UnsupportedOptionError
from ..common import StepObserver, StepRecord
from ..private_hooks import tested_range


# --- the loss scaler ---------------------------------------------------------------------------

class GradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` that follows ampbridge's reference loss-scale algorithm exactly.

    Hysteresis, min/max scale, ``on_min_scale``, static and none modes and ``skip_nonfinite`` are
    tensor ops on the scale's device (no host sync); with ``hysteresis = 1`` and no min/max it
    calls torch's own ``_amp_update_scale_``. Factors are handed to torch rounded to float32, so
    the trajectory equals ``ampbridge.trajectory`` bit for bit. ``state_dict()`` holds torch's keys
    plus ``hysteresis_left``, ``steps`` and ``skipped``; a plain GradScaler state dict loads too.

    Example:
        >>> s = GradScaler(ampbridge.LossScaleConfig(mode="dynamic", hysteresis=2), "cpu")
        >>> s.loss_scale_state().hysteresis_left
        2
    """

    observer: StepObserver | None = None  # (a scaler unpickled from an older ampbridge has none)

    def __init__(self, config: LossScaleConfig, device: str = "cpu", *, compute_dtype: str = "float16",
                 allow_fp16_grads: bool = False):
        cfg = config.resolve(compute_dtype)
        state = initial_state(cfg)
        # torch asserts growth_factor > 1; the reference allows 1 (and the real factor is set below)
        super().__init__(device, init_scale=state.scale, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=cfg.growth_interval, enabled=True)
        self._allow_fp16_grads = allow_fp16_grads
        self._configure(cfg)
        self._pending = state  # the state for the lazily created tensors
        self._hysteresis_left: torch.Tensor | None = None
        self._steps = state.steps  # known on the host exactly: one per update()
        self._skipped: torch.Tensor | None = None  # float64: exact to 2^53, and a single add_ per step
        self._streak: torch.Tensor | None = None  # int32: non-finite steps in a row (max_consecutive_skips)
        self._applied_anyway = False  # this step was non-finite and applied (max_consecutive_skips reached)
        self._host_state = state  # used while the scaler is disabled (mode none, no skipping)
        self._host_steps = state.steps
        self._warned = False
        self._found_read: dict[int, bool] = {}  # optimizer id -> found_inf read in step() (no extra sync)
        self._at_min_read: bool | None = None
        self._last_result: StepResult = _APPLIED
        self.observer: StepObserver | None = None  # a Monitor: fed by scale(), the unscale and update()
        self._agree_group: tuple[Any] | None = None  # (process group,): found_inf all-reduced there
        self._step_verified = False  # the first-step guard (_verified_step) has passed

    # configuration

    def _configure(self, cfg: LossScaleConfig) -> None:
        self.config = cfg
        self._enabled = not (cfg.mode == "none" and not cfg.skip_nonfinite)
        self._growth_factor = f32(cfg.growth_factor)
        self._backoff_factor = f32(cfg.backoff_factor)
        self._growth_interval = cfg.growth_interval
        self._native_update = (cfg.mode == "dynamic" and cfg.hysteresis == 1 and cfg.min_scale is None
                               and cfg.max_scale is None and restart_count(cfg) == 0)
        self._restart = restart_count(cfg)
        self._min = f32(cfg.min_scale) if cfg.min_scale is not None else None
        self._max = f32(cfg.max_scale) if cfg.max_scale is not None else None

    def _needs_min_check(self) -> bool:
        cfg = self.config
        return (cfg.mode == "dynamic" and self._min is not None and
                (cfg.on_min_scale == "error" or (cfg.on_min_scale == "warn" and not self._warned)))

    # lazy device state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        state = self._pending
        self._init_scale, self._init_growth_tracker = state.scale, state.good_steps
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_left = torch.full((), state.hysteresis_left, dtype=torch.int32, device=dev)
        self._skipped = torch.full((), state.skipped, dtype=torch.float64, device=dev)
        self._streak = torch.full((), state.nonfinite_streak, dtype=torch.int32, device=dev)

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        if self.observer is not None:
            self.observer.on_loss(outputs)
        if self._enabled and self.config.mode == "none":
            if self._scale is None:  # scale 1: nothing to multiply, but the state lives on the device
                first = outputs if isinstance(outputs, torch.Tensor) else next(iter(outputs))
                self._lazy_init_scale_growth_tracker(first.device)
            return outputs
        return super().scale(outputs)

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if self.observer is not None:  # the gradients as backward left them: still scaled
            self.observer.on_grads(self._scale, self._steps)
        # param_dtype = float16 means float16 gradients: the policy asked for them
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self._allow_fp16_grads)
        if self._agree_group is not None:  # every rank skips together (agree_across)
            for flag in found.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._agree_group[0])
        return found

    def _check_inf_per_device(self, optimizer: Any) -> dict[str, Any]:
        # a fused optimizer's check: its gradients are read, not unscaled (its kernel unscales them,
        # or on an overflow leaves them as they are)
        if self.observer is not None:
            self.observer.on_kept_scaled(optimizer)
        return super()._check_inf_per_device(optimizer)

    def agree_across(self, group: Any = None) -> None:
        """All-reduce ``found_inf`` (MAX) over ``group`` (None: the default group) at every unscale,
        so an overflow on any rank skips the step, and moves the scale, on every rank: one scalar
        all-reduce per optimizer and step. ``wrap_ddp`` and ``FSDPPrecision.shard`` call it."""
        self._agree_group = (group,)

    # stepping

    def _at_min(self) -> torch.Tensor:
        assert self._scale is not None and self._hysteresis_left is not None
        return (self._scale == self._min) & (self._hysteresis_left <= 1)

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not self.config.skip_nonfinite:  # applied whatever the gradients: nothing to read
            return optimizer.step(*args, **kwargs)
        found = list(optimizer_state["found_inf_per_device"].values())
        limit = self.config.max_consecutive_skips
        if len(found) != 1 and limit is None:
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        if len(found) != 1:  # several devices: torch's own reading, one flag each
            overflow = bool(sum(v.item() for v in found))
        elif self._needs_min_check():
            # one read answers both questions: was there an overflow, and is the scale at its floor
            code = int((found[0] > 0).to(torch.int32).add_(self._at_min().to(torch.int32), alpha=2).item())
            overflow, self._at_min_read = bool(code & 1), bool(code & 2)
        else:
            overflow = bool(found[0].item())
        self._found_read[id(optimizer)] = overflow
        if overflow and limit is not None:
            assert self._streak is not None
            # a second read, on non-finite steps only: max_consecutive_skips skipped in a row already?
            if bool((self._streak >= limit).item()):
                self._applied_anyway = True
                return optimizer.step(*args, **kwargs)
        return None if overflow else optimizer.step(*args, **kwargs)

    def _scale_one_if_never_scaled(self, optimizer: Any) -> None:
        """Scale 1 (mode "none") needs no ``scale(loss)``: a plain ``loss.backward()`` is exact, as in a
        native bfloat16 loop (Fabric's bf16 without ``fabric.backward``); only the state is missing."""
        if self._enabled and self.config.mode == "none" and self._scale is None:
            first = next((p for group in optimizer.param_groups for p in group["params"]), None)
            if first is not None:  # no parameters: nothing to step, torch's own check may speak
                self._lazy_init_scale_growth_tracker(first.device)

    def unscale_(self, optimizer: Any) -> None:
        self._scale_one_if_never_scaled(optimizer)
        super().unscale_(optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._scale_one_if_never_scaled(optimizer)
        if not getattr(self, "_step_verified", False):  # (a scaler unpickled from an older ampbridge)
            return self._verified_step(optimizer, *args, **kwargs)
        if (self._enabled and self.config.max_consecutive_skips is not None
                and getattr(optimizer, "_step_supports_amp_scaling", False)):
            raise UnsupportedOptionError(
                f"ampbridge.torch.GradScaler: loss_scale.max_consecutive_skips="
                f"{self.config.max_consecutive_skips} with a fused optimizer ({type(optimizer).__name__}, which "
                "skips a non-finite step on the device by itself): not supported; use the optimizer's "
                "non-fused form (fused=False) or leave max_consecutive_skips out")
        if self.observer is not None and not self._enabled:  # nothing is unscaled: scale 1
            self.observer.on_grads(None, self._host_steps)
        if (self._enabled and not self.config.skip_nonfinite
                and getattr(optimizer, "_step_supports_amp_scaling", False)
                and "grad_scaler" not in inspect.signature(optimizer.step).parameters):
            return self._fused_step_applying_all(optimizer, *args, **kwargs)
        if self._enabled and self.config.skip_nonfinite and _fused_sgd_unbuffered(optimizer):
            return self._fused_first_step(optimizer, *args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def _fused_first_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """A fused SGD's step before it has momentum buffers: skipped here on an overflow (one read
        of found_inf) instead of in its kernel, which makes the buffers with ``empty_like``, skips
        the update, and leaves them uninitialised for the next step to read (torch 2.13's
        ``_fused_sgd``; the ordinary loop never calls ``step`` on an overflow). Finite: torch's
        fused path, as always."""
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        flags = list(state["found_inf_per_device"].values())
        overflow = any(bool(f.item() > 0) for f in flags)
        if not overflow:
            return super().step(optimizer, *args, **kwargs)
        self._found_read[id(optimizer)] = True
        state["stage"] = OptState.STEPPED
        return None

    def _verified_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """The first ``step``, checked once (docs/versions.md): a finite step must run ``optimizer.step``
        (seen by a public step post-hook, removed right after), else torch's ``GradScaler`` changed
        under ampbridge's overrides and training would silently not update: raises
        :class:`ampbridge.errors.UnsupportedOptionError` naming the torch version. No extra host
        sync when the step ran; a step skipped for an overflow proves nothing (the next is checked)."""
        # a wrapper (accelerate's AcceleratedOptimizer: an Optimizer subclass that never ran its
        # __init__, so it has no hook lists) steps the torch optimizer it holds: observe that one
        inner = getattr(optimizer, "optimizer", None)
        register = getattr(inner if isinstance(inner, torch.optim.Optimizer) else optimizer,
                           "register_step_post_hook", None)
        if register is None:  # not a torch.optim.Optimizer: nothing to observe
            self._step_verified = True
            return self.step(optimizer, *args, **kwargs)
        ran: list[bool] = []
        handle = register(lambda *_: ran.append(True))
        self._step_verified = True
        try:
            out = self.step(optimizer, *args, **kwargs)
        except BaseException:
            self._step_verified = False
            raise
        finally:
            handle.remove()
        if ran:
            return out
        overflow = self._found_read.get(id(optimizer))
        if overflow is None and self._enabled and self.config.skip_nonfinite:
            flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            overflow = any(bool(f.item()) for f in flags)
        self._step_verified = False
        if overflow:
            return out
        raise UnsupportedOptionError(
            f"ampbridge.torch.GradScaler: a finite step did not run optimizer.step on torch "
            f"{torch.__version__}, so training would not update the weights; ampbridge supports "
            f"{tested_range('torch')}")

    def _fused_step_applying_all(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # torch's fused branch, except the optimizer is told nothing overflowed: skip_nonfinite = false
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        scale = self._get_scale_async()
        optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is OptState.UNSCALED
                                else scale * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            state["stage"] = OptState.STEPPED
            del optimizer.grad_scale, optimizer.found_inf

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the loss-scale state by one step (the reference ``next_state``)."""
        if not self._enabled:  # mode none without skipping: only the step counter moves
            if self.observer is not None:
                self.observer.on_step(StepRecord(self._host_steps, None, None, None, False))
            self._host_steps += 1
            self._last_result = _APPLIED
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [f.to(device=scale.device, non_blocking=True)
                      for s in self._per_optimizer_states.values() for f in s["found_inf_per_device"].values()]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_flag = found_infs[0]
        for f in found_infs[1:]:
            found_flag = found_flag + f
        read = [self._found_read.get(i) for i in self._per_optimizer_states]
        known = None if any(r is None for r in read) else any(read)
        skip = self.config.skip_nonfinite and not getattr(self, "_applied_anyway", False)
        if self.observer is not None:  # before the scale moves: the log holds the scale this step used
            self.observer.on_step(StepRecord(self._steps, found_flag, known, scale, skip))
        if self._needs_min_check():
            if known is not None and self._at_min_read is not None:
                hit = known and self._at_min_read
            else:
                hit = bool(((found_flag > 0) & self._at_min()).item())  # the documented extra sync
            if hit:
                self._on_min_scale()
        if self.config.mode == "dynamic":
            if self._native_update:
                torch._amp_update_scale_(scale, tracker, found_flag, self._growth_factor, self._backoff_factor,
                                         self._growth_interval)
            else:
                self._update_dynamic(scale, tracker, found_flag)
        assert self._skipped is not None and self._streak is not None
        self._steps += 1
        limit = self.config.max_consecutive_skips
        skipped_flag = found_flag
        if limit is not None:  # skipped: non-finite with fewer than `limit` skipped in a row before it
            skipped_flag = (found_flag > 0) & (self._streak < limit)
            bump = (self._streak < INT32_MAX).to(torch.int32)  # saturates, as optax's safe_increment
            self._streak.copy_(torch.where(found_flag > 0, self._streak + bump, torch.zeros_like(self._streak)))
        if self.config.skip_nonfinite:
            # one optimizer on one device: found_inf is exactly 0.0 or 1.0
            self._skipped.add_(skipped_flag if len(found_infs) == 1 or limit is not None else (found_flag > 0))
        if known is not None:
            self._last_result = _SKIPPED if known and skip else _APPLIED
        else:
            self._last_result = StepResult(skipped_flag) if skip else _APPLIED
        self._applied_anyway = False
        self._found_read.clear()
        self._at_min_read = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _on_min_scale(self) -> None:
        steps = self.loss_scale_state().steps
        if self.config.on_min_scale == "error":
            self._found_read.clear()
            self._at_min_read = None
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            raise LossScaleError(f"loss scale overflowed at min_scale={self.config.min_scale} (step {steps}); "
                                 "on_min_scale='error' stops the run")
        warnings.warn(f"loss scale is stuck at min_scale={self.config.min_scale} and gradients still overflow "
                      f"(step {steps})", AmpBridgeWarning, stacklevel=3)
        self._warned = True

    def _update_dynamic(self, scale: torch.Tensor, tracker: torch.Tensor, found_flag: torch.Tensor) -> None:
        cfg = self.config
        hyst = self._hysteresis_left
        assert hyst is not None
        found = found_flag > 0
        back_off = found & (hyst <= 1)
        good = torch.where(found, torch.full_like(tracker, getattr(self, "_restart", 0)), tracker + 1)
        grow = (~found) & (good == cfg.growth_interval)
        if cfg.consecutive_hysteresis:
            refill = torch.full_like(hyst, cfg.hysteresis)
            new_hyst = torch.where(found, torch.where(back_off, hyst, hyst - 1), refill)
        else:
            new_hyst = torch.where(grow, torch.full_like(hyst, cfg.hysteresis),
                                   torch.where(found & ~back_off, hyst - 1, hyst))
        backed = scale * self._backoff_factor  # float32 * float32 value: the reference's f32 product
        if self._min is not None:
            backed = torch.clamp_min(backed, self._min)
        grown = scale * self._growth_factor
        finite = torch.isfinite(grown)
        if self._max is not None:
            grown = torch.clamp_max(grown, self._max)
        grown = torch.where(finite, grown, scale)
        scale.copy_(torch.where(back_off, backed, torch.where(grow, grown, scale)))
        tracker.copy_(torch.where(grow, torch.zeros_like(good), good))
        hyst.copy_(new_hyst)

    @property
    def last_step_result(self) -> "StepResult":
        """Whether the last optimizer step was applied (reading it may sync; see :class:`StepResult`)."""
        return self._last_result

    # state

    def loss_scale_state(self) -> LossScaleState:
        """The five reference fields (reads the device: a sync)."""
        if not self._enabled:
            h = self._host_state
            return LossScaleState(1.0, 0, h.hysteresis_left, self._host_steps, h.skipped, h.nonfinite_streak)
        if self._scale is None:
            return self._pending
        assert self._growth_tracker is not None and self._hysteresis_left is not None
        assert self._skipped is not None and self._streak is not None
        return LossScaleState(float(self._scale.item()), int(self._growth_tracker.item()),
                              int(self._hysteresis_left.item()), self._steps, int(self._skipped.item()),
                              int(self._streak.item()))

    def load_loss_scale_state(self, state: LossScaleState) -> None:
        """Set the reference fields."""
        if self.config.mode == "none":
            state = LossScaleState(1.0, 0, state.hysteresis_left, state.steps, state.skipped, state.nonfinite_streak)
        elif self.config.mode == "static":
            state = LossScaleState(f32(self.config.initial_scale), 0, state.hysteresis_left, state.steps,
                                   state.skipped, state.nonfinite_streak)
        self._host_state = self._pending = state
        self._steps = self._host_steps = state.steps
        self._init_scale, self._init_growth_tracker = state.scale, state.good_steps
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            assert self._skipped is not None
            self._scale.fill_(state.scale)
            self._growth_tracker.fill_(state.good_steps)
            self._hysteresis_left.fill_(state.hysteresis_left)
            self._skipped.fill_(state.skipped)
            assert self._streak is not None
            self._streak.fill_(state.nonfinite_streak)

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, factors, interval, ``_growth_tracker``) plus ampbridge's."""
        s = self.loss_scale_state()
        return {"scale": s.scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": s.good_steps,
                "hysteresis_left": s.hysteresis_left, "steps": s.steps, "skipped": s.skipped,
                "nonfinite_streak": s.nonfinite_streak, "mode": self.config.mode}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ours or a plain ``torch.amp.GradScaler`` state dict (missing fields: their start values).

        The policy's factors and interval win over the checkpoint's; a difference is warned about.
        """
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        if "scale" not in state_dict:
            raise ValueError(f"not a loss-scaler state dict: needs at least 'scale'; got keys {sorted(state_dict)}")
        for key, mine in (("growth_factor", self._growth_factor), ("backoff_factor", self._backoff_factor),
                          ("growth_interval", self._growth_interval)):
            if key in state_dict and state_dict[key] != mine:
                warnings.warn(f"checkpoint's {key}={state_dict[key]!r} differs from the policy's {mine!r}; "
                              "the policy's is used", AmpBridgeWarning, stacklevel=2)
        start = initial_state(self.config)
        self.load_loss_scale_state(LossScaleState(
            float(state_dict["scale"]), int(state_dict.get("_growth_tracker", 0)),
            int(state_dict.get("hysteresis_left", start.hysteresis_left)), int(state_dict.get("steps", 0)),
            int(state_dict.get("skipped", 0)), int(state_dict.get("nonfinite_streak", 0))))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled and self._per_optimizer_states:
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of an iteration, "
                                 "or at the end after scaler.update().")
        pending = state["_pending"] = self.loss_scale_state()
        # torch's get_scale() and lazy init read these while the tensors are not yet re-created
        state["_init_scale"], state["_init_growth_tracker"] = pending.scale, pending.good_steps
        state["observer"] = None  # a log file stays with its process
        state["_agree_group"] = None  # a process group stays with its process: call agree_across again
        for name in ("_scale", "_growth_tracker", "_hysteresis_left", "_skipped", "_streak"):
            state[name] = None
        state["_last_result"] = _APPLIED
        return state

    def reconfigure(self, config: LossScaleConfig, *, compute_dtype: str = "float16", reset: bool = False,
                    allow_fp16_grads: bool | None = None) -> None:
        """Switch to another phase's settings; the state moves by the core's rule (``enter_phase``,
        the same in every backend): carried between dynamic phases, fresh on ``reset`` or a mode change.
        ``allow_fp16_grads``: the new phase stores parameters in float16 (None: unchanged)."""
        if allow_fp16_grads is not None:
            self._allow_fp16_grads = allow_fp16_grads
        new = config.resolve(compute_dtype)
        state = enter_phase(new, self.loss_scale_state(), previous=self.config, reset=reset)
        self._configure(new)
        self._warned = False
        self.load_loss_scale_state(state)


def _fused_sgd_unbuffered(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's fused SGD with momentum and no momentum buffer yet (its next
    step is the one whose kernel takes the buffers' "first step" branch)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(group.get("fused") and group["momentum"] != 0
               and all("momentum_buffer" not in optimizer.state.get(p, ()) for p in group["params"])
               for group in optimizer.param_groups)


class StepResult:
    """Whether an optimizer step was applied; truthiness reads the device only when needed.

    On the ordinary path the answer is already on the host (``scaler.step`` read it); after a
    fused optimizer (or several devices) ``bool(result)`` costs one sync, so a loop that ignores
    the result keeps torch's no-sync path. ``accumulating``: ``amp.step(..., accumulate=N)`` only
    ran the backward (no step was due); ``grad_norm``: the norm ``clip_grad_norm`` measured (a
    tensor, before clipping; None without clipping).
    """

    __slots__ = ("_value", "accumulating", "grad_norm")

    def __init__(self, value: bool | torch.Tensor, *, accumulating: bool = False,
                 grad_norm: torch.Tensor | None = None):
        self._value = value
        self.accumulating = accumulating
        self.grad_norm = grad_norm

    def with_grad_norm(self, norm: torch.Tensor) -> "StepResult":
        """This result carrying ``norm`` (a new object: the shared constants stay as they are)."""
        return StepResult(self._value, grad_norm=norm)

    def __bool__(self) -> bool:
        if isinstance(self._value, torch.Tensor):
            self._value = not bool(self._value.item() > 0)
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return "StepResult(accumulating)" if self.accumulating else f"StepResult({bool(self)})"


_APPLIED, _SKIPPED = StepResult(True), StepResult(False)
