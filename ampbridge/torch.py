"""PyTorch backend: ``apply(model, policy)`` realises the Plan with torch's own machinery.

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

Host syncs (the CPU waiting for the device) per optimizer step, as native ``GradScaler``:
one ``.item()`` per device in ``scaler.step`` for an ordinary optimizer, none for a fused one
(``_step_supports_amp_scaling``: the optimizer reads ``found_inf`` on the device). Settings that
need the host to know about an overflow add a sync: ``on_min_scale = "error"`` (and ``"warn"``
until it has warned) reads one flag in ``update()``, but folds it into the ``scaler.step`` read
where there is one, so only the fused path pays it. ``amp.step()``'s result reads the flag only
when it is used (``bool(result)``). Mode ``none`` with ``skip_nonfinite = true`` still checks
gradients (one sync, as a GradScaler would); ``skip_nonfinite = false`` disables the check.

Example:
    >>> import torch, ampbridge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> amp = ampbridge.torch.apply(model, ampbridge.preset("mixed_bfloat16").replace(keep_float32=("kind:norm",)))
    >>> amp.plan["0"].compute_dtype, amp.plan["1"].compute_dtype, model(torch.ones(2, 4)).dtype
    ('bfloat16', 'float32', torch.float32)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.utils._pytree import tree_leaves, tree_map_only

from .core.io import PRESETS, load, preset
from .core.loss_scale import LossScaleState, enter_phase, f32, initial_state
from .core.matching import KINDS
from .core.plan import Layer, Plan, PlanRow, build_plan, with_note
from .core.policy import LossScaleConfig, Policy
from .errors import AmpBridgeError, AmpBridgeWarning, LossScaleError, UnsupportedOptionError

__all__ = [
    "DTYPES",
    "FSDPPrecision",
    "GradScaler",
    "ModelNotSupportedError",
    "Monitor",
    "StepResult",
    "TorchAmp",
    "apply",
    "fsdp_policy",
    "kind_of",
    "layers",
    "native_dtype",
    "owns",
    "plan",
]

log = logging.getLogger("ampbridge.torch")

#: ampbridge dtype names -> torch dtypes (the one place they are mapped)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_LOW = (torch.float16, torch.bfloat16)


class ModelNotSupportedError(AmpBridgeError, TypeError):
    """``apply`` was given something it cannot realise a policy on (scripted, compiled, applied)."""


def native_dtype(name: str) -> torch.dtype:
    """The torch dtype of an ampbridge dtype name: ``native_dtype("bf16")`` is ``torch.bfloat16``."""
    from .core.dtypes import canonical_dtype

    return DTYPES[canonical_dtype(name)]


def owns(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` that is not a Keras layer (the registry's question).

    Under the torch Keras backend every Keras layer is also an ``nn.Module``; those belong to
    ``ampbridge.keras``, whose dtype policies they obey.
    """
    if not isinstance(obj, nn.Module):
        return False
    keras = sys.modules.get("keras")
    return not (keras is not None and isinstance(obj, keras.layers.Layer))


def _as_policy(policy: Policy | str | Path) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, Path)):
        return preset(str(policy)) if str(policy) in PRESETS else load(policy)
    raise TypeError(f"policy must be an ampbridge.Policy, a preset name ({', '.join(PRESETS)}) or a "
                    f"policy file path; received {policy!r} (of type {type(policy).__name__})")


# --- layers and kinds --------------------------------------------------------------------------

_MISSING = object()


def _kind_table() -> tuple[tuple[type, str], ...]:
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.conv import _ConvNd

    return (
        (_NormBase, "norm"), (nn.LayerNorm, "norm"), (nn.GroupNorm, "norm"), (nn.RMSNorm, "norm"),
        (nn.LocalResponseNorm, "norm"), (nn.CrossMapLRN2d, "norm"),
        (nn.Embedding, "embedding"), (nn.EmbeddingBag, "embedding"),
        (nn.Softmax, "softmax"), (nn.LogSoftmax, "softmax"), (nn.Softmin, "softmax"), (nn.Softmax2d, "softmax"),
        (nn.Linear, "linear"), (nn.Bilinear, "linear"),  # LazyLinear is a Linear
        (_ConvNd, "conv"),  # Conv*, ConvTranspose*, their Lazy forms
        (nn.MultiheadAttention, "attention"),
        (nn.RNNBase, "recurrent"), (nn.RNNCellBase, "recurrent"),
    )


# TorchScript modules keep their original class name only
_KIND_BY_NAME = {cls.__name__: kind for cls, kind in _kind_table()} | {
    name: kind for name, kind in (
        ("BatchNorm1d", "norm"), ("BatchNorm2d", "norm"), ("BatchNorm3d", "norm"), ("SyncBatchNorm", "norm"),
        ("InstanceNorm1d", "norm"), ("InstanceNorm2d", "norm"), ("InstanceNorm3d", "norm"),
        ("Conv1d", "conv"), ("Conv2d", "conv"), ("Conv3d", "conv"), ("ConvTranspose1d", "conv"),
        ("ConvTranspose2d", "conv"), ("ConvTranspose3d", "conv"), ("LazyLinear", "linear"),
        ("NonDynamicallyQuantizableLinear", "linear"), ("RNN", "recurrent"), ("LSTM", "recurrent"),
        ("GRU", "recurrent"), ("RNNCell", "recurrent"), ("LSTMCell", "recurrent"), ("GRUCell", "recurrent"))}


def kind_of(module: nn.Module) -> str | None:
    """The portable kind of a module: its ``ampbridge_kind`` attribute, else its torch.nn class.

    Example:
        >>> kind_of(torch.nn.LayerNorm(4)), kind_of(torch.nn.ReLU())
        ('norm', None)
    """
    declared = getattr(module, "ampbridge_kind", _MISSING)
    if declared is not _MISSING:
        if declared is not None and declared not in KINDS:
            raise ValueError(f"{type(module).__name__}.ampbridge_kind: unknown kind {declared!r}; "
                             f"accepted: {', '.join(KINDS)} or None")
        return declared
    if isinstance(module, torch.jit.ScriptModule):
        return _KIND_BY_NAME.get(_class_name(module))
    for cls, kind in _kind_table():
        if isinstance(module, cls):
            return kind
    return None


def _class_name(module: nn.Module) -> str:
    if isinstance(module, torch.jit.ScriptModule):
        return getattr(module, "original_name", type(module).__name__)
    cls = type(module)
    # FSDP2's fully_shard swaps in a class FSDP<Name>(FSDPModule, <Name>): report <Name>
    if cls.__name__.startswith("FSDP") and any(b.__name__ == "FSDPModule" for b in cls.__mro__[1:]):
        for base in cls.__bases__:
            if base.__name__ != "FSDPModule":
                return base.__name__
    return cls.__name__


