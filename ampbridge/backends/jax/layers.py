"""The model walk's vocabulary: portable kinds of Flax classes (linen and NNX), class names, the
facts a Plan note needs, rows resolved from a module's ancestry, and a plain pytree's key paths as
neutral ``Layer`` descriptors.

Holds: _LINEN_KINDS, _NNX_KINDS, _kind_of, _kind_and_source, _class_name, _has_field, _is_float_dtype_or_none,
_Facts, _facts, _row_notes, _Resolver, _key_name, _tree_layers.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...core.kinds import KindRegistry, infer_kind
from ...core.matching import join_path
from ...core.plan import Layer, PlanRow, RowResolver, with_note
from ...core.policy import Policy
from .environment import _floating, _linen, _nnx

# --- kinds and rows -----------------------------------------------------------------------------

_LINEN_KINDS = {
    "norm": ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm"),
    "embedding": ("Embed",),
    "linear": ("Dense", "DenseGeneral", "Einsum"),
    "conv": ("Conv", "ConvTranspose", "ConvLocal"),
    "attention": ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention"),
    "recurrent": ("RNNCellBase", "RNN", "Bidirectional"),
}
_NNX_KINDS = {
    "norm": ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm"),
    "embedding": ("Embed",),
    "linear": ("Linear", "LinearGeneral", "Einsum"),
    "conv": ("Conv", "ConvTranspose"),
    "attention": ("MultiHeadAttention",),
    "recurrent": ("RNNCellBase", "RNN", "Bidirectional"),
}


@functools.lru_cache(maxsize=None)
def _class_table(flavour: str) -> dict[type, str]:
    if flavour == "linen":
        mod, kinds = _linen(), _LINEN_KINDS
    else:
        mod, kinds = _nnx(), _NNX_KINDS
    table = {}
    for kind, names in kinds.items():
        for name in names:
            cls = getattr(mod, name, None)
            if isinstance(cls, type):
                table[cls] = kind
    return table


_REGISTERED = KindRegistry()


def register_kind(cls: type, kind: str | None) -> None:
    """Give a Flax module class (linen or NNX, and its subclasses) a portable kind in code; ``None``:
    no kind. Beats Flax's classes and the inference from names; the policy's ``[kinds]`` beats it."""
    _REGISTERED.register(cls, kind)


def _kind_of(obj: Any, flavour: str) -> str | None:
    return _kind_and_source(obj, flavour)[0]


def _kind_and_source(obj: Any, flavour: str) -> tuple[str | None, str | None]:
    """``(kind, how it was decided)``, as torch's and Keras's rows say it: the ``ampbridge_kind``
    attribute, :func:`register_kind`, Flax's own classes (``"framework class"``), then the core's
    inference from the class's and its bases' names (``"class name"``, ``"base class X"``)."""
    declared = getattr(obj, "ampbridge_kind", None)
    if declared is not None:
        return declared, "ampbridge_kind attribute"
    registered = _REGISTERED.lookup(getattr(type(obj), "_ampbridge_original", type(obj)))
    if _REGISTERED.found(registered):
        return registered, "registered"
    table = _class_table(flavour)
    for cls in type(obj).__mro__:
        if cls in table:
            return table[cls], "framework class"
    return _inferred(getattr(type(obj), "_ampbridge_original", type(obj)))


@functools.lru_cache(maxsize=None)
def _inferred(cls: type) -> tuple[str | None, str | None]:
    """The core's inference from the class's and its bases' names (Gemma's RMSNorm, an Embedder)."""
    return infer_kind([c.__name__ for c in cls.__mro__ if not c.__module__.startswith(("flax.", "builtins"))])


def _class_name(obj: Any) -> str:
    cls = getattr(type(obj), "_ampbridge_original", type(obj))
    return cls.__name__


def _has_field(obj: Any, name: str) -> bool:
    fields = getattr(type(obj), "__dataclass_fields__", None)
    if fields is not None:
        return name in fields
    return name in getattr(obj, "__dict__", {})


def _is_float_dtype_or_none(value: Any) -> bool:
    if value is None:
        return True
    try:
        return _floating(jnp.dtype(value))
    except TypeError:
        return False


class _Facts(NamedTuple):
    """What a Plan note needs to know about one module (kept instead of the module itself)."""

    float32_reductions: bool = False
    float32_softmax: bool = False
    batch_norm: bool = False
    odd_dtype: str | None = None  # a non-float ``dtype`` attribute, left alone
    kind_source: str | None = None  # how the module's kind was decided (the row shows it)


#: NNX's norms have no force_float32_reductions switch: their statistics always run in float32
#: (flax.nnx.nn.normalization._compute_stats promotes to float32) and so does the normalisation
_NNX_FLOAT32_NORMS = ("LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm")


def _nnx_float32_norm(module: Any) -> bool:
    return any(c.__module__ == "flax.nnx.nn.normalization" and c.__name__ in _NNX_FLOAT32_NORMS
               for c in type(module).__mro__)


def _facts(module: Any, kind_source: str | None = None) -> _Facts:
    if module is None:
        return _Facts()
    odd = None
    if _has_field(module, "dtype") and not _is_float_dtype_or_none(getattr(module, "dtype", None)):
        odd = str(getattr(module, "dtype"))
    return _Facts(bool(getattr(module, "force_float32_reductions", False)) or _nnx_float32_norm(module),
                  bool(getattr(module, "force_fp32_for_softmax", False)),
                  any(c.__name__ == "BatchNorm" for c in type(module).__mro__), odd, kind_source)


def _row_notes(row: PlanRow, facts: _Facts, output_dtype: str | None = None) -> PlanRow:
    """Say where Flax itself computes in another dtype than the row asks (its own machinery).

    ``output_dtype`` (the policy's) is what the root row ``""`` delivers: the model's outputs are
    cast to it, as in every backend.
    """
    notes = []
    low = row.compute_dtype != "float32"
    if row.kind == "norm" and low and facts.float32_reductions:
        notes.append("Flax computes the statistics and the normalisation in float32 "
                     f"(force_float32_reductions); input, parameters and output in {row.compute_dtype}")
    if facts.float32_softmax and low:
        notes.append("softmax in float32 (force_fp32_for_softmax)")
    if facts.batch_norm:
        notes.append("running statistics (batch_stats) kept in float32")
        if row.kind == "norm" and low and not facts.float32_reductions:
            # x - mean with a float32 mean promotes: Flax's (and its copies') BatchNorm normalises in float32
            notes.append("the normalisation runs in float32 (its float32 statistics promote it); "
                         f"input, parameters and output in {row.compute_dtype}")
    if facts.odd_dtype is not None:
        notes.append(f"the module's dtype={facts.odd_dtype} is not a float dtype; left as set")
    changes = {}
    if row.path == "" and output_dtype is not None:  # the model itself: what its caller receives
        changes["output_dtype"] = output_dtype
        if output_dtype != row.compute_dtype:
            notes.append(f"model outputs cast to output_dtype {output_dtype}")
    if not notes and not changes:
        return row
    return with_note(row, "; ".join(notes) or row.note, **changes)


class _Resolver:
    """Plan rows from a module's ancestry, cached: the same rule resolution as :func:`plan`."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._resolve = RowResolver(policy)
        self._rows: dict[tuple, PlanRow] = {}
        self._lock = threading.Lock()

    def row(self, chain: tuple[tuple[str, str | None, str], ...]) -> PlanRow:
        """``chain``: (path, kind, class name) from the root down to the module itself."""
        with self._lock:
            hit = self._rows.get(chain)
        if hit is not None:
            return hit
        row = self._resolve.row([Layer(path, kind, cls) for path, kind, cls in chain])
        with self._lock:
            self._rows[chain] = row
        return row


# --- plain pytrees -----------------------------------------------------------------------------

def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _tree_layers(tree: Any) -> list[Layer]:
    """One Layer per inner node of a pytree (its key path), for path rules on plain pytrees."""
    seen: dict[str, int] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_key_name(k) for k in keypath]
        size = int(np.prod(np.shape(leaf))) if hasattr(leaf, "shape") else 0
        for depth in range(len(names)):
            path = join_path(*names[:depth])
            seen.setdefault(path, 0)
        owner = join_path(*names[:-1])
        seen[owner] = seen.get(owner, 0) + size
    return [Layer(path, None, "", count) for path, count in seen.items()]
