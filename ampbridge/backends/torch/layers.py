"""The model's walk: neutral ``Layer`` descriptors (path, kind, class name, parameter count), the
portable kinds of torch.nn classes, and the registry's question (is this a torch model?).

Holds ``owns``, ``kind_of``, ``kind_and_source``, ``register_kind``, ``layers``, ``class_name``,
``module_entries`` and ``kept_in_float32`` (the modules a transformers model keeps in float32).
Kinds: ``ampbridge_kind`` attribute, ``register_kind``, torch.nn's classes, then the core's
inference (:mod:`ampbridge.core.kinds`) on the class and its bases' names, then structure.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any, NamedTuple

import torch
from torch import nn

from ...core.kinds import KindRegistry, infer_kind
from ...core.matching import KINDS
from ...core.plan import Layer


def owns(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` that is not a Keras layer (the registry's question).

    Under the torch Keras backend every Keras layer is also an ``nn.Module``; those belong to
    ``ampbridge.keras``, whose dtype policies they obey.
    """
    if not isinstance(obj, nn.Module):
        return False
    keras = sys.modules.get("keras")
    return not (keras is not None and isinstance(obj, keras.layers.Layer))


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


_REGISTERED = KindRegistry()


def register_kind(cls: type, kind: str | None) -> None:
    """Give a module class (and its subclasses) a portable kind in code; ``None``: no kind.

    Beats torch.nn's classes and the inference from names; the policy's ``[kinds]`` table beats it.

    Example:
        >>> import torch
        >>> class Scale(torch.nn.Module): pass
        >>> register_kind(Scale, "norm"); kind_and_source(Scale())
        ('norm', 'registered')
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"ampbridge.torch.register_kind needs a torch.nn.Module subclass; received {cls!r}")
    _REGISTERED.register(cls, kind)


def kind_of(module: nn.Module) -> str | None:
    """The portable kind of a module (see :func:`kind_and_source` for how it is decided).

    Example:
        >>> import torch
        >>> kind_of(torch.nn.LayerNorm(4)), kind_of(torch.nn.ReLU())
        ('norm', None)
    """
    return kind_and_source(module)[0]


def kind_and_source(module: nn.Module) -> tuple[str | None, str | None]:
    """``(kind, how it was decided)``: the ``ampbridge_kind`` attribute, :func:`register_kind`, the
    torch.nn class, the core's inference from the class's and its bases' names, then structure (a
    ``*Conv1D`` whose weight is 2-D, as transformers' GPT-2 ``Conv1D``, is a linear map).

    Example:
        >>> import torch
        >>> class LlamaRMSNorm(torch.nn.Module): pass
        >>> kind_and_source(LlamaRMSNorm()), kind_and_source(torch.nn.LayerNorm(4))
        (('norm', 'class name'), ('norm', 'framework class'))
    """
    declared = getattr(module, "ampbridge_kind", _MISSING)
    if declared is not _MISSING:
        if declared is not None and declared not in KINDS:
            raise ValueError(f"{type(module).__name__}.ampbridge_kind: unknown kind {declared!r}; "
                             f"accepted: {', '.join(KINDS)} or None")
        return declared, "ampbridge_kind attribute"
    registered = _REGISTERED.lookup(type(module))
    if _REGISTERED.found(registered):
        return registered, "registered"
    if isinstance(module, torch.jit.ScriptModule):
        name = class_name(module)
        if name in _KIND_BY_NAME:
            return _KIND_BY_NAME[name], "framework class"
        return infer_kind([name], leaf=next(module.children(), None) is None)
    for cls, kind in _kind_table():
        if isinstance(module, cls):
            return kind, "framework class"
    kind, source = _inferred(type(module), next(module.children(), None) is None)
    if kind == "conv":
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and next(module.children(), None) is None:
            return "linear", "structure: a 2-D weight is a linear map (conv weights have 3+ dims)"
    return kind, source


@functools.lru_cache(maxsize=4096)
def _inferred(cls: type, leaf: bool) -> tuple[str | None, str | None]:
    """The core's inference on a class's and its bases' names (once per class: a model repeats them)."""
    return infer_kind([c.__name__ for c in cls.__mro__ if c not in (nn.Module, object)], leaf=leaf)


