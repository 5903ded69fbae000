"""flax.nnx: one walk of the model (tree mode, graph mode for shared references), its Plan, and
the applied copy whose modules' calls follow their rows (a cached subclass per class).

Holds: nnx_layers, nnx_plan, apply_nnx, _NnxModel, _NnxKey, _shared_key, nnx_key, nnx_path,
_nnx_subclass, _own_variables, _is_callable_module, nnx_copy, _tree_mode_first.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...core.matching import join_path
from ...core.plan import BY_MODEL, Layer, Plan, PlanRow, build_plan, gc_paused, join_notes, stream_notes, with_note
from ...core.policy import Policy
from .cast import cast_model_inputs, cast_tree, uncast_model_inputs
from .environment import DTYPES, FRAMEWORK, MATMUL_PRECISION, is_float_array, nnx_module
from .layers import (
    author_dtypes,
    carried,
    class_name_of,
    facts_of,
    has_field,
    is_float_dtype_or_none,
    kind_and_source,
    row_notes,
)
from .watch import (edge_of, finished, nonfinite_inputs, watch_tree, watch_edge, watch_inputs, watch_output_gradients,
                    watch_outputs, watched)


def nnx_path(parts: Sequence[Any]) -> str:
    """An NNX key path as a Plan path (``("blocks", 0, "linear")`` -> ``"blocks.0.linear"``)."""
    return join_path(*parts)


def _tree_mode_first(fn: Callable[..., Any], module: Any) -> Any:
    """``fn(module, graph=False)``, else ``fn(module, graph=True)``: Flax's tree mode handles a
    10,000-module model 2-3x faster than its graph mode but refuses shared references (tied
    weights) and cycles, which only graph mode follows."""
    try:
        return fn(module, graph=False)
    except ValueError:  # shared references or a cycle
        return fn(module, graph=True)


def _nnx_graph(module: Any) -> list[tuple[tuple, Any]]:
    """(path, value) of every node and leaf, each shared one once (where first met)."""
    return _tree_mode_first(lambda m, graph: list(nnx_module().iter_graph(m, graph=graph)), module)


class _NnxModel(NamedTuple):
    layers: list[Layer]  # tree order, root first
    instances: dict[str, Any]  # path -> module
    owners: dict[str, str]  # parameter path -> the module that owns it
    params: dict[str, tuple[Any, Any]]  # parameter path -> (its nnx.Param, its value)
    batch_stats: list[Any]  # nnx.BatchStat variables


def nnx_layers(module: Any) -> _NnxModel:
    """One walk of an NNX model: its layers, their instances, and every parameter's owner."""
    nnx = nnx_module()
    modules: list[tuple[str, Any]] = []
    params: dict[str, tuple[Any, Any]] = {}
    stats: list[Any] = []
    for keypath, value in _nnx_graph(module):
        if isinstance(value, nnx.Module):
            modules.append((nnx_path(keypath), value))
        elif isinstance(value, nnx.Param):
            params[nnx_path(keypath)] = (value, value.get_value())
        elif isinstance(value, nnx.BatchStat):
            stats.append(value)
    modules.sort(key=lambda pm: (pm[0].count(".") + (1 if pm[0] else 0), pm[0]))
    instances = dict(modules)
    counts: dict[str, int] = {}
    owners: dict[str, str] = {}
    for path, (_, value) in params.items():
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        while owner not in instances and owner:
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        owners[path] = owner
        counts[owner] = counts.get(owner, 0) + int(np.size(value))
    fixed = _nnx_author_dtypes(module, modules)
    layers = [Layer(path, kind, class_name_of(m), counts.get(path, 0), source, fixed.get(path))
              for path, m in modules for kind, source in (kind_and_source(m, "nnx"),)]
    return _NnxModel(layers, instances, owners, params, stats)


