"""Every private framework name the backends use, in one place, with the versions it was checked
on and the test that breaks when it changes; and the releases each framework is tested on.

Framework-free data (docs/versions.md). ``tests/backend_<fw>/test_private_hooks.py`` scans each backend
(:func:`scan`) and fails when a private name is used that is not listed here, or a listed one is
no longer used. The backends' version errors quote :func:`tested_range`; ``constraints-min.txt``
pins the floors below and ``constraints.txt`` the newest (``tests/core/test_versions.py``).

Example:
    >>> tested_range("keras")
    'keras 3.12.0 to 3.15.1'
    >>> sorted({h.framework for h in HOOKS})
    ['jax', 'keras', 'tf_keras', 'torch']
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

#: framework -> (floor, newest tested): constraints-min.txt and constraints.txt pin these
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13.0", "2.13.0"),
    "keras": ("3.12.0", "3.15.1"),
    "tensorflow": ("2.20.0", "2.21.0"),
    "jax": ("0.10.0", "0.10.2"),
    "flax": ("0.12.5", "0.12.8"),
    "optax": ("0.2.6", "0.2.8"),
    "tf_keras": ("2.21.0", "2.21.0"),
}


def tested_range(framework: str) -> str:
    """``"keras 3.12.0 to 3.15.1"``: the releases ampbridge's CI runs ``framework`` at."""
    low, high = TESTED[framework]
    return f"{framework} {low}" if low == high else f"{framework} {low} to {high}"


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``, ``"0.12.5rc1"`` -> ``(0, 12, 5)``."""
    return tuple(int(m.group()) for m in (re.match(r"\d+", part) for part in version.split("+")[0].split("."))
                 if m is not None)


def check_release(framework: str, version: str) -> None:
    """Refuse a release older than the floor CI tests (:class:`ampbridge.errors.BackendUnavailableError`),
    and warn once about one newer than the newest tested (its private hooks may have changed; the
    first-step guards catch a loss scaler that stopped updating). ``AMPBRIDGE_UNTESTED_OK=1``
    turns the refusal into a warning: an explicit choice, still said.

    Example:
        >>> check_release("flax", "0.12.6")
        >>> check_release("flax", "0.11.0")
        Traceback (most recent call last):
        ...
        ampbridge.errors.BackendUnavailableError: flax 0.11.0 is older than ampbridge supports (flax 0.12.5 to 0.12.8, ...
    """
    import os

    from ..errors import AmpBridgeWarning, BackendUnavailableError, warn_once

    low, high = TESTED[framework]
    found = release(version)
    if found < release(low):
        message = (f"{framework} {version} is older than ampbridge supports ({tested_range(framework)}, the releases "
                   f"CI runs; docs/versions.md says what needs what): upgrade {framework}, or set "
                   "AMPBRIDGE_UNTESTED_OK=1 to run untested")
        if os.environ.get("AMPBRIDGE_UNTESTED_OK") != "1":
            raise BackendUnavailableError(message)
        warn_once(message.split(":")[0] + ": running untested (AMPBRIDGE_UNTESTED_OK=1)", AmpBridgeWarning,
                  key=f"release {framework} {version}")
    elif found[:len(release(high))] > release(high):
        warn_once(f"{framework} {version} is newer than ampbridge was tested on ({tested_range(framework)}): "
                  "its private hooks (ampbridge/backends/private_hooks.py) may have changed; the first "
                  "optimizer step is checked", AmpBridgeWarning, key=f"release {framework} {version}")


class PrivateHook(NamedTuple):
    """One private framework name: as :func:`scan` reports it, who owns it, why ampbridge uses it,
    what replaces it when it breaks, and the test that fails first when it changes."""

    name: str  # "torch._amp_update_scale_", or an attribute "GradScaler._scale" (class: ampbridge's)
    framework: str  # torch | keras | jax (the backend whose code uses it)
    purpose: str
    test: str  # tests/...::name


_VERSIONS = {"torch": "torch 2.13.0", "keras": "keras 3.12.0-3.15.1 (tensorflow 2.20-2.21, jax 0.10, torch 2.13)",
             "jax": "jax 0.10.0-0.10.2, flax 0.12.5-0.12.8", "tf_keras": "tf-keras 2.21.0 (tensorflow 2.21)"}


def versions_checked(hook: PrivateHook) -> str:
    """The releases a hook was checked on: those CI runs (``make test`` and ``make test-min``)."""
    return _VERSIONS[hook.framework]


_T = "tests/backend_torch/"
_K = "tests/backend_keras/"
_J = "tests/backend_jax/"
_TK = "tests/backend_tf_keras/"
_SCALER = _T + "test_scaler.py"
_TRACE = _T + "test_dtypes.py"
_KLS = _K + "test_loss_scale.py"
_KAPPLY = _K + "test_plan_apply.py"


def _h(name: str, framework: str, purpose: str, test: str) -> PrivateHook:
    return PrivateHook(name, framework, purpose, test)


HOOKS: tuple[PrivateHook, ...] = (
    # --- torch: the GradScaler subclass (loss_scale.py). torch's scaler keeps its state in these;
    # the public surface (scale/unscale_/step/update/state_dict) cannot express hysteresis, min/max,
    # on_min_scale or a one-read skip, so ampbridge extends the scaler from inside.
    _h("torch.amp.grad_scaler._refresh_per_optimizer_state", "torch", "reset per-optimizer stages in update()",
       _SCALER),
    _h("torch._amp_update_scale_", "torch", "torch's own update kernel for the plain dynamic case (bit-equal)",
       _SCALER),
    _h("GradScaler._lazy_init_scale_growth_tracker", "torch", "override: ampbridge's state tensors beside torch's",
       _SCALER),
    _h("GradScaler._unscale_grads_", "torch", "override: float16 grads when param_dtype asks; agree_across", _SCALER),
    _h("GradScaler._maybe_opt_step", "torch", "override: one read answers skip and min-scale check", _SCALER),
    _h("GradScaler._check_scale_growth_tracker", "torch", "torch's own state check in update()", _SCALER),
    _h("GradScaler._check_inf_per_device", "torch", "override: tells the monitor a fused step left its gradients"
       " scaled; called in the fused path with skip_nonfinite = false", _SCALER),
    _h("GradScaler._get_scale_async", "torch", "fused path with skip_nonfinite = false", _SCALER),
    _h("GradScaler._step_supports_amp_scaling", "torch", "an optimizer's fused-AMP flag (torch reads it too)",
       _SCALER),
    _h("GradScaler._per_optimizer_states", "torch", "found_inf flags per optimizer and device", _SCALER),
    _h("GradScaler._scale", "torch", "the scale tensor", _SCALER),
    _h("GradScaler._growth_tracker", "torch", "the good-steps tensor (and torch's state_dict key)", _SCALER),
    _h("GradScaler._init_scale", "torch", "start value torch's lazy init reads", _SCALER),
    _h("GradScaler._init_growth_tracker", "torch", "start value torch's lazy init reads", _SCALER),
    _h("GradScaler._enabled", "torch", "a disabled scaler for mode none without skipping", _SCALER),
    _h("GradScaler._growth_factor", "torch", "the float32-rounded growth factor", _SCALER),
    _h("GradScaler._backoff_factor", "torch", "the float32-rounded backoff factor", _SCALER),
    _h("GradScaler._growth_interval", "torch", "the growth interval", _SCALER),
    # --- torch: layers, forward, monitor, trace ---
    _h("torch.nn.modules.batchnorm._NormBase", "torch", "kind:norm for every batch/instance norm", _T + "test_kinds.py"),
    _h("torch.nn.modules.conv._ConvNd", "torch", "kind:conv for every convolution", _T + "test_kinds.py"),
    _h("._parameters", "torch", "cast a module's own parameters for one forward (forward.py)", _T + "test_apply.py"),
    _h("._orig_mod", "torch", "apply() on a torch.compile'd module reaches the original", _T + "test_compile.py"),
    _h("torch.utils._pytree.tree_map_only", "torch", "cast the tensors in nested forward inputs",
       _T + "test_apply.py"),
    _h("torch.utils._pytree.tree_leaves", "torch", "find the loss tensor in nested outputs (monitor)",
       _T + "test_monitor.py"),
    _h("torch._foreach_norm", "torch", "one kernel for every gradient norm the monitor logs", _T + "test_monitor.py"),
    _h("torch.utils._python_dispatch.TorchDispatchMode", "torch", "trace(): the dtype each ATen op ran in",
       _TRACE),
    _h("._after_closure", "torch", "Lightning precision plugin's post-closure hook (trainers.py)",
       _T + "test_trainers.py"),
    _h("._experts_implementation", "torch", "transformers' config attribute naming how MoE experts run "
       "(\"grouped_mm\": torch._grouped_mm, which autocast leaves alone; plan.py's static rows)",
       _T + "test_zoo_traced.py"),
    _h("._optimizers", "torch", "Accelerator._optimizers: accelerate's prepared optimizers, told a skipped step "
       "(trainers.py, the Hugging Face Trainer callback)", _T + "test_trainers.py"),
    # ATen overload names trace() matches (private ops are what autocast dispatches to)
    *(_h(f"aten.{op}", "torch", "trace(): op kinds to report or ignore", _TRACE) for op in (
        "_cudnn_rnn", "_embedding_bag", "_fused_rms_norm", "_grouped_mm", "_log_softmax",
        "_native_batch_norm_legit", "_native_multi_head_attention",
        "_prelu_kernel", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_softmax", "_to_copy", "_trilinear")),
    # --- keras: the LossScaleOptimizer subclass (loss_scale.py): Keras's class routes a step through
    # these; the first-step guard (_verified_apply) fails loudly if a release stops calling them
    _h("._output_dense", "keras", "MultiHeadAttention's output projection: the dtype its static Plan row "
       "says the layer returns (plan.py)", _K + "test_zoo.py"),
    _h("._keras_history", "keras", "the layer that made a Functional model's output tensor: the dtypes a "
       "composite model's static row says it returns (plan.py)", _K + "test_zoo.py"),
    _h("LossScaleOptimizer._common_apply", "keras", "override: the step on torch/JAX-eager backends", _KLS),
    _h("LossScaleOptimizer._stateful_handle_finite_grads", "keras", "override: TF merge_call path", _KLS),
    _h("LossScaleOptimizer._stateful_handle_non_finite_grads", "keras", "override: TF merge_call path", _KLS),
    _h("LossScaleOptimizer._tf_apply", "keras", "override: TF step agreeing on finiteness across replicas",
       _KLS),
    _h("LossScaleOptimizer._overwrite_variable_with_gradient", "keras", "leave overwrite-with-gradient vars unscaled",
       _KLS),
    _h("LossScaleOptimizer._trainable_variables", "keras", "the variables gradients pair with", _KLS),
    _h("LossScaleOptimizer._variables", "keras", "the optimizer's own variables (state, checkpoint layout)", _KLS),
    _h("keras.src.utils.tracking", "keras", "add state variables without auto-tracking them twice", _KLS),
    _h("keras.src.api_export", "keras", "save a subclass under keras.optimizers.LossScaleOptimizer", _KLS),
    _h("._model", "keras", "Callback._model: no JAX state sync per access", _K + "test_monitor.py"),
    _h("._jax_state", "keras", "the traced JAX state during fit (monitor, schedule)", _K + "test_monitor.py"),
    _h("._jax_state_synced", "keras", "whether that state is in the variables", _K + "test_monitor.py"),
    _h("._compile_config", "keras", "what model.save writes for the optimizer (saving.py)", _KLS),
    _h("keras.src.backend.torch.core.get_device", "keras", "Keras-on-torch's device without allocating on it",
       _K + "test_env_hardware.py"),
    # --- keras: layers and apply ---
    _h("._flatten_layers", "keras", "a layer's direct children (layer walk)", _KAPPLY),
    _h("._layers", "keras", "whether a layer is composite", _KAPPLY),
    _h("._trainable_variables", "keras", "a layer's own variables (not its children's)", _KAPPLY),
    _h("._non_trainable_variables", "keras", "a layer's own variables (not its children's)", _KAPPLY),
    _h("._dtype", "keras", "recast a built variable in place (same object)", _KAPPLY),
    _h("._initialize", "keras", "recast a built variable in place (same object)", _KAPPLY),
    _h("._dtype_policy", "keras", "scope(): a new layer's policy before it builds (no map semantics)",
       _KAPPLY),
    _h("._torch_params", "keras", "Keras-on-torch: re-track recast variables", _KAPPLY),
    _h("._track_variables", "keras", "Keras-on-torch: re-track recast variables", _KAPPLY),
    _h("._auto_config", "keras", "a layer's constructor arguments (kinds)", _K + "test_kinds.py"),
    _h("._float8_build", "keras", "whether a layer has Keras's float8 training path (fp8.py: Dense, EinsumDense)",
       _K + "test_fp8.py"),
    _h("._seed_generators", "keras", "the monitor's sampling slots travel with the JAX state",
       _K + "test_monitor.py"),
    _h("MixedDTypePolicy._parse_name", "keras", "override: policies with any compute/variable pair",
       _KAPPLY),
    *(_h(f"tensorflow.python.framework.ops.{name}", "keras", "TensorFlow's numpy-style promotion while a caller "
         "of a pinned layer runs (apply._tensorflow_promotion)", _K + "test_streams.py")
      for name in ("get_dtype_conversion_mode", "set_dtype_conversion_mode")),
    _h("patch .__init__", "keras", "scope(): keras.layers.Layer.__init__ patched while the block runs",
       _KAPPLY),
    _h("patch .__class__", "keras", "plan(model, policy, *inputs): a recording subclass on the clone's layers "
       "(the user's model is never touched)", _K + "test_traced_plan.py"),
    # --- jax ---
    _h("._pytree__nodes", "jax", "flax NNX: set a static attribute without NNX's 75 us checks",
       _J + "test_nnx.py"),
    # --- tf_keras (Keras 2): layers and apply ---
    _h("._flatten_layers", "tf_keras", "a layer's direct children (layer walk)", _TK + "test_plan_apply.py"),
    _h("._trainable_weights", "tf_keras", "a layer's own weights (not its children's)", _TK + "test_plan_apply.py"),
    _h("._non_trainable_weights", "tf_keras", "a layer's own weights (not its children's)", _TK + "test_plan_apply.py"),
    _h("._is_graph_network", "tf_keras", "a Functional or Sequential model (apply rebuilds those)",
       _TK + "test_plan_apply.py"),
    _h("._set_dtype_policy", "tf_keras", "apply on a model not built yet: what the constructor's dtype= calls",
       _TK + "test_plan_apply.py"),
    _h("._is_default", "tf_keras", "a layer whose build is Layer's own (Keras 2 never calls it): a schedule's "
       "layer switches to the first phase's policy at once rather than after its build", _TK + "test_schedule.py"),
    _h("._inbound_nodes", "tf_keras", "trace: a layer called once has one output tensor to read",
       _TK + "test_plan_apply.py"),
    # --- tf_keras: the reference loss-scale state inside Keras 2's LossScaleOptimizer (loss_scale.py)
    _h("._DynamicLossScaleState", "tf_keras", "the state class Keras 2's apply_gradients asks; subclassed",
       _TK + "test_loss_scale.py"),
    _h("._is_all_finite", "tf_keras", "Keras 2's own finiteness test of the gradients", _TK + "test_loss_scale.py"),
    _h("._add_weight", "tf_keras", "the state's checkpointed variables, as Keras 2's own", _TK + "test_loss_scale.py"),
    _h("._loss_scale", "tf_keras", "the optimizer's state object, replaced by the reference one",
       _TK + "test_loss_scale.py"),
    _h("._track_trackable", "tf_keras", "checkpoint the replacement state under Keras 2's own key",
       _TK + "test_loss_scale.py"),
)


def hooks_of(framework: str) -> tuple[PrivateHook, ...]:
    """The listed hooks of one backend."""
    return tuple(h for h in HOOKS if h.framework == framework)


# --- the scan: which private framework names a backend's source uses ---------------------------

_NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public despite the "_"
_METADATA = {"__doc__", "__name__", "__qualname__", "__module__", "__signature__", "__wrapped__"}
_ROOTS = {"torch", "keras", "tensorflow", "jax", "jaxlib", "flax", "optax", "jmp", "orbax"}
_PACKAGE = Path(__file__).resolve().parents[1]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__") and part not in _NAMEDTUPLE


def _first_private(parts: list[str]) -> int | None:
    if parts[:2] in (["keras", "src"], ["tensorflow", "python"]):  # their private trees
        return 1
    return next((i for i, p in enumerate(parts) if _private(p)), None)


def _chain(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


class _File(NamedTuple):
    module: str
    tree: ast.Module


def _files(framework: str) -> list[_File]:
    paths = sorted((_PACKAGE / "backends" / framework).glob("*.py")) + [_PACKAGE / f"{framework}.py"]
    out = []
    for path in paths:
        rel = path.relative_to(_PACKAGE.parent).with_suffix("")
        out.append(_File(".".join(rel.parts), ast.parse(path.read_text(encoding="utf-8"))))
    return out


@functools.lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    """Private names ampbridge itself defines where the backends can reach them (backends, core,
    diagnostics, the top-level modules); names on its framework subclasses are judged against
    the framework's source instead, in :func:`_classify`."""
    own: set[str] = set()
    paths = [p for d in ("backends", "core", "diagnostics") for p in (_PACKAGE / d).rglob("*.py")]
    for path in paths + sorted(_PACKAGE.glob("*.py")):
        _Definitions(own).visit(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(n for n in own if _private(n))


class _Definitions(ast.NodeVisitor):
    """Collects defined names: functions, classes, arguments, aliases, assigned names, keywords,
    and attributes assigned inside a class body (``self._x = ...`` in a method)."""

    def __init__(self, own: set[str]):
        self.own, self.in_class = own, 0

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.own.add(node.name)
        self.in_class += 1
        self.generic_visit(node)
        self.in_class -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.own.add(node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node: ast.arg) -> None:
        self.own.add(node.arg)

    def visit_alias(self, node: ast.alias) -> None:
        if node.asname:
            self.own.add(node.asname)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.own.add(node.id)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg:
            self.own.add(node.arg)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store) and self.in_class:
            self.own.add(node.attr)
        self.generic_visit(node)


def _aliases(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _ROOTS:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in _ROOTS:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _framework_base(cls: ast.ClassDef, aliases: dict[str, str]) -> bool:
    for base in cls.bases:
        parts = _chain(base)
        if parts and parts[0] in aliases:
            return True
    return False


def scan(framework: str, sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """The private framework names ``ampbridge/backends/<framework>/`` (and the facade) uses:
    name -> the modules using it. Module paths (``keras.src.utils.tracking``, ``torch._foo``,
    ``jax._src...``), private ATen op names the tracer matches (``aten._softmax``), and private
    attributes of framework objects: on ampbridge's subclasses of framework classes as
    ``Class._name`` when the framework's class source has the name (imports the framework),
    elsewhere as ``._name`` when ampbridge defines no such name. ``sources`` (module name -> source
    text) replaces the backend's files, for testing the scan itself.

    Example:
        >>> sorted(scan("torch", {"m": "import torch\\ntorch._foo(x._bar, torch.ops.aten.mm)"}))
        ['._bar', 'torch._foo']
    """
    own = _own_names()
    found: dict[str, set[str]] = {}

    def add(name: str, module: str) -> None:
        found.setdefault(name, set()).add(module)

    files = _files(framework) if sources is None else [_File(m, ast.parse(t)) for m, t in sources.items()]
    for file in files:
        _scan_file(file, own, add)
    return found


def _subclass_nodes(tree: ast.AST, aliases: dict[str, str]) -> dict[int, ast.ClassDef]:
    """Every node inside a class deriving from a framework class (directly or through ours) -> that class."""
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    _CONTEXT.update(aliases=aliases, classes={c.name: c for c in classes})
    derived: set[str] = set()
    while True:
        more = {c.name for c in classes if c.name not in derived and (_framework_base(c, aliases) or any(
            isinstance(b, ast.Name) and b.id in derived for b in c.bases))}
        if not more:
            break
        derived |= more
    subclass_nodes: dict[int, ast.ClassDef] = {}
    for cls in (c for c in classes if c.name in derived):
        for n in ast.walk(cls):
            subclass_nodes[id(n)] = cls
    return subclass_nodes


def _scan_file(file: "_File", own: Any, add: Callable[[str, str], None]) -> None:
    """One module's private framework names, told to ``add(name, module)``."""
    tree = file.tree
    aliases = _aliases(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for full in aliases.values():
        parts = full.split(".")
        if _first_private(parts) is not None:
            add(full, file.module)
    subclass_nodes = _subclass_nodes(tree, aliases)
    for node in ast.walk(tree):
        owner = subclass_nodes.get(id(node))
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(id(node)), ast.Attribute):
            parts = _chain(node)
            if parts and parts[0] in aliases:
                full = aliases[parts[0]].split(".") + parts[1:]
                at = _first_private(full)
                if at is not None and at >= len(aliases[parts[0]].split(".")):
                    keep = full if full[:2] in (["keras", "src"], ["jax", "_src"], ["tensorflow", "python"]) else full[:at + 1]
                    add(".".join(keep), file.module)
                continue
        _scan_node(node, owner, parents, aliases, own, file.module, add)


def _scan_node(node: ast.AST, owner: ast.ClassDef | None, parents: dict[int, ast.AST], aliases: dict[str, str],
               own: Any, module: str, add: Callable[[str, str], None]) -> None:
    """A node that is not a framework module path: a patched dunder, a private attribute (by
    attribute, getattr-like call, method of a subclass, subscript key), or an ATen table entry."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("__") \
            and node.attr not in _METADATA and (_chain(node) or ["self"])[0] != "self":
        add(f"patch .{node.attr}", module)  # a framework class's method replaced
    elif isinstance(node, ast.Attribute) and _private(node.attr):
        parts = _chain(node)
        if parts and parts[0] in aliases:
            return
        _classify(node.attr, owner, own, module, add)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
            _classify(arg.value, owner, own, module, add)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and owner is not None \
            and _private(node.name) and parents.get(id(node)) is owner:
        _classify(node.name, owner, own, module, add, defined=True)
    elif isinstance(node, ast.Subscript) and owner is not None and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str) and _private(node.slice.value):
        _classify(node.slice.value, owner, own, module, add)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and owner is None:
        parent = parents.get(id(node))
        holder = parents.get(id(parent)) if isinstance(parent, ast.Tuple) else None
        if isinstance(holder, ast.Assign) and any(isinstance(t, ast.Name) and t.id in _ATEN_TABLES
                                                  for t in holder.targets) and _private(node.value):
            add(f"aten.{node.value}", module)


#: tables of ATen op names the torch tracer matches against (torch.ops.aten overload names)
_ATEN_TABLES = {"_COMPUTE_OPS", "_IGNORED_OPS"}


_CONTEXT: dict[str, dict] = {}


def _framework_sources(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> str:
    """The source of the framework classes ``cls`` derives from (their whole MRO), found from its
    bases as written: a framework name (``torch.amp.GradScaler``) or another class of the module."""
    aliases, classes = _CONTEXT["aliases"], _CONTEXT["classes"]
    texts = []
    for base in cls.bases:
        parts = _chain(base)
        if not parts:
            continue
        if parts[0] in aliases:
            path = aliases[parts[0]].split(".") + parts[1:]
            obj = None
            for cut in range(len(path), 0, -1):  # the longest importable module, then attributes
                try:
                    obj = importlib.import_module(".".join(path[:cut]))
                except ImportError:
                    continue
                for attr in path[cut:]:
                    obj = getattr(obj, attr)
                break
            for klass in inspect.getmro(obj) if isinstance(obj, type) else ():
                if klass.__module__.split(".")[0] in _ROOTS:
                    try:
                        texts.append(inspect.getsource(klass))
                    except (OSError, TypeError):
                        texts.append(" ".join(vars(klass)))
        elif len(parts) == 1 and parts[0] in classes and parts[0] not in seen:
            texts.append(_framework_sources(classes[parts[0]], seen | {cls.name}))
    return "\n".join(texts)


_SOURCE_CACHE: dict[tuple[str, str], str] = {}


def _classify(name: str, owner: ast.ClassDef | None, own: set[str], module: str, add: object,
              defined: bool = False) -> None:
    if name.startswith("_ampbridge"):  # ampbridge's own marks on framework objects
        return
    if owner is None:
        if name not in own:
            add(f".{name}", module)  # type: ignore[operator]
        return
    key = (module, owner.name)
    if key not in _SOURCE_CACHE:
        _SOURCE_CACHE[key] = _framework_sources(owner)
    if re.search(rf"\b{re.escape(name)}\b", _SOURCE_CACHE[key]):
        add(f"{owner.name}.{name}", module)  # type: ignore[operator]
