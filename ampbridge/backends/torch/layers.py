"""The model's walk: neutral ``Layer`` descriptors (path, kind, class name, parameter count), the
portable kinds of torch.nn classes, and the registry's question (is this a torch model?).

Holds ``owns``, ``kind_of``, ``layers``, ``_class_name`` and ``_entries``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

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


def kind_of(module: nn.Module) -> str | None:
    """The portable kind of a module: its ``ampbridge_kind`` attribute, else its torch.nn class.

    Example:
        >>> import torch
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