def _entries(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules()``: the model itself first (path ``""``), then every submodule."""
    return list(model.named_modules())


def layers(model: nn.Module) -> list[Layer]:
    """The model as neutral layer descriptors (paths are ``named_modules()`` names).

    The model itself is the first, path ``""``, with the parameters it owns itself (a ViT's
    ``self.pos = nn.Parameter(...)``), as in every backend. A parameter shared by several
    modules (tied weights) counts once, at its first module.
    """
    seen: set[int] = set()
    out = []
    for path, module in _entries(model):
        own = 0
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not isinstance(p, nn.parameter.UninitializedParameter):
                own += p.numel()
        out.append(Layer(path, kind_of(module), _class_name(module), own))
    return out


# --- what autocast does with each module, per device ---------------------------------------------
#
# "cast": autocast runs its main ops (matmul, conv) in the region's dtype;
# "float32": autocast runs it in float32 whatever the region (the op is on autocast's fp32 list);
# "input": autocast leaves its ops alone: it runs in its input's dtype;
# "weights": an embedding lookup: it runs in its weights' dtype;
# "region": a container: its children decide; "custom": a leaf with parameters ampbridge does not know.
# CPU: observed (tests/backend_torch/test_plan.py re-checks every class). CUDA: torch's autocast op
# reference (layer_norm, group_norm, rms_norm, softmax, log_softmax, pow are on its fp32 list), the
# dispatcher's AutocastCUDA registrations (checked by the same test), cudnn's RNN autocast wrapper.

def _behaviour(module: nn.Module, device_type: str) -> str:
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.conv import _ConvNd

    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "weights"
    cast: tuple[type, ...] = (nn.Linear, _ConvNd, nn.MultiheadAttention, nn.RNNBase, nn.RNNCellBase, nn.PReLU)
    if device_type == "cpu":
        if isinstance(module, cast):
            return "cast"
        if isinstance(module, (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
                               nn.CrossMapLRN2d, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d,
                               nn.Bilinear)):
            return "input"
    else:
        if isinstance(module, cast + (nn.Bilinear,)):
            return "cast"
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d,
                               nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)):
            return "float32"
        if isinstance(module, _NormBase):
            return "input"
    if next(module.children(), None) is not None:
        return "region"
    if next(module.parameters(recurse=False), None) is not None:
        return "custom"
    return "input"


def _bypassed(model: nn.Module) -> dict[str, str]:
    """Modules whose forward their parent never calls (it uses their parameters directly)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            for name, _ in module.named_modules():
                if name:
                    out[f"{path}.{name}" if path else name] = path
    return out


# --- the realisation ---------------------------------------------------------------------------

class _Spec(NamedTuple):
    """How one module's forward is run (frozen; stored on the module's forward wrapper)."""

    path: str
    device_type: str
    region: torch.dtype | None  # autocast region to enter; float32 = autocast off; None = enclosing
    input_dtype: torch.dtype | None  # floating inputs cast to this
    output_dtype: torch.dtype | None  # floating outputs cast to this
    param_dtype: torch.dtype | None  # own parameters presented in this dtype for the call
    matmul_precision: str | None = None  # the root only
    root: bool = False
    params_follow_input: bool = False  # present own parameters in the first floating input's dtype


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t,
                         value)


