"""The monitor's float8 readers on torch: per float8 layer, a step's amaxes, the scales it used and
saturation (``ampbridge.diagnostics.runlog.Fp8TensorStats``).

- **torchao** ``Float8Linear`` (current scaling) keeps nothing between steps, so the monitor
  computes the amaxes itself, on the steps it records only: :class:`CurrentScalingProbe` puts a
  forward hook on each ``Float8Linear`` before such a step (the input as torchao casts it under
  autocast, the weight, and a hook on the output for the output gradient: one ``max(abs(x))``
  each) and takes them off after it; other steps run no hook. The scale is torchao's
  ``amax_to_scale`` as :func:`ampbridge.core.fp8.current_scale` computes it (``fp8_max / amax``, the
  amax floored at 1e-12), and torchao multiplies in float32 (``x * scale``, clamped to the max):
  with margin 0 only a rounding step (or a non-finite amax) goes beyond the max.
- **delayed scaling modules** with public buffers ``input_divisor``/``input_amax_history``,
  ``weight_*``, ``grad_output_*`` (ampbridge's own delayed float8 linear): :func:`delayed_stats`
  reads them after the step; such a module quantizes step t with the divisor it computes at step t
  (Flax's timing), which is the one stored after it, and the history's first entry is step t's amax.

Example:
    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> for name in ("input", "weight", "grad_output"):
    ...     m.register_buffer(f"{name}_divisor", torch.tensor(1.0))
    ...     m.register_buffer(f"{name}_amax_history", torch.tensor([900.0, 1.0]))
    >>> stats = delayed_stats(m)
    >>> stats["input"].saturated, stats["grad_output"].saturated
    (True, False)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ...core.fp8 import FP8_MAX, current_scale
from ...diagnostics.runlog import FP8_TENSORS, Fp8TensorStats

_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def is_delayed(module: nn.Module) -> bool:
    """Whether ``module`` keeps delayed-scaling state as public buffers (``input_divisor``, ...)."""
    buffers = dict(module.named_buffers(recurse=False))
    return all(f"{t}_divisor" in buffers and f"{t}_amax_history" in buffers for t in FP8_TENSORS)


def is_torchao(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (found by name: torchao stays an optional import)."""
    return type(module).__name__ == "Float8Linear" and hasattr(module, "config")


def _delayed_formats(module: nn.Module) -> tuple[str, str, str]:
    forward, backward = getattr(module, "forward_format", "e4m3"), getattr(module, "backward_format", "e5m2")
    return forward, forward, backward


def delayed_stats(module: nn.Module) -> dict[str, Fp8TensorStats]:
    """A delayed-scaling module's record of the step just run, from its buffers (one host read)."""
    values = torch.stack([getattr(module, f"{t}_amax_history").reshape(-1)[0].float() for t in FP8_TENSORS]
                         + [getattr(module, f"{t}_divisor").reshape(()).float() for t in FP8_TENSORS]).tolist()
    return {t: Fp8TensorStats(amax=values[i], scale=values[3 + i], scale_op="divide", fp8_max=FP8_MAX[fmt])
            for i, (t, fmt) in enumerate(zip(FP8_TENSORS, _delayed_formats(module)))}


def _torchao_formats(module: nn.Module) -> tuple[str, str, str]:
    c = module.config
    return tuple(_FORMATS[cfg.target_dtype] for cfg in (  # type: ignore[return-value]
        c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output))


class CurrentScalingProbe:
    """Hooks on torchao ``Float8Linear`` modules for one recorded step: the amax of each float8
    tensor as torchao computes it, kept on the device until :meth:`take`.

    Example:
        >>> probe = CurrentScalingProbe({})
        >>> probe.take()
        {}
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self._amax: dict[str, dict[str, torch.Tensor]] = {}
        self._handles = [m.register_forward_hook(functools.partial(self._forward, path)) for path, m in modules.items()]

    def _forward(self, path: str, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return  # an evaluation forward: not the training step's
        x = args[0]
        if torch.is_autocast_enabled():  # as Float8Linear.forward casts its input
            x = x.to(torch.get_autocast_dtype("cuda"))  # torchao: get_autocast_gpu_dtype(), deprecated
        with torch.no_grad():
            self._amax[path] = {"input": x.detach().abs().max(), "weight": module.weight.detach().abs().max()}
        out.register_hook(functools.partial(self._grad_output, path))

    def _grad_output(self, path: str, grad: torch.Tensor) -> None:
        if path in self._amax:
            self._amax[path]["grad_output"] = grad.detach().abs().max()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> dict[str, dict[str, Fp8TensorStats]]:
        """The step's records (one host read), and the hooks removed."""
        self.remove()
        names = [(p, t) for p, tensors in self._amax.items() for t in FP8_TENSORS if t in tensors]
        if not names:
            return {}
        values = torch.stack([self._amax[p][t].float() for p, t in names]).tolist()
        out: dict[str, dict[str, Fp8TensorStats]] = {}
        for (path, t), amax in zip(names, values):
            fmt = _torchao_formats(self.modules[path])[FP8_TENSORS.index(t)]
            out.setdefault(path, {})[t] = Fp8TensorStats(amax=amax, scale=current_scale(amax, fmt),
                                                         scale_op="multiply", fp8_max=FP8_MAX[fmt])
        return out


def float8_modules(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """(torchao Float8Linear modules, delayed-scaling modules) of ``model``, by path."""
    torchao, delayed = {}, {}
    for path, m in model.named_modules():
        if is_torchao(m):
            torchao[path] = m
        elif is_delayed(m):
            delayed[path] = m
    return torchao, delayed
