"""The model walk's vocabulary: portable kinds of Flax classes (linen and NNX), class names, the
facts a Plan note needs, rows resolved from a module's ancestry, and a plain pytree's key paths as
neutral ``Layer`` descriptors; the contract's ``layers``, ``owns`` and ``register_kind``.

Holds: layers, owns, register_kind,
_LINEN_KINDS, _NNX_KINDS, kind_of, kind_and_source, class_name_of, has_field, is_float_dtype_or_none,
Facts, facts_of, row_notes, Resolver, dtype_name, carried, author_dtypes, key_name, tree_layers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...core.kinds import KindRegistry, infer_kind, settle_kinds
from ...core.matching import join_path
from ...core.plan import BY_MODEL, Layer, PlanRow, RowResolver, with_note
from ...core.policy import Policy
from ..common import room_above
from .environment import is_floating, linen_module, nnx_module

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
        mod, kinds = linen_module(), _LINEN_KINDS
    else:
        mod, kinds = nnx_module(), _NNX_KINDS
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


def kind_of(obj: Any, flavour: str) -> str | None:
    return kind_and_source(obj, flavour)[0]


def kind_and_source(obj: Any, flavour: str) -> tuple[str | None, str | None]:
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


def class_name_of(obj: Any) -> str:
    cls = getattr(type(obj), "_ampbridge_original", type(obj))
    return cls.__name__


def has_field(obj: Any, name: str) -> bool:
    fields = getattr(type(obj), "__dataclass_fields__", None)
    if fields is not None:
        return name in fields
    return name in getattr(obj, "__dict__", {})


def is_float_dtype_or_none(value: Any) -> bool:
    if value is None:
        return True
    try:
        return is_floating(jnp.dtype(value))
    except TypeError:
        return False


class Facts(NamedTuple):
    """What a Plan note needs to know about one module (kept instead of the module itself)."""

    float32_reductions: bool = False
    float32_softmax: bool = False
    batch_norm: bool = False
    odd_dtype: str | None = None  # a non-float ``dtype`` attribute, left alone
    kind_source: str | None = None  # how the module's kind was decided (the row shows it)
    fixed: tuple[str, str] | None = None  # (dtype, param_dtype) its author fixed (author_dtypes)


#: NNX's norms have no force_float32_reductions switch: their statistics always run in float32
#: (flax.nnx.nn.normalization._compute_stats promotes to float32) and so does the normalisation
_NNX_FLOAT32_NORMS = ("LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm")


def _nnx_float32_norm(module: Any) -> bool:
    return any(c.__module__ == "flax.nnx.nn.normalization" and c.__name__ in _NNX_FLOAT32_NORMS
               for c in type(module).__mro__)


def facts_of(module: Any, kind_source: str | None = None) -> Facts:
    if module is None:
        return Facts()
    odd = None
    if has_field(module, "dtype") and not is_float_dtype_or_none(getattr(module, "dtype", None)):
        odd = str(getattr(module, "dtype"))
    return Facts(bool(getattr(module, "force_float32_reductions", False)) or _nnx_float32_norm(module),
                  bool(getattr(module, "force_fp32_for_softmax", False)),
                  any(c.__name__ == "BatchNorm" for c in type(module).__mro__), odd, kind_source)


def row_notes(row: PlanRow, facts: Facts, output_dtype: str | None = None) -> PlanRow:
    """Say where Flax itself computes in another dtype than the row asks (its own machinery).

    ``output_dtype`` (the policy's) is what the root row ``""`` delivers: the model's outputs are
    cast to it, as in every backend.
    """
    notes, changes = [], {}
    low = row.compute_dtype != "float32"
    if row.kind == "norm" and low and facts.float32_reductions:
        notes.append("Flax computes the statistics and the normalisation in float32 "
                     f"(force_float32_reductions); input, parameters and output in {row.compute_dtype}")
        changes["float32_inside"] = True
    if facts.float32_softmax and low:
        notes.append("softmax in float32 (force_fp32_for_softmax)")
        changes["float32_inside"] = True
    if facts.batch_norm:
        notes.append("running statistics (batch_stats) kept in float32")
        if row.kind == "norm" and low and not facts.float32_reductions:
            # x - mean with a float32 mean promotes: Flax's (and its copies') BatchNorm normalises in float32
            notes.append("the normalisation runs in float32 (its float32 statistics promote it); "
                         f"input, parameters and output in {row.compute_dtype}")
            changes["float32_inside"] = True
    if facts.odd_dtype is not None:
        notes.append(f"the module's dtype={facts.odd_dtype} is not a float dtype; left as set")
    if row.path == "" and output_dtype is not None:  # the model itself: what its caller receives
        changes["output_dtype"] = output_dtype
        if output_dtype != row.compute_dtype:
            notes.append(f"model outputs cast to output_dtype {output_dtype}")
    if not notes and not changes:
        return row
    return with_note(row, "; ".join(notes) or row.note, **changes)


# --- the model author's dtypes --------------------------------------------------------------------

_NO_DEFAULT = object()


def dtype_name(value: Any) -> str | None:
    """The canonical name of a float dtype (``jnp.float32``, ``"bfloat16"``, a dtype); None otherwise."""
    if value is None or isinstance(value, bool):
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        return None
    return dtype.name if is_floating(dtype) else None


@functools.lru_cache(maxsize=None)
def _class_default(cls: type, name: str) -> Any:
    """The default of a linen field, or of an NNX ``__init__`` argument; ``_NO_DEFAULT`` where none."""
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields is not None:
        f = fields.get(name)
        if f is None or f.default is dataclasses.MISSING:
            return _NO_DEFAULT
        return f.default
    try:
        parameter = inspect.signature(cls.__init__).parameters.get(name)
    except (TypeError, ValueError):  # pragma: no cover - a builtin __init__
        return _NO_DEFAULT
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return _NO_DEFAULT
    return parameter.default


def _attribute_values(module: Any) -> list[Any]:
    fields = getattr(type(module), "__dataclass_fields__", None)
    if fields is not None:
        return [getattr(module, f, None) for f in fields if f not in ("parent", "name")]
    return list(vars(module).values())


def carried(module: Any) -> set[str]:
    """The float dtypes a module can hand down to the modules it makes: its own ``dtype`` and the
    ``dtype`` of a configuration object among its attributes (``self.config.dtype``)."""
    names = {dtype_name(getattr(module, "dtype", None))} if has_field(module, "dtype") else set()
    skip = _not_configurations()
    for value in _attribute_values(module):
        if type(value) is types.FunctionType:
            # initialisers, promote_dtype...: never an array, module or variable, so the checks
            # below (jax.Array's and nnx.Variable's isinstance run Python code) are spared
            if hasattr(value, "dtype"):
                names.add(dtype_name(getattr(value, "dtype", None)))
            continue
        # a dtype itself (param_dtype = jnp.float32: a type with a .dtype) is not a configuration
        if value is None or isinstance(value, (str, int, float, tuple, list, dict, type, np.dtype) + skip):
            continue
        if hasattr(value, "dtype"):
            names.add(dtype_name(getattr(value, "dtype", None)))
    names.discard(None)
    return names  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def _not_configurations() -> tuple[type, ...]:
    """Attribute types that are not a configuration object (arrays, modules, variables)."""
    return (jax.Array, np.ndarray, linen_module().Module) + ((nnx_module().Module, nnx_module().Variable) if _has_nnx() else ())


@functools.lru_cache(maxsize=1)
def _has_nnx() -> bool:
    try:
        nnx_module()
    except ImportError:  # pragma: no cover - Flax without NNX
        return False
    return True


def author_dtypes(module: Any, handed_down: set[str], configured: bool = True) -> tuple[str, str] | None:
    """The (dtype, param_dtype) the model's code fixed for a (non-root) Flax module, or None.

    Fixed: its ``dtype`` is a float dtype that differs from the class's default for it and from
    every dtype its enclosing modules hand down (``handed_down``: each one's ``dtype`` as written
    and as ampbridge runs it, and a configuration's ``dtype``), e.g. ``nn.Dense(3, dtype=jnp.float32)``
    in a model whose ``dtype`` is None or bfloat16. A model that passes its one ``dtype`` to every
    module fixes none of them. Where no enclosing module has a dtype setting at all (``configured``
    False: no ``dtype`` attribute, no configuration with one), float32 is Flax's own default written
    out (``dtype=jnp.float32`` on every module), not a decision. The module's ``param_dtype`` as
    written comes with it.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn
        >>> author_dtypes(nn.Dense(3, dtype=jnp.float32), {"bfloat16"})
        ('float32', 'float32')
        >>> author_dtypes(nn.Dense(3, dtype=jnp.float32), {"float32"}) is None  # handed down
        True
        >>> author_dtypes(nn.Dense(3, dtype=jnp.float32), set(), configured=False) is None
        True
    """
    if not has_field(module, "dtype"):
        return None
    name = dtype_name(getattr(module, "dtype", None))
    if name is None or name in handed_down or (name == "float32" and not configured):
        return None
    cls = getattr(type(module), "_ampbridge_original", type(module))
    default = _class_default(cls, "dtype")
    if default is not _NO_DEFAULT and default is not None and dtype_name(default) == name:
        return None
    param = dtype_name(getattr(module, "param_dtype", None)) if has_field(module, "param_dtype") else None
    return name, param or name


class Resolver:
    """Plan rows from a module's ancestry, cached: the same rule resolution as :func:`plan`."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._resolve = RowResolver(policy)
        self._rows: dict[tuple, PlanRow] = {}
        self._lock = threading.Lock()
        self._settled: dict[str, str | None] = {}  # path -> its kind where settle_kinds changed it
        self._settled_from = -1  # how many modules the tree had when settled

    def settle(self, known: dict[str, tuple[str | None, str, Any]]) -> None:
        """Learn which inferred kinds the whole module tree takes away (:func:`settle_kinds`: a
        wrapper named like a norm holding a Dense, the model itself); ``known``: path -> (kind,
        class name, facts), as the recording interceptor fills it. Rows resolved later follow it."""
        if len(known) == self._settled_from:
            return
        items = list(known.items())
        raw = [Layer(path, kind, cls, 0, getattr(facts, "kind_source", None)) for path, (kind, cls, facts) in items]
        listed = [self._resolve.layer(layer) for layer in raw]  # the [kinds] table first, as build_plan
        settled = {layer.path: layer.kind for layer, before in zip(settle_kinds(listed), listed)
                   if layer.kind != before.kind}
        with self._lock:
            if settled != self._settled:
                self._settled, self._rows = settled, {}
            self._settled_from = len(items)

    def row(self, chain: tuple[tuple[str, str | None, str, tuple[str, str] | None], ...]) -> PlanRow:
        """``chain``: (path, kind, class name, dtypes the author fixed) from the root down to the module."""
        settled = self._settled
        if settled:
            chain = tuple((p, settled[p] if p in settled else k, c, f) for p, k, c, f in chain)
        with self._lock:
            hit = self._rows.get(chain)
        if hit is not None:
            return hit
        row = self._resolve.row([Layer(path, kind, cls, fixed=fixed) for path, kind, cls, fixed in chain])
        with self._lock:
            self._rows[chain] = row
        return row


# --- plain pytrees -----------------------------------------------------------------------------

def key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_layers(tree: Any) -> list[Layer]:
    """One Layer per inner node of a pytree (its key path), for path rules on plain pytrees."""
    seen: dict[str, int] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [key_name(k) for k in keypath]
        size = int(np.prod(np.shape(leaf))) if hasattr(leaf, "shape") else 0
        for depth in range(len(names)):
            path = join_path(*names[:depth])
            seen.setdefault(path, 0)
        owner = join_path(*names[:-1])
        seen[owner] = seen.get(owner, 0) + size
    return [Layer(path, None, "", count) for path, count in seen.items()]


# --- the contract's walk: layers / owns ---------------------------------------------------------

def layers(model: Any, *example_inputs: Any, **kwargs: Any) -> list[Layer]:
    """The model's layers as core :class:`~ampbridge.Layer` descriptors, in tree order: what the
    Plan is built from. A ``flax.linen`` module's layers are only known once it runs, so it needs
    example inputs (traced, not computed), as ``plan`` does; NNX modules and dicts of arrays do not.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn
        >>> [(layer.path, layer.kind) for layer in layers(nn.Sequential([nn.Dense(4)]), jnp.ones((1, 3)))]
        [('', None), ('layers_0', 'linear')]
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return list(room_above(__package__, "nnx").nnx_layers(model).layers)
    if isinstance(model, Mapping):
        return tree_layers(model)
    # linen (or its Applied): the rows of its trace, in the order it met them (plan refuses anything else)
    plan = room_above(__package__, "plan").plan  # linen's walk is its Plan's
    rows = plan(model, Policy(), *example_inputs, warn=False, **kwargs).rows
    fixed = {r.path: (r.compute_dtype, r.param_dtype) for r in rows
             if r.rule == BY_MODEL and r.inherited_from is None}
    return [Layer(r.path, r.kind, r.class_name, r.param_count, r.kind_source, fixed.get(r.path))
            for r in rows]


def owns(obj: Any) -> bool:
    """True for Flax modules (linen, NNX) and what ``apply`` returns for linen (``Applied``).

    Plain pytrees are not claimed (the registry caches its answer per type, and a ``dict`` may
    hold any framework's tensors): plan them with ``ampbridge.jax.plan(tree, policy)``.
    """
    if isinstance(obj, room_above(__package__, "apply").Applied):
        return True
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None and isinstance(obj, linen.Module):
        return True
    return nnx is not None and isinstance(obj, nnx.Module)