def _region(device_type: str, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    if dtype == torch.float32:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


class _matmul_precision:
    """``torch.set_float32_matmul_precision`` for a scope, restored after (nothing when it is equal)."""

    __slots__ = ("precision", "previous")

    def __init__(self, precision: str | None):
        self.precision, self.previous = precision, None

    def __enter__(self) -> None:
        # inside torch.compile the setting in force when the compiled call starts applies (call it in
        # amp.autocast(), which sets it eagerly); reading it here would break the graph
        if self.precision is not None and not torch.compiler.is_compiling():
            previous = torch.get_float32_matmul_precision()
            if previous != self.precision:
                self.previous = previous
                torch.set_float32_matmul_precision(self.precision)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            torch.set_float32_matmul_precision(self.previous)
            self.previous = None


@contextlib.contextmanager
def _params_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    # The parameters are presented in the compute dtype for this call only (their storage dtype
    # cannot feed the kernel); autograd carries the gradients back to the stored ones. A
    # MultiheadAttention reads its out_proj's parameters itself, so those are included.
    owners = [m for _, m in module.named_modules()] if isinstance(module, nn.MultiheadAttention) else [module]
    saved = [(m, name, p) for m in owners for name, p in m._parameters.items()
             if p is not None and p.is_floating_point() and p.dtype != dtype]
    for m, name, p in saved:
        m._parameters[name] = p.to(dtype)  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p


class _Forward:
    """The forward ampbridge installs on a module (an instance attribute; ``remove()`` deletes it)."""

    __slots__ = ("module", "spec", "previous")

    def __init__(self, module: nn.Module, spec: _Spec, previous: Any):
        self.module, self.spec, self.previous = module, spec, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # kept flat (this runs for every pinned module on every forward): no helper frames on the
        # common path of tensor arguments, one region, no parameter presentation
        spec, module = self.spec, self.module
        dtype = spec.input_dtype
        if dtype is not None:
            args = tuple((a.to(dtype) if a.is_floating_point() and a.dtype != dtype else a)
                         if isinstance(a, torch.Tensor) else _cast_floating(a, dtype) for a in args)
            if kwargs:
                kwargs = {k: _cast_floating(v, dtype) for k, v in kwargs.items()}
        present = spec.param_dtype
        if spec.params_follow_input:
            present = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        # looked up at call time: FSDP2's fully_shard swaps the module's class after apply
        inner = self.previous if self.previous is not None else type(module).forward.__get__(module)
        region = spec.region
        if region is None:
            scope: Any = contextlib.nullcontext()
        elif region is torch.float32:
            scope = torch.autocast(spec.device_type, enabled=False)
        else:
            scope = torch.autocast(spec.device_type, dtype=region)
        if spec.root:
            with _matmul_precision(spec.matmul_precision), scope:
                out = inner(*args, **kwargs) if present is None else _call_with_params(module, present, inner,
                                                                                        args, kwargs)
        else:
            with scope:
                out = inner(*args, **kwargs) if present is None else _call_with_params(module, present, inner,
                                                                                        args, kwargs)
        dtype = spec.output_dtype
        if dtype is None:
            return out
        if isinstance(out, torch.Tensor):
            return out.to(dtype) if out.is_floating_point() and out.dtype != dtype else out
        return _cast_floating(out, dtype)


def _keep_slow_path(module: nn.Module, args: Any) -> None:
    """A no-op forward pre-hook: TransformerEncoderLayer skips its fused eval fast path (which would
    bypass its children's forwards, and with them their rules) while any hook is attached."""


def _call_with_params(module: nn.Module, dtype: torch.dtype, inner: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    with _params_as(module, dtype):
        return inner(*args, **kwargs)


def _installed(module: nn.Module) -> _Forward | None:
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, _Forward) else None


def _install(module: nn.Module, spec: _Spec) -> None:
    previous = module.__dict__.get("forward")
    module.forward = _Forward(module, spec, previous)  # type: ignore[method-assign]


def _uninstall(module: nn.Module) -> None:
    fwd = _installed(module)
    if fwd is None:
        return
    if fwd.previous is not None:
        module.forward = fwd.previous  # type: ignore[method-assign]
    else:
        del module.__dict__["forward"]


# --- devices and dtypes ------------------------------------------------------------------------

def _device_type_of(model: nn.Module, device_type: str | None) -> str:
    found = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    found.discard("meta")
    if device_type is None:
        if len(found) > 1:
            raise AmpBridgeError(f"the model's tensors are on several device types ({', '.join(sorted(found))}); "
                                 "pass device_type= to say which one autocast should run on")
        device_type = found.pop() if found else "cpu"
    if not isinstance(device_type, str) or not device_type:
        raise AmpBridgeError(f"device_type must be a torch device type such as 'cuda' or 'cpu'; "
                             f"received {device_type!r}")
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:
        available = False
    if not available:
        raise UnsupportedOptionError(f"device_type={device_type!r}: torch autocast is not available on this "
                                     "device type; accepted: cpu, cuda, and the accelerators torch supports")
    if found and found != {device_type}:
        raise AmpBridgeError(f"device_type={device_type!r} but the model's tensors are on "
                             f"{', '.join(sorted(found))}; move the model first or pass the matching device_type")
    return device_type


@functools.lru_cache(maxsize=None)
def _supported_compute_dtypes(device_type: str) -> frozenset[str]:
    """The compute dtypes torch autocast really runs on this device type (it only warns otherwise)."""
    ok = {"float32"}
    for name in ("bfloat16", "float16"):
        dtype = DTYPES[name]
        if device_type == "cuda":
            if torch.cuda.is_available() and (name != "bfloat16" or torch.cuda.is_bf16_supported()):
                ok.add(name)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.autocast(device_type, dtype=dtype):
                    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype:
                        ok.add(name)
            except RuntimeError:
                pass
    return frozenset(ok)


def _device(device_type: str) -> Any:
    """This device as the core's ``Device`` (what ``compute_dtype = "auto"`` is decided on)."""
    from .diagnostics.hardware import Device, cpu_flags

    if device_type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        return Device("cuda", torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
    if device_type == "cpu":
        return Device("cpu", cpu_flags=cpu_flags())
    return Device(device_type)


def _resolve_for_device(policy: Policy, device_type: str) -> tuple[Policy, list[str]]:
    """Resolve ``compute_dtype = "auto"`` (the core's rule) and refuse dtypes the device cannot run."""
    from .diagnostics.hardware import resolve_auto

    notes = []
    supported = _supported_compute_dtypes(device_type)
    if policy.compute_dtype == "auto":
        policy, reason = resolve_auto(policy, _device(device_type))
        notes.append(reason)
    wanted = [("compute_dtype", policy.compute_dtype)] + [
        (f"{label}.compute_dtype", rule.compute_dtype) for label, rule in policy.rules
        if label.startswith("override") and rule.compute_dtype]
    for key, name in wanted:
        if name not in supported:
            raise UnsupportedOptionError(
                f"{key}={name!r}: torch autocast cannot run {name} on this {device_type} device; "
                f"accepted here: {', '.join(sorted(supported))}")
    return policy, notes


def _widest(names: Iterable[str]) -> str:
    names = set(names)
    if len(names) == 1:
        return names.pop()
    return "float32"  # float16 and bfloat16 do not contain each other


# --- planning ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Realisation:
    """The Plan of one (phase) policy, and how each module is run to make it true."""

    plan: Plan
    policy: Policy
    specs: Mapping[str, _Spec]  # path ("" = the root) -> spec
    storage: Mapping[int, tuple[nn.Parameter, torch.dtype]] = field(default_factory=dict)
    input_following: frozenset[str] = frozenset()  # rows whose dtype follows their input


def _realise(model: nn.Module, policy: Policy, device_type: str, *, warn: bool = True,
             notes: Sequence[str] = ()) -> _Realisation:
    entries = _entries(model)
    modules = dict(entries)
    raw = build_plan(layers(model), policy, framework="torch", warn=warn)
    rules = dict(policy.rules)
    bypassed = _bypassed(model)

    # 1. storage: each parameter in the dtype its module's row asks for (the widest, if shared)
    requests: dict[int, list[tuple[str, str]]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    from torch.nn.modules.batchnorm import _NormBase

    for row in raw.rows:
        module = modules[row.path]
        wanted = row.param_dtype
        if isinstance(module, _NormBase) and module.track_running_stats and wanted != "float32":
            wanted = "float32"  # see the row's note below
        for p in module.parameters(recurse=False):
            requests[id(p)].append((row.path, wanted))
            params[id(p)] = p
    storage: dict[int, tuple[nn.Parameter, torch.dtype]] = {}
    for pid, asks in requests.items():
        chosen = _widest(d for _, d in asks)
        p = params[pid]
        if p.is_floating_point() or isinstance(p, nn.parameter.UninitializedParameter):
            if isinstance(p, nn.parameter.UninitializedParameter):
                if chosen != "float32":
                    path = asks[0][0]
                    raise AmpBridgeError(f"{path!r} ({_class_name(modules[path])}) has uninitialised lazy "
                                         f"parameters; run one forward to materialise them before applying "
                                         f"param_dtype={chosen!r}")
                continue
            storage[pid] = (p, DTYPES[chosen])

    # 2. regions: a module whose compute dtype differs from its parent's region runs its own.
    # Without autocast (a float32 region) torch cannot mix dtypes, so where a lower-precision rule
    # sits inside one, the region's leaves get their floating inputs cast to float32.
    low_below: set[str] = set()
    for row in raw.rows:
        if row.output_dtype != "float32" or row.compute_dtype != "float32":
            parts = row.path.split(".")
            low_below.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    region_root: dict[str, str] = {}
    specs: dict[str, _Spec] = {}
    wrapped_output: dict[str, str] = {}
    final: list[PlanRow] = []
    input_following: set[str] = set()
    for row in raw.rows:
        module = modules[row.path]
        behaviour = _behaviour(module, device_type)
        path = row.path
        if path in bypassed:
            parent = raw[bypassed[path]]
            if row.compute_dtype != parent.compute_dtype:
                raise UnsupportedOptionError(
                    f"{row.rule} ({row.pattern}) sets {path!r} to compute in {row.compute_dtype}, but "
                    f"{_class_name(modules[bypassed[path]])} {bypassed[path]!r} uses its parameters in its own "
                    f"forward (it never calls {path!r}); match {bypassed[path]!r} instead")
            final.append(with_note(row, f"its parameters are used by {bypassed[path]}'s forward, which "
                                        f"runs in {parent.compute_dtype}", output_dtype=parent.compute_dtype))
            continue
        is_root = path == ""  # its region, input and output casts are the root spec (below)
        parent_path = path.rsplit(".", 1)[0] if "." in path else ""
        enclosing = policy.compute_dtype if is_root else raw[parent_path].compute_dtype
        compute = row.compute_dtype
        own_float = [p for p in module.parameters(recurse=False)
                     if p.is_floating_point() and not isinstance(p, nn.parameter.UninitializedParameter)]
        own_stored = {storage[id(p)][1] for p in own_float if id(p) in storage}
        own_low = any(d in _LOW for d in own_stored)
        region_change = compute != enclosing and not is_root
        region_root[path] = path if region_change else region_root.get(parent_path, "")
        mixed_float32 = (compute == "float32" and not region_change and region_root[path] in low_below
                         and next(module.children(), None) is None and behaviour != "weights")
        present_as = None  # own parameters presented in the compute dtype for the call
        if own_low and any(d != DTYPES[compute] for d in own_stored) and (
                compute == "float32" or behaviour not in ("cast", "float32")):
            present_as = DTYPES[compute]
        cast_inputs = region_change or mixed_float32 or (own_low and behaviour in ("input", "custom"))
        if is_root:  # the caller's region is the policy's: a rule on the root changes it
            cast_inputs = compute != policy.compute_dtype or (own_low and behaviour in ("input", "custom"))
        rule = rules.get(row.rule)
        explicit_output = rule is not None and rule.output_dtype is not None
        natural, natural_out, note, follows = _natural(row, module, behaviour, device_type, present_as, cast_inputs,
                                                       own_stored)
        # cpu bilinear cannot mix dtypes and autocast leaves it alone: it gets its input's dtype
        follow_params = (device_type == "cpu" and isinstance(module, nn.Bilinear) and not cast_inputs
                         and present_as is None and compute != "float32")
        wrap = region_change or cast_inputs or present_as is not None or follow_params or (
            explicit_output and row.output_dtype != natural_out)
        if is_root:
            wrap = False
            specs[""] = _Spec("", device_type, DTYPES[compute], DTYPES[compute] if cast_inputs else None,
                              DTYPES[policy.output_dtype], present_as, policy.matmul_precision, root=True)
        changes: dict[str, Any] = {}
        notes_here = [note] if note else []
        stored = {_NAMES[d] for d in own_stored}
        if len(stored) == 1 and stored != {row.param_dtype}:
            stored_name = stored.pop()
            changes["param_dtype"] = stored_name
            if isinstance(module, _NormBase) and module.track_running_stats:
                notes_here.append(f"parameters kept in {stored_name}: torch's batch_norm needs them in its float32 "
                                  f"running statistics' dtype")
            else:
                notes_here.append(f"parameters kept in {stored_name}: shared with another module that needs it")
        if wrap:
            specs[path] = _Spec(path, device_type, DTYPES[compute] if region_change else None,
                                DTYPES[compute] if cast_inputs else None,
                                None if follows else DTYPES[row.output_dtype], present_as,
                                params_follow_input=follow_params)
            if natural != compute and behaviour != "region":
                changes["compute_dtype"] = natural
            if follows:
                input_following.add(path)
            wrapped_output[path] = row.output_dtype
        else:
            if natural != compute and behaviour != "region":
                changes["compute_dtype"] = natural
            if natural_out != row.output_dtype and not explicit_output and behaviour != "region":
                changes["output_dtype"] = natural_out
            if follows:
                input_following.add(path)
        if is_root:  # the model's outputs: the policy's output_dtype, whatever a rule says
            changes["output_dtype"] = policy.output_dtype
            if policy.output_dtype != changes.get("compute_dtype", compute):
                notes_here.append(f"model outputs cast to output_dtype {policy.output_dtype}")
        final.append(with_note(row, "; ".join(notes_here) or None, **changes) if notes_here or changes else row)

    plan_notes = list(notes)
    if policy.matmul_precision != "highest":
        plan_notes.append(f"matmul_precision {policy.matmul_precision}: torch.set_float32_matmul_precision"
                          f"({policy.matmul_precision!r}) inside amp.model, amp.autocast() and amp.step(), "
                          f"restored after (float32 matmuls may use "
                          f"{'TF32' if policy.matmul_precision == 'high' else 'bfloat16'} on hardware that has it)")
    if input_following:
        plan_notes.append(f"{len(input_following)} row(s) follow their input's dtype (autocast leaves those ops "
                          "alone); ampbridge.torch.plan(model, policy, *example_inputs) traces the exact dtypes")
    out = Plan(tuple(final), policy, "torch", raw.unmatched_rules, tuple(plan_notes))
    return _Realisation(out, policy, specs, storage, frozenset(input_following))


def _natural(row: PlanRow, module: nn.Module, behaviour: str, device_type: str, present_as: torch.dtype | None,
             cast_inputs: bool, own_stored: set[torch.dtype]) -> tuple[str, str, str, bool]:
    """What the module really does: (compute dtype, output dtype, note, output follows the input)."""
    compute = row.compute_dtype
    cls = _class_name(module)
    if behaviour == "weights":
        weights = _NAMES[present_as] if present_as is not None else (
            _NAMES[next(iter(own_stored))] if len(own_stored) == 1 else row.param_dtype)
        if weights != compute:
            return weights, weights, (f"autocast does not cast embedding lookups: it runs in its weights' dtype "
                                      f"({weights})"), False
        return compute, compute, "", False
    if compute == "float32":
        return compute, compute, "", False
    if isinstance(module, nn.RMSNorm) and behaviour == "input":
        fed = f"({compute})" if cast_inputs else f"({compute} when fed by a {compute} layer)"
        return "float32", compute, f"torch's rms_norm computes in float32 and returns its input's dtype {fed}", \
            not cast_inputs
    if behaviour == "float32":
        return "float32", "float32", f"{device_type} autocast runs {cls} in float32", False
    if behaviour == "input" and not cast_inputs:
        also = ("; its parameters are presented in that dtype (torch's bilinear cannot mix dtypes)"
                if isinstance(module, nn.Bilinear) and present_as is None else "")
        return compute, compute, (f"follows its input's dtype: {device_type} autocast leaves {cls} alone "
                                  f"({compute} when fed by a {compute} layer){also}"), True
    if behaviour == "custom" and not cast_inputs:
        return compute, compute, "custom module: its ops follow autocast's per-op rules", False
    if behaviour == "cast" and device_type == "cpu" and isinstance(module, (nn.GRU, nn.RNNCellBase)) \
            and not cast_inputs:
        return compute, compute, (f"the gates' matmuls run in {compute}; the output keeps its input's dtype "
                                  f"({compute} when fed by a {compute} layer)"), True
    if behaviour == "cast" and isinstance(module, nn.LSTM) and device_type == "cpu" and \
            not cpu_lstm_takes_float32_inputs(compute):
        return compute, compute, (f"cpu LSTM under {compute} autocast needs {compute} inputs on this CPU "
                                  f"(oneDNN); pin it or feed {compute}"), False
    return compute, compute, "", False


@functools.lru_cache(maxsize=None)
def cpu_lstm_takes_float32_inputs(compute_dtype: str) -> bool:
    """Whether ``nn.LSTM`` runs on float32 inputs inside ``torch.autocast("cpu", dtype=compute_dtype)``.

    autocast sends the LSTM to oneDNN in the lower precision, and oneDNN refuses the mixed
    float32-input primitive for float16 everywhere and for bfloat16 on CPUs without native
    bfloat16 (seen on an AVX2-only CPU; it ran on an AVX512_BF16 one), so it is measured, on a
    one-unit LSTM.

    Example:
        >>> cpu_lstm_takes_float32_inputs("float32")
        True
    """
    if compute_dtype == "float32":
        return True
    lstm = nn.LSTM(1, 1)
    try:
        with torch.autocast("cpu", dtype=getattr(torch, compute_dtype)), torch.no_grad():
            lstm(torch.zeros(1, 1, 1))
    except RuntimeError:
        return False
    return True


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
        self._host_state = state  # used while the scaler is disabled (mode none, no skipping)
        self._host_steps = state.steps
        self._warned = False
        self._found_read: dict[int, bool] = {}  # optimizer id -> found_inf read in step() (no extra sync)
        self._at_min_read: bool | None = None
        self._last_result: StepResult = _APPLIED
        self._monitor: Monitor | None = None  # fed by scale(), the unscale and update()

    # configuration

    def _configure(self, cfg: LossScaleConfig) -> None:
        self.config = cfg
        self._enabled = not (cfg.mode == "none" and not cfg.skip_nonfinite)
        self._growth_factor = f32(cfg.growth_factor)
        self._backoff_factor = f32(cfg.backoff_factor)
        self._growth_interval = cfg.growth_interval
        self._native_update = (cfg.mode == "dynamic" and cfg.hysteresis == 1 and cfg.min_scale is None
                               and cfg.max_scale is None)
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

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        if self._monitor is not None:
            self._monitor._saw_loss(outputs)
        if self._enabled and self.config.mode == "none":
            if self._scale is None:  # scale 1: nothing to multiply, but the state lives on the device
                first = outputs if isinstance(outputs, torch.Tensor) else next(iter(outputs))
                self._lazy_init_scale_growth_tracker(first.device)
            return outputs
        return super().scale(outputs)

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if self._monitor is not None:  # the gradients as backward left them: still scaled
            self._monitor._saw_grads(self._scale, self._steps)
        # param_dtype = float16 means float16 gradients: the policy asked for them
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self._allow_fp16_grads)

    # stepping

    def _at_min(self) -> torch.Tensor:
        assert self._scale is not None and self._hysteresis_left is not None
        return (self._scale == self._min) & (self._hysteresis_left <= 1)

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not self.config.skip_nonfinite:  # applied whatever the gradients: nothing to read
            return optimizer.step(*args, **kwargs)
        found = list(optimizer_state["found_inf_per_device"].values())
        if len(found) != 1:
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        flag = found[0]
        if self._needs_min_check():
            # one read answers both questions: was there an overflow, and is the scale at its floor
            code = int((flag > 0).to(torch.int32).add_(self._at_min().to(torch.int32), alpha=2).item())
            overflow, self._at_min_read = bool(code & 1), bool(code & 2)
        else:
            overflow = bool(flag.item())
        self._found_read[id(optimizer)] = overflow
        return None if overflow else optimizer.step(*args, **kwargs)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self._monitor is not None and not self._enabled:  # nothing is unscaled: scale 1
            self._monitor._saw_grads(None, self._host_steps)
        if (self._enabled and not self.config.skip_nonfinite
                and getattr(optimizer, "_step_supports_amp_scaling", False)
                and "grad_scaler" not in inspect.signature(optimizer.step).parameters):
            return self._fused_step_applying_all(optimizer, *args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

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
            if self._monitor is not None:
                self._monitor._step_done(self._host_steps, None, None, None, False)
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
        if self._monitor is not None:  # before the scale moves: the log holds the scale this step used
            self._monitor._step_done(self._steps, found_flag, known, scale, self.config.skip_nonfinite)
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
        assert self._skipped is not None
        self._steps += 1
        if self.config.skip_nonfinite:
            # one optimizer on one device: found_inf is exactly 0.0 or 1.0
            self._skipped.add_(found_flag if len(found_infs) == 1 else (found_flag > 0))
        skip = self.config.skip_nonfinite
        if known is not None:
            self._last_result = _SKIPPED if known and skip else _APPLIED
        else:
            self._last_result = StepResult(found_flag) if skip else _APPLIED
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
        good = torch.where(found, torch.zeros_like(tracker), tracker + 1)
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
            return LossScaleState(1.0, 0, h.hysteresis_left, self._host_steps, h.skipped)
        if self._scale is None:
            return self._pending
        assert self._growth_tracker is not None and self._hysteresis_left is not None
        assert self._skipped is not None
        return LossScaleState(float(self._scale.item()), int(self._growth_tracker.item()),
                              int(self._hysteresis_left.item()), self._steps, int(self._skipped.item()))

    def load_loss_scale_state(self, state: LossScaleState) -> None:
        """Set the five reference fields."""
        if self.config.mode == "none":
            state = LossScaleState(1.0, 0, state.hysteresis_left, state.steps, state.skipped)
        elif self.config.mode == "static":
            state = LossScaleState(f32(self.config.initial_scale), 0, state.hysteresis_left, state.steps,
                                   state.skipped)
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

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, factors, interval, ``_growth_tracker``) plus ampbridge's."""
        s = self.loss_scale_state()
        return {"scale": s.scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": s.good_steps,
                "hysteresis_left": s.hysteresis_left, "steps": s.steps, "skipped": s.skipped,
                "mode": self.config.mode}

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
            int(state_dict.get("skipped", 0))))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled and self._per_optimizer_states:
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of an iteration, "
                                 "or at the end after scaler.update().")
        state["_pending"] = self.loss_scale_state()
        state["_monitor"] = None  # a log file stays with its process
        for name in ("_scale", "_growth_tracker", "_hysteresis_left", "_skipped"):
            state[name] = None
        state["_last_result"] = _APPLIED
        return state

    def reconfigure(self, config: LossScaleConfig, *, compute_dtype: str = "float16", reset: bool = False) -> None:
        """Switch to another phase's settings; the state moves by the core's rule (``enter_phase``,
        the same in every backend): carried between dynamic phases, fresh on ``reset`` or a mode change."""
        new = config.resolve(compute_dtype)
        state = enter_phase(new, self.loss_scale_state(), previous=self.config, reset=reset)
        self._configure(new)
        self._warned = False
        self.load_loss_scale_state(state)