def _nnx_author_dtypes(model: Any, modules: list[tuple[str, Any]]) -> dict[str, tuple[str, str]]:
    """path -> the (dtype, param_dtype) the model's code fixed (:func:`author_dtypes`; the enclosing
    modules' ``dtype`` and configuration as the model holds them). A copy ampbridge already applied
    holds its Plan's dtypes instead of the author's: its Plan's ``set by the model`` rows stand for them."""
    key = nnx_key(model)
    if key is not None:
        return {r.path: (r.compute_dtype, r.param_dtype) for r in key.plan if r.rule == BY_MODEL
                and r.inherited_from is None}
    handed: dict[str, tuple[set[str], bool]] = {}  # path -> what it and its ancestors hand down, configured
    fixed = {}
    for path, m in modules:  # parents first
        own = (carried(m), has_field(m, "dtype"))
        if not path:
            handed[path] = own
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        while parent not in handed and parent:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        above, configured = handed.get(parent, (set(), False))
        author = author_dtypes(m, above, configured or bool(above))
        if author is not None:
            fixed[path] = author
        handed[path] = (above | own[0], configured or own[1])
    return fixed


@gc_paused()
def nnx_plan(module: Any, policy: Policy, *, warn: bool = True, notes: tuple[str, ...] = (),
              described: _NnxModel | None = None) -> Plan:
    """The Plan of an NNX model (``described``: its :func:`nnx_layers`, where already walked)."""
    layers, instances = (described or nnx_layers(module))[:2]
    plan_notes = list(notes) + [
        f"matmul_precision {policy.matmul_precision} -> jax.default_matmul_precision"
        f"({MATMUL_PRECISION[policy.matmul_precision]!r})",
    ]
    streams = stream_notes(policy, lambda path: _nnx_caller(path, instances))  # the same rule in every backend

    def adjust(row: PlanRow) -> PlanRow:
        stream = streams(row)  # from the requested row
        row = row_notes(row, facts_of(instances.get(row.path)), policy.output_dtype)
        return with_note(row, join_notes(stream, row.note)) if stream else row

    return build_plan(layers, policy, framework=FRAMEWORK, warn=warn, notes=plan_notes, adjust=adjust)


def _nnx_caller(path: str, instances: Mapping[str, Any]) -> str | None:
    """The nearest enclosing callable module (its own code calls the one at ``path``), or None
    where an ``nnx.Sequential`` feeds it (the next module casts its inputs itself)."""
    sequential = getattr(nnx_module(), "Sequential", ())
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        module = instances.get(path)
        if module is not None and isinstance(module, sequential):
            return None
        if module is not None and _is_callable_module(module):
            return path
    return None


_NNX_SUBCLASSES: dict[type, type] = {}
_NNX_LOCK = threading.Lock()


def _own_variables(module: Any, kind: Any = None) -> list[Any]:
    """The Params (or other ``kind`` of Variable) a module's own methods read: its attributes,
    through containers and non-callable modules (``nnx.List``), but not through callable
    submodules (they cast their own)."""
    nnx = nnx_module()
    kind = nnx.Param if kind is None else kind
    out: list[Any] = []
    seen: set[int] = set()

    def walk(value: Any, top: bool) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, kind):
            out.append(value)
        elif isinstance(value, nnx.Module):
            if not top and _is_callable_module(value):
                return
            for child in vars(value).values():
                walk(child, False)
        elif isinstance(value, (list, tuple)):
            for child in value:
                walk(child, False)
        elif isinstance(value, dict):
            for child in value.values():
                walk(child, False)

    walk(module, True)
    return out


def _is_callable_module(module: Any) -> bool:
    return _is_callable_class(type(module))


@functools.lru_cache(maxsize=None)
def _is_callable_class(cls: type) -> bool:
    # look in the class dicts: getattr(cls, "__call__") would find the metaclass's
    return any("__call__" in vars(klass) for klass in cls.__mro__ if klass is not object)


#: methods Flax itself calls on every module (``nnx.view``): not the model's computation
_NNX_HOOKS = frozenset({"set_view"})


def _nnx_methods(cls: type) -> tuple[str, ...]:
    """The methods of ``cls`` that compute with the module: ``__call__`` and every public plain
    function defined by a class of its own (not by ``nnx.Module`` and its bases), e.g. Gemma's
    ``attend``, a model's ``encode``/``decode``, attention's ``init_cache``."""
    base = set(nnx_module().Module.__mro__)
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if klass in base:
            continue
        for name, value in vars(klass).items():
            if (name == "__call__" or not name.startswith("_")) and name not in _NNX_HOOKS \
                    and type(value) is type(_nnx_methods):  # plain functions only (no property, classmethod)
                names.setdefault(name, None)
    return tuple(names)


