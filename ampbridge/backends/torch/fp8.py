"""FP8 on torch: the ``[fp8]`` table realised with torchao's ``Float8Linear`` (current scaling) or
ampbridge's own :class:`~.fp8_delayed.DelayedFloat8Linear` (delayed scaling: torchao has none).

Under ``scaling = "current"`` the layers the Plan marks float8 are swapped by torchao's own
``convert_to_float8_training(model, module_filter_fn=..., config=Float8LinearConfig(...))`` (the same
``Parameter`` objects move into the new modules, so optimizers keep working); torchao's tensorwise
dynamic scaling is the reference's *current* scaling (:mod:`ampbridge.core.fp8`). Off CUDA, and on
GPUs below compute capability 8.9, ``emulate=True``: the float8 casts are real, the matmul runs in
the high-precision dtype on the dequantised values.

Under ``scaling = "delayed"`` each such layer becomes a ``DelayedFloat8Linear`` holding the same
parameters (:mod:`.fp8_delayed`: ``core.fp8``'s delayed scaling on torch's float8 dtypes, its state
in buffers, always emulated: no float8 GEMM); torchao is not needed.

Refused by name: ``margin`` other than 0 under current scaling (torchao's scale has none), and a
matched layer that is not a ``torch.nn.Linear``. A phase that changes ``[fp8]`` swaps the layers in
or out (or rebuilds them with fresh state where a setting changed) when it comes into force.

Holds ``realised_by``, ``mark_rows``, ``check``, ``sync``, ``realise`` and ``float8_config``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...core.plan import Plan
from ...diagnostics.doctor import float8_support
from ...diagnostics.hardware import Device
from ...core.policy import Fp8Config, Policy
from ...errors import BackendUnavailableError, UnsupportedOptionError
from .fp8_delayed import DelayedFloat8Linear

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _emulated(device_type: str) -> bool:
    """No float8 matmul units: the rule ``ampbridge doctor`` reports (``float8_support``)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return True
    device = Device("cuda", capability=tuple(torch.cuda.get_device_capability()))
    return not float8_support(device).startswith("native")


#: ampbridge's delayed scaling multiplies the dequantised values (no torch._scaled_mm) on every device
DELAYED_BY = "ampbridge delayed scaling (emulated)"


def realised_by(device_type: str, scaling: str = "current") -> str:
    """The machinery a float8 row runs on, for the Plan row's ``fp8_by``."""
    if scaling == "delayed":
        return DELAYED_BY
    return "torchao Float8Linear" + (" (emulated)" if _emulated(device_type) else "")


def mark_rows(plan: Plan, device_type: str) -> Plan:
    """``plan`` with each float8 row's ``fp8_by`` filled in."""
    if not any(r.fp8 for r in plan.rows):
        return plan
    by = realised_by(device_type, next(r.fp8_scaling for r in plan.rows if r.fp8))
    return replace(plan, rows=tuple(replace(r, fp8_by=by) if r.fp8 else r for r in plan.rows))


def check(policy: Policy, plan: Plan, model: nn.Module) -> None:
    """Refuse, by name, what torchao (current) or ampbridge's delayed layer cannot carry (before anything
    is changed)."""
    fp8 = policy.fp8
    if not fp8.enabled:
        return
    who = "torchao converts" if fp8.scaling == "current" else "ampbridge's delayed scaling replaces"
    if fp8.scaling == "current" and fp8.margin != 0:
        raise UnsupportedOptionError(
            f"fp8.margin = {fp8.margin} is not realised on torch under current scaling: torchao's scale is "
            f'fp8_max / amax with no margin; write margin = 0 (or scaling = "delayed", which honours it)')
    modules = dict(model.named_modules())
    if plan.rows and plan.rows[0].path == "" and plan.rows[0].fp8:
        raise UnsupportedOptionError(f"fp8.match matches the model itself; {who} the Linear layers "
                                     "inside a model: wrap it in a container, or match the layers")
    for row in plan.rows:
        if row.fp8 and not isinstance(modules.get(row.path), nn.Linear):
            raise UnsupportedOptionError(
                f"fp8.match puts {row.path or '(root)'!r} ({row.class_name}) in float8, but {who} "
                f"torch.nn.Linear layers only; match the Linear layers (kind:linear or their paths)")


