"""flax.linen: the method interceptor that runs every module call in its Plan row's dtypes, the
planning memo (a repeated leaf call traced once), and the linen Plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from ...core.matching import join_path
from ...core.plan import Layer, Plan, PlanRow, build_plan, gc_paused, join_notes, stream_notes, with_note
from ...core.policy import Policy
from .cast import cast_model_inputs, cast_tree, uncast_model_inputs
from .fp8 import check as check_fp8
from .fp8 import dot_general_cls, fp8_call, mark_rows
from .environment import DTYPES, FRAMEWORK, MATMUL_PRECISION, is_floating, is_float_array, linen_module
from .layers import (
    class_name_of,
    dtype_name,
    Facts,
    facts_of,
    has_field,
    is_float_dtype_or_none,
    kind_and_source,
    kind_of,
    author_dtypes,
    carried,
    Resolver,
    row_notes,
)
from .watch import (edge_of, finished, nonfinite_inputs, watch_tree, watch_edge, watch_inputs, watch_output_gradients,
                    watch_outputs, watched)


def _linen_path(module: Any) -> str:
    return join_path(*[str(p) for p in module.path])


def _linen_entry(module: Any, cache: dict) -> tuple[Any, tuple, set[str], str | None]:
    """(module, chain, what it hands down as first seen, how its kind was decided), made once per
    module; chain: (path, kind, class, dtypes its author fixed) of the module and its ancestors,
    root first. ``cache`` (by ``id``, the module kept alive in its entry) spares recomputing the
    ancestors' part, and keeps what each hands down as first seen (before ampbridge set its dtype)."""
    nn = linen_module()
    hit = cache.get(id(module))
    if hit is not None and hit[0] is module:
        return hit
    parent = module.parent
    head = _linen_entry(parent, cache)[1] if isinstance(parent, nn.Module) else ()
    fixed = None
    if head:  # the model's own dtype is the user's
        handed_down: set[str] = set()
        configured = False  # some enclosing module has a dtype setting (even None)
        above = parent
        while isinstance(above, nn.Module):
            # as first seen, and as running now: only its own dtype changes while it runs (_attributes
            # sets it), what a configuration among its fields hands down is in the first-seen set
            handed_down |= cache[id(above)][2]
            if has_field(above, "dtype"):
                configured = True
                now = dtype_name(getattr(above, "dtype", None))
                if now is not None:
                    handed_down.add(now)
            above = above.parent
        fixed = author_dtypes(module, handed_down, configured or bool(handed_down))
    kind, source = kind_and_source(module, "linen")
    entry = (module, head + ((_linen_path(module), kind, class_name_of(module), fixed),), carried(module), source)
    cache[id(module)] = entry
    return entry


@contextlib.contextmanager
def _attributes(module: Any, **values: Any):
    """Set a Flax module's own dtype attributes for one call (bound clones only), then restore."""
    old = {}
    for name, value in values.items():
        if value is None or not has_field(module, name):
            continue
        current = getattr(module, name, None)
        if not is_float_dtype_or_none(current):
            continue  # an integer "dtype" means something else; leave it
        old[name] = current
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            object.__setattr__(module, name, value)


class Observed(NamedTuple):
    """The dtypes one module call actually saw (from :meth:`Applied.observe`)."""

    path: str
    class_name: str
    method: str
    inputs: tuple[str, ...]  # floating inputs, as the module's method received them
    params: tuple[str, ...]  # the module's own floating parameters, as it read them
    outputs: tuple[str, ...]  # floating outputs, after the row's output cast


def _float_dtypes(tree: Any) -> tuple[str, ...]:
    return tuple(str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if is_float_array(x))


def trace_state() -> Any:
    """The JAX trace in force (comparable with ``==``), or None where this JAX cannot say."""
    try:
        from jax.extend.core import get_opaque_trace_state
        return get_opaque_trace_state()
    except (ImportError, AssertionError):  # pragma: no cover - older JAX, or no trace at all
        return None


@functools.lru_cache(maxsize=None)
def _config_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("parent", "name"))