class StepResult:
    """Whether an optimizer step was applied; truthiness reads the device only when needed.

    On the ordinary path the answer is already on the host (``scaler.step`` read it); after a
    fused optimizer (or several devices) ``bool(result)`` costs one sync, so a loop that ignores
    the result keeps torch's no-sync path.
    """

    __slots__ = ("_value",)

    def __init__(self, value: bool | torch.Tensor):
        self._value = value

    def __bool__(self) -> bool:
        if isinstance(self._value, torch.Tensor):
            self._value = not bool(self._value.item() > 0)
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return f"StepResult({bool(self)})"


_APPLIED, _SKIPPED = StepResult(True), StepResult(False)


# --- the numerics monitor ----------------------------------------------------------------------

#: steps a monitor keeps on the device while the host has not learnt their found_inf (a fused
#: optimizer, or skip_nonfinite = false); it reads them together at the next sampled step, or here
_PENDING_LIMIT = 1000


def _to_host(values: torch.Tensor) -> list[float]:
    """The monitor's one device-to-host transfer for a logged step (tests count the calls)."""
    return values.to("cpu").tolist()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.layout is not torch.strided else grad


def _extremes(t: torch.Tensor, values: list[torch.Tensor], who: list[int], index: int) -> None:
    """Append min and max of ``t`` (one kernel; non-finite iff some element is: nan propagates)."""
    low, high = torch.aminmax(t)
    values += (low, high)
    who += (index, index)