def float8_config(fp8: Fp8Config, device_type: str) -> Any:
    """The ``Float8LinearConfig`` that realises ``fp8`` (torchao imported here, on demand)."""
    try:
        from torchao.float8 import CastConfig, Float8LinearConfig
    except ImportError as e:
        raise BackendUnavailableError(f"the [fp8] table needs torchao on torch ({e}); install the "
                                      f"'ampbridge[torch-fp8]' extra") from None
    forward, backward = _FORMATS[fp8.forward], _FORMATS[fp8.backward]
    return Float8LinearConfig(cast_config_input=CastConfig(target_dtype=forward),
                              cast_config_weight=CastConfig(target_dtype=forward),
                              cast_config_grad_output=CastConfig(target_dtype=backward),
                              emulate=_emulated(device_type))


def realise(model: nn.Module, policy: Policy, realisation: Any, device_type: str) -> Any:
    """Swap the Plan's float8 rows to torchao's Float8Linear (and back where a phase ends FP8);
    returns the realisation with the rows' ``fp8_by`` filled in."""
    sync(model, policy, realisation.plan, device_type)
    return replace(realisation, plan=mark_rows(realisation.plan, device_type))


def _plain_linear(module: nn.Linear) -> nn.Linear:
    """A ``torch.nn.Linear`` holding ``module``'s own parameters (undoing a float8 swap)."""
    with torch.device("meta"):
        plain = nn.Linear(module.in_features, module.out_features, bias=False)
    plain.weight, plain.bias = module.weight, module.bias
    plain.train(module.training)
    return plain


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _delayed_settings(fp8: Fp8Config) -> dict[str, Any]:
    return {"forward": fp8.forward, "backward": fp8.backward, "amax_history": fp8.amax_history,
            "amax_compute": fp8.amax_compute, "margin": fp8.margin}


def sync(model: nn.Module, policy: Policy, plan: Plan, device_type: str) -> None:
    """Make the model's Linear layers float8 exactly where ``plan`` says (swap in, out, or re-config);
    a delayed layer whose settings are unchanged keeps its state."""
    check(policy, plan, model)
    wanted = {r.path for r in plan.rows if r.fp8}
    delayed = policy.fp8.scaling == "delayed"
    settings = _delayed_settings(policy.fp8)
    for path, module in list(model.named_modules()):
        if isinstance(module, DelayedFloat8Linear) and (path not in wanted or not delayed
                                                        or module.settings != settings):
            _set(model, path, _plain_linear(module))
    _sync_torchao(model, policy, set() if delayed else wanted, device_type)
    if delayed:
        for path, module in list(model.named_modules()):
            if path in wanted and not isinstance(module, DelayedFloat8Linear):
                _set(model, path, DelayedFloat8Linear.from_linear(module, **settings))


def _sync_torchao(model: nn.Module, policy: Policy, wanted: set[str], device_type: str) -> None:
    """torchao's Float8Linear exactly on ``wanted`` (its current scaling)."""
    if not wanted and "torchao.float8" not in sys.modules:
        return  # no Float8Linear can be in the model; importing torchao costs seconds
    config = float8_config(policy.fp8, device_type) if wanted else None  # a missing torchao: the named error
    from torchao.float8.float8_linear import Float8Linear

    for path, module in list(model.named_modules()):
        if isinstance(module, Float8Linear) and (path not in wanted or module.config != config):
            _set(model, path, _plain_linear(module))
    if wanted:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda module, fqn: fqn in wanted
                                   and not isinstance(module, Float8Linear))