def _inputs_key(tree: Any, compute: np.dtype) -> tuple | None:
    """Structure, shapes and dtypes (after the cast to ``compute``) of a call's inputs, static values
    as themselves; None where an input is a concrete array (a module may branch on its values)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts: list[Any] = [treedef]
    for x in leaves:
        if isinstance(x, jax.core.Tracer):
            aval = x.aval
            cast = is_floating(x.dtype) and x.dtype != compute
            parts.append((aval.shape, compute if cast else x.dtype, not cast and aval.weak_type))
        elif x is None or isinstance(x, (bool, int, float, str)):
            parts.append((type(x), x))
        else:
            return None
    return tuple(parts)


def _call_key(module: Any, method: str, args: tuple, kwargs: dict, row: PlanRow) -> tuple | None:
    """What a module call's result can depend on while planning: its class, its configuration (with
    the row's dtypes set), the method, the inputs' shapes and dtypes, and the row's output dtype.

    None where any of them cannot be compared safely (modules or arrays as fields, unhashables).
    """
    try:
        config = tuple(getattr(module, name) for name in _config_fields(type(module)))
    except TypeError:  # not a dataclass
        return None
    nn = linen_module()
    # a function field (an initialiser) is none of these: spared jax.Array's Python isinstance check
    if any(type(v) is not types.FunctionType and isinstance(v, (nn.Module, jax.Array, np.ndarray)) for v in config):
        return None
    inputs = _inputs_key((args, kwargs), DTYPES[row.compute_dtype])
    if inputs is None:
        return None
    key = (type(module), config, method, inputs, row.output_dtype)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Memo(NamedTuple):
    """A leaf call's result while planning: its outputs (tracers of the planning trace) and the
    module's own parameter count."""

    out: Any
    params: int


def _own_param_count(module: Any) -> int:
    if module.scope is None:
        return 0
    own = module.variables.get("params", {})
    return sum(int(np.prod(np.shape(v))) for v in jax.tree_util.tree_leaves(own))


#: Flax's float8 dot_general modules; under a float8 row they are ampbridge's realisation of it
_FP8_OPS = frozenset({"Fp8DirectDotGeneralOp", "Fp8Einsum", "Fp8DotGeneralOp"})