class _Flags:
    """What attribution saw in one step: extremes on the device, and on the host whose they are."""

    __slots__ = ("fwd_vals", "fwd_who", "bwd_vals", "bwd_who")

    def __init__(self) -> None:
        # forward outputs per candidate call, then the gradients w.r.t. each call's inputs in
        # backward order (who[k]: the candidate of values[k])
        self.fwd_vals: list[torch.Tensor] = []
        self.fwd_who: list[int] = []
        self.bwd_vals: list[torch.Tensor] = []
        self.bwd_who: list[int] = []


class _Pending(NamedTuple):
    """A step whose found_inf is still on the device (read later, all pending steps at once)."""

    step: int
    skip: bool
    found_by_norms: bool  # values[0] is the sum of gradient maxima (no scaler flag): found if non-finite
    values: torch.Tensor  # found, loss, scale, then the attribution maxima (forward, backward, parameters)
    fwd_who: list[int]
    bwd_who: list[int]
    param_who: list[int]


class Monitor:
    """The numerics log of a training run (JSON Lines; ``ampbridge report RUN.jsonl`` reads it).

    Made by :meth:`TorchAmp.monitor`; the scaler feeds it (``amp.step``, or the native
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` loop). Every step record
    holds the loss (of the last ``scaler.scale`` call), the scale the step used, ``found_inf`` and
    ``skipped``. On steps 0, N, 2N, ... of the scaler's step counter (``every=N``) it also holds
    each layer's gradient statistics (``ampbridge.diagnostics.runlog.layer_stats``: the gradients of the
    parameters the layer owns, before unscaling, in the layer's compute dtype), computed with
    torch ops on the device and read in one transfer. A step whose gradients were non-finite is
    always logged, with ``first_nonfinite``: the first leaf module (forward order) whose output was
    non-finite, else the first (backward order) whose input gradient or own parameter gradient
    was, else ``{"path": "", "where": "loss"}``.

    Attribution (``attribution=True``) costs a forward hook per leaf module and a view plus a
    tensor hook per leaf input that needs a gradient (two small device ops each, every step, no
    host sync); the flags are read only on a non-finite step, which the host learns anyway (the
    scaler reads found_inf; with a fused optimizer, or ``skip_nonfinite = false``, the host never
    does: those steps wait on the device and are read with the next sampled step, at the latest
    every 1000 steps). Modules with ``inplace=True`` get no input probe (an in-place op on a
    probed input would lose it); a leaf whose output holds inf on purpose (an additive mask) would
    be named first: pass ``attribution=False`` or keep the mask out of a module.

    Example:
        >>> import tempfile, os, ampbridge
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> amp = apply(model, "mixed_float16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with amp.monitor(path, every=10):
        ...     for _ in range(3):
        ...         _ = amp.step(model(torch.ones(2, 4)).mean() * 1e-3, opt)
        >>> log = ampbridge.diagnostics.runlog.read_log(path)
        >>> log.header["layers"], [s["step"] for s in log.steps], sorted(log.steps[0]["layers"])
        (['0', '1'], [0], ['0', '1'])
    """

    def __init__(self, amp: "TorchAmp", path: str | Path, every: int = 1, *, attribution: bool = True):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (statistics on every N-th step); received {every!r}")
        self.path = Path(path)
        self.every = every
        self.attribution = bool(attribution)
        self.path.open("w", encoding="utf-8").close()  # an unwritable path fails here, not mid-run
        self._amp = amp
        named = list(amp.model.named_modules())
        modules = dict(named)
        # the parameters each layer owns (a shared one counts at its first module, as in layers())
        seen: set[int] = set()
        self._owned: list[tuple[str, list[nn.Parameter]]] = []
        for path_, module in named:
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            own = [p for p in own if p.is_floating_point() and not isinstance(p, nn.parameter.UninitializedParameter)]
            if own:
                self._owned.append((path_, own))
        # attribution candidates: modules that run no sub-module (a MultiheadAttention never calls
        # its out_proj: it is the candidate, not out_proj)
        bypassed = _bypassed(amp.model)
        whole = set(bypassed.values())
        self._candidates = [p for p, m in named
                            if p not in bypassed and (next(m.children(), None) is None or p in whole)]
        index = {p: i for i, p in enumerate(self._candidates)}
        # candidates' own parameters first: their flags are the attribution fallback
        owned_by = [(index.get(p, -1), q) for p, params in self._owned for q in params]
        self._grad_params = sorted(owned_by, key=lambda t: t[0] < 0)
        self._order: list[str] = []
        self._order_seen: set[str] = set()
        self._order_hooks = [m.register_forward_pre_hook(functools.partial(self._first_call, p)) for p, m in named]
        self._hooks = []
        if self.attribution:
            for i, p in enumerate(self._candidates):
                m = modules[p]
                if not getattr(m, "inplace", False):
                    self._hooks.append(m.register_forward_pre_hook(functools.partial(self._probe_inputs, i)))
                self._hooks.append(m.register_forward_hook(functools.partial(self._check_output, i)))
        self._acc = torch.float32 if amp.device_type == "mps" else torch.float64  # mps has no float64
        self._flags = _Flags()
        self._loss: torch.Tensor | None = None
        self._stats: tuple[torch.Tensor, list[tuple[str, int]]] | None = None
        self._took_grads = False
        self._pending: list[_Pending] = []
        self._writer: Any = None
        self.closed = False
        amp.scaler._monitor = self

    def __repr__(self) -> str:
        return f"Monitor({str(self.path)!r}, every={self.every}, attribution={self.attribution}" + (
            ", closed)" if self.closed else ")")

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> "Monitor":
        return self  # a deep copy of the model (an EMA twin) keeps feeding this log

    def __getstate__(self) -> None:
        raise TypeError("an ampbridge.torch.Monitor writes a file of this process: close it (monitor.close()) "
                        "before pickling the model")

    def close(self) -> None:
        """Read any steps still on the device, write them, close the file, remove the hooks."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._pending:
                self._flush()
            self._header()
        finally:
            for handle in self._order_hooks + self._hooks:
                handle.remove()
            self._order_hooks, self._hooks = [], []
            if self._amp.scaler._monitor is self:
                self._amp.scaler._monitor = None
            if self._writer is not None:
                self._writer.close()

    # --- hooks (kept small: they run on every forward and backward)

    def _first_call(self, path: str, module: nn.Module, args: Any) -> None:
        if path not in self._order_seen:
            self._order_seen.add(path)
            self._order.append(path)

    def _probe_inputs(self, index: int, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # a view per input: its gradient is exactly this call's contribution (torch's full backward
        # hooks do the same with a custom Function, which forbids in-place ops on the module's
        # outputs, as in `out += identity`); the same tensor passed twice stays one tensor
        if not torch.is_grad_enabled():
            return None
        views: dict[int, torch.Tensor] | None = None
        new: list[Any] = []
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.requires_grad and a.layout is torch.strided and a.is_floating_point():
                if views is None:
                    views, new = {}, list(args)
                v = views.get(id(a))
                if v is None:
                    v = a.view_as(a)
                    v.register_hook(functools.partial(self._check_input_grad, index))
                    views[id(a)] = v
                new[k] = v
        return tuple(new) if views else None

    def _check_input_grad(self, index: int, grad: torch.Tensor) -> None:
        if grad.numel():
            flags = self._flags
            _extremes(grad, flags.bwd_vals, flags.bwd_who, index)

    def _check_output(self, index: int, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        flags = self._flags
        with torch.no_grad():  # a flag, not part of the graph (it would keep the output alive)
            if isinstance(out, torch.Tensor):
                if out.is_floating_point() and out.numel():
                    _extremes(out, flags.fwd_vals, flags.fwd_who, index)
                return
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    _extremes(t, flags.fwd_vals, flags.fwd_who, index)

    # --- fed by the scaler

    def _saw_loss(self, outputs: Any) -> None:
        self._loss = outputs.detach() if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 else None

    def _saw_grads(self, scale: torch.Tensor | None, step: int) -> None:
        if self._took_grads:  # once per step, before the first unscale
            return
        self._took_grads = True
        if step % self.every == 0:
            self._stats = self._layer_stats(scale)

    def _layer_stats(self, scale: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[str, int]]] | None:
        """Per layer on the device: finite count, max |g/S|, sum (g/S)^2, zeros, below the smallest
        subnormal once unscaled (zeros included), zero once unscaled, beyond the compute max (scaled)."""
        from .core.dtypes import formats

        plan, facts, acc = self._amp.plan, formats(), self._acc
        fallback = facts[self._amp.active_policy.compute_dtype]
        rows, meta = [], []
        for path, params in self._owned:
            grads = [_dense(p.grad) for p in params if p.grad is not None]
            n = sum(g.numel() for g in grads)
            if not n:
                continue
            fmt = facts.get(plan[path].compute_dtype, fallback) if path in plan else fallback
            flat = grads[0].reshape(-1) if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
            a = flat.to(acc, copy=True).abs_()
            zero = (a == 0).sum()
            finite = (a < math.inf).sum()  # a = |g|: false for inf and nan
            a.nan_to_num_(0.0, 0.0, 0.0)
            over = (a > fmt.max).sum()
            if scale is not None:
                a.div_(scale.to(acc))
            rows.append(torch.stack([finite, a.max(), torch.dot(a, a), zero, (a < fmt.smallest_subnormal).sum(),
                                     (a == 0).sum(), over]).to(acc))
            meta.append((path, n))
        return (torch.stack(rows), meta) if rows else None

    def _step_done(self, step: int, found: torch.Tensor | None, known: bool | None, scale: torch.Tensor | None,
                   skip: bool) -> None:
        """Called by the scaler's update() before the scale moves; ``known``: found_inf if the host read it."""
        self._took_grads = False
        if self._order_hooks:  # the first forward showed the order
            for handle in self._order_hooks:
                handle.remove()
            self._order_hooks = []
        flags, self._flags = self._flags, _Flags()
        loss, self._loss = self._loss, None
        stats, self._stats = self._stats, None
        if known is False and stats is None:
            return  # the common step: nothing read, nothing written
        acc = self._acc
        device = scale.device if scale is not None else torch.device(self._amp.device_type)
        # device values, read as one vector; the host tells non-finite maxima apart itself
        norms = None
        param_who: list[int] = []
        if (known is not False and self.attribution) or found is None:
            grads = [(i, _dense(p.grad)) for i, p in self._grad_params if p.grad is not None and p.grad.numel()]
            if grads and device.type == "cuda":  # one multi-tensor kernel
                norms = torch.stack(torch._foreach_norm([g for _, g in grads], math.inf)).to(acc)
                param_who = [i for i, _ in grads if i >= 0]
            elif grads:  # elsewhere torch loops anyway, and aminmax is the cheap reduction
                values: list[torch.Tensor] = []
                who: list[int] = []
                for i, g in grads:
                    _extremes(g, values, who, i)
                norms = torch.stack(values).to(acc)
                param_who = [i for i in who if i >= 0]
        # found: the scaler's flag (> 0), or without one the sum of all gradient maxima (non-finite)
        if found is None:
            found = norms.sum() if norms is not None else torch.zeros((), dtype=acc, device=device)
            by_norms = True
        else:
            by_norms = False
        parts = [torch.stack([found.to(device, acc).reshape(()),
                              loss.to(device, acc).reshape(()) if loss is not None else
                              torch.full((), math.nan, dtype=acc, device=device),
                              scale.to(acc).reshape(()) if scale is not None else
                              torch.ones((), dtype=acc, device=device)])]
        fwd_who: list[int] = []
        bwd_who: list[int] = []
        if self.attribution and known is not False:
            if flags.fwd_vals:
                parts.append(torch.stack(flags.fwd_vals).to(acc))
                fwd_who = flags.fwd_who
            if flags.bwd_vals:
                parts.append(torch.stack(flags.bwd_vals).to(acc))
                bwd_who = flags.bwd_who
            if param_who:
                assert norms is not None
                parts.append(norms[:len(param_who)])  # the candidates' own parameters come first
        values = torch.cat(parts)
        entry = _Pending(step, skip, by_norms, values, fwd_who, bwd_who, param_who)
        if known is None and stats is None and len(self._pending) < _PENDING_LIMIT:
            if self._pending:  # a static graph calls the same modules each step: keep one list
                last = self._pending[-1]
                entry = entry._replace(fwd_who=last.fwd_who if last.fwd_who == fwd_who else fwd_who,
                                       bwd_who=last.bwd_who if last.bwd_who == bwd_who else bwd_who)
            self._pending.append(entry)
            return
        self._flush(entry, known, stats)

    def _flush(self, now: _Pending | None = None, known: bool | None = None,
               stats: tuple[torch.Tensor, list[tuple[str, int]]] | None = None) -> None:
        """One transfer: every pending step, and this one with its statistics."""
        entries = self._pending + ([now] if now is not None else [])
        self._pending = []
        blocks = [e.values for e in entries] + ([stats[0].reshape(-1)] if stats is not None else [])
        host = _to_host(torch.cat(blocks))
        self._header()
        offset = 0
        for e in entries:
            count = e.values.numel()
            values, offset = host[offset:offset + count], offset + count
            if e is now and known is not None:
                found = known
            else:
                found = not math.isfinite(values[0]) if e.found_by_norms else values[0] > 0
            layers = self._decode_stats(host[offset:], stats[1]) if e is now and stats is not None else None
            if not found and layers is None:
                continue  # a finite step that only waited to be read
            loss = values[1] if math.isfinite(values[1]) else None
            first = self._origin(values[3:], e, loss is not None) if found and self.attribution else None
            self._writer.step(e.step, loss=loss, loss_scale=values[2], found_inf=found, skipped=found and e.skip,
                              layers=layers or {}, first_nonfinite=first)

    def _decode_stats(self, values: list[float], meta: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
        out = {}
        for k, (path, n) in enumerate(meta):
            finite, max_abs, sumsq, zero, below, zero_unscaled, over = values[7 * k:7 * k + 7]
            nonfinite = n - finite
            out[path] = {
                "grad_max_abs": max_abs if finite else float("nan"),
                "grad_rms": math.sqrt(sumsq / finite) if finite else float("nan"),
                "zero": zero / n,
                "nonfinite": nonfinite / n,
                # zero once unscaled = zero, non-finite (set to 0) or flushed by the division
                "underflow": (below - zero_unscaled) / n,
                "overflow": over / n,
            }
        return out

    def _origin(self, maxima: list[float], e: _Pending, finite_loss: bool) -> dict[str, str]:
        bad = [not math.isfinite(x) for x in maxima]
        nf, nb = len(e.fwd_who), len(e.bwd_who)
        for k in range(nf):
            if bad[k]:
                return {"path": self._candidates[e.fwd_who[k]], "where": "output"}
        if not finite_loss:  # the loss comes after every layer's output and before every gradient
            return {"path": "", "where": "loss"}
        for k in range(nb):
            if bad[nf + k]:
                return {"path": self._candidates[e.bwd_who[k]], "where": "gradient"}
        # a parameter gradient overflowed while no input gradient did: the first such layer in
        # backward order (the one called last in the forward)
        last_call = {i: k for k, i in enumerate(e.fwd_who)}
        hit = {e.param_who[k] for k in range(len(e.param_who)) if bad[nf + nb + k]}
        if hit:
            return {"path": self._candidates[max(hit, key=lambda i: last_call.get(i, -1))], "where": "gradient"}
        return {"path": "", "where": "loss"}

    def _header(self) -> None:
        if self._writer is not None:
            return
        from .core.io import policy_to_dict
        from .diagnostics.runlog import RunLogWriter

        policy = self._amp.active_policy
        self._writer = RunLogWriter(self.path, framework="torch", compute_dtype=policy.compute_dtype,
                                    layers=self._forward_order(), policy=policy_to_dict(policy),
                                    min_scale=self._amp.scaler.config.min_scale,
                                    extra={"every": self.every, "attribution": self.attribution})

    def _forward_order(self) -> list[str]:
        """The Plan's paths in the order the first forward called them; modules it did not call
        (MultiheadAttention's out_proj) right after their parent's subtree."""
        paths = [r.path for r in self._amp.plan.rows if r.path]
        known = set(paths)
        order = [p for p in self._order if p in known]
        placed = set(order)
        for p in paths:
            if p in placed:
                continue
            parent = p.rsplit(".", 1)[0] if "." in p else ""
            at = max((j for j, q in enumerate(order) if not parent or q == parent or q.startswith(parent + ".")),
                     default=len(order) - 1)
            order.insert(at + 1, p)
            placed.add(p)
        return order


# --- apply -------------------------------------------------------------------------------------

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
    fwd = _installed(model)
    if fwd is not None:
        raise ModelNotSupportedError(
            "this model is already applied (ampbridge.torch.apply was called on it); call amp.remove() first, "
            "or use amp.set_epoch/set_step for a schedule")
    for path, module in model.named_modules():
        if path and _installed(module) is not None:
            raise ModelNotSupportedError(f"module {path!r} of this model is already part of an applied model; "
                                         "remove that first (amp.remove())")


def apply(model: nn.Module, policy: Policy | str | Path, device_type: str | None = None) -> "TorchAmp":
    """Realise a policy on a model in place; returns the :class:`TorchAmp` that drives training.

    ``policy``: a Policy, a preset name or a policy file path. ``device_type``: where autocast
    runs (default: the model's parameters' device type).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> amp = apply(model, "mixed_float16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> bool(amp.step(model(torch.ones(3, 4)).mean(), opt))  # |grads| * 65536 stays below float16's max
        True
    """
    _check_model(model)
    from .diagnostics.environment import effective_policy

    given = _as_policy(policy)
    effective = effective_policy(given, "torch")  # the bisect switch; warns once, at the caller
    return TorchAmp(model, effective, _device_type_of(model, device_type), notes=_environment_notes(given, effective))


def _environment_notes(given: Policy, effective: Policy) -> tuple[str, ...]:
    """The Plan note when ``AMPBRIDGE_DISABLE=1`` or ``AMPBRIDGE_POLICY=...`` replaced the policy."""
    if effective is given:
        return ()
    return (f"the environment replaced the policy given ({given.source or 'in code'}) with "
            f"{effective.source or 'another'} (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY)",)


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
        self._position = {"step": 0, "epoch": 0}
        self._unit = policy.phase_unit
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._last_optimizers: list[Any] = []
        self._phase_index = policy.phase_index(step=0, epoch=0) if policy.phases else None
        phase_policy = policy.at(step=0, epoch=0)
        resolved, notes = _resolve_for_device(phase_policy, device_type)
        self._realisation = _realise(model, resolved, device_type, notes=self._env_notes + tuple(notes))
        self._resolved = resolved
        self._cast_storage(self._realisation)
        self._install(self._realisation)
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
    def active_policy(self) -> Policy:
        """The resolved policy in force (the current phase's, ``auto`` resolved for the device)."""
        return self._resolved

    @property
    def phase(self) -> int | None:
        """Index of the phase in force (None without a schedule, or past a closed last phase)."""
        return self._phase_index

    def __repr__(self) -> str:
        p = self._resolved
        return (f"TorchAmp({type(self.model).__name__} on {self.device_type}: compute {p.compute_dtype}, "
                f"params {p.param_dtype}, loss scale {self.scaler.config.mode})")

    # --- realisation

    def _cast_storage(self, realisation: _Realisation) -> None:
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
        for opt in list(self._optimizers):
            for p, _, dtype in changed:
                state = opt.state.get(p)
                if not state:
                    continue
                for key, value in state.items():
                    if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape
                            and value.dtype != dtype):
                        state[key] = value.to(dtype)

    def _install(self, realisation: _Realisation) -> None:
        modules = dict(self.model.named_modules())
        for path, spec in realisation.specs.items():
            _install(modules[path], spec)
        self._hooks = [module.register_forward_pre_hook(_keep_slow_path)
                       for path, module in modules.items() if isinstance(module, nn.TransformerEncoderLayer)
                       and any(p != path and (not path or p.startswith(path + ".")) for p in realisation.specs)]

    def _uninstall(self) -> None:
        for _, module in self.model.named_modules():
            _uninstall(module)
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []

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
        with _matmul_precision(root.matmul_precision), _region(self.device_type, root.region):
            yield

    def step(self, loss: torch.Tensor, optimizer: Any | Sequence[Any]) -> StepResult:
        """Scale, backward, unscale, skip or step, update; True (truthy) when the step was applied.

        ``optimizer`` may be a sequence of optimizers sharing one loss. Gradients are not zeroed.
        """
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if optimizers != self._last_optimizers:
            self._optimizers.update(optimizers)
            self._last_optimizers = optimizers
        with _matmul_precision(self._resolved.matmul_precision):
            self.scaler.scale(loss).backward()
            for opt in optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        result = self.scaler.last_step_result
        self._position["step"] += 1
        if self._unit == "step":
            self._switch_to(self.policy.phase_index(step=self._position["step"]))
        return result

    def monitor(self, path: str | Path, every: int = 1, *, attribution: bool = True) -> Monitor:
        """Log loss, scale, skips, overflow origins and (every N-th step) per-layer gradient
        statistics to ``path`` (JSON Lines, read by ``ampbridge report``); see :class:`Monitor`.

        Use it as a context manager, or call ``.close()``; ``amp.remove()`` closes it too.
        """
        if self._monitor is not None and not self._monitor.closed:
            raise AmpBridgeError(f"this model already has a monitor writing {str(self._monitor.path)!r}; close it "
                                 "first (monitor.close())")
        self._monitor = Monitor(self, path, every, attribution=attribution)
        return self._monitor

    def trace(self, *args: Any, **kwargs: Any) -> Plan:
        """The Plan as observed in one forward on these inputs (no gradients; buffers and RNG restored).

        Every row that ran says what it really computed in; rows that follow their input's dtype
        get the observed dtype, rows that did not run say so.
        """
        return _trace(self, args, kwargs)

    # --- schedules

    def set_epoch(self, epoch: int, optimizers: Iterable[Any] = ()) -> None:
        """Tell amp the epoch (for a schedule by epoch: switch to the phase in force).

        ``optimizers``: optimizers whose state must follow a parameter-storage change (those used
        with ``amp.step`` are known already).
        """
        self._set_position("epoch", epoch, optimizers)

    def set_step(self, step: int, optimizers: Iterable[Any] = ()) -> None:
        """Tell amp the global step (for a schedule by step: switch to the phase in force)."""
        self._set_position("step", step, optimizers)

    def _set_position(self, unit: str, value: int, optimizers: Iterable[Any]) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{unit} must be an integer >= 0; received {value!r}")
        for opt in optimizers:
            self._optimizers.add(opt)
        self._position[unit] = value
        if self.policy.phase_unit == unit:
            self._switch_to(self.policy.phase_index(**{unit: value}))

    def _switch_to(self, index: int | None) -> None:
        if index == self._phase_index or not self.policy.phases:
            return
        before = self._resolved
        phase_policy = self.policy.phases[index].policy if index is not None else self.policy.replace(phases=())
        resolved, notes = _resolve_for_device(phase_policy, self.device_type)
        realisation = _realise(self.model, resolved, self.device_type, notes=self._env_notes + tuple(notes))
        self._uninstall()
        self._cast_storage(realisation)
        self._install(realisation)
        reset = index is not None and self.policy.phases[index].reset_loss_scale
        self.scaler._allow_fp16_grads = any(d == torch.float16 for _, d in realisation.storage.values())
        self.scaler.reconfigure(resolved.loss_scale, compute_dtype=resolved.compute_dtype, reset=reset)
        self._realisation, self._resolved, self._phase_index = realisation, resolved, index
        unit = self.policy.phase_unit
        log.info("%s %d: phase %s in force (compute %s -> %s, loss scale %s%s)", unit, self._position[unit],
                 index if index is not None else "after the schedule", before.compute_dtype,
                 resolved.compute_dtype, self.scaler.config.mode, ", reset" if reset else "")

    # --- state

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state (five reference fields) and the schedule position, for checkpoints."""
        return {"loss_scale": self.scaler.loss_scale_state().to_dict(), "step": self._position["step"],
                "epoch": self._position["epoch"], "phase": self._phase_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the phase in force follows the saved position)."""
        unknown = set(state) - {"loss_scale", "step", "epoch", "phase"}
        if "loss_scale" not in state or unknown:
            raise ValueError(f"not an ampbridge.torch state dict: needs 'loss_scale' (and step, epoch, phase); "
                             f"unknown keys {sorted(unknown)}")
        self._position["step"] = int(state.get("step", 0))
        self._position["epoch"] = int(state.get("epoch", 0))
        if self.policy.phases:
            unit = self.policy.phase_unit or "step"
            self._switch_to(self.policy.phase_index(**{unit: self._position[unit]}))
        self.scaler.load_loss_scale_state(LossScaleState.from_dict(state["loss_scale"]))


