"""The model's walk: neutral ``Layer`` descriptors (path, kind, class name, parameter count), the
portable kinds of torch.nn classes, and the registry's question (is this a torch model?).

Holds ``owns``, ``kind_of``, ``kind_and_source``, ``register_kind``, ``layers``, ``_class_name`` and
``_entries``. Kinds: ``ampbridge_kind`` attribute, ``register_kind``, torch.nn's classes, then the core's
inference (:mod:`ampbridge.core.kinds`) on the class and its bases' names, then structure.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

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
        name = _class_name(module)
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
        kind, source = kind_and_source(module)
        out.append(Layer(path, kind, _class_name(module), own, source))
    return out