class LinenInterceptor:
    """The method interceptor: every module method runs in its Plan row's dtypes.

    With ``memo`` (planning only: under ``jax.eval_shape``, nothing computed), a *leaf* call (one
    during which no other module was called) is traced once per :func:`_call_key`; a later call
    with the same key gets the first one's outputs back (their shapes and dtypes are what a Plan
    needs) and the module's parameter count is taken from the first. Tracing the maths of 10,000
    layers costs seconds; a Plan only needs the module tree. Only calls in the planning trace
    itself are memoised, never inside a lifted transform (``nn.scan``, ``nn.remat``, ...).
    """

    def __init__(self, resolver: Resolver, *, record: dict | None = None,
                 observer: Callable[[Observed], None] | None = None, memo: dict | None = None,
                 fixed: dict | None = None):
        check_fp8(resolver.policy)  # before any call: [fp8] settings Flax cannot carry are refused by name
        self.resolver = resolver
        self.record = record
        self.fixed = fixed  # path -> the dtypes its author fixed, as this policy runs the model
        self.observer = observer
        self.memo = memo
        self.memo_params: dict[str, int] = {}  # paths answered from the memo -> own parameter count
        self.top_trace: Any = None  # the planning trace (memo only)
        self.modules: list[Any] = []  # the module of each call in progress (memo only)
        self.entered = 0  # calls of another module than the caller's so far (memo only)
        self.depth = 0  # module calls in progress; 0 on entry: the model's own (outermost) call
        self.chains: dict[int, tuple] = {}  # id(module) -> its _linen_entry, for this trace
        self.calling: list[str] = []  # paths of the module calls in progress, outermost first
        self.callers: dict[str, str] = {}  # path -> the module whose code first called it (record only)
        self.model_inputs: dict[int, tuple[Any, Any]] = {}  # the outermost call's cast inputs -> originals

    def __call__(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        _, chain, _, kind_source = _linen_entry(module, self.chains)
        path, kind, class_name, fixed = chain[-1]
        if class_name in _FP8_OPS and len(chain) > 1 and self.resolver.row(chain[:-1]).fp8:
            return next_fun(*args, **kwargs)  # the float8 op ampbridge put under a float8 row: not a layer of its own
        self._note(module, path, kind, class_name, fixed, kind_source)
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        if self.record is not None:
            # who calls whom (a Sequential made in a compact method owns none of its layers' paths)
            caller = next((p for p in reversed(self.calling) if p != path), None)
            if caller is not None:
                self.callers.setdefault(path, caller)
        row = self.resolver.row(chain)
        compute = DTYPES[row.compute_dtype]
        watch = watched(self.resolver, path)
        edge = edge_of(self.resolver, path)
        attrs = {"dtype": compute, "param_dtype": DTYPES[row.param_dtype]}
        outermost = self.depth == 0
        if outermost:
            self.model_inputs = {}
        else:
            args, kwargs = uncast_model_inputs((args, kwargs), self.model_inputs, compute)
        # its inputs as its caller made them (a cast at its entry is its own: seen in its output)
        inputs_bad = nonfinite_inputs((args, kwargs), edge)
        key = None
        if self.memo is not None and not outermost and watch is None and edge is None and self.observer is None:
            key = self._memo_key(module, context.method_name, args, kwargs, row, attrs)
            hit = self.memo.get(key) if key is not None else None
            if hit is not None:
                self.memo_params[path] = hit.params
                return hit.out
        if outermost:
            args, kwargs = cast_model_inputs((args, kwargs), compute, self.model_inputs)
        else:
            args, kwargs = cast_tree((args, kwargs), compute)
        if watch is not None and watch[1]:
            args, kwargs = watch_tree(watch_inputs, (args, kwargs), watch[0])
        entered = self.entered
        out = self._run(next_fun, args, kwargs, module, path, row, attrs, outermost)
        # the model's own call delivers the policy's output_dtype (the root row says so)
        out = cast_tree(out, DTYPES[self.resolver.policy.output_dtype if outermost else row.output_dtype])
        if key is not None and self.entered == entered:  # a leaf call: no other module ran inside it
            self.memo[key] = _Memo(out, _own_param_count(module))
        if watch is not None:
            out = watch_tree(watch_outputs if watch[1] else watch_output_gradients, out, watch[0])
        out = watch_edge(out, edge, inputs_bad)
        finished(self.resolver, path)
        if self.observer is not None:
            self._observe(module, path, class_name, context.method_name, args, kwargs, out)
        return out

    def _note(self, module: Any, path: str, kind: str, class_name: str, fixed: Any, kind_source: Any) -> None:
        """What every call records, ``setup`` included: the module's facts, its fixed dtypes, and
        whether another module than the caller's was entered (a memo hit needs a leaf call)."""
        if self.record is not None and path not in self.record:
            self.record[path] = (kind, class_name, facts_of(module, kind_source)._replace(fixed=fixed))
        if self.fixed is not None:
            self.fixed[path] = fixed
        if self.memo is not None and (not self.modules or self.modules[-1] is not module):
            self.entered += 1

    def _memo_key(self, module: Any, method: str, args: tuple, kwargs: dict, row: PlanRow,
                  attrs: dict) -> Any:
        # the key reads the module's config as this row runs it
        with _attributes(module, **attrs):
            key = _call_key(module, method, args, kwargs, row)
        if key is not None and (self.top_trace is None or trace_state() != self.top_trace):
            return None  # inside a lifted transform (another trace, other shapes), or cannot tell
        return key

    def _run(self, next_fun: Callable, args: tuple, kwargs: dict, module: Any, path: str, row: PlanRow,
             attrs: dict, outermost: bool) -> Any:
        """The module's own call in the row's dtypes, with the stacks of calls in progress kept."""
        self.depth += 1
        if self.memo is not None:
            self.modules.append(module)
        if self.record is not None:
            self.calling.append(path)
        try:
            with _attributes(module, **attrs), fp8_call(module, dot_general_cls(module, row, self.resolver.policy)):
                return next_fun(*args, **kwargs)
        finally:
            self.depth -= 1
            if outermost:
                self.model_inputs = {}
            if self.record is not None:
                self.calling.pop()
            if self.memo is not None:
                self.modules.pop()

    def _observe(self, module: Any, path: str, class_name: str, method: str, args: tuple, kwargs: dict,
                 out: Any) -> None:
        own = module.variables.get("params", {}) if module.scope is not None else {}
        params = {k: v for k, v in own.items() if not isinstance(v, Mapping)}
        self.observer(Observed(path, class_name, method, _float_dtypes((args, kwargs)), _float_dtypes(params),
                               _float_dtypes(out)))


def _own_param_counts(params: Any) -> dict[str, int]:
    counts: dict[str, int] = {}

    def walk(node: Any, names: tuple[str, ...]) -> None:
        path = join_path(*names)
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, names + (str(key),))
            else:
                counts[path] = counts.get(path, 0) + int(np.prod(np.shape(value)))

    if isinstance(params, Mapping):
        walk(params, ())
    return counts


def param_paths(params: Any) -> set[str]:
    """The module paths that own parameters in a linen ``params`` tree."""
    return set(_own_param_counts(params))