# --- plan and trace ----------------------------------------------------------------------------

def plan(model: nn.Module, policy: Policy | str | Path, *example_inputs: Any, device_type: str | None = None,
         **example_kwargs: Any) -> Plan:
    """The Plan of a model under a policy (what ``apply`` would run).

    With example inputs, one forward runs (on a copy, applied, without gradients) and every row
    shows the dtype its module really computed in.

    Example:
        >>> p = plan(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1)), "mixed_bfloat16")
        >>> p["1"].note
        "follows its input's dtype: cpu autocast leaves Softmax alone (bfloat16 when fed by a bfloat16 layer)"
    """
    from .diagnostics.environment import effective_policy

    given = _as_policy(policy)
    policy = effective_policy(given, "torch", warn=False)  # what apply would run
    env_notes = _environment_notes(given, policy)
    if not example_inputs and not example_kwargs:
        device_type = _device_type_of(model, device_type) if not isinstance(model, torch.jit.ScriptModule) else (
            device_type or "cpu")
        resolved, notes = _resolve_for_device(policy.at(step=0, epoch=0), device_type)
        notes = list(env_notes) + notes
        if isinstance(model, torch.jit.ScriptModule):
            def model_output(row: PlanRow) -> PlanRow:
                out = resolved.output_dtype
                if row.path or row.output_dtype == out:
                    return row
                note = f"model outputs cast to output_dtype {out}" if out != row.compute_dtype else None
                return with_note(row, note, output_dtype=out)

            built = build_plan(layers(model), resolved, framework="torch", adjust=model_output)
            return Plan(built.rows, built.policy, "torch", built.unmatched_rules,
                        tuple(notes) + ("a TorchScript module: rows as requested (autocast's per-op behaviour "
                                        "is not inspected)",))
        return _realise(model, resolved, device_type, notes=notes).plan
    if isinstance(model, torch.jit.ScriptModule) or _installed(model) is not None:
        raise ModelNotSupportedError("plan(model, policy, *example_inputs) traces an eager, un-applied model; "
                                     "for an applied one call amp.trace(*example_inputs)")
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpBridgeWarning)
        _check_model(twin)
        amp = TorchAmp(twin, policy, _device_type_of(twin, device_type), notes=env_notes)
    # the unmatched-rule warnings belong to the caller, once
    _realise(model, amp.active_policy, amp.device_type)
    return amp.trace(*example_inputs, **example_kwargs)


