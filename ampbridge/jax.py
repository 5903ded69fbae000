"""ampbridge for JAX: Flax (linen and NNX) casting per Plan row, and loss scaling as optax.

JAX has no AMP of its own. This adapter realises a policy with Flax's and optax's own pieces:

- :func:`apply` on a ``flax.linen.Module`` returns an :class:`Applied` with ``init``/``apply``.
  A linen *method interceptor* (``nn.intercept_methods``) runs around every module method: it
  casts the module's floating inputs to the compute dtype of its Plan row, sets the module's own
  ``dtype``/``param_dtype`` attributes (so Flax's ``promote_dtype`` agrees) and casts its outputs
  to the row's output dtype. Parameters are cast per module path inside ``apply``, i.e. inside the
  function you differentiate, so gradients arrive in the stored (``param_dtype``) parameters.
  Mutable collections (``batch_stats``) stay float32.
- :func:`apply` on a ``flax.nnx.Module`` returns a copy whose modules follow the Plan: parameters
  stored in the row's ``param_dtype``, ``dtype`` attributes set, and every module's ``__call__``
  casting its inputs, its own parameters and its outputs.
- :func:`cast` (and ``cast_to_compute``/``cast_to_param``/``cast_to_output``) for plain pytrees
  (equinox, haiku): floating leaves only; ints, bools and non-arrays pass through.
- :func:`optimizer` wraps any optax transformation with the reference loss-scale algorithm
  (``ampbridge.core.loss_scale``): ``update`` unscales, checks finiteness, and on a non-finite step
  returns (negative) zero updates and leaves the inner state untouched. Everything is pure
  ``jnp``/``lax`` on pytree state with static settings: no host sync, no Python branch on a
  traced value, no host callback unless you ask for one (``host_callback=True``).
- :func:`scale_loss`, :func:`loss_scale`, :func:`check` find the loss-scale state anywhere in an
  optax state (chains, ``MultiSteps``, ``nnx.Optimizer``).
- :func:`plan` / :func:`owns` for ``ampbridge.plan(module, policy, *example_inputs)``.
- :class:`Schedule`: precision phases (``[[phase]]``), one jitted step per phase.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ampbridge
    >>> policy = ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm",))
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> amp = ampbridge.jax.apply(model, policy)
    >>> variables = amp.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> amp.apply(variables, jnp.ones((4, 3))).dtype
    dtype('float32')
    >>> tx = ampbridge.jax.optimizer(optax.sgd(0.1), policy)
    >>> opt_state = tx.init(variables["params"])
    >>> float(ampbridge.jax.loss_scale(opt_state).scale)
    65536.0
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .core import io as _io
from .core.loss_scale import LossScaleState as ReferenceState
from .core.loss_scale import initial_state as _reference_initial_state
from .core.matching import join_path
from .core.plan import Layer, Plan, PlanRow, RowResolver, build_plan, gc_paused, with_note
from .core.policy import LossScaleConfig, Policy
from .errors import (
    AmpBridgeWarning,
    BackendUnavailableError,
    LossScaleError,
    UnsupportedOptionError,
)

__all__ = [
    "Applied",
    "AmpState",
    "LossScaleState",
    "Monitor",
    "Numerics",
    "Schedule",
    "apply",
    "cast",
    "cast_to_compute",
    "cast_to_output",
    "cast_to_param",
    "check",
    "dtype",
    "enter_phase",
    "initial_loss_scale",
    "loss_scale",
    "next_loss_scale",
    "numerics",
    "optimizer",
    "owns",
    "plan",
    "reset_loss_scale",
    "resolve_policy",
    "scale_loss",
    "unscale",
]

FRAMEWORK = "jax"

#: the one place canonical dtype names become JAX dtypes
_DTYPES: dict[str, np.dtype] = {
    "float32": jnp.dtype("float32"),
    "float16": jnp.dtype("float16"),
    "bfloat16": jnp.dtype("bfloat16"),
    "float64": jnp.dtype("float64"),
}

#: ampbridge's matmul_precision (torch's names) -> jax.default_matmul_precision
MATMUL_PRECISION = {"highest": "highest", "high": "high", "medium": "default"}


def _require(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(
            f"ampbridge.jax.{what} requires {module.split('.')[0]!r} ({e}). "
            "Install with: pip install 'ampbridge[jax]'") from e


def _linen() -> Any:
    return _require("flax.linen", "apply")


def _nnx() -> Any:
    return _require("flax.nnx", "apply")


def _optax() -> Any:
    return _require("optax", "optimizer")


def dtype(name: str | Any) -> np.dtype:
    """The JAX dtype of a canonical dtype name (aliases accepted), or a dtype passed through.

    Example:
        >>> dtype("bf16")
        dtype(bfloat16)
    """
    if isinstance(name, str):
        from .core.dtypes import canonical_dtype

        try:
            return _DTYPES[canonical_dtype(name)]
        except ValueError:
            if name in _DTYPES:
                return _DTYPES[name]
            raise ValueError(f"unknown dtype {name!r}; accepted: {', '.join(_DTYPES)} "
                             "(aliases: fp16 half f16 bf16 fp32 f32 float single)") from None
    return jnp.dtype(name)


# --- policies -----------------------------------------------------------------------------------

def _device() -> Any:
    from .diagnostics.hardware import Device, cpu_flags

    dev = jax.devices()[0]
    platform = {"gpu": "cuda"}.get(dev.platform, dev.platform)
    capability = None
    cc = getattr(dev, "compute_capability", None)
    if cc:
        try:
            major, minor = str(cc).split(".")[:2]
            capability = (int(major), int(minor))
        except ValueError:
            capability = None
    return Device(platform, getattr(dev, "device_kind", ""), capability,
                  cpu_flags() if platform == "cpu" else frozenset())


def resolve_policy(policy: Policy | str, *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy this backend applies, and notes saying why it differs from the one given.

    Accepts a Policy, a preset name or a policy file path. The environment's bisect switch
    (``AMPBRIDGE_DISABLE``/``AMPBRIDGE_POLICY``) applies, and ``compute_dtype = "auto"`` is
    resolved for the default JAX device (``ampbridge.diagnostics.hardware``).

    Example:
        >>> resolve_policy("mixed_bfloat16")[0].compute_dtype
        'bfloat16'
    """
    from .diagnostics.environment import effective_policy
    from .diagnostics.hardware import resolve_auto

    if isinstance(policy, str):
        policy = _io.preset(policy) if policy in _io.PRESETS else _io.load(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"expected an ampbridge.Policy, a preset name or a policy file path; received "
                        f"{policy!r} (of type {type(policy).__name__})")
    notes: list[str] = []
    given = policy
    policy = effective_policy(policy, FRAMEWORK, warn=warn)
    if policy is not given:
        notes.append("the environment (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY) replaced the policy")
    policy, why = resolve_auto(policy, _device(), warn=warn)
    if why:
        notes.append(why)
    return policy, tuple(notes)


def _phase_policy(policy: Policy, step: int | None = None, epoch: int | None = None) -> Policy:
    if not policy.phases:
        return policy
    if step is None and epoch is None:
        step, epoch = 0, 0
    return policy.at(step=step, epoch=epoch)


# --- casting pytrees ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _is_float_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and _floating(x.dtype)


def _cast_leaf(x: Any, to: np.dtype) -> Any:
    if _is_float_array(x) and x.dtype != to:
        return x.astype(to)
    return x


def _cast_tree(tree: Any, to: np.dtype) -> Any:
    return jax.tree_util.tree_map(lambda x: _cast_leaf(x, to), tree)


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


def _row_for(plan: Plan, path: str) -> PlanRow | None:
    while True:
        if path in plan:
            return plan[path]
        if not path:
            return None
        path = path.rsplit(".", 1)[0] if "." in path else ""


