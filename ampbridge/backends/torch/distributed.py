"""Distributed engines configured from the policy: DDP (``wrap_ddp``: gradients all-reduced in
``reduce_dtype``, the loss scaler's overflow flag agreed across ranks), DeepSpeed
(``deepspeed_initialize``: the engine from the config the policy writes) and FSDP (a policy in FSDP's
terms: FSDP2 ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``, per pinned module when given the
model; ``FSDPPrecision.shard`` realises it with ``fully_shard``). See docs/distributed.md.

Holds ``wrap_ddp``, ``deepspeed_initialize``, ``wrap_fsdp``, ``FSDPPrecision`` and ``fsdp_policy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...core.policy import Policy
from ..common import as_policy
from .environment import DTYPES, device_type_of, resolve_for_device
from .plan import realise_plan

if TYPE_CHECKING:
    from .apply import TorchAmp

# --- DDP -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reduce:
    """The comm hook's state: the amp whose policy in force names the dtype, and the group."""

    amp: Any
    group: Any

    def dtype(self) -> torch.dtype:
        return DTYPES[self.amp.active_policy.reduce_dtype]


def _all_reduce_in_reduce_dtype(state, bucket):  # type: ignore[no-untyped-def]
    # no annotations: DDP's register_comm_hook rejects any but the real GradBucket/Future objects,
    # and this module's annotations are strings
    # what torch's fp16_compress_hook / bf16_compress_hook do, for any reduce_dtype (float32 too: a
    # bfloat16 param_dtype gives bfloat16 buckets, which this widens), read at every step so a
    # [[phase]] that changes reduce_dtype takes effect
    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    # divided before the sum, as DDP's own reduction does (exact for a power-of-two world; keeps a
    # float16 sum in range)
    sent = buffer.to(state.dtype()).div_(world)
    future = dist.all_reduce(sent, group=state.group, async_op=True).get_future()

    def back(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(back)


def wrap_ddp(amp: "TorchAmp", *, process_group: Any = None, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(amp.model, ...)`` whose gradient all-reduce runs in the policy's
    ``reduce_dtype`` (a DDP communication hook), with the loss scaler's overflow flag all-reduced
    (MAX) across the ranks, so every rank skips an overflowed step and moves the scale together.

    Call it after ``apply`` and ``init_process_group``; run the forward through the returned
    module and step with ``amp.step`` (or ``amp.scaler``) as usual.

    Example (2 processes: see docs/distributed.md)::

        amp = ampbridge.torch.apply(model, "mixed_float16")
        ddp_model = ampbridge.torch.wrap_ddp(amp, device_ids=[rank])
        loss = loss_fn(ddp_model(x), y); amp.step(loss, optimizer)
    """
    from torch.nn.parallel import DistributedDataParallel

    if not (hasattr(amp, "model") and hasattr(amp, "scaler")):
        raise TypeError(f"wrap_ddp takes the TorchAmp that ampbridge.torch.apply returns; received a "
                        f"{type(amp).__name__} (amp = ampbridge.torch.apply(model, policy); wrap_ddp(amp))")
    ddp = DistributedDataParallel(amp.model, process_group=process_group, **ddp_kwargs)
    ddp.register_comm_hook(_Reduce(amp, process_group), _all_reduce_in_reduce_dtype)
    amp.scaler.agree_across(process_group)
    return ddp

# --- DeepSpeed -----------------------------------------------------------------------------------

_DS_PRECISION_KEYS = ("fp16", "bf16", "bfloat16", "torch_autocast", "amp", "communication_data_type")


def deepspeed_initialize(model: "nn.Module | TorchAmp", policy: Policy | str | Path | None, config: Mapping[str, Any],
                         *, via: str = "native", accept: Iterable[str] = (), **initialize_kwargs: Any) -> Any:
    """``deepspeed.initialize`` with ``config`` plus the precision sections written from the policy
    (``ampbridge.recipes.to_deepspeed`` for the installed DeepSpeed and the config's ZeRO stage).

    What DeepSpeed cannot do as the policy says is refused by name (``UnsupportedOptionError``
    listing each setting and why) unless ``accept`` names the setting (e.g.
    ``"loss_scale.first_growth_interval"``: DeepSpeed from 0.17.1 grows one step later than a policy
    without ``first_growth_interval = window + 1``). ``config`` must
    not hold precision sections of its own. ``via="torch_autocast"`` with an applied model (pass
    the ``TorchAmp``; ``policy`` None: its policy) runs DeepSpeed's ``torch_autocast`` over
    ampbridge's regions, which realise the pins and the output dtype DeepSpeed cannot express.
    Returns what ``deepspeed.initialize`` returns.

    Example (needs DeepSpeed and a launched process group; see docs/distributed.md)::

        engine, optimizer, _, _ = ampbridge.torch.deepspeed_initialize(
            model, "mixed_float16.toml", {"train_micro_batch_size_per_gpu": 8, "optimizer": {...}},
            model_parameters=model.parameters())
    """
    import deepspeed

    from ...errors import UnsupportedOptionError
    from ...recipes import to_deepspeed
    from .apply import TorchAmp

    amp = model if isinstance(model, TorchAmp) else None
    if amp is not None and via != "torch_autocast":
        raise ValueError(f"an applied model (TorchAmp) runs under via='torch_autocast', not via={via!r}: DeepSpeed's "
                         "fp16/bf16 modes cast the whole module, over ampbridge's float32 pins")
    if amp is not None:
        policy = amp.active_policy if policy is None else policy
    if policy is None:
        raise ValueError("policy=None needs an applied model (a TorchAmp)")
    clash = [key for key in _DS_PRECISION_KEYS if key in config]
    if clash:
        raise ValueError(f"config holds precision section(s) {clash}: the policy writes them; remove them")
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    conversion = to_deepspeed(as_policy(policy), via=via, version=deepspeed.__version__, stage=stage)
    # the settings ampbridge's own regions realise inside DeepSpeed's torch.autocast
    realised = {"keep_float32", "override", "kinds", "output_dtype"} if amp is not None else set()
    refused = [loss for loss in conversion.losses if loss.setting not in set(accept) | realised]
    if refused:
        raise UnsupportedOptionError(f"DeepSpeed {deepspeed.__version__} (ZeRO stage {stage}) cannot realise "
                                     + "; ".join(f"{loss.setting} = {loss.value!r}: {loss.reason}" for loss in refused)
                                     + " (accept=[...] names the settings you accept as they are)")
    _refuse_unsupported_engine(conversion.result, as_policy(policy))
    module = amp.model if amp is not None else model
    # the stage was read from this config: its own zero_optimization section (offload, buckets) stays whole
    precision = {key: value for key, value in conversion.result.items() if key != "zero_optimization"}
    return deepspeed.initialize(model=module, config={**config, **precision}, **initialize_kwargs)


def _refuse_unsupported_engine(sections: Mapping[str, Any], policy: Policy) -> None:
    """Refuse by name, before DeepSpeed's bare ``Type fp16 is not supported on your device``, an
    fp16/bf16 engine the accelerator says it cannot run (DeepSpeed's CPU accelerator: float16 only
    where torch's oneDNN has float16 kernels)."""
    from deepspeed.accelerator import get_accelerator

    from ...errors import UnsupportedOptionError

    accelerator = get_accelerator()
    engines = {"fp16": "float16", "bf16": "bfloat16"}
    supported = {dtype: bool(getattr(accelerator, f"is_{section}_supported", lambda: True)())
                 for section, dtype in engines.items()}
    for section, dtype in engines.items():
        if (sections.get(section) or {}).get("enabled") and not supported[dtype]:
            accepted = ", ".join(repr(d) for d in ("float32", *(d for d, ok in supported.items() if ok)))
            raise UnsupportedOptionError(
                f"{policy.source or 'the policy'}: compute_dtype = {dtype!r} needs DeepSpeed's {section} engine, which "
                f"its {accelerator.device_name()!r} accelerator refuses on this machine "
                f"(is_{section}_supported() is False; on a CPU: torch's oneDNN has no {dtype} kernels here); "
                f"accepted here: compute_dtype {accepted}")


# --- FSDP ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FSDPPrecision:
    """A policy in FSDP's terms.

    - ``mp_policy``: FSDP2 ``MixedPrecisionPolicy`` for the model's units (``fully_shard(block, mp_policy=...)``);
    - ``root_mp_policy``: the same with ``output_dtype`` (for ``fully_shard(model, ...)``);
    - ``pinned``: path -> FSDP2 ``MixedPrecisionPolicy`` of every module that computes in another dtype
      than its surroundings (keep_float32, overrides, and rows such as an Embedding that the Plan
      computes in float32 without a rule): shard each on its own, before its parents,
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


def wrap_fsdp(amp: "TorchAmp", *, units: Iterable[str] = (), mesh: Any = None, **fully_shard_kwargs: Any
              ) -> nn.Module:
    """FSDP2: shard ``amp.model`` with the policy in force, one ``fully_shard`` per group of the Plan
    (:meth:`FSDPPrecision.shard`: the modules that compute in another dtype first, then ``units``,
    then the root), gradients reduced in ``reduce_dtype``, and the loss scaler's overflow flag
    all-reduced over the mesh's group (every shard sees only its part of the gradients).

    Call it after ``apply`` (whose autocast and pinned regions make the casts at the group
    boundaries) and ``init_process_group``; step with ``amp.step`` / ``amp.scaler`` as usual.

    Example (2 processes: see docs/distributed.md)::

        amp = ampbridge.torch.apply(model, policy)
        ampbridge.torch.wrap_fsdp(amp, units=[f"layers.{i}" for i in range(n)], mesh=mesh)
    """
    fsdp = fsdp_policy(amp.active_policy, amp.model, amp.device_type)
    kwargs = dict(fully_shard_kwargs, **({"mesh": mesh} if mesh is not None else {}))
    fsdp.shard(amp.model, units=units, **kwargs)
    # a 2-D (HSDP) mesh: every rank holds a different part of the gradients, so the whole world agrees
    amp.scaler.agree_across(mesh.get_group() if mesh is not None and mesh.ndim == 1 else None)
    return amp.model


def fsdp_policy(policy: Policy | str | Path, model: nn.Module | None = None, device_type: str | None = None
                ) -> FSDPPrecision:
    """FSDP2 ``MixedPrecisionPolicy`` and FSDP1 ``MixedPrecision`` for a policy (pins need the model).

    The dtype mapping is ``ampbridge.recipes.to_fsdp`` (what ``ampbridge convert --to fsdp``
    writes), given this backend's Plan; ``notes`` carries its losses and notes. Given the model,
    a module without a rule whose Plan row computes in another dtype than its unit would all-gather
    it in (an ``Embedding`` under autocast: float32) is added to ``pinned`` too, with a note. One
    choice is this backend's: FSDP1's ``buffer_dtype`` is float32 and BatchNorm stays in FSDP1's
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
        device_type = device_type_of(model, device_type)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    policy, notes = resolve_for_device(policy.at(step=0, epoch=0), device_type)
    plan = realise_plan(model, policy, device_type, warn=False).plan if model is not None else None
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
    if plan is not None:
        _follow_the_plan(model, plan, policy, root["fsdp2"]["param_dtype"], pinned, pinned1, notes)
    if model is None and policy.rules:
        notes.append(f"pass the model to get the per-module policies of {len(policy.rules)} pinning rule(s)")
    return FSDPPrecision(fsdp2(root["fsdp2"], output=False), fsdp2(root["fsdp2"]), fsdp1(root["fsdp1"], True),
                         pinned, pinned1, tuple(notes) + tuple(conversion.notes) +
                         tuple(str(loss) for loss in conversion.losses))


def _follow_the_plan(model: nn.Module, plan: Any, policy: Policy, root_dtype: str, pinned: dict, pinned1: dict,
                     notes: list[str]) -> None:
    # FSDP all-gathers a unit's parameters in its param_dtype, so a module whose Plan computes in
    # another dtype without a rule saying so (an Embedding: autocast leaves lookups in float32)
    # would compute in the unit's dtype instead: it becomes a unit of its own, in its row's dtype
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    modules = dict(model.named_modules())
    for row in plan.rows:
        module = modules.get(row.path)
        if not row.path or row.path in pinned or module is None or \
                next(module.parameters(recurse=False), None) is None:
            continue
        around = next((pinned[a].param_dtype for a in sorted(pinned, key=len, reverse=True)
                       if row.path.startswith(a + ".")), DTYPES[root_dtype])
        if DTYPES[row.compute_dtype] == around:
            continue
        compute, reduce = DTYPES[row.compute_dtype], DTYPES[policy.reduce_dtype]
        pinned[row.path] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce,
                                                output_dtype=DTYPES[row.output_dtype], cast_forward_inputs=True)
        pinned1[row.path] = MixedPrecision(param_dtype=compute, reduce_dtype=reduce, buffer_dtype=torch.float32,
                                           cast_forward_inputs=True)
        notes.append(f"{row.path}: the Plan computes it in {row.compute_dtype} (no rule: {row.kind or 'its op'} "
                     f"under autocast), so it is a unit of its own all-gathered in {row.compute_dtype}")