def keep_state_dtypes(state: Any, before: Any) -> Any:
    """Mutable collections as the module made them: a leaf that came in (``before``) goes out in the
    dtype it came in with, a new one (created by this call) in the dtype its module created it in.

    So a state's dtypes stay fixed from step to step (a ``lax.scan``/``fori_loop`` carry, a jitted
    step's signature): Flax's BatchNorm keeps float32 ``batch_stats``, a decode cache holds the
    keys' compute dtype (Flax creates it from them), and nothing is cast to what it was not made in.
    """
    if not isinstance(state, Mapping) or not isinstance(before, Mapping):
        return state

    def keep(new: Any, old: Any) -> Any:
        if isinstance(new, Mapping):
            if not isinstance(old, Mapping):
                return new
            return type(new)({k: keep(v, old[k]) if k in old else v for k, v in new.items()})
        if is_float_array(new) and is_float_array(old) and new.dtype != old.dtype:
            return new.astype(old.dtype)
        return new

    return {name: keep(value, before[name]) if name in before and name not in ("params", "intermediates")
            else value for name, value in state.items()}


def needs_classes(policy: Policy) -> bool:
    """Whether a rule matches by ``kind:``/``type:`` (so a module's class must be known to place it)."""
    return any(m.startswith(("kind:", "type:")) for _, rule in policy.rules for m in rule.match)


def is_frozen(variables: Any) -> bool:
    """Whether ``variables`` is a Flax ``FrozenDict`` (what ``init`` gives back keeps its type)."""
    try:
        from flax.core import FrozenDict
    except ImportError:  # pragma: no cover
        return False
    return isinstance(variables, FrozenDict)


@gc_paused()  # a Plan of a large model is an allocation storm; see gc_paused
def linen_plan(module: Any, policy: Policy, example_inputs: tuple, *, rngs: Any = None,
                method: Any = None, warn: bool = True, notes: tuple[str, ...] = (), known: dict | None = None,
                _memo: bool = True, **kwargs: Any) -> Plan:
    """The Plan of a linen module, walked by one abstract call on ``example_inputs`` (nothing
    computed; a repeated leaf call traced once unless ``_memo=False``): ``ampbridge.jax.plan``'s and
    ``Applied.plan``'s linen side."""
    nn = linen_module()
    if not example_inputs and not kwargs:
        raise TypeError("a flax.linen module's layers are only known once it runs: pass example "
                        "inputs, as in ampbridge.plan(module, policy, x) (they are traced, not computed)")
    record: dict[str, tuple[str | None, str, Any]] = {}
    recorder = LinenInterceptor(Resolver(policy), record=record, memo={} if _memo else None)
    if rngs is None:
        rngs = jax.random.key(0)

    def run() -> Any:
        recorder.top_trace = trace_state()
        with nn.intercept_methods(recorder):
            return module.init(rngs, *example_inputs, method=method, **kwargs)

    variables = jax.eval_shape(run)
    if known is not None:
        for path, entry in record.items():
            known.setdefault(path, entry)
    counts = {**recorder.memo_params, **_own_param_counts(variables.get("params", {}))}
    layers = [Layer(path, kind, cls, counts.get(path, 0), fact.kind_source, fact.fixed)
              for path, (kind, cls, fact) in record.items()]
    facts = {path: fact for path, (_, _, fact) in record.items()}
    plan_notes = list(notes) + [
        f"matmul_precision {policy.matmul_precision} -> jax.default_matmul_precision"
        f"({MATMUL_PRECISION[policy.matmul_precision]!r})",
    ]
    streams = stream_notes(policy, lambda path: _linen_caller(path, recorder.callers, record))  # as every backend

    def adjust(row: PlanRow) -> PlanRow:
        stream = streams(row)  # from the requested row
        row = row_notes(row, facts.get(row.path, Facts()), policy.output_dtype)
        return with_note(row, join_notes(stream, row.note)) if stream else row

    return mark_rows(build_plan(layers, policy, framework=FRAMEWORK, warn=warn, notes=plan_notes, adjust=adjust))


def _linen_caller(path: str, callers: Mapping[str, str], record: Mapping[str, tuple]) -> str | None:
    """The module whose own code calls the one at ``path`` (as the planning trace saw it), or None
    where a ``linen.Sequential`` feeds it (the next module casts its inputs itself) or nothing
    called it (the model). ``record``: path -> (kind, class name, facts)."""
    caller = callers.get(path)
    if caller is None or record.get(caller, (None, ""))[1] == "Sequential":  # flax.linen.Sequential by name
        return None
    return caller