def cast(tree: Any, policy: Policy | str | Any, to: str = "compute", *,
         plan: Plan | bool | None = None) -> Any:
    """Cast the floating leaves of a pytree; ints, bools and non-array leaves pass through.

    ``policy`` is a Policy (``to`` picks its ``"compute"``, ``"param"`` or ``"output"`` dtype)
    or a dtype (a name such as ``"bf16"``, or a JAX dtype). With ``plan`` (a Plan, or True to
    plan the tree's own key paths against the policy's path rules), each leaf takes the row of the
    module that owns it: a leaf ``encoder/norm/scale`` follows the row of ``encoder.norm``. A new
    tree is returned; the input is never modified.

    Example:
        >>> import jax.numpy as jnp, ampbridge
        >>> p = ampbridge.Policy(compute_dtype="bf16", keep_float32=("norm",))
        >>> tree = {"dense": {"w": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}, "step": 3}
        >>> out = cast(tree, p, plan=True)
        >>> out["dense"]["w"].dtype, out["norm"]["scale"].dtype, out["step"]
        (dtype(bfloat16), dtype('float32'), 3)
    """
    roles = {"compute": "compute_dtype", "param": "param_dtype", "output": "output_dtype"}
    if to not in roles:
        raise ValueError(f"cast: to={to!r} is not accepted; accepted: {', '.join(roles)}")
    if not isinstance(policy, Policy):
        if plan:
            raise ValueError("cast: plan= needs a Policy, not a dtype")
        return _cast_tree(tree, dtype(policy))
    from .diagnostics.environment import effective_policy

    policy = _phase_policy(effective_policy(policy, FRAMEWORK))  # the bisect switch reaches pytrees too
    if policy.compute_dtype == "auto":
        policy = resolve_policy(policy, warn=False)[0]
    if not plan:
        return _cast_tree(tree, dtype(getattr(policy, roles[to])))
    if plan is True:  # kind:/type: rules cannot match a bare tree; no unmatched-rule warnings
        plan = build_plan(_tree_layers(tree), policy, framework=FRAMEWORK, warn=False)
    role = roles[to]

    def leaf(keypath: tuple, x: Any) -> Any:
        row = _row_for(plan, join_path(*[_key_name(k) for k in keypath[:-1]]))
        target = getattr(row, role) if row is not None else getattr(policy, role)
        return _cast_leaf(x, dtype(target))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def cast_to_compute(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "compute")`` (jmp's name)."""
    return cast(tree, policy, "compute")


def cast_to_param(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "param")`` (jmp's name)."""
    return cast(tree, policy, "param")


def cast_to_output(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "output")`` (jmp's name)."""
    return cast(tree, policy, "output")


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


def _kind_of(obj: Any, flavour: str) -> str | None:
    declared = getattr(obj, "ampbridge_kind", None)
    if declared is not None:
        return declared
    table = _class_table(flavour)
    for cls in type(obj).__mro__:
        if cls in table:
            return table[cls]
    return None


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


def _facts(module: Any) -> _Facts:
    if module is None:
        return _Facts()
    odd = None
    if _has_field(module, "dtype") and not _is_float_dtype_or_none(getattr(module, "dtype", None)):
        odd = str(getattr(module, "dtype"))
    return _Facts(bool(getattr(module, "force_float32_reductions", False)),
                  bool(getattr(module, "force_fp32_for_softmax", False)),
                  any(c.__name__ == "BatchNorm" for c in type(module).__mro__), odd)


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


# --- flax.linen -------------------------------------------------------------------------------

def _linen_path(module: Any) -> str:
    return join_path(*[str(p) for p in module.path])


def _linen_chain(module: Any, cache: dict | None = None) -> tuple[tuple[str, str | None, str], ...]:
    """(path, kind, class) of the module and its ancestors, root first; ``cache`` (by ``id``, the
    module kept alive beside its chain) spares recomputing the ancestors' part."""
    nn = _linen()
    if cache is not None:
        hit = cache.get(id(module))
        if hit is not None and hit[0] is module:
            return hit[1]
    parent = module.parent
    head = _linen_chain(parent, cache) if isinstance(parent, nn.Module) else ()
    chain = head + ((_linen_path(module), _kind_of(module, "linen"), _class_name(module)),)
    if cache is not None:
        cache[id(module)] = (module, chain)
    return chain


@contextlib.contextmanager
def _attributes(module: Any, **values: Any):
    """Set a Flax module's own dtype attributes for one call (bound clones only), then restore."""
    old = {}
    for name, value in values.items():
        if value is None or not _has_field(module, name):
            continue
        current = getattr(module, name, None)
        if not _is_float_dtype_or_none(current):
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
    return tuple(str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x))


def _trace_state() -> Any:
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
            cast = _floating(x.dtype) and x.dtype != compute
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
    nn = _linen()
    if any(isinstance(v, (nn.Module, jax.Array, np.ndarray)) for v in config):
        return None
    inputs = _inputs_key((args, kwargs), _DTYPES[row.compute_dtype])
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


class _LinenInterceptor:
    """The method interceptor: every module method runs in its Plan row's dtypes.

    With ``memo`` (planning only: under ``jax.eval_shape``, nothing computed), a *leaf* call (one
    during which no other module was called) is traced once per :func:`_call_key`; a later call
    with the same key gets the first one's outputs back (their shapes and dtypes are what a Plan
    needs) and the module's parameter count is taken from the first. Tracing the maths of 10,000
    layers costs seconds; a Plan only needs the module tree. Only calls in the planning trace
    itself are memoised, never inside a lifted transform (``nn.scan``, ``nn.remat``, ...).
    """

    def __init__(self, resolver: _Resolver, *, record: dict | None = None,
                 observer: Callable[[Observed], None] | None = None, memo: dict | None = None):
        self.resolver = resolver
        self.record = record
        self.observer = observer
        self.memo = memo
        self.memo_params: dict[str, int] = {}  # paths answered from the memo -> own parameter count
        self.top_trace: Any = None  # the planning trace (memo only)
        self.modules: list[Any] = []  # the module of each call in progress (memo only)
        self.entered = 0  # calls of another module than the caller's so far (memo only)
        self.depth = 0  # module calls in progress; 0 on entry: the model's own (outermost) call
        self.chains: dict[int, tuple] = {}  # id(module) -> (module, its chain), for this trace

    def __call__(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        chain = _linen_chain(module, self.chains)
        path, kind, class_name = chain[-1]
        if self.record is not None and path not in self.record:
            self.record[path] = (kind, class_name, _facts(module))
        if self.memo is not None and (not self.modules or self.modules[-1] is not module):
            self.entered += 1
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        row = self.resolver.row(chain)
        compute = _DTYPES[row.compute_dtype]
        watch = _watched(self.resolver, path)
        attrs = {"dtype": compute, "param_dtype": _DTYPES[row.param_dtype]}
        outermost = self.depth == 0
        key = None
        if self.memo is not None and not outermost and watch is None and self.observer is None:
            with _attributes(module, **attrs):
                key = _call_key(module, context.method_name, args, kwargs, row)
            if key is not None and (self.top_trace is None or _trace_state() != self.top_trace):
                key = None  # inside a lifted transform (another trace, other shapes), or cannot tell
            hit = self.memo.get(key) if key is not None else None
            if hit is not None:
                self.memo_params[path] = hit.params
                return hit.out
        args, kwargs = _cast_tree((args, kwargs), compute)
        if watch is not None and watch[1]:
            args, kwargs = _watch(_watch_inputs, (args, kwargs), watch[0])
        entered = self.entered
        self.depth += 1
        if self.memo is not None:
            self.modules.append(module)
        try:
            with _attributes(module, **attrs):
                out = next_fun(*args, **kwargs)
        finally:
            self.depth -= 1
            if self.memo is not None:
                self.modules.pop()
        # the model's own call delivers the policy's output_dtype (the root row says so)
        out = _cast_tree(out, _DTYPES[self.resolver.policy.output_dtype if outermost else row.output_dtype])
        if key is not None and self.entered == entered:
            self.memo[key] = _Memo(out, _own_param_count(module))
        if watch is not None:
            out = _watch(_watch_outputs if watch[1] else _watch_output_gradients, out, watch[0])
        if self.observer is not None:
            own = module.variables.get("params", {}) if module.scope is not None else {}
            params = {k: v for k, v in own.items() if not isinstance(v, Mapping)}
            self.observer(Observed(path, class_name, context.method_name,
                                   _float_dtypes((args, kwargs)), _float_dtypes(params),
                                   _float_dtypes(out)))
        return out


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


def _param_paths(params: Any) -> set[str]:
    return set(_own_param_counts(params))


def _state_to_float32(collections: Any) -> Any:
    """Mutable collections (batch_stats, ...) stay float32; sown intermediates stay as computed."""
    if not isinstance(collections, Mapping):
        return collections
    return {name: (value if name in ("params", "intermediates") else _cast_tree(value, _DTYPES["float32"]))
            for name, value in collections.items()}


class Applied:
    """A linen module under a policy: ``init`` and ``apply`` run every module per its Plan row.

    ``init`` creates parameters in their row's ``param_dtype`` (pinned ones float32); ``apply``
    casts parameters per module (inside your loss function, so gradients reach the stored ones),
    runs each module in its compute dtype and returns outputs in the policy's ``output_dtype``.
    ``plan(*x)`` is the Plan; ``observe(variables, *x)`` the dtypes every call actually saw;
    ``at(epoch=...)`` the same model under the phase in force.
    """

    def __init__(self, module: Any, policy: Policy | str, *, _phase: tuple | None = None,
                 _schedule: Policy | None = None, _notes: tuple[str, ...] = (), _known: dict | None = None):
        nn = _linen()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ampbridge.jax.Applied needs a flax.linen.Module; received {type(module).__name__}")
        if _schedule is None:
            schedule, notes = resolve_policy(policy)
            _phase = (0, 0)
        else:
            schedule, notes = _schedule, _notes
        self.module = module
        self.schedule = schedule  # the whole policy, phases included
        self.policy = _phase_policy(schedule, *(_phase or (None, None)))  # the phase in force
        self.notes = notes
        self._resolver = _Resolver(self.policy)
        # path -> (kind, class, facts), learnt while tracing; shared by the phases of one model
        self._known: dict[str, tuple[str | None, str, _Facts]] = {} if _known is None else _known
        self._lock = threading.Lock()
        self._phases: dict[int | None, Applied] = {}

    def __repr__(self) -> str:
        return (f"Applied({type(self.module).__name__}, compute={self.policy.compute_dtype}, "
                f"params={self.policy.param_dtype}, output={self.policy.output_dtype})")

    # -- phases --
    def at(self, *, step: int | None = None, epoch: int | None = None) -> "Applied":
        """The model under the phase in force at ``step``/``epoch`` (cached per phase)."""
        index = self.schedule.phase_index(step=step, epoch=epoch) if self.schedule.phases else None
        with self._lock:
            hit = self._phases.get(index)
        if hit is None:
            hit = Applied(self.module, self.schedule, _phase=(step, epoch), _schedule=self.schedule,
                          _notes=self.notes, _known=self._known)
            with self._lock:
                self._phases[index] = hit
        return hit

    # -- the Flax API --
    def _interceptor(self, observer: Callable | None = None) -> Any:
        return _LinenInterceptor(self._resolver, record=self._known, observer=observer)

    @contextlib.contextmanager
    def _scope(self, interceptor: Any):
        nn = _linen()
        with jax.default_matmul_precision(MATMUL_PRECISION[self.policy.matmul_precision]):
            with nn.intercept_methods(interceptor):
                yield

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """``module.init`` with parameters created in each row's ``param_dtype``.

        Warns (:class:`ampbridge.UnmatchedRuleWarning`) once for each rule no module matched.
        """
        with self._scope(self._interceptor()):
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        self._warn_unmatched()
        return self.cast_params(variables)

    def _warn_unmatched(self) -> None:
        if getattr(self, "_warned_unmatched", False) or not self.policy.rules:
            return
        self._warned_unmatched = True
        layers = [Layer(path, kind, cls) for path, (kind, cls, _) in self._known.items()]
        build_plan(layers, self.policy, framework=FRAMEWORK, warn=True)

    def init_with_output(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        with self._scope(self._interceptor()):
            out, variables = self.module.init_with_output(rngs, *args, method=method, **kwargs)
        self._warn_unmatched()
        return _cast_tree(out, _DTYPES[self.policy.output_dtype]), self.cast_params(variables)

    def apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, **kwargs: Any) -> Any:
        """``module.apply`` following the Plan; outputs in ``output_dtype``."""
        variables = self._compute_variables(variables, args, kwargs, rngs=rngs, method=method,
                                            mutable=mutable)
        with self._scope(self._interceptor()):
            result = self.module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable,
                                       **kwargs)
        out_dtype = _DTYPES[self.policy.output_dtype]
        if mutable is not False:
            out, state = result
            return _cast_tree(out, out_dtype), _state_to_float32(state)
        return _cast_tree(result, out_dtype)

    __call__ = apply

    def observe(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
                mutable: Any = False, **kwargs: Any) -> list[Observed]:
        """Trace ``apply`` (abstractly: nothing runs) and return what every module call saw."""
        seen: list[Observed] = []
        cast_vars = self._compute_variables(variables, args, kwargs, rngs=rngs, method=method,
                                            mutable=mutable)

        def run(v: Any) -> Any:
            with self._scope(self._interceptor(seen.append)):
                return self.module.apply(v, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

        jax.eval_shape(run, cast_vars)
        return seen

    # -- parameters --
    def _rows_for_paths(self, paths: Iterable[str]) -> dict[str, PlanRow]:
        rows = {}
        for path in paths:
            parts = path.split(".") if path else []
            chain = []
            for depth in range(len(parts) + 1):
                prefix = ".".join(parts[:depth])
                kind, cls, _ = self._known.get(prefix, (None, "", None))
                chain.append((prefix, kind, cls))
            rows[path] = self._resolver.row(tuple(chain))
        return rows

    def _ensure_known(self, variables: Any, args: tuple, kwargs: dict, paths: set[str] | None = None,
                      **apply_kw: Any) -> None:
        if paths is None:
            paths = _param_paths(variables.get("params", {}) if isinstance(variables, Mapping) else {})
        if all(p in self._known for p in paths):
            return
        # learn the module tree (classes, kinds) by tracing once; nothing is computed
        recorder = _LinenInterceptor(self._resolver, record=self._known, memo={})

        def run() -> Any:
            nn = _linen()
            recorder.top_trace = _trace_state()
            with nn.intercept_methods(recorder):
                return self.module.apply(variables, *args, **apply_kw, **kwargs)

        with gc_paused():
            jax.eval_shape(run)

    def _compute_variables(self, variables: Any, args: tuple, kwargs: dict, **apply_kw: Any) -> Any:
        if not isinstance(variables, Mapping) or "params" not in variables:
            return variables
        params = variables["params"]
        paths = _param_paths(params)
        self._ensure_known(variables, args, kwargs, paths, **apply_kw)
        rows = self._rows_for_paths(paths)
        return {**variables, "params": self._cast_by_row(params, rows, "compute_dtype")}

    @staticmethod
    def _cast_by_row(params: Any, rows: Mapping[str, PlanRow], role: str) -> Any:
        def walk(node: Any, names: tuple[str, ...]) -> Any:
            path = join_path(*names)
            out = {}
            for key, value in node.items():
                if isinstance(value, Mapping):
                    out[key] = walk(value, names + (str(key),))
                else:
                    out[key] = _cast_tree(value, _DTYPES[getattr(rows[path], role)])
            return out

        return walk(params, ())

    @gc_paused()
    def cast_params(self, variables: Any, *example_inputs: Any, **kwargs: Any) -> Any:
        """Variables with every parameter in its row's ``param_dtype`` and mutable state float32.

        Use it on a float32 checkpoint, or at a phase boundary where ``param_dtype`` changes. The
        module tree is known once ``init``/``apply``/``plan`` ran; otherwise pass example inputs
        (traced, not computed) when the policy has ``kind:``/``type:`` rules.
        """
        if not isinstance(variables, Mapping):
            return variables
        out = dict(_state_to_float32(variables))
        if "params" in variables:
            params = variables["params"]
            paths = _param_paths(params)
            unknown = [p for p in paths if p not in self._known]
            if unknown and example_inputs:
                self._ensure_known(variables, example_inputs, kwargs, paths)
            elif unknown and _needs_classes(self.policy):
                raise ValueError(
                    f"cast_params: the module tree is not known yet (e.g. {unknown[0]!r}), and this policy's "
                    "kind:/type: rules need it; call init/apply/plan first or pass example inputs: "
                    "amp.cast_params(variables, x)")
            rows = self._rows_for_paths(paths)
            out["params"] = self._cast_by_row(params, rows, "param_dtype")
        return type(variables)(out) if type(variables) is not dict and _is_frozen(variables) else out

    # -- the Plan --
    def plan(self, *example_inputs: Any, rngs: Any = None, method: Any = None, warn: bool = True,
             **kwargs: Any) -> Plan:
        """The Plan of this module under the phase in force (``example_inputs`` as for ``init``)."""
        return _linen_plan(self.module, self.policy, example_inputs, rngs=rngs, method=method, warn=warn,
                           notes=self.notes, known=self._known, **kwargs)


def _needs_classes(policy: Policy) -> bool:
    return any(m.startswith(("kind:", "type:")) for _, rule in policy.rules for m in rule.match)


def _is_frozen(variables: Any) -> bool:
    try:
        from flax.core import FrozenDict
    except ImportError:  # pragma: no cover
        return False
    return isinstance(variables, FrozenDict)


@gc_paused()  # a Plan of a large model is an allocation storm; see gc_paused
def _linen_plan(module: Any, policy: Policy, example_inputs: tuple, *, rngs: Any = None,
                method: Any = None, warn: bool = True, notes: tuple[str, ...] = (), known: dict | None = None,
                _memo: bool = True, **kwargs: Any) -> Plan:
    nn = _linen()
    if not example_inputs and not kwargs:
        raise TypeError("a flax.linen module's layers are only known once it runs: pass example "
                        "inputs, as in ampbridge.plan(module, policy, x) (they are traced, not computed)")
    record: dict[str, tuple[str | None, str, Any]] = {}
    recorder = _LinenInterceptor(_Resolver(policy), record=record, memo={} if _memo else None)
    if rngs is None:
        rngs = jax.random.key(0)

    def run() -> Any:
        recorder.top_trace = _trace_state()
        with nn.intercept_methods(recorder):
            return module.init(rngs, *example_inputs, method=method, **kwargs)

    variables = jax.eval_shape(run)
    if known is not None:
        for path, entry in record.items():
            known.setdefault(path, entry)
    counts = {**recorder.memo_params, **_own_param_counts(variables.get("params", {}))}
    layers = [Layer(path, kind, cls, counts.get(path, 0)) for path, (kind, cls, _) in record.items()]
    facts = {path: fact for path, (_, _, fact) in record.items()}
    plan_notes = list(notes) + [
        f"matmul_precision {policy.matmul_precision} -> jax.default_matmul_precision"
        f"({MATMUL_PRECISION[policy.matmul_precision]!r})",
    ]
    return build_plan(layers, policy, framework=FRAMEWORK, warn=warn, notes=plan_notes,
                      adjust=lambda row: _row_notes(row, facts.get(row.path, _Facts()), policy.output_dtype))


# --- flax.nnx ---------------------------------------------------------------------------------

def _nnx_path(parts: Sequence[Any]) -> str:
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
    return _tree_mode_first(lambda m, graph: list(_nnx().iter_graph(m, graph=graph)), module)


class _NnxModel(NamedTuple):
    layers: list[Layer]  # tree order, root first
    instances: dict[str, Any]  # path -> module
    owners: dict[str, str]  # parameter path -> the module that owns it
    params: dict[str, tuple[Any, Any]]  # parameter path -> (its nnx.Param, its value)
    batch_stats: list[Any]  # nnx.BatchStat variables


def _nnx_layers(module: Any) -> _NnxModel:
    """One walk of an NNX model: its layers, their instances, and every parameter's owner."""
    nnx = _nnx()
    modules: list[tuple[str, Any]] = []
    params: dict[str, tuple[Any, Any]] = {}
    stats: list[Any] = []
    for keypath, value in _nnx_graph(module):
        if isinstance(value, nnx.Module):
            modules.append((_nnx_path(keypath), value))
        elif isinstance(value, nnx.Param):
            params[_nnx_path(keypath)] = (value, value.get_value())
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
    layers = [Layer(path, _kind_of(m, "nnx"), _class_name(m), counts.get(path, 0)) for path, m in modules]
    return _NnxModel(layers, instances, owners, params, stats)


@gc_paused()
def _nnx_plan(module: Any, policy: Policy, *, warn: bool = True, notes: tuple[str, ...] = (),
              described: _NnxModel | None = None) -> Plan:
    layers, instances = (described or _nnx_layers(module))[:2]
    plan_notes = list(notes) + [
        f"matmul_precision {policy.matmul_precision} -> jax.default_matmul_precision"
        f"({MATMUL_PRECISION[policy.matmul_precision]!r})",
    ]
    return build_plan(layers, policy, framework=FRAMEWORK, warn=warn, notes=plan_notes,
                      adjust=lambda row: _row_notes(row, _facts(instances.get(row.path)), policy.output_dtype))


_NNX_SUBCLASSES: dict[type, type] = {}
_NNX_LOCK = threading.Lock()


def _own_variables(module: Any) -> list[Any]:
    """The Params a module's own ``__call__`` reads: its attributes, through containers and
    non-callable modules (``nnx.List``), but not through callable submodules (they cast their own)."""
    nnx = _nnx()
    out: list[Any] = []
    seen: set[int] = set()

    def walk(value: Any, top: bool) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, nnx.Param):
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
    # look in the class dicts: getattr(cls, "__call__") would find the metaclass's
    return any("__call__" in vars(cls) for cls in type(module).__mro__ if cls is not object)


def _nnx_subclass(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` follows the row stored on the instance."""
    with _NNX_LOCK:
        hit = _NNX_SUBCLASSES.get(cls)
        if hit is not None:
            return hit
        original_call = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            compute_name, output_name, final_name, precision, scope, path, key = self._ampbridge_row
            compute = _DTYPES[compute_name]
            args, kwargs = _cast_tree((args, kwargs), compute)
            watch = _watched(key, path)
            if watch is not None and watch[1]:
                args, kwargs = _watch(_watch_inputs, (args, kwargs), watch[0])
            own = [v for v in _own_variables(self) if _is_float_array(v.get_value())
                   and v.get_value().dtype != compute]
            stored = [v.get_value() for v in own]
            for var, value in zip(own, stored):
                var.set_value(value.astype(compute))  # traced: gradients flow to the stored value
            try:
                # the module's name in the trace (as linen's named calls give), for profiles and tests
                with jax.default_matmul_precision(precision), jax.named_scope(scope):
                    out = original_call(self, *args, **kwargs)
            finally:
                for var, value in zip(own, stored):
                    var.set_value(value)
            out = _cast_tree(out, _DTYPES[output_name])
            if final_name is not None:
                out = _cast_tree(out, _DTYPES[final_name])
            if watch is not None:
                out = _watch(_watch_outputs if watch[1] else _watch_output_gradients, out, watch[0])
            return out

        __call__.__doc__ = original_call.__doc__
        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_ampbridge_original": cls,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _NNX_SUBCLASSES[cls] = sub
        return sub


class _NnxKey:
    """One applied NNX model: its Plan and parameter owners, kept (by identity) in every module's
    row, so :func:`numerics` finds them again after ``nnx.split``/``nnx.merge``."""

    def __init__(self, plan: Plan, owners: Mapping[str, str]):
        self.plan = plan
        self.owners = dict(owners)

    def __repr__(self) -> str:
        return f"<ampbridge NNX plan of {len(self.plan)} modules>"


def _nnx_key(model: Any) -> _NnxKey | None:
    row = getattr(model, "_ampbridge_row", None)
    return row[-1] if isinstance(row, tuple) and row and isinstance(row[-1], _NnxKey) else None


def _nnx_copy(module: Any) -> Any:
    """A copy with its own modules and Variables (arrays shared): Flax's ``nnx.clone``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _tree_mode_first(_nnx().clone, module)


def _set_static(module: Any, name: str, value: Any) -> None:
    """``setattr`` for an attribute NNX already holds as static (a dtype): NNX's own checks, which
    cost 75 us an attribute, cannot change anything there."""
    nodes = getattr(module, "_pytree__nodes", None)
    if nodes is not None and nodes.get(name, None) is False:
        object.__setattr__(module, name, value)
    else:
        setattr(module, name, value)


@gc_paused()
def _apply_nnx(module: Any, policy: Policy, notes: tuple[str, ...]) -> Any:
    model = _nnx_copy(module)
    described = _nnx_layers(model)
    plan_ = _nnx_plan(model, policy, warn=True, notes=notes, described=described)
    _, instances, owners, params, stats = described
    for path, (var, value) in params.items():
        want = _DTYPES[plan_[owners[path]].param_dtype]
        if _is_float_array(value) and value.dtype != want:
            var.set_value(value.astype(want))
    for var in stats:
        value = var.get_value()
        if _is_float_array(value) and value.dtype != jnp.float32:
            var.set_value(value.astype(jnp.float32))
    precision = MATMUL_PRECISION[policy.matmul_precision]
    key = _NnxKey(plan_, owners)
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
        for name, value in (("dtype", _DTYPES[row.compute_dtype]), ("param_dtype", _DTYPES[row.param_dtype])):
            if name in vars(sub) and _is_float_dtype_or_none(current := getattr(sub, name)) and current != value:
                _set_static(sub, name, value)
        if path in callable_paths:
            final = policy.output_dtype if path == "" else None
            caller = caller_of(path) if path else None
            scope = _class_name(sub) if path == "" else path[len(caller) + 1:] if caller else path
            object.__setattr__(sub, "_ampbridge_row",
                               (row.compute_dtype, row.output_dtype, final, precision, scope, path, key))
            original = getattr(type(sub), "_ampbridge_original", type(sub))
            object.__setattr__(sub, "__class__", _nnx_subclass(original))  # not an NNX attribute
    return model


# --- public: apply / plan / owns --------------------------------------------------------------

def apply(module: Any, policy: Policy | str) -> Any:
    """Run a Flax module under a policy.

    A ``flax.linen.Module`` gives an :class:`Applied` (``init``/``apply``/``plan``); a
    ``flax.nnx.Module`` gives a copy of it whose calls follow the Plan (the original is left as it
    was). A policy with ``[[phase]]`` tables starts in its first phase; see :class:`Schedule`.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, ampbridge
        >>> amp = apply(nn.Dense(3), ampbridge.preset("mixed_bfloat16"))
        >>> v = amp.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> v["params"]["kernel"].dtype, amp.apply(v, jnp.ones((1, 2))).dtype
        (dtype('float32'), dtype('float32'))
    """
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None and isinstance(module, linen.Module):
        return Applied(module, policy)
    if nnx is not None and isinstance(module, nnx.Module):
        resolved, notes = resolve_policy(policy)
        return _apply_nnx(module, _phase_policy(resolved), notes)
    raise TypeError(f"ampbridge.jax.apply needs a flax.linen.Module or a flax.nnx.Module; received "
                    f"{type(module).__module__}.{type(module).__qualname__}. For plain pytrees "
                    "(equinox, haiku) use ampbridge.jax.cast(tree, policy)")


def owns(obj: Any) -> bool:
    """True for Flax modules (linen, NNX) and :class:`Applied`.

    Plain pytrees are not claimed (the registry caches its answer per type, and a ``dict`` may
    hold any framework's tensors): plan them with ``ampbridge.jax.plan(tree, policy)``.
    """
    if isinstance(obj, Applied):
        return True
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None and isinstance(obj, linen.Module):
        return True
    return nnx is not None and isinstance(obj, nnx.Module)


def plan(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True, **kwargs: Any) -> Plan:
    """The Plan of a Flax model (linen needs example inputs, traced only) or a pytree of arrays.

    Paths join the module tree's names with ``.`` (``encoder.layers_0.norm``; NNX lists give
    ``layers.0``). A pytree's inner nodes become layers without kind or class, so only path rules
    match them.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn, ampbridge
        >>> p = plan(nn.Sequential([nn.Dense(4), nn.LayerNorm()]),  # or ampbridge.plan(...)
        ...          ampbridge.Policy(compute_dtype="bf16", keep_float32=("kind:norm",)), jnp.ones((1, 3)))
        >>> p["layers_1"].compute_dtype, p["layers_0"].compute_dtype
        ('float32', 'bfloat16')
    """
    if isinstance(model, Applied):
        return model.plan(*example_inputs, warn=warn, **kwargs)
    resolved, notes = resolve_policy(policy, warn=warn)
    resolved = _phase_policy(resolved)
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None and isinstance(model, linen.Module):
        return _linen_plan(model, resolved, example_inputs, warn=warn, notes=notes, **kwargs)
    if nnx is not None and isinstance(model, nnx.Module):
        return _nnx_plan(model, resolved, warn=warn, notes=notes)
    if isinstance(model, Mapping):
        return build_plan(_tree_layers(model), resolved, framework=FRAMEWORK, warn=warn, notes=notes)
    raise TypeError(f"ampbridge.jax.plan: cannot plan a {type(model).__qualname__}; accepted: a "
                    "flax.linen.Module (with example inputs), a flax.nnx.Module, or a dict of arrays")


# --- loss scaling as an optax transformation --------------------------------------------------

class LossScaleState(NamedTuple):
    """The loss-scale state as JAX arrays: every field a leaf, so jit, tree_map, ``lax.scan`` and
    checkpoints (orbax, flax.serialization) keep all of it.

    The first five fields are the reference algorithm's (``ampbridge.LossScaleState``);
    ``min_scale_hits`` counts overflows at ``min_scale`` (the event ``on_min_scale`` acts on,
    read on the host by :func:`check`).
    """

    scale: jax.Array  # float32
    good_steps: jax.Array  # int32
    hysteresis_left: jax.Array  # int32
    steps: jax.Array  # int32
    skipped: jax.Array  # int32
    min_scale_hits: jax.Array  # int32

    def to_reference(self) -> ReferenceState:
        """The core's ``LossScaleState`` (host values; this reads the device)."""
        return ReferenceState(scale=float(self.scale), good_steps=int(self.good_steps),
                              hysteresis_left=int(self.hysteresis_left), steps=int(self.steps),
                              skipped=int(self.skipped))

    @classmethod
    def from_reference(cls, state: ReferenceState, min_scale_hits: int = 0) -> "LossScaleState":
        return cls(jnp.asarray(state.scale, jnp.float32), jnp.asarray(state.good_steps, jnp.int32),
                   jnp.asarray(state.hysteresis_left, jnp.int32), jnp.asarray(state.steps, jnp.int32),
                   jnp.asarray(state.skipped, jnp.int32), jnp.asarray(min_scale_hits, jnp.int32))


class AmpState(NamedTuple):
    """The state of :func:`optimizer`: the loss-scale state and the inner optimizer's state."""

    loss_scale: LossScaleState
    inner_state: Any


def _config(policy: Policy | LossScaleConfig | str) -> tuple[LossScaleConfig, str]:
    if isinstance(policy, LossScaleConfig):
        cfg = policy.resolve("float16")
        return cfg, "float16"
    resolved, _ = resolve_policy(policy, warn=False)
    resolved = _phase_policy(resolved)
    return resolved.resolved_loss_scale, resolved.compute_dtype


def _initial(cfg: LossScaleConfig) -> LossScaleState:
    return LossScaleState.from_reference(_reference_initial_state(cfg))


_F32_INF_BITS = 0x7F800000


def _f32_bits(x: float) -> int:
    return int(np.asarray(x, np.float32).view(np.int32))


def _mul_exact(x: jax.Array, factor: float) -> jax.Array:
    """``float32(x * float32(factor))`` for a finite ``x >= 0``, correctly rounded, subnormals included.

    XLA flushes subnormal float32 values to zero at run time (and constant folding does not), so a
    scale that decays past 2^-126 would leave the reference trajectory. The product is formed
    exactly (Dekker's two-product on 12-bit halves of the integer significands), then placed with
    integer exponent arithmetic, rounding half to even into the subnormal range.
    """
    i32, f32 = jnp.int32, jnp.float32
    c = np.float32(factor)
    cbits = _f32_bits(c)
    c_exp, c_man = (cbits >> 23) & 0xFF, cbits & 0x7FFFFF
    mc, ec = (c_man, -149) if c_exp == 0 else (c_man | 0x800000, c_exp - 150)
    bits = jax.lax.bitcast_convert_type(x, i32)
    x_exp, x_man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    mx = jnp.where(x_exp == 0, x_man, x_man | 0x800000)
    e = jnp.where(x_exp == 0, -149, x_exp - 150) + ec  # x * c == mx * mc * 2^e exactly
    hi = mx.astype(f32) * f32(mc)  # round-to-nearest-even of the exact product (an integer < 2^48)
    xh, xl = (mx >> 12).astype(f32), (mx & 0xFFF).astype(f32)
    ch, cl = f32(mc >> 12), f32(mc & 0xFFF)
    err = (((xh * ch * f32(2.0 ** 24) - hi) + xh * cl * f32(2.0 ** 12)) + xl * ch * f32(2.0 ** 12)) + xl * cl
    hbits = jax.lax.bitcast_convert_type(hi, i32)
    h_exp, h_man = (hbits >> 23) & 0xFF, hbits & 0x7FFFFF
    r_exp = h_exp + e  # the result's biased exponent when it is normal
    normal = (jnp.clip(r_exp, 0, 255) << 23) | h_man
    # subnormal result: round hi * 2^(e + 149) (< 2^23) to an integer; err breaks exact ties
    y_exp = h_exp + e + 149
    y = jnp.where(y_exp >= 1, jax.lax.bitcast_convert_type((jnp.clip(y_exp, 0, 255) << 23) | h_man, f32),
                  f32(0.0))
    low = jnp.floor(y)
    tie = (y - low) == f32(0.5)
    rounded = jnp.where(tie & (err > 0), low + 1, jnp.where(tie & (err < 0), low, jnp.round(y)))
    out = jnp.where(hi == 0, 0, jnp.where(r_exp >= 255, _F32_INF_BITS,
                                          jnp.where(r_exp >= 1, normal, rounded.astype(i32))))
    return jax.lax.bitcast_convert_type(out.astype(i32), f32)


def _advance(cfg: LossScaleConfig, s: LossScaleState, found_inf: jax.Array) -> tuple[LossScaleState, jax.Array]:
    """One step of the reference algorithm in float32/int32 ``jnp``; returns (state, halted).

    ``halted`` is True when ``on_min_scale = "error"`` stops the run: the reference raises before
    backing off, so the state stays as it was (except ``min_scale_hits``) from then on.
    """
    i32, f32 = jnp.int32, np.float32
    found_inf = jnp.asarray(found_inf, bool)
    steps = s.steps + 1
    skipped = s.skipped + found_inf.astype(i32) if cfg.skip_nonfinite else s.skipped
    if cfg.mode != "dynamic":
        return s._replace(steps=steps, skipped=skipped), jnp.zeros((), bool)
    scale, good, hyst = s.scale, s.good_steps, s.hysteresis_left
    # Plain float32 products are exact while the scale stays normal, which a normal min_scale
    # guarantees (a flushed backoff product loses to the floor either way); otherwise go exact.
    floor_is_normal = cfg.min_scale is not None and np.float32(cfg.min_scale) >= np.finfo(np.float32).tiny
    if floor_is_normal:
        def mul(factor: float) -> jax.Array:
            return scale * f32(factor)
    else:
        def mul(factor: float) -> jax.Array:
            return _mul_exact(scale, factor)
    as_int = functools.partial(jax.lax.bitcast_convert_type, new_dtype=i32)
    as_f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    exhausted = hyst <= 1
    backoff = found_inf & exhausted
    backed = mul(cfg.backoff_factor)
    event = jnp.zeros((), bool)
    if cfg.min_scale is not None:
        # non-negative float32 values order like their bit patterns: compare those (no flushing)
        floor_bits = _f32_bits(cfg.min_scale)
        event = backoff & (as_int(scale) == floor_bits)
        backed = as_f32(jnp.maximum(as_int(backed), floor_bits))
    good_next = good + 1
    grow = ~found_inf & (good_next == cfg.growth_interval)
    grown = mul(cfg.growth_factor)
    grown_ok = grow & ((as_int(grown) & _F32_INF_BITS) != _F32_INF_BITS)
    if cfg.max_scale is not None:
        grown = as_f32(jnp.minimum(as_int(grown), _f32_bits(cfg.max_scale)))
    new_scale = jnp.where(backoff, backed, jnp.where(grown_ok, grown, scale))
    new_good = jnp.where(found_inf | grow, jnp.zeros((), i32), good_next)
    full = jnp.asarray(cfg.hysteresis, i32)
    hyst_finite = full if cfg.consecutive_hysteresis else jnp.where(grow, full, hyst)
    new_hyst = jnp.where(found_inf, jnp.where(exhausted, hyst, hyst - 1), hyst_finite)
    hits = s.min_scale_hits + event.astype(i32)
    new = LossScaleState(new_scale, new_good, new_hyst, steps, skipped, hits)
    if cfg.on_min_scale != "error" or cfg.min_scale is None:
        return new, jnp.zeros((), bool)
    halted = (s.min_scale_hits > 0) | event
    frozen = s._replace(min_scale_hits=jnp.maximum(s.min_scale_hits, 1))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(halted, a, b), frozen, new), halted


def next_loss_scale(config: Policy | LossScaleConfig | str, state: LossScaleState,
                    found_inf: Any) -> LossScaleState:
    """One step of the reference loss-scale algorithm on JAX arrays (jit- and scan-safe).

    This is what :func:`optimizer` runs each step; ``found_inf`` is a boolean scalar.

    Example:
        >>> import ampbridge
        >>> cfg = ampbridge.LossScaleConfig(mode="dynamic", initial_scale=8.0)
        >>> s = next_loss_scale(cfg, initial_loss_scale(cfg), True)
        >>> float(s.scale), int(s.skipped)
        (4.0, 1)
    """
    cfg, _ = _config(config)
    return _advance(cfg, state, found_inf)[0]


def initial_loss_scale(config: Policy | LossScaleConfig | str) -> LossScaleState:
    """The loss-scale state before the first step (the reference ``initial_state``)."""
    cfg, _ = _config(config)
    return _initial(cfg)


def _all_finite(tree: Any) -> jax.Array:
    finite = jnp.ones((), bool)
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            finite = finite & jnp.all(jnp.isfinite(leaf))
    return finite


def _unscale_leaf(g: Any, inv: jax.Array) -> Any:
    if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
        return g
    if g.dtype == jnp.float32:
        return g * inv
    if g.dtype == jnp.float64:
        return g * inv.astype(jnp.float64)
    return (g.astype(jnp.float32) * inv).astype(g.dtype)  # half grads: unscale in float32


def _host_report(kind: str, limit: float | None) -> Callable:
    warned = [False]

    def report(event: Any, steps: Any) -> None:
        if not bool(event):
            return
        text = (f"loss scale overflowed at min_scale={limit} (step {int(steps)})")
        if kind == "error":
            raise LossScaleError(text + "; on_min_scale='error' stops the run")
        if not warned[0]:
            warned[0] = True
            warnings.warn(text + ": the scale is stuck and gradients still overflow", AmpBridgeWarning,
                          stacklevel=2)

    return report


def optimizer(inner: Any, policy: Policy | LossScaleConfig | str, *, host_callback: bool = False) -> Any:
    """Wrap an optax transformation with the policy's loss scaling (the reference algorithm).

    ``update(grads, state, params)`` takes the gradients of :func:`scale_loss`'s scaled loss,
    unscales them (in float32), checks that all are finite and, when one is not and
    ``skip_nonfinite`` holds, returns updates of ``-0.0`` (``p + -0.0`` is ``p`` bit for bit, even
    for ``-0.0``) and keeps the inner state as it was. The scale then follows
    ``ampbridge.core.loss_scale`` exactly (float32 arithmetic). Settings are closed over (static); the
    state is an :class:`AmpState` pytree. Put it outermost: ``optimizer(optax.chain(clip, adam), p)``,
    so every inner transformation sees unscaled gradients.

    ``on_min_scale``: ``"clamp"`` stays at ``min_scale``; ``"warn"`` and ``"error"`` count the event
    in ``min_scale_hits`` and :func:`check` (host side, where you already sync, e.g. when logging)
    warns or raises ``LossScaleError``. With ``"error"`` the step that would raise, and every step
    after it, is skipped with the loss-scale state frozen, as the reference's raise leaves it.
    ``host_callback=True`` also reports from inside the step through ``jax.debug.callback``
    (one host callback per step; the default adds none). A policy with ``[[phase]]`` tables gives
    its first phase's loss scaling; :class:`Schedule` builds one optimizer per phase.

    Example:
        >>> import jax.numpy as jnp, optax, ampbridge
        >>> tx = optimizer(optax.sgd(1.0), ampbridge.preset("mixed_float16"))
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state)
        >>> updates["w"], float(loss_scale(state).scale), int(loss_scale(state).skipped)
        (Array([-0., -0.], dtype=float32), 32768.0, 1)
    """
    optax = _optax()
    cfg, compute = _config(policy)
    inner = optax.with_extra_args_support(inner)
    if host_callback and cfg.on_min_scale == "clamp":
        raise UnsupportedOptionError("ampbridge.jax.optimizer: host_callback=True reports on_min_scale "
                                     "'warn'/'error'; this policy's on_min_scale is 'clamp'")
    report = _host_report(cfg.on_min_scale, cfg.min_scale) if host_callback else None
    scaled = cfg.mode in ("dynamic", "static")
    checks_finite = cfg.skip_nonfinite or cfg.mode == "dynamic"

    def init_fn(params: Any) -> AmpState:
        return AmpState(_initial(cfg), inner.init(params))

    def update_fn(updates: Any, state: AmpState, params: Any = None, **extra: Any) -> tuple[Any, AmpState]:
        if not isinstance(state, AmpState):
            raise TypeError(f"ampbridge.jax.optimizer: expected the AmpState from this transformation's "
                            f"init; received {type(state).__name__}")
        ls = state.loss_scale
        if scaled:
            inv = jnp.ones((), jnp.float32) / ls.scale
            grads = jax.tree_util.tree_map(lambda g: _unscale_leaf(g, inv), updates)
        else:
            grads = updates
        finite = _all_finite(grads) if checks_finite else jnp.ones((), bool)
        new_ls, halted = _advance(cfg, ls, ~finite)
        if report is not None:
            event = new_ls.min_scale_hits > ls.min_scale_hits
            jax.debug.callback(report, event, ls.steps)
        inner_updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        skip_conditions = []
        if cfg.skip_nonfinite:
            skip_conditions.append(~finite)
        if cfg.on_min_scale == "error" and cfg.min_scale is not None:
            skip_conditions.append(halted)
        if skip_conditions:
            take = ~functools.reduce(jnp.logical_or, skip_conditions)
            # -0.0, not 0.0: p + -0.0 == p bit for bit for every p (p + 0.0 turns -0.0 into +0.0)
            inner_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(take, u, jnp.full_like(u, -0.0)), inner_updates)
            inner_state = optax.tree_utils.tree_where(take, inner_state, state.inner_state)
        return inner_updates, AmpState(new_ls, inner_state)

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return tx


def _unwrap_variables(tree: Any) -> Any:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree
    if isinstance(tree, getattr(nnx, "Optimizer", ())):
        tree = tree.opt_state

    def value(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            return v.get_value() if hasattr(v, "get_value") else v.value
        return v

    return jax.tree_util.tree_map(value, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _find_states(tree: Any) -> list[LossScaleState]:
    tree = _unwrap_variables(tree)
    if isinstance(tree, LossScaleState):
        return [tree]
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (AmpState, LossScaleState)))
    return [x.loss_scale if isinstance(x, AmpState) else x for x in leaves
            if isinstance(x, (AmpState, LossScaleState))]


def loss_scale(opt_state: Any) -> LossScaleState:
    """The :class:`LossScaleState` inside an optimizer state (any optax chain, ``MultiSteps``,
    ``inject_hyperparams``, or an ``nnx.Optimizer``)."""
    found = _find_states(opt_state)
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"no ampbridge loss-scale state in this optimizer state (of type "
                         f"{type(opt_state).__name__}); build the optimizer with "
                         "ampbridge.jax.optimizer(inner, policy) and pass its state")
    raise ValueError(f"{len(found)} ampbridge loss-scale states in this optimizer state; wrap the whole "
                     "optimizer once: ampbridge.jax.optimizer(optax.chain(...), policy)")


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss * scale`` in (at least) float32, inside the function you differentiate.

    A float16 loss is computed on in float32 here, but its own gradient is the scale itself,
    which float16 cannot hold above 65504: compute the loss in float32 (``output_dtype``).
    """
    scale = loss_scale(opt_state).scale
    loss = jnp.asarray(loss)
    if loss.dtype == jnp.float16:
        warnings.warn("scale_loss got a float16 loss: its gradient (the loss scale) overflows float16 "
                      "above 65504; compute the loss in float32 (output_dtype = 'float32')",
                      AmpBridgeWarning, stacklevel=2)
    wide = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(wide) * scale.astype(wide)


def unscale(tree: Any, opt_state: Any) -> Any:
    """Gradients divided by the current scale (float32 arithmetic), e.g. to log their norm."""
    inv = jnp.ones((), jnp.float32) / loss_scale(opt_state).scale
    return jax.tree_util.tree_map(lambda g: _unscale_leaf(g, inv), tree)


_WARNED: set[Any] = set()


def check(opt_state: Any, policy: Policy | LossScaleConfig | str) -> ReferenceState:
    """Read the loss-scale state on the host and act on ``on_min_scale`` (this syncs).

    ``"error"`` raises :class:`ampbridge.LossScaleError` once the scale has overflowed at
    ``min_scale`` (the optimizer has skipped every step since); ``"warn"`` warns once per policy;
    ``"clamp"`` does nothing. Returns the state as the core's ``LossScaleState``, for logging.
    """
    cfg, _ = _config(policy)
    state = loss_scale(opt_state)
    hits = int(state.min_scale_hits)
    reference = state.to_reference()
    if hits and cfg.on_min_scale == "error":
        raise LossScaleError(f"loss scale overflowed at min_scale={cfg.min_scale} (step {reference.steps}); "
                             "on_min_scale='error' stops the run (the optimizer has skipped every step since)")
    if hits and cfg.on_min_scale == "warn" and cfg not in _WARNED:
        _WARNED.add(cfg)
        warnings.warn(f"loss scale is stuck at min_scale={cfg.min_scale} and gradients still overflow "
                      f"({hits} times by step {reference.steps})", AmpBridgeWarning, stacklevel=2)
    return reference


def reset_loss_scale(opt_state: Any, policy: Policy | LossScaleConfig | str) -> Any:
    """The optimizer state with its loss-scale state restarted for ``policy`` (counters kept)."""
    cfg, _ = _config(policy)
    fresh = _initial(cfg)

    def swap(x: Any) -> Any:
        if isinstance(x, AmpState):
            ls = x.loss_scale
            return x._replace(loss_scale=fresh._replace(steps=ls.steps, skipped=ls.skipped))
        return x

    return jax.tree_util.tree_map(swap, opt_state, is_leaf=lambda x: isinstance(x, AmpState))


def _loss_scale_configs(policy: Policy) -> Any:
    return _phase_policy(policy).resolved_loss_scale


def enter_phase(opt_state: Any, config: LossScaleConfig, previous: LossScaleConfig | None = None, *,
                reset: bool = False) -> Any:
    """The optimizer state with its loss-scale state moved into a new phase (the core's rule,
    ``ampbridge.core.loss_scale.enter_phase``: carry, or start fresh on ``reset`` or a mode change).

    Runs on the host (it reads the state once); the inner optimizer state is left as it is.
    """
    from .core.loss_scale import enter_phase as reference_enter_phase

    def move(x: Any) -> Any:
        if not isinstance(x, AmpState):
            return x
        ls = x.loss_scale
        before = ls.to_reference()
        after = reference_enter_phase(config, before, previous=previous, reset=reset)
        hits = int(ls.min_scale_hits) if after is before else 0
        return x._replace(loss_scale=LossScaleState.from_reference(after, hits))

    return jax.tree_util.tree_map(move, opt_state, is_leaf=lambda x: isinstance(x, AmpState))


# --- numerics: per-layer statistics, overflow attribution, the monitor ------------------------

class _Watch:
    """What :func:`numerics` is tracing: module paths seen (discovery) or the probes to place."""

    def __init__(self, owner: Any, probes: Mapping[str, jax.Array] | None = None, *, inputs: bool = True):
        self.owner = owner  # the linen model's resolver, or the NNX model's key
        self.probes = probes
        self.inputs = inputs  # watch input cotangents (else output cotangents)
        self.seen: dict[str, None] = {}  # call order, each path once


_WATCH: "contextvars.ContextVar[_Watch | None]" = contextvars.ContextVar("ampbridge_jax_watch", default=None)


def _watched(owner: Any, path: str) -> tuple[jax.Array, bool] | None:
    """(probe, watch inputs) for the module at ``path`` while :func:`numerics` traces this model."""
    watch = _WATCH.get()
    if watch is None or watch.owner is not owner:
        return None
    if watch.probes is None:
        watch.seen.setdefault(path, None)
        return None
    probe = watch.probes.get(path)
    return None if probe is None else (probe, watch.inputs)


def _any_nonfinite(xs: Sequence[jax.Array]) -> jax.Array:
    return functools.reduce(jnp.logical_or, [~jnp.all(jnp.isfinite(x)) for x in xs], jnp.zeros((), bool))


def _flags(forward: Any, backward: Any) -> jax.Array:
    return jnp.stack([jnp.asarray(forward, jnp.float32), jnp.asarray(backward, jnp.float32)])


# Identities whose backward passes report through the gradient of a dummy ``probe`` (2,):
# [0] counts calls whose forward output was non-finite (a residual of the forward pass, so it
# crosses scan/remat boundaries like any gradient); [1] calls whose input cotangent was
# (``_watch_inputs``) or, with ``_watch_output_gradients``, whose output cotangent was.
@jax.custom_vjp
def _watch_outputs(xs: tuple, probe: jax.Array) -> tuple:
    return xs


_watch_outputs.defvjp(lambda xs, probe: (xs, _any_nonfinite(xs)), lambda bad, ct: (ct, _flags(bad, 0)))


@jax.custom_vjp
def _watch_output_gradients(xs: tuple, probe: jax.Array) -> tuple:
    return xs


_watch_output_gradients.defvjp(lambda xs, probe: (xs, _any_nonfinite(xs)),
                               lambda bad, ct: (ct, _flags(bad, _any_nonfinite(ct))))


@jax.custom_vjp
def _watch_inputs(xs: tuple, probe: jax.Array) -> tuple:
    return xs


_watch_inputs.defvjp(lambda xs, probe: (xs, None), lambda _, ct: (ct, _flags(0, _any_nonfinite(ct))))


def _watch(fn: Callable, tree: Any, probe: jax.Array) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, x in enumerate(leaves) if _is_float_array(x)]
    if not picked:
        return tree
    for i, x in zip(picked, fn(tuple(leaves[i] for i in picked), probe)):
        leaves[i] = x
    return treedef.unflatten(leaves)


_WHERE = (None, "output", "gradient", "loss")
_STAT_COUNTS = ("zero", "nonfinite", "underflow", "overflow")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["step", "loss", "loss_scale", "found_inf", "skipped", "sampled", "counts",
                                "magnitudes", "output_nonfinite", "gradient_nonfinite", "where", "origin"],
                   meta_fields=["layers", "sizes", "compute_dtypes", "paths", "leaves", "watched", "order"])
@dataclasses.dataclass(frozen=True)
class Numerics:
    """What :func:`numerics` returns from inside the jitted step: arrays, and static path names.

    Arrays: ``step`` (the optimizer step this is, ``loss_scale(opt_state).steps``), ``loss``
    (unscaled), ``loss_scale`` (the scale used), ``found_inf``, ``skipped``, ``sampled`` (per-layer
    statistics computed this step), ``counts`` (int32, one row per layer: zero, non-finite,
    underflow, overflow element counts), ``magnitudes`` (float32 rows: max-abs and RMS of the
    finite unscaled gradients), ``output_nonfinite`` / ``gradient_nonfinite`` (one flag per leaf
    module: its forward output; the gradient with respect to its inputs, or its outputs when
    ``watched == "outputs"``), and the attribution ``where`` (0 none, 1 output, 2 gradient,
    3 loss) with ``origin`` (an index into ``paths``). Static: ``layers`` (the parameter-owning
    Plan paths the rows stand for), their ``sizes`` (elements) and ``compute_dtypes``; ``paths``
    (leaves and layers, forward order), ``leaves``, ``watched`` (``"inputs"``, ``"outputs"``, ``"none"``).

    Attribution, on a non-finite step: ``output`` names the first leaf in forward order whose
    output was non-finite; otherwise a non-finite loss is ``loss``; otherwise ``gradient`` names
    the first leaf in backward order (the last in forward order) whose input gradient went
    non-finite, else whose own parameter gradient did, then a non-leaf layer's own parameters;
    ``loss`` when nothing else explains it (the order torch's monitor uses too).

    On the host, :meth:`layer_stats` and :meth:`first_nonfinite` give the log's values.
    """

    step: Any
    loss: Any
    loss_scale: Any
    found_inf: Any
    skipped: Any
    sampled: Any
    counts: Any
    magnitudes: Any
    output_nonfinite: Any
    gradient_nonfinite: Any
    where: Any
    origin: Any
    layers: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    compute_dtypes: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()
    watched: str = "inputs"
    order: tuple[str, ...] = ()  # every module path the step called, in call (forward) order

    def layer_stats(self) -> dict[str, dict[str, float]]:
        """Per layer, the statistics of ``ampbridge.diagnostics.runlog.layer_stats`` (reads the device)."""
        if not bool(self.sampled):
            return {}
        counts, magnitudes = np.asarray(self.counts), np.asarray(self.magnitudes)
        out = {}
        for i, path in enumerate(self.layers):
            n = max(self.sizes[i], 1)
            entry = {"grad_max_abs": float(magnitudes[i, 0]), "grad_rms": float(magnitudes[i, 1])}
            entry.update({k: int(counts[i, j]) / n for j, k in enumerate(_STAT_COUNTS)})
            out[path] = entry
        return out

    def first_nonfinite(self) -> dict[str, str] | None:
        """``{"path": ..., "where": "output" | "gradient" | "loss"}`` on a non-finite step, else None."""
        where = _WHERE[int(self.where)]
        if where is None:
            return None
        return {"path": "" if where == "loss" else self.paths[int(self.origin)], "where": where}


_F32_ABS = 0x7FFFFFFF


def _underflow_limit_bits(scale: jax.Array, e: int) -> jax.Array:
    """The bits of the smallest float32 >= ``scale * 2**-e`` (exact, from integer arithmetic).

    Non-negative float32 values order like their bit patterns, so ``|g| < scale * 2**-e`` is
    ``bits(|g|) < this`` for every float32 ``g``: no float comparison, which XLA's CPU would make
    with subnormals flushed to zero (bfloat16's limit, 2**-133 times the scale, is subnormal).
    """
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32) & _F32_ABS
    exp, man = bits >> 23, bits & 0x7FFFFF
    normal = bits - (e << 23)  # the exponent field drops by e, the significand stays
    significand = jnp.where(exp == 0, man, man | 0x800000)
    shift = jnp.clip(e + 1 - jnp.maximum(exp, 1), 0, 25)  # to subnormal units of 2**-149
    subnormal = (significand + (1 << shift) - 1) >> shift  # rounded up: a strict limit stays strict
    return jnp.where(exp - e >= 1, normal, jnp.where(bits == 0, 0, subnormal))


def _leaf_statistics(g: jax.Array, limit_bits: jax.Array, max_bits: int) -> tuple[jax.Array, ...]:
    """(zero, non-finite, underflow, overflow) counts and the bits of the finite max |g| of one leaf.

    All from the bit pattern of ``|g|`` (float16/bfloat16 gradients widen to float32 exactly).
    """
    x = g.astype(jnp.float32) if g.dtype != jnp.float32 else g
    bits = jax.lax.bitcast_convert_type(x, jnp.int32) & _F32_ABS
    finite = bits < _F32_INF_BITS
    i32 = jnp.int32
    # one variadic reduce: one pass over the gradient (five separate ones cost ~20% more here)
    operands = ((bits == 0).astype(i32), (~finite).astype(i32),
                ((bits != 0) & (bits < limit_bits)).astype(i32), (finite & (bits > max_bits)).astype(i32),
                jnp.where(finite, bits, 0))
    zero = jnp.zeros((), i32)

    def combine(a: tuple, b: tuple) -> tuple:
        return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], jnp.maximum(a[4], b[4]))

    return jax.lax.reduce(operands, (zero,) * 5, combine, tuple(range(x.ndim)))


def _layer_statistics(owned: Mapping[str, list], compute: Mapping[str, str], scale: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """``counts`` (L, 4) int32 and ``magnitudes`` (L, 2) float32 for the layers in ``owned``."""
    from .core.dtypes import formats

    counts, magnitudes = [], []
    limits: dict[str, jax.Array] = {}
    for path, leaves in owned.items():
        fmt = formats()[compute[path]]
        if fmt.name not in limits:
            e = int(round(-np.log2(fmt.smallest_subnormal)))  # a power of two in every format
            limits[fmt.name] = _underflow_limit_bits(scale, e)
        parts = [_leaf_statistics(g, limits[fmt.name], _f32_bits(fmt.max)) for g in leaves]
        layer_counts = [functools.reduce(jnp.add, [p[k] for p in parts]) for k in range(4)]
        counts.append(jnp.stack(layer_counts))
        top_bits = functools.reduce(jnp.maximum, [p[4] for p in parts])
        top = jax.lax.bitcast_convert_type(top_bits, jnp.float32)
        # squares relative to a power of two near the maximum: no float32 overflow, exact scaling
        unit = jax.lax.bitcast_convert_type(jnp.clip(254 - (top_bits >> 23), 1, 254) << 23, jnp.float32)
        squares = functools.reduce(jnp.add, [
            jnp.sum(jnp.where(jnp.isfinite(x), jnp.square(x * unit), 0.0))
            for x in (g.astype(jnp.float32) for g in leaves)])
        n_finite = sum(int(np.prod(g.shape)) for g in leaves) - layer_counts[1]
        rms = jnp.sqrt(squares / jnp.maximum(n_finite, 1).astype(jnp.float32)) / unit
        some = n_finite > 0
        magnitudes.append(jnp.stack([jnp.where(some, top / scale, jnp.nan),
                                     jnp.where(some, rms / scale, jnp.nan)]))
    if not counts:
        return jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 2), jnp.float32)
    return jnp.stack(counts), jnp.stack(magnitudes).astype(jnp.float32)


def _owned_leaves(grads: Any) -> dict[str, list]:
    """The floating gradient leaves by the path of the module that owns them."""
    owned: dict[str, list] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            continue
        owner = join_path(*[_key_name(k) for k in keypath[:-1]])
        owned.setdefault(owner, []).append(leaf)
    return owned


def _leaves_of(paths: Sequence[str]) -> list[str]:
    """The paths with no other path below them (the model itself only when it is alone)."""
    def has_child(p: str) -> bool:
        return any(q != p and (p == "" or q.startswith(p + ".")) for q in paths)

    return [p for p in paths if not has_child(p)]


def _attribute(finite: jax.Array, loss_bad: jax.Array, probes: list, leaf_index: list[int],
               leaf_params_bad: list, other_params_bad: list[tuple[int, jax.Array]], *,
               inputs: bool) -> tuple[jax.Array, ...]:
    """(where, origin, forward flags, gradient flags) from the probes' gradients, on the device.

    Leaves are in forward order. ``output``: the first leaf whose forward output was non-finite.
    ``gradient``: the first leaf in backward order, i.e. the last in forward order, whose input
    gradient went non-finite (watching output gradients instead: the leaf after the last one whose
    output gradient did, as its input gradient fed that one); else whose own parameter gradient
    did; then a non-leaf layer's own parameters; ``loss`` when nothing else explains it.
    """
    i32 = jnp.int32
    k = len(probes)
    forward = jnp.stack([p[0] > 0 for p in probes]) if k else jnp.zeros((0,), bool)
    backward = jnp.stack([p[1] > 0 for p in probes]) if k else jnp.zeros((0,), bool)
    params_bad = jnp.stack(leaf_params_bad) if k else jnp.zeros((0,), bool)
    order = jnp.arange(k, dtype=i32)

    def last(mask: jax.Array) -> jax.Array:
        return jnp.max(jnp.where(mask, order, -1), initial=-1)

    first_output = jnp.min(jnp.where(forward, order, k), initial=k)
    first_output = jnp.where(first_output < k, first_output, -1)
    if inputs:
        by_gradient = last(backward)
    else:
        fed = last(backward)
        by_gradient = jnp.where((fed >= 0) & (fed + 1 < k), fed + 1, -1)
    # then the leaves' own parameter gradients (torch's monitor decides in the same order)
    by_gradient = jnp.where(by_gradient >= 0, by_gradient, last(params_bad))
    by_params = i32(-1)
    for idx, bad in other_params_bad:  # forward order: the last flagged is the first in backward order
        by_params = jnp.where(bad, i32(idx), by_params)
    paths_of = jnp.asarray(leaf_index + [-1], i32)  # index -1 picks the trailing -1
    where = jnp.where(finite, i32(0), jnp.where(first_output >= 0, i32(1), jnp.where(
        loss_bad, i32(3), jnp.where((by_gradient >= 0) | (by_params >= 0), i32(2), i32(3)))))
    origin = jnp.where(where == 1, paths_of[first_output], jnp.where(
        where == 2, jnp.where(by_gradient >= 0, paths_of[by_gradient], by_params), i32(-1)))
    return where, origin, forward, backward


def numerics(model: Applied | Any, loss_fn: Callable[..., Any], opt_state: Any, *, has_aux: bool = False,
             every: int | None = 1, attribution: bool | str = True
             ) -> Callable[..., tuple[Any, Any, Numerics]]:
    """``jax.value_and_grad`` for a loss-scaled step, plus the step's numerics, all on the device.

    ``numerics(amp, loss_fn, opt_state)(params, *args)`` returns ``(loss, grads, stats)``:
    ``loss_fn(params, *args)`` returns the plain loss (or ``(loss, aux)`` with ``has_aux``;
    then the first result is ``(loss, aux)``); it is scaled by the ``opt_state``'s loss scale
    (:func:`scale_loss`) and differentiated, so ``grads`` are what ``tx.update`` expects. For
    NNX, ``numerics(model, loss_fn, optimizer)(model, *args)`` with ``loss_fn(model, *args)`` is
    ``nnx.value_and_grad`` the same way (``grads``: the ``nnx.Param`` state, for
    ``optimizer.update(model, grads)``).
    ``stats`` is a :class:`Numerics` of arrays:

    - per layer owning parameters (its Plan path), counts and magnitudes from which
      ``ampbridge.diagnostics.runlog.layer_stats`` follows exactly, of the scaled gradients against the row's
      compute dtype; computed every ``every``-th optimizer step (``lax.cond`` on the step counter
      in the loss-scale state; 1: every step; None: never, for a second compiled step without them);
    - with ``attribution``, flags per leaf module (a module without submodules): its forward
      output was non-finite (the method interceptor watches every output) and its gradient went
      non-finite (identities with a ``custom_vjp`` report the cotangent's finiteness through the
      gradient of a dummy probe argument, so they work through ``nn.scan``/``nn.remat``), and the
      attribution (the first non-finite output in forward order, else the first non-finite
      gradient in backward order, see :class:`Numerics`).

    ``attribution=True`` (``"inputs"``) watches each leaf's input gradient, as torch's full
    backward hooks do. That identity makes a module's input gradient one sum before it joins
    the other uses of its input, so where an input is also used elsewhere (a residual), float16
    gradients can differ from a step without it by float16 rounding (about 1e-3 relative). ``"outputs"``
    watches output gradients only and leaves ``grads`` bit-identical to the hand-written step;
    it names the leaf after the last one whose output gradient went non-finite (exact in a
    chain; in a fan-out, e.g. query/key/value, it may name a sibling). ``False``: no flags;
    a non-finite step is then attributed by the parameter gradients alone.

    Nothing syncs with the host and no callback is added; read ``stats`` with a :class:`Monitor`.
    With attribution the model is traced once more (abstractly) to learn its leaf modules.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ampbridge
        >>> policy = ampbridge.preset("mixed_float16")
        >>> amp = apply(nn.Sequential([nn.Dense(4), nn.Dense(1)]), policy)
        >>> x = jnp.ones((2, 3))
        >>> params = amp.init(jax.random.key(0), x)["params"]
        >>> tx = optimizer(optax.sgd(0.1), policy)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... def step(params, opt_state, x):
        ...     loss_fn = lambda p, x: jnp.mean(amp.apply({"params": p}, x) ** 2)
        ...     loss, grads, stats = numerics(amp, loss_fn, opt_state)(params, x)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, stats
        >>> params, opt_state, stats = step(params, opt_state, x)  # the first scale, 2**16, overflows here
        >>> stats.layers, bool(stats.skipped), stats.first_nonfinite()
        (('layers_0', 'layers_1'), True, {'path': 'layers_1', 'where': 'gradient'})
        >>> sorted(stats.layer_stats()["layers_0"])
        ['grad_max_abs', 'grad_rms', 'nonfinite', 'overflow', 'underflow', 'zero']
    """
    nnx = sys.modules.get("flax.nnx")
    key = _nnx_key(model) if nnx is not None and isinstance(model, nnx.Module) else None
    if isinstance(model, Applied):
        owner, policy = model._resolver, model.policy
    elif key is not None:
        owner, policy = key, key.plan.policy
    else:
        raise TypeError("ampbridge.jax.numerics needs the model ampbridge.jax.apply returned (the Applied "
                        f"linen model, or the NNX copy); received {type(model).__name__}")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"ampbridge.jax.numerics: every={every!r}; accepted: a positive int (1: every step) "
                         "or None (no per-layer statistics)")
    if attribution not in (True, False, None, "inputs", "outputs"):
        raise ValueError(f"ampbridge.jax.numerics: attribution={attribution!r}; accepted: True (= 'inputs'), "
                         "'outputs', False")
    watching = bool(attribution)
    watch_inputs = attribution in (True, "inputs")
    cfg = policy.resolved_loss_scale
    scaled_mode = cfg.mode in ("dynamic", "static")
    checks_finite = cfg.skip_nonfinite or cfg.mode == "dynamic"

    def run(target: Any, *args: Any) -> tuple[Any, Any, Numerics]:
        def call(p: Any, watch: _Watch | None) -> Any:
            token = _WATCH.set(watch)
            try:
                return loss_fn(p, *args)
            finally:
                _WATCH.reset(token)

        order: list[str] = []
        leaves: list[str] = []
        if watching:
            discovery = _Watch(owner)
            if key is None:
                jax.eval_shape(lambda p: call(p, discovery), target)
            else:  # on a throwaway copy: the model's own state is left alone
                graphdef, state = nnx.split(target)
                jax.eval_shape(lambda s: call(nnx.merge(graphdef, s), discovery), state)
            order = list(discovery.seen)
            leaves = _leaves_of(order)
        probes = {path: jnp.zeros((2,), jnp.float32) for path in leaves}
        ls = loss_scale(opt_state)

        def scaled(p: Any, probes: Any) -> tuple[jax.Array, tuple]:
            out = call(p, _Watch(owner, probes, inputs=watch_inputs) if watching else None)
            loss, aux = out if has_aux else (out, None)
            value = scale_loss(loss, opt_state)
            return value, (loss, aux, value)

        grad = jax.value_and_grad if key is None else nnx.value_and_grad
        (_, (loss, aux, value)), (grads, probe_grads) = grad(scaled, argnums=(0, 1), has_aux=True)(
            target, probes)
        if key is None:
            owned = _owned_leaves(grads)
            known = order or list(model._known)
        else:
            owned = {}
            for keypath, var in nnx.to_flat_state(grads):
                g = var.get_value() if hasattr(var, "get_value") else var.value
                if jnp.issubdtype(jnp.result_type(g), jnp.floating):
                    path = _nnx_path(keypath)
                    owned.setdefault(key.owners.get(path, _nnx_path(keypath[:-1])), []).append(g)
            known = order or [r.path for r in key.plan]
        position = {p: i for i, p in enumerate(known)}
        layers = sorted(owned, key=lambda p: (position.get(p, len(position)), p))
        owned = {p: owned[p] for p in layers}
        if key is None:
            rows = model._rows_for_paths(layers)
            compute = {p: rows[p].compute_dtype for p in layers}
        else:
            compute = {p: (key.plan[p] if p in key.plan else key.plan[""]).compute_dtype for p in layers}
        sizes = tuple(sum(int(np.prod(g.shape)) for g in owned[p]) for p in layers)

        # found_inf and skipped exactly as the optimizer decides them (the same ops: XLA shares them)
        inv = jnp.ones((), jnp.float32) / ls.scale
        bad_layer = {path: ~_all_finite([_unscale_leaf(g, inv) if scaled_mode else g for g in leaves_])
                     for path, leaves_ in owned.items()}
        finite = (~functools.reduce(jnp.logical_or, bad_layer.values(), jnp.zeros((), bool))
                  if checks_finite else jnp.ones((), bool))
        _, halted = _advance(cfg, ls, ~finite)
        skipped = jnp.zeros((), bool)
        if cfg.skip_nonfinite:
            skipped = skipped | ~finite
        if cfg.on_min_scale == "error" and cfg.min_scale is not None:
            skipped = skipped | halted

        def compute_stats(_: Any) -> tuple[jax.Array, jax.Array]:
            return _layer_statistics(owned, compute, ls.scale)

        def no_stats(_: Any) -> tuple[jax.Array, jax.Array]:
            return (jnp.zeros((len(layers), 4), jnp.int32), jnp.full((len(layers), 2), jnp.nan, jnp.float32))

        if every is None:
            sampled = jnp.zeros((), bool)
            counts, magnitudes = no_stats(None)
        elif every == 1:
            sampled = jnp.ones((), bool)
            counts, magnitudes = compute_stats(None)
        else:
            sampled = ls.steps % every == 0
            counts, magnitudes = jax.lax.cond(sampled, compute_stats, no_stats, None)

        # attribution: candidates are the leaf modules (then any other layer owning parameters)
        paths = tuple(sorted(set(leaves) | set(layers), key=lambda p: (position.get(p, len(position)), p)))
        index = {p: i for i, p in enumerate(paths)}
        where, origin, out_flags, grad_flags = _attribute(
            finite, ~jnp.isfinite(value), [probe_grads[p] for p in leaves], [index[p] for p in leaves],
            [bad_layer.get(p, jnp.zeros((), bool)) for p in leaves],
            [(index[p], bad_layer[p]) for p in layers if p not in set(leaves)], inputs=watch_inputs)
        stats = Numerics(step=ls.steps, loss=jnp.asarray(loss, jnp.float32), loss_scale=ls.scale,
                         found_inf=~finite, skipped=skipped, sampled=sampled, counts=counts,
                         magnitudes=magnitudes, output_nonfinite=out_flags, gradient_nonfinite=grad_flags,
                         where=where, origin=origin, layers=tuple(layers), sizes=sizes,
                         compute_dtypes=tuple(compute[p] for p in layers), paths=paths, leaves=tuple(leaves),
                         watched=("inputs" if watch_inputs else "outputs") if watching else "none",
                         order=tuple(order))
        return ((loss, aux) if has_aux else loss), grads, stats

    return run


def _arrived(arrays: Sequence[Any]) -> bool:
    return all(a.is_ready() for a in arrays if hasattr(a, "is_ready"))


class Monitor:
    """Writes the shared numerics log (``ampbridge report`` reads it) from :func:`numerics` results.

    ``Monitor(path, amp, *example_inputs, every=N)`` (an NNX model needs no inputs; or
    ``Monitor(path, plan, every=N)``) writes the header from the Plan (with the first record:
    its layers in the order the step called them); ``record(step, stats)`` after each step (``step=None``: the
    optimizer's own counter, ``stats.step``). Per-layer statistics are written every ``every``-th
    step (step 0 included) when the step computed them (give :func:`numerics` the same
    ``every``); a step whose gradients were non-finite is always written, with its attribution.

    Reading costs no stall: ``record`` starts an asynchronous copy of what it needs (the whole
    ``stats`` on a sampled step, ``found_inf`` otherwise) and writes the queued steps whose values
    have arrived; it waits only when more than ``max_lag`` steps are still on their way (reading
    every step's ``found_inf`` at once would keep the host from running ahead of the device, about
    10% of a small CPU step here). ``flush()`` / ``close()`` write the rest. Usable as a context
    manager.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, tempfile, os, ampbridge
        >>> policy = ampbridge.preset("mixed_float16")
        >>> amp = apply(nn.Dense(1), policy)
        >>> x = jnp.ones((2, 3))
        >>> params = amp.init(jax.random.key(0), x)["params"]
        >>> tx = optimizer(optax.sgd(0.1), policy)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... def step(params, opt_state, x):
        ...     loss, grads, stats = numerics(amp, lambda p: jnp.mean(amp.apply({"params": p}, x) ** 2),
        ...                                   opt_state)(params)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, stats
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with Monitor(path, amp, x, every=1) as monitor:
        ...     for i in range(3):
        ...         params, opt_state, stats = step(params, opt_state, x)
        ...         monitor.record(i, stats)
        >>> [s["step"] for s in ampbridge.diagnostics.runlog.read_log(path).steps]
        [0, 1, 2]
    """

    def __init__(self, path: Any, model: Applied | Plan | Any, *example_inputs: Any, every: int = 1,
                 max_lag: int = 8, **plan_kwargs: Any):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"ampbridge.jax.Monitor: every={every!r}; accepted: a positive int "
                             "(1: every step)")
        if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0:
            raise ValueError(f"ampbridge.jax.Monitor: max_lag={max_lag!r}; accepted: an int >= 0 (steps a "
                             "record may wait for its values; 0: write each step at once)")
        nnx = sys.modules.get("flax.nnx")
        key = _nnx_key(model) if nnx is not None and isinstance(model, nnx.Module) else None
        if isinstance(model, Plan):
            plan_ = model
        elif isinstance(model, Applied):
            plan_ = model.plan(*example_inputs, warn=False, **plan_kwargs)
        elif key is not None:
            plan_ = key.plan
        else:
            raise TypeError("ampbridge.jax.Monitor needs the model ampbridge.jax.apply returned (a linen "
                            "model with example inputs, or the NNX copy) or its Plan; received "
                            f"{type(model).__name__}")
        self.plan = plan_
        self.path = path
        self.every = every
        self.max_lag = max_lag
        self._writer: RunLogWriter | None = None
        self._pending: list[tuple[int | None, list, Numerics]] = []

    def _open(self, order: Sequence[str] = ()) -> Any:
        """Write the header: the Plan's paths in forward order (the order the step called them)."""
        from .diagnostics.runlog import RunLogWriter

        if self._writer is None:
            position = {p: i for i, p in enumerate(order)}
            rows = [r.path for r in self.plan if r.path]
            layers = sorted(rows, key=lambda p: (position.get(p, len(position)), rows.index(p)))
            policy = self.plan.policy
            self._writer = RunLogWriter(self.path, framework=FRAMEWORK, compute_dtype=policy.compute_dtype,
                                        layers=layers, policy=_io.policy_to_dict(policy),
                                        min_scale=policy.resolved_loss_scale.min_scale)
        return self._writer

    def due(self, step: int) -> bool:
        """Whether ``step`` is one with per-layer statistics (``step % every == 0``)."""
        return int(step) % self.every == 0

    def record(self, step: int | None, stats: Numerics) -> None:
        """Queue one step's :class:`Numerics`; writes the previous one (no wait for this step)."""
        if not isinstance(stats, Numerics):
            raise TypeError(f"Monitor.record needs the Numerics from ampbridge.jax.numerics; received "
                            f"{type(stats).__name__}")
        wanted = jax.tree_util.tree_leaves(stats) if step is None or self.due(step) else [stats.found_inf]
        for leaf in wanted:
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()
        self._pending.append((step, wanted, stats))
        # write what has arrived; wait only when more than max_lag steps are still on their way
        while self._pending and (len(self._pending) > self.max_lag or _arrived(self._pending[0][1])):
            self._write(*self._pending.pop(0))

    def _write(self, step: int | None, _: Any, stats: Numerics) -> None:
        writer = self._open(stats.order)
        if step is None:
            step = int(stats.step)
        found_inf = bool(stats.found_inf)
        due = self.due(step)
        if not (due or found_inf):
            return
        host = jax.device_get(stats)  # one transfer of the small arrays (already on their way)
        loss = float(host.loss)
        writer.step(step, loss=loss if np.isfinite(loss) else None, loss_scale=float(host.loss_scale),
                          found_inf=found_inf, skipped=bool(host.skipped),
                          layers=host.layer_stats() if due else None,
                          first_nonfinite=host.first_nonfinite() if found_inf else None)

    def flush(self) -> None:
        """Write every queued step."""
        while self._pending:
            self._write(*self._pending.pop(0))

    def close(self) -> None:
        self.flush()
        self._open().close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Schedule:
    """A precision schedule (``[[phase]]``) for a linen model: one jitted train step per phase.

    Write the train step once, for any phase::

        def train_step(amp, tx, params, opt_state, x, y):
            def loss_fn(p):
                return ampbridge.jax.scale_loss(cross_entropy(amp.apply({"params": p}, x), y), opt_state)
            grads = jax.grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        schedule = ampbridge.jax.Schedule(module, policy, optax.adam(1e-3), train_step)
        params, opt_state = schedule.init(jax.random.key(0), x)
        for epoch in range(epochs):
            for x, y in batches:
                params, opt_state = schedule(params, opt_state, x, y, epoch=epoch)

    ``amp`` and ``tx`` are the phase's :class:`Applied` model and :func:`optimizer`. Each phase's
    step is traced and compiled once and cached (``traces`` counts them). At a phase boundary
    the parameters are re-cast to the new phase's ``param_dtype`` rows and the loss-scale state
    moves on by the core's rule (:func:`enter_phase`: carried over, or fresh on ``reset = true`` or
    a loss-scale mode change); the inner optimizer state (Adam's moments, its count) carries over
    untouched. ``params`` may be the ``params`` collection or the whole variables dict.

    The schedule follows one run: it remembers the phase of the state it last returned. After
    restoring a checkpoint, call ``resume(epoch=...)`` (or ``step=``) before the next step.
    """

    def __init__(self, module: Any, policy: Policy | str, inner: Any, train_step: Callable[..., Any], *,
                 host_callback: bool = False, **jit_kwargs: Any):
        self.amp = apply(module, policy)
        if not isinstance(self.amp, Applied):
            raise TypeError("ampbridge.jax.Schedule drives flax.linen modules; for flax.nnx apply the "
                            "phase's policy with ampbridge.jax.apply(model, policy.at(epoch=...))")
        self.policy = self.amp.schedule
        self.inner = inner
        self.train_step = train_step
        self.host_callback = host_callback
        self.jit_kwargs = jit_kwargs
        self.traces: dict[int | None, int] = {}
        self.phase: int | None | str = "unset"
        self._steps: dict[int | None, Callable] = {}
        self._txs: dict[int | None, Any] = {}
        self._models: dict[int | None, Applied] = {}
        self._lock = threading.Lock()

    # -- phases --
    def key(self, *, step: int | None = None, epoch: int | None = None) -> int | None:
        """The phase index in force (None: past a closed last phase, the top-level settings)."""
        if not self.policy.phases:
            return 0
        return self.policy.phase_index(step=step, epoch=epoch)

    def _policy_of(self, key: int | None) -> Policy:
        if not self.policy.phases:
            return self.policy
        if key is None:
            return dataclasses.replace(self.policy, phases=())
        return self.policy.phases[key].policy

    def _at(self, key: int | None) -> tuple[Applied, Any]:
        with self._lock:
            if key in self._txs:
                return self._models[key], self._txs[key]
        model = self.amp if not self.policy.phases else self._model_for(key)
        tx = optimizer(self.inner, self._policy_of(key), host_callback=self.host_callback)
        with self._lock:
            self._txs.setdefault(key, tx)
            self._models.setdefault(key, model)
            return self._models[key], self._txs[key]

    def _model_for(self, key: int | None) -> Applied:
        policy = self._policy_of(key)
        return Applied(self.amp.module, policy, _phase=(None, None), _schedule=policy, _notes=self.amp.notes,
                       _known=self.amp._known)

    def model(self, *, step: int | None = None, epoch: int | None = None) -> Applied:
        """The :class:`Applied` model of the phase in force."""
        return self._at(self.key(step=step, epoch=epoch))[0]

    def optimizer(self, *, step: int | None = None, epoch: int | None = None) -> Any:
        """The loss-scaling optimizer of the phase in force."""
        return self._at(self.key(step=step, epoch=epoch))[1]

    def plan(self, *example_inputs: Any, step: int | None = None, epoch: int | None = None, **kw: Any) -> Plan:
        return self.model(step=step, epoch=epoch).plan(*example_inputs, **kw)

    # -- state --
    def init(self, rngs: Any, *example_inputs: Any, step: int | None = None, epoch: int | None = None,
             collections: bool = False, **kwargs: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` for the phase in force (``collections=True``: all variables)."""
        if step is None and epoch is None:
            step, epoch = 0, 0
        key = self.key(step=step, epoch=epoch)
        model, tx = self._at(key)
        variables = jax.jit(functools.partial(model.init, **kwargs))(rngs, *example_inputs)
        params = variables if collections else variables["params"]
        opt_state = jax.jit(tx.init)(variables["params"])
        self.phase = key
        return params, opt_state

    def resume(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Declare the phase of a restored state (no conversion happens)."""
        self.phase = self.key(step=step, epoch=epoch)

    def _recast(self, model: Applied, params: Any) -> Any:
        if isinstance(params, Mapping) and "params" in params:
            return model.cast_params(params)
        return model.cast_params({"params": params})["params"]

    def enter(self, params: Any, opt_state: Any, *, step: int | None = None,
              epoch: int | None = None) -> tuple[Any, Any]:
        """Move ``(params, opt_state)`` into the phase in force (a no-op inside a phase)."""
        key = self.key(step=step, epoch=epoch)
        if self.phase == "unset":
            self.phase = key
        if key == self.phase:
            return params, opt_state
        order = list(range(len(self.policy.phases))) + [None]
        path = [key]
        if self.phase in order and key in order and order.index(key) > order.index(self.phase):
            path = order[order.index(self.phase) + 1:order.index(key) + 1]
        previous = _loss_scale_configs(self._policy_of(self.phase))
        for k in path:
            cfg = _loss_scale_configs(self._policy_of(k))
            reset = k is not None and self.policy.phases[k].reset_loss_scale
            opt_state = enter_phase(opt_state, cfg, previous, reset=reset)
            previous = cfg
        params = self._recast(self._at(key)[0], params)
        self.phase = key
        return params, opt_state

    # -- the steps --
    def step_fn(self, *, step: int | None = None, epoch: int | None = None) -> Callable:
        """The jitted train step of the phase in force (traced once per phase, then cached)."""
        key = self.key(step=step, epoch=epoch)
        with self._lock:
            hit = self._steps.get(key)
        if hit is not None:
            return hit
        model, tx = self._at(key)

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.traces[key] = self.traces.get(key, 0) + 1  # runs only while tracing
            return self.train_step(model, tx, *args, **kwargs)

        fn = jax.jit(traced, **self.jit_kwargs)
        with self._lock:
            self._steps.setdefault(key, fn)
            return self._steps[key]

    def __call__(self, params: Any, opt_state: Any, *args: Any, step: int | None = None,
                 epoch: int | None = None, **kwargs: Any) -> Any:
        """``enter`` the phase in force, then run its jitted step."""
        params, opt_state = self.enter(params, opt_state, step=step, epoch=epoch)
        return self.step_fn(step=step, epoch=epoch)(params, opt_state, *args, **kwargs)