_ACTIVE = threading.local()  # ids of the modules whose wrapped method is running (this thread)


def _cast_caches(module: Any, compute: Any) -> None:
    """A module's own floating ``nnx.Cache`` variables into its compute dtype (the decode-cache rule:
    the keys written into a cache are in the compute dtype; ``init_cache`` creates float32)."""
    for var in _own_variables(module, nnx_module().Cache):
        value = var.get_value()
        if is_float_array(value) and value.dtype != compute:
            var.set_value(value.astype(compute))


def _wrap_method(name: str, original: Callable) -> Callable:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        active = getattr(_ACTIVE, "ids", None)
        if active is None:
            active = _ACTIVE.ids = set()
        compute_name, output_name, final_name, precision, scope, path, key = self._ampbridge_row
        compute = DTYPES[compute_name]
        outermost = not active
        # its inputs as its caller made them (a cast at its entry is its own: seen in its output)
        edge = edge_of(key, path) if id(self) not in active else None
        if outermost:
            _ACTIVE.model_inputs = {}
            inputs_bad = nonfinite_inputs((args, kwargs), edge)
            args, kwargs = cast_model_inputs((args, kwargs), compute, _ACTIVE.model_inputs)
        else:
            args, kwargs = uncast_model_inputs((args, kwargs), getattr(_ACTIVE, "model_inputs", {}), compute)
            inputs_bad = nonfinite_inputs((args, kwargs), edge)
            args, kwargs = cast_tree((args, kwargs), compute)
        if id(self) in active:  # one of its own methods calling another: parameters already cast
            out = cast_tree(original(self, *args, **kwargs), DTYPES[output_name])
            return out if final_name is None else cast_tree(out, DTYPES[final_name])
        watch = watched(key, path)
        if watch is not None and watch[1]:
            args, kwargs = watch_tree(watch_inputs, (args, kwargs), watch[0])
        own = [v for v in _own_variables(self) if is_float_array(v.get_value())
               and v.get_value().dtype != compute]
        stored = [v.get_value() for v in own]
        for var, value in zip(own, stored):
            var.set_value(value.astype(compute))  # traced: gradients flow to the stored value
        _cast_caches(self, compute)
        active.add(id(self))
        try:
            # the module's name in the trace (as linen's named calls give), for profiles and tests
            with jax.default_matmul_precision(precision), jax.named_scope(scope):
                out = original(self, *args, **kwargs)
        finally:
            active.discard(id(self))
            if outermost:
                _ACTIVE.model_inputs = {}
            for var, value in zip(own, stored):
                var.set_value(value)
        _cast_caches(self, compute)
        out = cast_tree(out, DTYPES[output_name])
        if final_name is not None:
            out = cast_tree(out, DTYPES[final_name])
        if watch is not None:
            out = watch_tree(watch_outputs if watch[1] else watch_output_gradients, out, watch[0])
        out = watch_edge(out, edge, inputs_bad)
        finished(key, path)
        return out

    method.__name__ = name
    method.__qualname__ = getattr(original, "__qualname__", name)
    method.__doc__ = original.__doc__
    return method


