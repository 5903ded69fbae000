"""FSDP: a policy in FSDP's terms (FSDP2 ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``),
per pinned module when given the model.

Holds ``FSDPPrecision`` and ``fsdp_policy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.policy import Policy
from ..common import as_policy
from .environment import DTYPES, _device_type_of, _resolve_for_device
from .plan import _realise

# --- FSDP ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FSDPPrecision:
    """A policy in FSDP's terms.

    - ``mp_policy``: FSDP2 ``MixedPrecisionPolicy`` for the model's units (``fully_shard(block, mp_policy=...)``);
    - ``root_mp_policy``: the same with ``output_dtype`` (for ``fully_shard(model, ...)``);
    - ``pinned``: path -> FSDP2 ``MixedPrecisionPolicy`` of every module that computes in another dtype
      than its surroundings (keep_float32, overrides): shard each on its own, before its parents,
      so its parameters are all-gathered in its own dtype (``shard(model)`` does all of it);
    - ``mixed_precision``: FSDP1 ``MixedPrecision`` (``buffer_dtype`` float32: running statistics
      stay float32; BatchNorm is in its ``_module_classes_to_ignore`` as torch's default);
    - ``pinned_fsdp1``: path -> FSDP1 ``MixedPrecision``: wrap each in its own ``FSDP(module, mixed_precision=...)``.

    FSDP's ``param_dtype`` is the dtype parameters are all-gathered and computed in (the compute
    dtype); the sharded parameters keep their storage dtype (``param_dtype`` of the policy, which
    ``apply`` sets). Use it together with ``ampbridge.torch.apply`` (apply first): autocast and the
    pinned regions handle the ops FSDP's module-level casting does not.
    """

    mp_policy: Any
    root_mp_policy: Any
    mixed_precision: Any
    pinned: Mapping[str, Any] = field(default_factory=dict)
    pinned_fsdp1: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what ampbridge.recipes.to_fsdp says about the mapping

    def shard(self, model: nn.Module, *, units: Iterable[str] = (), **fully_shard_kwargs: Any) -> nn.Module:
        """FSDP2: ``fully_shard`` the pinned modules, then ``units`` (paths), then the root."""
        from torch.distributed.fsdp import fully_shard

        modules = dict(model.named_modules())
        for path in sorted(self.pinned, key=lambda p: -p.count(".")):
            fully_shard(modules[path], mp_policy=self.pinned[path], **fully_shard_kwargs)
        for path in units:
            fully_shard(modules[path], mp_policy=self.mp_policy, **fully_shard_kwargs)
        fully_shard(model, mp_policy=self.root_mp_policy, **fully_shard_kwargs)
        return model


def fsdp_policy(policy: Policy | str | Path, model: nn.Module | None = None, device_type: str | None = None
                ) -> FSDPPrecision:
    """FSDP2 ``MixedPrecisionPolicy`` and FSDP1 ``MixedPrecision`` for a policy (pins need the model).

    The dtype mapping is ``ampbridge.recipes.to_fsdp`` (what ``ampbridge convert --to fsdp``
    writes), given this backend's Plan; ``notes`` carries its losses and notes. One choice is this
    backend's: FSDP1's ``buffer_dtype`` is float32 and BatchNorm stays in FSDP1's
    ``_module_classes_to_ignore`` (torch's default), because ``apply`` keeps buffers, and so
    BatchNorm's parameters, in float32.

    Example:
        >>> fsdp_policy("mixed_bfloat16").mp_policy.param_dtype
        torch.bfloat16
    """
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    from ...recipes import to_fsdp

    policy = as_policy(policy)
    if model is not None:
        device_type = _device_type_of(model, device_type)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    policy, notes = _resolve_for_device(policy.at(step=0, epoch=0), device_type)
    plan = _realise(model, policy, device_type, warn=False).plan if model is not None else None
    conversion = to_fsdp(policy, plan)

    def dtype(name: str | None) -> torch.dtype | None:
        return DTYPES[name] if name is not None else None

    def fsdp2(settings: Mapping[str, Any], output: bool = True) -> Any:
        return MixedPrecisionPolicy(param_dtype=dtype(settings["param_dtype"]),
                                    reduce_dtype=dtype(settings["reduce_dtype"]),
                                    output_dtype=dtype(settings["output_dtype"]) if output else None,
                                    cast_forward_inputs=settings["cast_forward_inputs"])

    def fsdp1(settings: Mapping[str, Any], root: bool) -> Any:
        return MixedPrecision(param_dtype=dtype(settings["param_dtype"]), reduce_dtype=dtype(settings["reduce_dtype"]),
                              buffer_dtype=torch.float32, cast_forward_inputs=not root)

    root = conversion.result["root"]
    groups = conversion.result["pinned"]
    pinned = {path: fsdp2(g["fsdp2"]) for g in groups for path in g["paths"] or () if path}
    pinned1 = {path: fsdp1(g["fsdp1"], False) for g in groups for path in g["paths"] or () if path}
    # a rule on the model itself (``**``, ``type:MyModel``) decides the root's own wrapping, which
    # shard() applies last; its outputs stay in the policy's output_dtype
    on_root = next((g for g in groups if "" in (g["paths"] or ())), None)
    if on_root is not None:
        root = {"fsdp2": dict(on_root["fsdp2"], output_dtype=policy.output_dtype), "fsdp1": on_root["fsdp1"]}
    if model is None and policy.rules:
        notes.append(f"pass the model to get the per-module policies of {len(policy.rules)} pinning rule(s)")
    return FSDPPrecision(fsdp2(root["fsdp2"], output=False), fsdp2(root["fsdp2"]), fsdp1(root["fsdp1"], True),
                         pinned, pinned1, tuple(notes) + tuple(conversion.notes) +
                         tuple(str(loss) for loss in conversion.losses))
