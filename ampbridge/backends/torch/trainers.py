"""The trainers people use, running ampbridge's Plan and scaler (not a second AMP): the Hugging
Face ``Trainer`` (``hf_trainer``, ``HFTrainerMixin``), Lightning's Trainer (``lightning_precision``)
and Fabric (``fabric_precision``).
Accelerate's own loop needs no adapter: ``amp.step(loss, optimizer, clip_grad_norm=...,
accumulate=...)`` drives an ``accelerator.prepare``'d optimizer (docs/torch.md, "Trainers").

transformers, accelerate and lightning are imported when one of these is first used.

Holds ``hf_trainer``, ``HFTrainerMixin``, ``lightning_precision``, ``fabric_precision`` and the
lazily built classes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.policy import Policy
from ...errors import BackendUnavailableError
from .apply import TorchAmp, apply


def _import(module: str, user: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise BackendUnavailableError(f"ampbridge.torch.{user} needs {top!r}, which is not installed ({e}); "
                                      f"install it: pip install {top.replace('_', '-')}") from e


# --- Hugging Face Trainer ----------------------------------------------------------------------


def _unwrap_optimizer(optimizer: Any) -> Any:
    # Accelerate's AcceleratedOptimizer keeps the torch optimizer as .optimizer; the scaler's
    # per-optimizer state is keyed by the torch optimizer, which AcceleratedOptimizer.step hands it
    accelerate = _import("accelerate.optimizer", "hf_trainer")
    while isinstance(optimizer, accelerate.AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _applied(model: nn.Module, policy: Policy | str | Path | TorchAmp, device_type: str) -> TorchAmp:
    if isinstance(policy, TorchAmp):
        if policy.model is not model:
            raise ValueError("the TorchAmp given as policy was applied to another model than the one given; pass the "
                             "policy itself, or amp.model as the model")
        return policy
    return apply(model, policy, device_type=device_type)


class HFTrainerMixin:
    """Mixed in before a ``transformers.Trainer`` class: the model runs the policy's Plan, and the
    Trainer's Accelerator uses ``amp.scaler`` (backward scaled, step skipped on overflow, scale
    moved, saved and resumed as the Trainer's ``scaler.pt``).

    On top of the Trainer's own loop it unscales the gradients once per optimizer step, before
    ``max_grad_norm`` clipping (so the clip and the logged ``grad_norm`` see true gradients, with
    fused optimizers too), and tells Accelerate which steps were skipped so the learning-rate
    scheduler does not advance on them (Accelerate finds out by whether the optimizer's ``step``
    ran, which a fused optimizer's always does). ``gradient_accumulation_steps`` work as in the
    Trainer (one scale for the micro-batches, one unscale, one update per optimizer step). A
    ``[[phase]]`` schedule follows the Trainer's global step and epoch.

    ``TrainingArguments(fp16=True)`` / ``bf16=True`` and DeepSpeed are refused (Accelerate would run
    its own autocast and scaler, DeepSpeed its own loss scaling: see ``ampbridge.recipes``).
    ``self.amp`` is the applied :class:`TorchAmp`. Use it as ``class MyTrainer(HFTrainerMixin,
    SFTTrainer)``, or :func:`hf_trainer`. The first positional argument is the model; ``policy=``
    is a Policy, a preset name, a file, or a :class:`TorchAmp` already applied to that model.
    """

    amp: TorchAmp

    def __init__(self, model: nn.Module | None = None, args: Any = None, *trainer_args: Any,
                 policy: Policy | str | Path | TorchAmp, **kwargs: Any):
        if model is None or kwargs.get("model_init") is not None:
            raise ValueError("ampbridge's Trainer needs the model itself (model=...), not model_init: the policy is "
                             "applied to it once, before training")
        super().__init__(model, args, *trainer_args, **kwargs)  # type: ignore[call-arg]
        self_: Any = self
        targs = self_.args
        if targs.fp16 or targs.bf16 or self_.accelerator.mixed_precision != "no":
            raise ValueError(f"TrainingArguments(fp16={targs.fp16}, bf16={targs.bf16}) (Accelerate's mixed_precision="
                             f"{self_.accelerator.mixed_precision!r}) asks Accelerate for its own autocast and "
                             "GradScaler: the policy already runs them; leave fp16 and bf16 False")
        if self_.is_deepspeed_enabled:
            raise ValueError("DeepSpeed runs its own loss scaling and precision: give it ampbridge's DeepSpeed config "
                             "(ampbridge convert --to deepspeed, or ampbridge.recipes) instead of this Trainer")
        self.amp = _applied(self_.model, policy, targs.device.type)
        # public attribute, read by accelerator.backward (scaler.scale(loss).backward()), by prepare
        # (the AcceleratedOptimizer's step: scaler.step + update) and by the Trainer's scaler.pt
        self_.accelerator.scaler = self.amp.scaler
        self_.add_callback(_hf_callback_class()(self))

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step (forward, scaled backward); on the last micro-batch of an optimizer step,
        ``amp.scaler.unscale_`` too, before the Trainer clips (torch.amp's documented order)."""
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        self_: Any = self
        if self_.accelerator.sync_gradients:
            self.amp.scaler.unscale_(_unwrap_optimizer(self_.optimizer))
        return loss


@functools.cache
def _hf_callback_class() -> type:
    transformers = _import("transformers", "hf_trainer")

    class _AmpCallback(transformers.TrainerCallback):
        """Skipped steps told to Accelerate; the Trainer's position told to a ``[[phase]]`` schedule."""

        def __init__(self, trainer: Any):
            self.trainer = trainer

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            skipped = not bool(self.trainer.amp.scaler.last_step_result)  # a fused optimizer: one read
            for opt in self.trainer.accelerator._optimizers:  # private: accelerate 1.16's list of prepared optimizers
                opt._is_overflow = skipped  # private: what AcceleratedOptimizer.step_was_skipped reads (1.16)

        def _position(self, state: Any) -> None:
            amp = self.trainer.amp
            if amp.policy.phases:
                optimizers = [_unwrap_optimizer(self.trainer.optimizer)] if self.trainer.optimizer is not None else []
                amp.set_step(int(state.global_step), optimizers)
                amp.set_epoch(int(state.epoch or 0), optimizers)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._position(state)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._position(state)

    return _AmpCallback


@functools.cache
def _trainer_class(base: type) -> type:
    return type(f"Amp{base.__name__}", (HFTrainerMixin, base), {"__module__": __name__})


def hf_trainer(model: nn.Module, policy: Policy | str | Path | TorchAmp, args: Any = None, *,
               trainer_class: type | None = None, **kwargs: Any) -> Any:
    """A ``transformers.Trainer`` (or ``trainer_class``, e.g. trl's ``SFTTrainer``) training
    ``model`` under ``policy`` with ampbridge's scaler: see :class:`HFTrainerMixin`.

    ``args`` and ``kwargs`` go to the Trainer as they are (``train_dataset``, ``data_collator``...).
    The policy is applied after the Trainer placed the model (autocast on ``args.device``).

    Example (needs transformers; not run here)::

        trainer = ampbridge.torch.hf_trainer(model, "amp.toml", TrainingArguments("out"), train_dataset=ds)
        trainer.train()  # trainer.amp.scaler.get_scale(), trainer.amp.plan
    """
    base = trainer_class if trainer_class is not None else _import("transformers", "hf_trainer").Trainer
    return _trainer_class(base)(model, args, policy=policy, **kwargs)


# --- Lightning ---------------------------------------------------------------------------------


def _attached_trainer(module: nn.Module) -> Any:
    try:  # a LightningModule's trainer raises when it is not attached to one
        return getattr(module, "trainer", None)
    except RuntimeError:
        return None


class _AmpPrecisionHooks:
    """The hooks of ampbridge's Lightning ``Precision`` plugin (see :func:`lightning_precision`);
    a mixin because ``Precision`` itself is imported only when the plugin is first built."""

    precision = "ampbridge"  # Lightning's label (logs, checkpoints' hyper-parameters)

    def __init__(self, policy: Policy | str | Path | TorchAmp, device_type: str | None = None):
        self.policy, self.device_type = policy, device_type
        self.amp: TorchAmp | None = policy if isinstance(policy, TorchAmp) else None
        self._pending_state: dict[str, Any] | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.amp is not None and self.amp.model is module:  # fit, then validate: applied once
            return module
        trainer = _attached_trainer(module)
        device_type = self.device_type or (trainer.strategy.root_device.type if trainer is not None else None)
        self.amp = _applied(module, self.policy, device_type or "cpu")
        if self._pending_state is not None:
            self.amp.load_state_dict(self._pending_state)
            self._pending_state = None
        return module

    def _require_amp(self) -> TorchAmp:
        if self.amp is None:
            raise RuntimeError("ampbridge's Precision plugin has no model yet: Lightning calls convert_module first "
                               "(pass it to Trainer(plugins=[...]))")
        return self.amp

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # the model-wide region around the step (the loss too), as Lightning's MixedPrecision;
        # the model's own forward enters it again (and its pinned regions)
        amp = self._require_amp()
        if amp.policy.phases:
            trainer = _attached_trainer(amp.model)
            if trainer is not None and trainer.training:
                amp.set_step(int(trainer.global_step), [o for o in trainer.optimizers])
                amp.set_epoch(int(trainer.current_epoch), [o for o in trainer.optimizers])
        with amp.autocast():
            yield

    def autocast_context_manager(self) -> Any:
        """The policy's model-wide autocast region, as Lightning's ``MixedPrecision`` offers it
        (its own plugin tests and user code enter it directly)."""
        return self._require_amp().autocast()

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return super().pre_backward(self._require_amp().scaler.scale(tensor), module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        scaler = self._require_amp().scaler
        closure_result = closure()
        # a training_step that returned None ran no backward: nothing to unscale or step
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            # before Lightning's clipping hooks; a fused optimizer then gets found_inf only (torch's
            # UNSCALED path), so clipping works with fused optimizers too
            scaler.unscale_(optimizer)
        # private: Lightning's own MixedPrecision calls it here (lightning 2.6.6): the
        # on_before_optimizer_step hooks, then the Trainer's gradient clipping
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = scaler.step(optimizer, **kwargs)
        scaler.update()
        return out

    def unscale_gradients(self, optimizer: Any) -> None:
        self._require_amp().scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.amp.state_dict() if self.amp is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.amp is None:  # restored before convert_module: applied then
            self._pending_state = dict(state_dict)
        else:
            self.amp.load_state_dict(state_dict)


@functools.cache
def _lightning_class(package: str) -> type:
    precision = _import(f"{package}.plugins.precision", "lightning_precision")

    class AmpPrecision(_AmpPrecisionHooks, precision.Precision):  # type: ignore[misc, name-defined]
        """Lightning's ``Precision`` plugin for ampbridge (see :func:`lightning_precision`)."""

    return AmpPrecision


@functools.cache
def _fabric_class() -> type:
    precision = _import("lightning.fabric.plugins.precision", "fabric_precision")

    class AmpFabricPrecision(precision.Precision):  # type: ignore[misc, name-defined]
        """Lightning Fabric's ``Precision`` plugin for ampbridge (see :func:`fabric_precision`)."""

        precision = "ampbridge"

        def __init__(self, policy: Policy | str | Path | TorchAmp, device_type: str):
            self.policy, self.device_type = policy, device_type
            self.amp: TorchAmp | None = policy if isinstance(policy, TorchAmp) else None

        def convert_module(self, module: nn.Module) -> nn.Module:
            if self.amp is None or self.amp.model is not module:
                self.amp = _applied(module, self.policy, self.device_type)
            return module

        def _require_model(self) -> TorchAmp:
            if self.amp is None:
                raise RuntimeError("ampbridge's Fabric plugin has no model yet: call fabric.setup(model, ...) first")
            return self.amp

        def _scaler(self) -> Any:
            return self._require_model().scaler

        def forward_context(self) -> Any:
            return self.amp.autocast() if self.amp is not None else contextlib.nullcontext()

        def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
            self._scaler().scale(tensor).backward(*args, **kwargs)

        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            scaler = self._scaler()
            out = scaler.step(optimizer, **kwargs)
            scaler.update()
            return out

        def unscale_gradients(self, optimizer: Any) -> None:  # fabric.clip_gradients calls it first
            self._scaler().unscale_(optimizer)

        def state_dict(self) -> dict[str, Any]:
            return self.amp.state_dict() if self.amp is not None else {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if state_dict:
                self._require_model().load_state_dict(state_dict)

    return AmpFabricPrecision


def fabric_precision(policy: Policy | str | Path | TorchAmp, device_type: str) -> Any:
    """A Lightning Fabric ``Precision`` plugin that applies ``policy`` in ``fabric.setup(model, ...)``
    and trains with ampbridge's scaler: ``Fabric(accelerator="cuda", plugins=[fabric_precision("amp.toml",
    "cuda")])``. ``device_type`` is required (the plugin sees the model before Fabric moves it).

    ``fabric.backward(loss)`` scales, ``fabric.clip_gradients(model, opt, max_norm=...,
    error_if_nonfinite=False)`` unscales then clips (an overflow step has a non-finite norm: Fabric's
    default raises on it), ``optimizer.step()`` skips on overflow and updates the scale; steps run
    in ``amp.autocast()``; the plugin's ``state_dict`` is ``amp.state_dict()``. Skipped steps are
    ``not plugin.amp.scaler.last_step_result``: step your schedulers only after applied ones.

    Example (needs lightning; not run here)::

        fabric = lightning.Fabric(accelerator="cpu", plugins=[ampbridge.torch.fabric_precision("amp.toml", "cpu")])
    """
    return _fabric_class()(policy, device_type)


def lightning_precision(policy: Policy | str | Path | TorchAmp, *, device_type: str | None = None,
                        package: str = "lightning.pytorch") -> Any:
    """A Lightning ``Precision`` plugin that applies ``policy`` to the LightningModule and trains it
    with ampbridge's scaler: ``lightning.Trainer(plugins=[ampbridge.torch.lightning_precision("amp.toml")])``.

    Leave the Trainer's ``precision`` at its default (the plugin is the precision). The step runs
    inside ``amp.autocast()`` (the loss too, as Lightning's ``MixedPrecision``); gradients are
    unscaled before Lightning's ``gradient_clip_val`` clipping, fused optimizers included (which
    ``MixedPrecision`` refuses); the loss-scale state and schedule position are the plugin's
    checkpoint state. ``device_type``: where autocast runs (default: the strategy's root device).
    ``package``: ``"pytorch_lightning"`` for the standalone package's Trainer. Lightning steps its
    schedulers after a skipped step too (as with its own ``MixedPrecision``). Fabric's plugins have
    other signatures (``backward(tensor, model)``, ``optimizer_step(optimizer)``): this object is for
    the Trainer only; Fabric's is :func:`fabric_precision`.

    Example (needs lightning; not run here)::

        trainer = lightning.Trainer(max_steps=100, plugins=[ampbridge.torch.lightning_precision("amp.toml")])
    """
    return _lightning_class(package)(policy, device_type)