def _nnx_subclass(cls: type) -> type:
    """A subclass of ``cls`` whose methods (:func:`_nnx_methods`) follow the row stored on the
    instance: inputs, the parameters it owns and its caches in the compute dtype, outputs in the
    row's output dtype."""
    with _NNX_LOCK:
        hit = _NNX_SUBCLASSES.get(cls)
        if hit is not None:
            return hit
        methods = {name: _wrap_method(name, getattr(cls, name)) for name in _nnx_methods(cls)}
        sub = type(cls.__name__, (cls,), {**methods, "_ampbridge_original": cls,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _NNX_SUBCLASSES[cls] = sub
        return sub


class _NnxKey:
    """One applied NNX model: its Plan and parameter owners, kept in every module's row, so
    :func:`numerics` finds them again after ``nnx.split``/``nnx.merge``. The row is static data
    of the graphdef, which jit caches on: equal by value (the Plan, a frozen dataclass, and the
    owners), so copies applied with the same policy, or a model rebuilt to restore a checkpoint,
    reuse the compiled steps."""

    def __init__(self, plan: Plan, owners: Mapping[str, str]):
        self.plan = plan
        self.owners = dict(owners)
        self._value = (plan, tuple(sorted(self.owners.items())))
        self._hash = hash(self._value)  # once: jit hashes every module's row on every call

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _NnxKey):
            return NotImplemented
        return self._hash == other._hash and self._value == other._value

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<ampbridge NNX plan of {len(self.plan)} modules>"


_NNX_KEYS: "weakref.WeakValueDictionary[tuple, _NnxKey]" = weakref.WeakValueDictionary()


def _shared_key(plan: Plan, owners: Mapping[str, str]) -> _NnxKey:
    """The one live key equal to ``_NnxKey(plan, owners)``: rows of equal copies are then the same
    object, and jit's graphdef comparison on every call stops at ``is`` instead of comparing Plans."""
    key = _NnxKey(plan, owners)
    with _NNX_LOCK:
        return _NNX_KEYS.setdefault(key._value, key)


def nnx_key(model: Any) -> _NnxKey | None:
    """The key of an NNX model :func:`ampbridge.jax.apply` converted (its Plan, the variables'
    owners), or None for any other object."""
    row = getattr(model, "_ampbridge_row", None)
    return row[-1] if isinstance(row, tuple) and row and isinstance(row[-1], _NnxKey) else None


def nnx_copy(module: Any) -> Any:
    """A copy with its own modules and Variables (arrays shared): Flax's ``nnx.clone``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _tree_mode_first(nnx_module().clone, module)


def _set_static(module: Any, name: str, value: Any) -> None:
    """``setattr`` for an attribute NNX already holds as static (a dtype): NNX's own checks, which
    cost 75 us an attribute, cannot change anything there."""
    nodes = getattr(module, "_pytree__nodes", None)
    if nodes is not None and nodes.get(name, None) is False:
        object.__setattr__(module, name, value)
    else:
        setattr(module, name, value)


@gc_paused()
def apply_nnx(model: Any, policy: Policy, notes: tuple[str, ...], described: _NnxModel) -> Any:
    """Convert ``model`` (a fresh :func:`nnx_copy`, ``described`` by :func:`nnx_layers`) in place."""
    plan_ = nnx_plan(model, policy, warn=True, notes=notes, described=described)
    _, instances, owners, params, stats = described
    for path, (var, value) in params.items():
        want = DTYPES[plan_[owners[path]].param_dtype]
        if is_float_array(value) and value.dtype != want:
            var.set_value(value.astype(want))
    for var in stats:
        value = var.get_value()
        if is_float_array(value) and value.dtype != jnp.float32:
            var.set_value(value.astype(jnp.float32))
    precision = MATMUL_PRECISION[policy.matmul_precision]
    key = _shared_key(plan_, owners)
    callable_paths = {p for p, m in instances.items() if _is_callable_module(m)}

    def caller_of(path: str) -> str | None:
        """The nearest enclosing callable module (its call names this one's scope)."""
        while path:
            path = path.rsplit(".", 1)[0] if "." in path else ""
            if path in callable_paths:
                return path
        return None

    for path, sub in instances.items():
        row = plan_[path]
        for name, value in (("dtype", DTYPES[row.compute_dtype]), ("param_dtype", DTYPES[row.param_dtype])):
            if name in vars(sub) and is_float_dtype_or_none(current := getattr(sub, name)) and current != value:
                _set_static(sub, name, value)
        if path in callable_paths:
            final = policy.output_dtype if path == "" else None
            caller = caller_of(path) if path else None
            scope = class_name_of(sub) if path == "" else path[len(caller) + 1:] if caller else path
            object.__setattr__(sub, "_ampbridge_row",
                               (row.compute_dtype, row.output_dtype, final, precision, scope, path, key))
            original = getattr(type(sub), "_ampbridge_original", type(sub))
            object.__setattr__(sub, "__class__", _nnx_subclass(original))  # not an NNX attribute
    return model