def class_name(module: nn.Module) -> str:
    """The module's class name as Plans and messages give it (a scripted module's original class,
    FSDP2's wrapper class's model class).

    Example:
        >>> class_name(nn.Linear(1, 1))
        'Linear'
    """
    if isinstance(module, torch.jit.ScriptModule):
        return getattr(module, "original_name", type(module).__name__)
    cls = type(module)
    # FSDP2's fully_shard swaps in a class FSDP<Name>(FSDPModule, <Name>): report <Name>
    if cls.__name__.startswith("FSDP") and any(b.__name__ == "FSDPModule" for b in cls.__mro__[1:]):
        for base in cls.__bases__:
            if base.__name__ != "FSDPModule":
                return base.__name__
    return cls.__name__


def module_entries(model: nn.Module) -> list[tuple[str, nn.Module]]:
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
    for path, module in module_entries(model):
        own = 0
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not isinstance(p, nn.parameter.UninitializedParameter):
                own += p.numel()
        kind, source = kind_and_source(module)
        out.append(Layer(path, kind, class_name(module), own, source))
    return out


# --- the model author's float32 modules (transformers' _keep_in_fp32_modules) ---------------------

class Kept(NamedTuple):
    """A module that a model's ``_keep_in_fp32_modules`` (or ``_strict``) names."""

    strict: bool  # _keep_in_fp32_modules_strict: float32 under float16 and bfloat16; else under float16 only
    declared: str  # where, for the row's note: "T5ForConditionalGeneration._keep_in_fp32_modules 'wo'"


def kept_in_float32(model: nn.Module) -> tuple[dict[str, Kept], list[str]]:
    """The modules transformers keeps in float32, and notes on the entries ampbridge cannot pin.

    As transformers 5 does when loading (``PreTrainedModel._get_dtype_plan`` and
    ``core_model_loading.build_glob_alternation``): each entry of a module's
    ``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict`` is a regex (``*`` read as ``.*``)
    *searched* in the names of that module's parameters and buffers (``encoder.block.0.layer.1.
    DenseReluDense.wo.weight`` for T5's ``wo``); the module owning a matching one is kept. A
    parameter the declaring model owns itself (BLIP-2's ``query_tokens``) has no module of its own
    to pin: it is listed in the notes instead. Any module may declare them (duck-typed: no import).

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     _keep_in_fp32_modules = ["head"]
        ...     def __init__(self):
        ...         super().__init__(); self.body, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> kept, notes = kept_in_float32(Net())
        >>> sorted(kept), kept["head"].strict, notes
        (['head'], False, [])
    """
    kept: dict[str, Kept] = {}
    notes: list[str] = []
    for prefix, module in model.named_modules():
        for strict, attr in ((False, "_keep_in_fp32_modules"), (True, "_keep_in_fp32_modules_strict")):
            entries = getattr(module, attr, None)
            if not entries or isinstance(entries, str):
                continue
            names = [n for n, _ in module.named_parameters(remove_duplicate=False)] + \
                    [n for n, _ in module.named_buffers(remove_duplicate=False)]
            for entry in sorted(entries):
                searched = re.compile(str(entry).replace("*", ".*"))
                declared = f"{class_name(module)}.{attr} {entry!r}"
                for name in names:
                    if searched.search(name) is None:
                        continue
                    owner = name.rpartition(".")[0]
                    if not owner:
                        note = (f"{declared} names {prefix + '.' if prefix else ''}{name}, a parameter of the "
                                f"{'model' if not prefix else repr(prefix)} itself: no module of its own to keep in "
                                f"float32, so it follows its module's row")
                        if note not in notes:
                            notes.append(note)
                        continue
                    path = f"{prefix}.{owner}" if prefix else owner
                    if path not in kept or (strict and not kept[path].strict):
                        kept[path] = Kept(strict, declared)
    return kept, notes