_COMPUTE_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_trilinear", "native_layer_norm",
                "native_group_norm", "native_batch_norm", "_native_batch_norm_legit", "_softmax", "_log_softmax",
                "embedding", "_embedding_bag", "mkldnn_rnn_layer", "_fused_rms_norm", "gelu",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention", "_cudnn_rnn", "cudnn_batch_norm", "_prelu_kernel")
_IGNORED_OPS = ("_to_copy", "copy_", "detach", "empty", "zeros", "ones", "full", "empty_like", "zeros_like",
                "arange", "lift_fresh")


def _trace(amp: TorchAmp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    from torch.utils._python_dispatch import TorchDispatchMode

    model = amp.model
    paths = {id(m): p for p, m in model.named_modules()}
    stack: list[str] = []
    main: dict[str, list[str]] = defaultdict(list)  # path -> dtypes of its main ops
    last: dict[str, str] = {}  # path -> dtype of its last floating op
    regions: dict[str, str] = {}  # path -> region seen by its children
    delivered: dict[str, str] = {}  # path -> dtype of its (first floating) output
    ran: set[str] = set()

    def region_now() -> str:
        if torch.is_autocast_enabled(amp.device_type):
            return _NAMES.get(torch.get_autocast_dtype(amp.device_type), "float32")
        return "float32"

    def pre(module: nn.Module, _args: Any) -> None:
        path = paths.get(id(module))
        if path is None:
            return
        if stack:
            regions.setdefault(stack[-1], region_now())
        stack.append(path)
        ran.add(path)

    def post(module: nn.Module, _args: Any, out: Any) -> None:
        path = paths.get(id(module))
        if path is not None and stack:
            stack.pop()
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype in _NAMES:
                delivered.setdefault(path, _NAMES[first.dtype])

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if stack and name not in _IGNORED_OPS:
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if isinstance(first, torch.Tensor) and first.is_floating_point():
                    dtype = _NAMES.get(first.dtype, str(first.dtype).replace("torch.", ""))
                    last[stack[-1]] = dtype
                    if name in _COMPUTE_OPS:
                        main[stack[-1]].append(dtype)
            return out

    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    hooks = [nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post, always_call=True)]
    rng_devices = [] if amp.device_type == "cpu" else None  # None: every device of that type
    rng_type = "cuda" if amp.device_type == "cpu" else amp.device_type
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=rng_devices, device_type=rng_type), Recorder():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])
    rows = []
    for row in amp.plan.rows:
        path = row.path
        if path not in ran:
            rows.append(row if row.note and "used by" in row.note else
                        with_note(row, _join(row.note, "did not run in the traced forward")))
            continue
        if path in regions and not main.get(path):
            observed = regions[path]
        elif main.get(path):
            observed = main[path][0] if len(set(main[path])) == 1 else "+".join(sorted(set(main[path])))
        else:
            observed = last.get(path)
        follows = path in amp._realisation.input_following
        if observed is None or (observed == row.compute_dtype and not follows):
            rows.append(row)
            continue
        changes: dict[str, Any] = {}
        if observed in DTYPES:
            changes["compute_dtype"] = observed
            if follows and path in delivered:
                changes["output_dtype"] = delivered[path]
        reason = row.note.split(" (")[0] if follows and row.note else row.note
        rows.append(with_note(row, _join(reason, f"traced: ran in {observed}"), **changes))
    return Plan(tuple(rows), amp.plan.policy, "torch", amp.plan.unmatched_rules,
                amp.plan.notes + ("traced: compute dtypes observed in one forward",))


def _join(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


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

    from .recipes import to_fsdp

    policy = _as_policy(policy)
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
