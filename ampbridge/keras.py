"""The Keras 3 backend: the Plan as per-layer dtype policies, and a loss-scaling optimizer.

Works the same on Keras's TensorFlow, JAX and torch backends; it imports ``keras`` only (and
``tensorflow`` only for the TF32 switch when TensorFlow is the active Keras backend).

* :func:`apply` sets every layer's ``dtype_policy`` to its Plan row (compute / variable dtype),
  re-casts built weights whose variable dtype changes (values kept), casts outputs where a row
  (or the policy, for the model) asks for another output dtype, and sets ``matmul_precision``.
* :func:`scope` builds models under the policy: the global Keras dtype policy, plus the
  ``kind:``/``type:`` rules applied to each layer as it is created.
* :func:`optimizer` wraps a Keras optimizer in :class:`LossScaleOptimizer`, a subclass of
  Keras's own that runs ampbridge's reference loss-scale algorithm in ``keras.ops``.
* :class:`PhaseCallback` switches phases of a precision schedule during ``fit``.
* :class:`MonitorCallback` (``fit``) and :class:`Monitor` (custom loops) write the numerics log
  ``ampbridge report`` reads: per-layer gradient statistics and which layer overflowed first.

All of them apply the environment's bisect switch (``AMPBRIDGE_DISABLE=1``,
``AMPBRIDGE_POLICY=...``) and resolve ``compute_dtype = "auto"`` for the backend's
:func:`device` (:func:`resolve_policy`).

Example:
    >>> import keras, ampbridge
    >>> policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="dense"),
    ...                           keras.layers.LayerNormalization(name="norm")])
    >>> model = ampbridge.keras.apply(model, policy)
    >>> model.get_layer("dense").compute_dtype, model.get_layer("norm").compute_dtype
    ('float16', 'float32')
    >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from .core.loss_scale import LossScaleState, f32, initial_state
from .core.matching import compile_pattern
from .core.plan import Layer, Plan, PlanRow, build_plan, with_note
from .core.policy import LossScaleConfig, Policy
from .errors import AmpBridgeWarning, LossScaleError, PolicyError, UnsupportedOptionError

__all__ = [
    "LossScaleCallback",
    "LossScaleOptimizer",
    "MixedDTypePolicy",
    "Monitor",
    "MonitorCallback",
    "PhaseCallback",
    "apply",
    "bfloat16_rounding",
    "device",
    "dtype_policy",
    "kind_of",
    "layers",
    "load_model",
    "optimizer",
    "owns",
    "plan",
    "resolve_policy",
    "scope",
    "set_matmul_precision",
]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _backend() -> str:
    return keras.backend.backend()


def _as_policy(policy: Policy | str) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        from .core.io import PRESETS, load, preset

        return preset(policy) if policy in PRESETS else load(policy)
    raise TypeError(f"expected an ampbridge.Policy, a preset name or a policy file path; "
                    f"received {policy!r} (of type {type(policy).__name__})")


# --- the policy that actually runs: environment switch, "auto" ----------------------------------

def device() -> Any:
    """The device the active Keras backend computes on, as the core's ``ampbridge.diagnostics.hardware.Device``
    (what ``compute_dtype = "auto"`` is decided on).

    TensorFlow: its first GPU (name and compute capability from ``tf.config``), else a TPU, else
    the CPU; JAX: ``jax.devices()[0]``; torch: the CUDA device Keras uses, else the CPU. CPU
    flags come from ``/proc/cpuinfo`` (``_hardware.cpu_flags()``).

    Example:
        >>> device().platform in ("cpu", "cuda", "tpu", "mps", "rocm")
        True
    """
    from .diagnostics import hardware as _hardware
    from .diagnostics.hardware import Device

    backend = _backend()
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0]) or {}
            capability = details.get("compute_capability")
            return Device("cuda", str(details.get("device_name", gpus[0].name)),
                          tuple(int(c) for c in capability) if capability else None)
        if tf.config.list_physical_devices("TPU"):
            return Device("tpu")
    elif backend == "jax":
        import jax

        dev = jax.devices()[0]
        platform = {"gpu": "cuda"}.get(dev.platform, dev.platform)
        if platform != "cpu":
            capability = None
            cc = getattr(dev, "compute_capability", None)
            if cc:
                try:
                    capability = tuple(int(c) for c in str(cc).split(".")[:2])
                except ValueError:
                    capability = None
            return Device(platform, str(getattr(dev, "device_kind", "")), capability)  # type: ignore[arg-type]
    elif backend == "torch":
        import torch

        where = str(keras.src.backend.torch.core.get_device())
        if where.startswith("cuda") and torch.cuda.is_available():
            index = torch.cuda.current_device()
            return Device("cuda", torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
        if where.startswith("mps"):
            return Device("mps")
    return Device("cpu", cpu_flags=_hardware.cpu_flags())


def resolve_policy(policy: Policy | str, *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy :func:`apply`, :func:`scope`, :func:`optimizer` and :func:`plan` use, and why it
    differs from the one given (the Plan keeps these notes).

    ``AMPBRIDGE_DISABLE=1`` swaps in the ``float32`` preset and ``AMPBRIDGE_POLICY=NAME_OR_FILE``
    another policy (``ampbridge.diagnostics.environment``; each says so once per process); ``compute_dtype = "auto"``
    becomes the :func:`device`'s choice (``ampbridge.diagnostics.hardware.resolve_auto``).

    Example:
        >>> import ampbridge
        >>> resolve_policy(ampbridge.preset("mixed_bfloat16"))[0].compute_dtype
        'bfloat16'
    """
    from .diagnostics import environment as _env
    from .diagnostics.hardware import resolve_auto

    given = _as_policy(policy)
    notes: list[str] = []
    policy = _env.effective_policy(given, f"keras ({_backend()})", warn=warn)
    if policy is not given:
        notes.append("the environment (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY) replaced the policy given")
    where = device()
    policy, why = resolve_auto(policy, where, warn=warn)
    if why:
        notes.append(why)
    if where.platform == "cpu" and _uses_bfloat16(policy) and bfloat16_rounding() == "toward zero":
        notes.append(_TRUNCATION_NOTE)
        if warn and _TRUNCATION_NOTE not in _env._said:  # once per process, like the bisect switch
            _env._said.add(_TRUNCATION_NOTE)
            warnings.warn(_TRUNCATION_NOTE, AmpBridgeWarning, stacklevel=3)
    return policy, tuple(notes)


_TRUNCATION_NOTE = (
    "TensorFlow's CPU kernels for bfloat16 round toward zero on this machine (measured), where "
    "torch, JAX and TensorFlow's own XLA round to nearest; bfloat16 training "
    "drifts from theirs by about an ulp per matmul. Compile the model with jit_compile=True "
    "(XLA rounds to nearest) to match them, or use float32 (what compute_dtype='auto' picks here)")


def _uses_bfloat16(policy: Policy) -> bool:
    return "bfloat16" in {policy.compute_dtype, policy.param_dtype} | {
        getattr(rule, name) for rule in policy.overrides for name in ("compute_dtype", "param_dtype")} | {
        dtype for phase in policy.phases for dtype in (phase.policy.compute_dtype, phase.policy.param_dtype)}


def bfloat16_rounding() -> str | None:
    """How the TensorFlow backend's own (non-XLA) CPU kernels round to bfloat16: ``"nearest"`` or
    ``"toward zero"`` (measured by ``ampbridge.diagnostics.hardware.tensorflow_bfloat16_rounding``); None on
    the JAX and torch Keras backends, which round to nearest everywhere.

    Example:
        >>> bfloat16_rounding() in ("nearest", "toward zero", None)
        True
    """
    if _backend() != "tensorflow":
        return None
    from .diagnostics.hardware import tensorflow_bfloat16_rounding

    return tensorflow_bfloat16_rounding()


# --- dtype policies ---------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="ampbridge")
class MixedDTypePolicy(keras.DTypePolicy):
    """A Keras dtype policy for the (compute, variable) pairs Keras has no name for.

    Keras names ``mixed_float16`` (float16 compute, float32 variables), ``mixed_bfloat16`` and
    single dtypes; ampbridge uses those whenever they fit (so a saved model needs nothing from
    ampbridge to reload), and this class for the rest, e.g. float32 compute with bfloat16
    storage. Its name is ``"<compute>/<variable>"``.

    Keras's ``Layer.from_config`` turns every non-quantized policy into its name and parses it
    with ``DTypePolicy``, which knows no such pair; so a layer config records the variable dtype
    only (weights reload exactly, in their storage dtype) and :func:`load_model` re-applies the
    compute dtype from the policy.

    Example:
        >>> MixedDTypePolicy("float32/bfloat16").variable_dtype
        'bfloat16'
    """

    def _parse_name(self, name: str) -> tuple[str, str]:
        compute, sep, variable = str(name).partition("/")
        if not sep:
            variable = compute
        if compute not in _FLOATS or variable not in _FLOATS:
            raise ValueError(f"MixedDTypePolicy name must be '<compute>/<variable>' (or one dtype) with float "
                             f"dtypes ({', '.join(_FLOATS)}); received name={name!r}")
        return compute, variable

    def get_config(self) -> dict[str, Any]:
        return {"name": self.variable_dtype}


def dtype_policy(compute_dtype: str, param_dtype: str) -> keras.DTypePolicy:
    """The Keras dtype policy computing in ``compute_dtype`` with variables in ``param_dtype``.

    Example:
        >>> dtype_policy("float16", "float32").name
        'mixed_float16'
    """
    if compute_dtype == param_dtype:
        return keras.DTypePolicy(compute_dtype)
    if param_dtype == "float32" and compute_dtype in ("float16", "bfloat16"):
        return keras.DTypePolicy(f"mixed_{compute_dtype}")
    return MixedDTypePolicy(f"{compute_dtype}/{param_dtype}")


def _same_policy(a: Any, b: Any) -> bool:
    return (getattr(a, "compute_dtype", None), getattr(a, "variable_dtype", None)) == (
        getattr(b, "compute_dtype", None), getattr(b, "variable_dtype", None))


# --- layers, kinds and the Plan ---------------------------------------------------------------

def _kind_table() -> list[tuple[tuple[type, ...], str]]:
    L = keras.layers
    norm = tuple(getattr(L, n) for n in ("BatchNormalization", "LayerNormalization", "GroupNormalization",
                                          "UnitNormalization", "RMSNormalization") if hasattr(L, n))
    conv = tuple(getattr(L, n) for n in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D") if hasattr(L, n))
    attention = tuple(getattr(L, n) for n in ("MultiHeadAttention", "GroupedQueryAttention",
                                               "Attention", "AdditiveAttention") if hasattr(L, n))
    recurrent = tuple(getattr(L, n) for n in ("RNN", "Bidirectional", "LSTMCell", "GRUCell",
                                               "SimpleRNNCell", "StackedRNNCells") if hasattr(L, n))
    # most specific first: ConvLSTM subclasses RNN, so it stays recurrent
    return [(norm, "norm"), ((L.Embedding,), "embedding"), ((L.Softmax,), "softmax"),
            ((L.Dense, L.EinsumDense), "linear"), (attention, "attention"), (recurrent, "recurrent"),
            (conv, "conv")]


_KINDS: list[tuple[tuple[type, ...], str]] | None = None


def kind_of(layer: Any) -> str | None:
    """The portable kind of a Keras layer: its ``ampbridge_kind`` attribute, else its class."""
    declared = getattr(layer, "ampbridge_kind", None)
    if declared is not None:
        return declared
    global _KINDS
    if _KINDS is None:
        _KINDS = _kind_table()
    for classes, kind in _KINDS:
        if isinstance(layer, classes):
            return kind
    return None


# Built-in composite layers create some sublayers with auto-generated, process-dependent names
# ("softmax_7"); their path segment is the role instead, so a Plan is stable across runs.
_ROLE_NAMES = {"_softmax": "softmax", "_dropout_layer": "dropout"}


def _children(layer: Any) -> list[tuple[str, Any]]:
    out = []
    for child in layer._flatten_layers(include_self=False, recursive=False):
        if isinstance(child, keras.layers.InputLayer):
            continue
        name = child.name
        for attr, role in _ROLE_NAMES.items():
            if getattr(layer, attr, None) is child:  # torch keeps sublayers in _modules, not __dict__
                name = role
        out.append((name.replace("/", "."), child))
    return out


def layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` for the model (path ``""``) and every nested layer, depth first.

    Paths join the layers' names with ``.``; a layer reached twice (shared) is listed once, at
    its first path; sublayers of Keras's attention layers that Keras names automatically are
    named by role (``mha.softmax``, ``mha.dropout``).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> [path for path, _ in layers(m)]
        ['', 'head']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"expected a Keras layer or model; received {type(model).__qualname__}")
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", model)]
    while stack:
        path, layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield path, layer
        kids, used = [], set()
        for name, child in _children(layer):
            segment, n = name, 1
            while segment in used:  # siblings with one name (possible in subclassed models)
                n += 1
                segment = f"{name}_{n}"
            used.add(segment)
            kids.append((f"{path}.{segment}" if path else segment, child))
        stack.extend(reversed(kids))


def _own_params(layer: Any) -> int:
    return sum(int(np.prod(v.shape)) for v in layer._trainable_variables + layer._non_trainable_variables)


def _describe(model: Any) -> tuple[list[Layer], dict[str, Any]]:
    described, by_path = [], {}
    for path, layer in layers(model):
        described.append(Layer(path, kind_of(layer), type(layer).__name__, _own_params(layer)))
        by_path[path] = layer
    return described, by_path


_INTERNAL_FLOAT32 = ("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization")


def _adjuster(policy: Policy, by_path: dict[str, Any]):
    backend = _backend()
    norms = tuple(getattr(keras.layers, n) for n in _INTERNAL_FLOAT32 if hasattr(keras.layers, n))

    def adjust(row: PlanRow) -> PlanRow:
        layer, notes, changes = by_path[row.path], [], {}
        half = row.compute_dtype in ("float16", "bfloat16")
        if row.path == "" and row.output_dtype != policy.output_dtype:
            notes.append(f"model outputs cast to output_dtype {policy.output_dtype}")
            changes["output_dtype"] = policy.output_dtype
        if half and isinstance(layer, norms):
            # ops.layer_normalization / batch_normalization / rms_normalization upcast to float32
            notes.append(f"Keras normalises in float32 internally, output {row.output_dtype}")
            changes["compute_dtype"] = "float32"
        if row.compute_dtype == "float16" and isinstance(layer, keras.layers.Softmax) and backend == "torch":
            if str(keras.src.backend.torch.core.get_device()) == "cpu":
                notes.append("Keras-on-torch computes float16 softmax in float32 internally on CPU")
                changes["compute_dtype"] = "float32"
        parent = by_path.get(row.path.rsplit(".", 1)[0]) if "." in row.path else None
        if row.path.endswith((".softmax", ".dropout")) and isinstance(parent, keras.layers.MultiHeadAttention):
            notes.append("runs only when MultiHeadAttention takes its explicit path (dropout > 0, attention "
                         "scores returned, or inputs not 3-D); otherwise ops.dot_product_attention "
                         "computes the softmax itself")
        if half and isinstance(layer, keras.layers.MultiHeadAttention) and backend in ("tensorflow", "jax"):
            notes.append("ops.dot_product_attention computes logits and softmax in float32")
        return with_note(row, "; ".join(notes), **changes) if notes else row

    return adjust


def plan(model: Any, policy: Policy | str, *, warn: bool = True) -> Plan:
    """The Plan of a Keras model under a policy: one row per layer, what will actually run.

    Rows where Keras itself overrides the request say so in their ``note`` (norm layers
    normalise in float32 whatever their compute dtype; see the README's Keras section).

    Example:
        >>> import keras, ampbridge
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> plan(m, ampbridge.preset("mixed_bfloat16"))["head"].compute_dtype
        'bfloat16'
    """
    policy, notes = resolve_policy(policy, warn=warn)
    described, by_path = _describe(model)
    return build_plan(described, policy, framework=f"keras ({_backend()})",
                      adjust=_adjuster(_phase0(policy), by_path), warn=warn, notes=notes)


def _phase0(policy: Policy) -> Policy:
    return policy.at(step=0, epoch=0) if policy.phases else policy


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model (what this backend plans and applies to)."""
    return isinstance(obj, keras.layers.Layer)


# --- apply ------------------------------------------------------------------------------------

_WRAPPER = "_ampbridge_call"  # the layer's ampbridge call wrapper, kept in its __dict__


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        return keras.backend.standardize_dtype(dtype) in _FLOATS
    except ValueError:
        return False


def _call_wrapper(layer: Any) -> Any:
    """The one ``call`` wrapper ampbridge puts on a layer instance (made on first use).

    It carries two settings read at every call (so at every trace): ``cast``, the dtype the
    layer's float outputs are cast to (or None), and ``probe``, the monitor's hooks on the
    layer's inputs and outputs (or None). An instance attribute: ``Layer.__call__`` runs
    ``self.call`` on every backend and inside jit, and JAX's ``stateless_call`` runs the model's.
    """
    wrapper = layer.__dict__.get(_WRAPPER)
    if wrapper is not None:
        return wrapper
    inner = layer.call

    @functools.wraps(inner)
    def call(*args: Any, **kwargs: Any) -> Any:
        probe = call.probe
        if probe is not None:
            args, kwargs = probe.before(args, kwargs)
        out = inner(*args, **kwargs)
        if call.cast is not None:
            out = keras.tree.map_structure(lambda t: _cast_float(t, call.cast), out)
        if probe is not None:
            probe.after(out)
        return out

    call.cast = None  # type: ignore[attr-defined]
    call.probe = None  # type: ignore[attr-defined]
    object.__setattr__(layer, _WRAPPER, call)
    object.__setattr__(layer, "call", call)
    return call


def _drop_idle_wrapper(layer: Any) -> None:
    """Remove the wrapper once it has nothing to do (unless someone wrapped ``call`` over it)."""
    wrapper = layer.__dict__.get(_WRAPPER)
    if wrapper is None or wrapper.cast is not None or wrapper.probe is not None:
        return
    del layer.__dict__[_WRAPPER]
    if layer.__dict__.get("call") is not wrapper:
        return  # wrapped again from outside: stays in the chain, idle
    inner = wrapper.__wrapped__
    if getattr(inner, "__func__", None) is type(layer).call:
        del layer.__dict__["call"]  # back to the class's own call
    else:
        object.__setattr__(layer, "call", inner)


def _set_output_cast(layer: Any, dtype: str | None) -> None:
    """Cast the layer's float outputs to ``dtype`` (None: no ampbridge cast)."""
    if dtype is None:
        wrapper = layer.__dict__.get(_WRAPPER)
        if wrapper is not None:
            wrapper.cast = None
            _drop_idle_wrapper(layer)
        return
    _call_wrapper(layer).cast = dtype


def _cast_float(t: Any, dtype: str) -> Any:
    if _is_float(t) and keras.backend.standardize_dtype(t.dtype) != dtype:
        return ops.cast(t, dtype)
    return t


def _recast_variables(layer: Any, old_dtype: str, new_dtype: str) -> bool:
    """Re-create the layer's own variables that follow its policy in ``new_dtype``, values kept."""
    changed = False
    for v in layer._trainable_variables + layer._non_trainable_variables:
        if keras.backend.standardize_dtype(v._dtype) != old_dtype or old_dtype not in _FLOATS:
            continue  # created with an explicit dtype (int counters, float32 LoRA...): left alone
        value = ops.cast(v.value, new_dtype)
        v._dtype = new_dtype
        v._initialize(value)  # same Variable object: layers, lists and trackers stay valid
        changed = True
    return changed


def _refresh_torch_params(model: Any) -> None:
    # torch.nn.Module keeps its own ParameterDict of the variables' tensors
    for _, layer in layers(model):
        if "_torch_params" in layer.__dict__ or hasattr(layer, "_torch_params"):
            layer._track_variables()


def _refresh_compiled(model: Any) -> None:
    # traced train/test/predict functions baked in the old dtypes: rebuild them (lazily traced)
    for kind in ("train", "test", "predict"):
        if getattr(model, f"{kind}_function", None) is not None:
            getattr(model, f"make_{kind}_function")(force=True)


def apply(model: Any, policy: Policy | str, *, warn: bool = True) -> Any:
    """Make every layer of ``model`` run its Plan row; returns the model (changed in place).

    Each layer's ``dtype_policy`` becomes its row's (compute, param) pair; a built layer whose
    variable dtype changes has its variables re-created in the new dtype with the same values;
    a row whose output dtype differs from its compute dtype, every composite layer (its output
    is its last sublayer's otherwise) and the model itself (to ``output_dtype``) get their
    float outputs cast. Layers not yet built are set up now and
    re-checked when they build (composite layers create their sublayers then). Compiled
    train/test/predict functions are rebuilt, and ``matmul_precision`` is set process-wide.
    Calling it again with another policy re-applies cleanly.

    Example:
        >>> import keras, ampbridge
        >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="head")])
        >>> m = apply(m, ampbridge.preset("mixed_float16"))
        >>> m.get_layer("head").dtype_policy.name, keras.backend.standardize_dtype(m(keras.ops.ones((1, 2))).dtype)
        ('mixed_float16', 'float32')
    """
    policy, _ = resolve_policy(policy, warn=warn)
    active = _phase0(policy)
    set_matmul_precision(active.matmul_precision)  # first: it is the setting that can be refused
    described, by_path = _describe(model)
    requested = build_plan(described, active, framework="keras", warn=warn)
    optimizer_built = bool(getattr(getattr(model, "optimizer", None), "built", False))
    recast = False
    for row in requested:
        layer = by_path[row.path]
        if getattr(layer.dtype_policy, "quantization_mode", None) is not None:
            if (layer.compute_dtype, layer.variable_dtype) != (row.compute_dtype, row.param_dtype):
                raise UnsupportedOptionError(
                    f"layer {row.path or '(model)'!r} is quantized ({layer.dtype_policy.name}); ampbridge "
                    f"cannot give it compute_dtype={row.compute_dtype}, param_dtype={row.param_dtype}")
            continue
        new = dtype_policy(row.compute_dtype, row.param_dtype)
        old_variable_dtype = layer.variable_dtype
        if not _same_policy(layer.dtype_policy, new):
            if layer.built and old_variable_dtype != row.param_dtype and (
                    layer._trainable_variables or layer._non_trainable_variables):
                if optimizer_built:
                    raise UnsupportedOptionError(
                        f"param_dtype={row.param_dtype} for layer {row.path or '(model)'!r}: its variables "
                        f"are {old_variable_dtype} and the model's optimizer is already built on them; "
                        "apply the policy before compiling/training, or build the model under "
                        "ampbridge.keras.scope(policy)")
                recast |= _recast_variables(layer, old_variable_dtype, row.param_dtype)
            layer.dtype_policy = new
        wanted = policy.output_dtype if row.path == "" else row.output_dtype
        # Keras layers emit their compute dtype; a composite layer emits whatever its last
        # sublayer does (a pinned norm at the end of an unpinned block: float32), so composites
        # always get the cast (a no-op where the dtype already matches)
        composite = bool(layer._layers)
        _set_output_cast(layer, wanted if wanted != row.compute_dtype or composite else None)
        if not layer.built:
            _rebuild_hook(layer, model, policy)
    if recast and _backend() == "torch":
        _refresh_torch_params(model)
    try:
        object.__setattr__(model, "_ampbridge_policy", policy)
    except AttributeError:  # pragma: no cover - exotic layer classes
        pass
    monitor = model.__dict__.get("_ampbridge_monitor")
    if monitor is not None:
        monitor._refresh()  # the rows' compute dtypes decide the underflow/overflow thresholds
    _refresh_compiled(model)
    return model


def _rebuild_hook(layer: Any, model: Any, policy: Policy) -> None:
    """Re-apply once ``layer`` is built, if building created sublayers (MultiHeadAttention...)."""
    build = layer.build
    if getattr(build, "_ampbridge_hook", False):
        build = build.__wrapped__
    root = weakref.ref(model)

    @functools.wraps(build)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        before = len(layer._flatten_layers(include_self=False))
        out = build(*args, **kwargs)
        object.__setattr__(layer, "build", build)
        owner = root()
        if owner is not None and len(layer._flatten_layers(include_self=False)) != before:
            apply(owner, policy, warn=False)
        return out

    hooked._ampbridge_hook = True  # type: ignore[attr-defined]
    object.__setattr__(layer, "build", hooked)


# --- matmul precision -------------------------------------------------------------------------

def set_matmul_precision(precision: str) -> None:
    """Set float32 matmul precision for the active Keras backend (process-wide).

    ``highest``: full float32; ``high``: TF32 allowed (TensorFlow's TF32 switch, JAX
    ``"high"``, torch ``"high"``); ``medium``: bfloat16 passes allowed (JAX ``"bfloat16"``, torch
    ``"medium"``; TensorFlow has no such mode, so it is an error there).
    """
    accepted = ("highest", "high", "medium")
    if precision not in accepted:
        raise PolicyError(f"matmul_precision: received {precision!r}; accepted: {', '.join(accepted)}")
    backend = _backend()
    if backend == "tensorflow":
        if precision == "medium":
            raise UnsupportedOptionError(
                "matmul_precision='medium' (bfloat16 passes for float32 matmuls) has no TensorFlow "
                "equivalent; accepted on the TensorFlow backend: 'highest' (TF32 off) or 'high' (TF32 on)")
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(precision == "high")
    elif backend == "jax":
        import jax

        # XLA:CPU always multiplies float32 in float32 (and rejects a "highest" precision on
        # float16 dots), so the setting only reaches GPUs and TPUs
        if jax.default_backend() != "cpu":
            jax.config.update("jax_default_matmul_precision",
                              {"highest": "highest", "high": "high", "medium": "bfloat16"}[precision])
    elif backend == "torch":
        import torch

        torch.set_float32_matmul_precision(precision)
    elif precision != "highest":
        raise UnsupportedOptionError(f"matmul_precision={precision!r} is not supported on the Keras "
                                     f"{backend!r} backend; accepted there: 'highest'")


# --- scope ------------------------------------------------------------------------------------

def _creation_rule(policy: Policy, layer: Any) -> tuple[str, str] | None:
    """The (compute, param) dtypes of the last kind:/type: rule matching a new layer, or None."""
    kind, cls = kind_of(layer), type(layer).__name__
    for _, rule in reversed(policy.rules):
        for text in rule.match:
            if text.startswith(("kind:", "type:")) and compile_pattern(text).matches("", kind, cls):
                return (rule.compute_dtype or policy.compute_dtype, rule.param_dtype or policy.param_dtype)
    return None


@contextlib.contextmanager
def scope(policy: Policy | str) -> Iterator[Policy]:
    """Build models under ``policy``: the global Keras dtype policy is the policy's, and each
    layer created inside gets the ``kind:``/``type:`` rules that match it (before it builds,
    so its variables are created in the right dtype). Path rules need the finished model:
    call :func:`apply` after building (it changes only what differs). The previous global
    policy is restored on exit, even on error.

    Example:
        >>> import keras, ampbridge
        >>> with scope(ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))):
        ...     dense, norm = keras.layers.Dense(2), keras.layers.LayerNormalization()
        >>> dense.dtype_policy.name, norm.dtype_policy.name, keras.config.dtype_policy().name
        ('mixed_float16', 'float32', 'float32')
    """
    policy = _phase0(resolve_policy(policy)[0])
    previous = keras.config.dtype_policy()
    layer_class = keras.layers.Layer
    original_init = layer_class.__dict__["__init__"]

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        decided = _creation_rule(policy, self)
        if decided is not None:
            self._dtype_policy = dtype_policy(*decided)

    keras.config.set_dtype_policy(dtype_policy(policy.compute_dtype, policy.param_dtype))
    layer_class.__init__ = init
    try:
        yield policy
    finally:
        layer_class.__init__ = original_init
        keras.config.set_dtype_policy(previous)


# --- the loss-scaling optimizer ---------------------------------------------------------------

def _config_from(value: LossScaleConfig | dict[str, Any]) -> LossScaleConfig:
    cfg = value if isinstance(value, LossScaleConfig) else LossScaleConfig(**value)
    if cfg.mode == "auto":
        raise ValueError("resolve loss_scale mode 'auto' first: LossScaleConfig.resolve(compute_dtype)")
    return cfg


def _concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (eager), not inside a traced tf.function or jax.jit."""
    backend = _backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


def _host(x: Any) -> np.ndarray:
    """A tensor or variable's value on the host (a sync)."""
    if isinstance(x, keras.Variable):
        x = x.value
    if _backend() == "tensorflow":  # np.array(tf.Variable) warns under numpy 2
        import tensorflow as tf

        return np.asarray(tf.convert_to_tensor(x).numpy())
    if _backend() == "torch":  # as is np.array(torch.Tensor)
        return x.detach().cpu().numpy()
    return np.asarray(ops.convert_to_numpy(x))



@keras.saving.register_keras_serializable(package="ampbridge")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's ``LossScaleOptimizer`` running ampbridge's reference loss-scale algorithm.

    Every setting of ``[loss_scale]`` is honoured (growth and backoff factors, interval,
    hysteresis, ``consecutive_hysteresis``, min/max, ``on_min_scale``, static and none modes,
    ``skip_nonfinite``), in backend-agnostic ``keras.ops``, for ``fit`` on every backend
    (``scale_loss`` / ``apply`` / ``stateless_apply``) and for custom loops. A skipped step
    leaves the weights and the inner optimizer's variables untouched. The state (all five
    reference fields, plus the count of overflows at ``min_scale``) is optimizer variables,
    so ``model.save`` / checkpoints carry it. Build one with :func:`optimizer`.

    ``on_min_scale = "warn" | "error"`` needs the host to look at the state after a step:
    eager steps check it themselves; under a compiled ``fit`` pass
    ``callbacks=[ampbridge.keras.LossScaleCallback()]`` (or a :class:`PhaseCallback`); a compiled
    custom loop sets ``optimizer.host_checked = True`` and calls ``optimizer.check_min_scale()``
    after each step. Tracing without either is an error rather than a silently ignored setting.
    """

    def __init__(self, inner_optimizer: Any, loss_scale: LossScaleConfig | dict[str, Any] | None = None,
                 policy: Policy | dict[str, Any] | None = None, name: str | None = None, **kwargs: Any):
        cfg = _config_from(loss_scale if loss_scale is not None else LossScaleConfig(mode="dynamic"))
        start = initial_state(cfg)
        super().__init__(inner_optimizer, initial_scale=start.scale,
                         dynamic_growth_steps=cfg.growth_interval, name=name, **kwargs)
        # the policy rides along (in get_config, so in .keras files) for load_model to re-apply
        self.policy = Policy.from_dict(policy) if isinstance(policy, dict) else policy
        self._config = cfg
        self.host_checked = False
        self._overflows_seen = 0
        self._jitted_apply = None
        self._monitor: _MonitorSpec | None = None  # set by ampbridge.keras.Monitor
        self._monitor_variables: list[Any] = []
        self._monitor_cache: tuple[tuple[int, ...], Any] | None = None

    # --- configuration ---

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The resolved loss-scale settings in force."""
        return self._config

    def set_loss_scale_config(self, config: LossScaleConfig, *, reset: bool = False) -> None:
        """Switch settings (a phase boundary); the state moves by the core's rule
        (:func:`ampbridge.core.loss_scale.enter_phase`, the same in every backend): carried over
        between dynamic phases, within the new bounds; fresh, step counters kept, on ``reset`` or
        any other change. Rebuild traced train functions afterwards (:class:`PhaseCallback` does)."""
        from .core.loss_scale import enter_phase

        config = _config_from(config)
        previous, before = self._config, self.state if self.built else None
        self._config = config
        self._jitted_apply = None  # the settings are baked into the compiled step
        self.initial_scale = initial_state(config).scale
        self.dynamic_growth_steps = config.growth_interval
        if before is not None:
            self.set_state(enter_phase(config, before, previous=previous, reset=reset))

    # --- state ---

    def build(self, var_list: Any) -> None:
        super().build(var_list)  # step_counter (= good_steps), dynamic_scale, inner optimizer
        from keras.src.utils import tracking

        @tracking.no_automatic_dependency_tracking
        def extra() -> None:
            start = initial_state(self._config)
            self.dynamic_scale.assign(np.float32(start.scale))
            for attr, init in (("hysteresis_left", start.hysteresis_left), ("loss_scale_steps", 0),
                               ("skipped_steps", 0), ("min_scale_overflows", 0)):
                setattr(self, attr, self.add_variable(
                    shape=(), dtype="int32", initializer=keras.initializers.Constant(init),
                    aggregation="none", name=attr))

        extra()
        if self._monitor is not None:
            self._build_monitor_variables()

    @property
    def _state_variables(self) -> list[Any]:
        # good_steps, scale, hysteresis_left, steps, skipped, overflows at min_scale
        return [self.step_counter, self.dynamic_scale, self.hysteresis_left, self.loss_scale_steps,
                self.skipped_steps, self.min_scale_overflows]

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state as the core's :class:`ampbridge.LossScaleState` (reads values)."""
        if not self.built:
            return initial_state(self._config)
        own = [_host(v) for v in self._state_variables[:5]]
        return LossScaleState(scale=float(own[1]), good_steps=int(own[0]), hysteresis_left=int(own[2]),
                              steps=int(own[3]), skipped=int(own[4]))

    def set_state(self, state: LossScaleState) -> None:
        """Overwrite the loss-scale state (all five fields)."""
        if not self.built:
            raise ValueError("build the optimizer first: optimizer.build(model.trainable_variables)")
        for v, x in zip(self._state_variables[:5], (state.good_steps, np.float32(state.scale),
                                              state.hysteresis_left, state.steps, state.skipped)):
            v.assign(x)

    @property
    def scale(self) -> Any:
        """The current loss scale (a float32 tensor once built)."""
        return self.dynamic_scale if self.built else self.initial_scale

    def scale_loss(self, loss: Any) -> Any:
        if self._config.mode == "none":
            return loss
        return super().scale_loss(loss)

    # --- the algorithm, in keras.ops (the same numbers as ampbridge.core.loss_scale.next_state) ---

    def _next_state(self, own: list[Any], found_inf: Any) -> list[Any]:
        cfg = self._config
        good, scale, hyst, steps, skipped, overflows = own
        one = ops.cast(1, "int32")
        inf_i = ops.cast(found_inf, "int32")
        steps_new = ops.add(steps, one)
        skipped_new = ops.add(skipped, inf_i) if cfg.skip_nonfinite else skipped
        if cfg.mode != "dynamic":
            return [good, scale, hyst, steps_new, skipped_new, overflows]
        backoff_now = ops.logical_and(found_inf, ops.less_equal(hyst, 1))
        backed = ops.multiply(scale, np.float32(f32(cfg.backoff_factor)))
        if cfg.min_scale is not None:
            lo = np.float32(f32(cfg.min_scale))
            at_min = ops.logical_and(backoff_now, ops.equal(scale, lo))
            backed = ops.maximum(backed, lo)
        good_plus = ops.add(good, one)
        grow = ops.logical_and(ops.logical_not(found_inf), ops.equal(good_plus, cfg.growth_interval))
        candidate = ops.multiply(scale, np.float32(f32(cfg.growth_factor)))
        grown = candidate if cfg.max_scale is None else ops.minimum(candidate, np.float32(f32(cfg.max_scale)))
        grown = ops.where(ops.isfinite(candidate), grown, scale)
        scale_new = ops.where(found_inf, ops.where(backoff_now, backed, scale), ops.where(grow, grown, scale))
        good_new = ops.where(ops.logical_or(found_inf, grow), ops.zeros_like(good), good_plus)
        hyst_on_inf = ops.where(backoff_now, hyst, ops.subtract(hyst, one))
        refill = ops.full_like(hyst, cfg.hysteresis)
        hyst_on_ok = refill if cfg.consecutive_hysteresis else ops.where(grow, refill, hyst)
        hyst_new = ops.where(found_inf, hyst_on_inf, hyst_on_ok)
        new = [good_new, scale_new, hyst_new, steps_new, skipped_new, overflows]
        if cfg.min_scale is not None:
            if cfg.on_min_scale == "error":
                # the reference raises before changing anything: keep the step's state as it was
                new = [ops.where(at_min, old, n) for old, n in zip(own[:5], new[:5])] + [overflows]
            new[5] = ops.add(overflows, ops.cast(at_min, "int32"))
        return new

    def _unscale(self, grads: list[Any], scale: Any) -> list[Any]:
        if self._config.mode == "none":
            return list(grads)
        return [g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
                for g, v in zip(grads, self._trainable_variables)]

    def _needs_host_check(self) -> bool:
        return self._config.min_scale is not None and self._config.on_min_scale in ("warn", "error")

    def _guard_traced(self, x: Any) -> None:
        if self._needs_host_check() and not _concrete(x) and not self.host_checked:
            raise UnsupportedOptionError(
                f"loss_scale.on_min_scale={self._config.on_min_scale!r} needs a host-side check after each "
                "compiled step: pass callbacks=[ampbridge.keras.LossScaleCallback()] to fit (a PhaseCallback "
                "does it too), or run_eagerly=True; in a compiled custom loop set optimizer.host_checked = "
                "True and call optimizer.check_min_scale() after each step")

    def check_min_scale(self, overflows: Any = None) -> None:
        """Warn (once) or raise :class:`ampbridge.LossScaleError` if a step overflowed at
        ``min_scale`` since the last check (``on_min_scale`` decides). Reads a variable: a host
        sync; eager steps call it themselves."""
        if not self._needs_host_check() or not self.built:
            return
        if overflows is None:
            overflows = self.min_scale_overflows.value
        count = int(_host(overflows))
        if count <= self._overflows_seen:
            return
        first = self._overflows_seen == 0
        self._overflows_seen = count
        message = (f"loss scale overflowed at min_scale={self._config.min_scale} "
                   f"({count} time{'s' if count > 1 else ''} so far)")
        if self._config.on_min_scale == "error":
            raise LossScaleError(message + "; on_min_scale='error' stops the run")
        if first:
            warnings.warn(message + "; gradients still overflow at the floor", AmpBridgeWarning, stacklevel=3)

    # --- stateful apply (TensorFlow, torch; JAX goes through stateless_apply) ---

    def _apply_inner(self, grads: Any, trainable_variables: Any, scale: Any) -> None:
        self.inner_optimizer.apply(self._unscale(grads, scale), trainable_variables=trainable_variables)

    def _own_values(self) -> list[Any]:
        return [v.value for v in self._state_variables]

    def _assign_own(self, values: list[Any]) -> None:
        for v, x in zip(self._state_variables, values):
            v.assign(x)

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        own = self._own_values()
        self._apply_inner(grads, trainable_variables, own[1])
        self._assign_own(self._next_state(own, ops.convert_to_tensor(False)))

    def _stateful_handle_non_finite_grads(self) -> None:
        if not self._config.skip_nonfinite:
            raise UnsupportedOptionError("loss_scale.skip_nonfinite=false is not supported with a "
                                         "tf.distribute strategy that needs merge_call")
        self._assign_own(self._next_state(self._own_values(), ops.convert_to_tensor(True)))

    def _common_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        flags = self._finite_flags(grads) if self._monitor is not None else None
        finite = self.check_finite(grads) if flags is None else _all(flags)
        self._guard_traced(finite)
        own = self._own_values()
        if flags is not None:
            variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
            head, stats = self.monitor_head, self.monitor_stats
            new_head, new_stats = self._monitor_values(grads, variables, own, finite, flags, stats.value)
        if self._config.skip_nonfinite:
            ops.cond(finite, lambda: self._apply_inner(grads, trainable_variables, own[1]), lambda: None)
        else:
            self._apply_inner(grads, trainable_variables, own[1])
        self._assign_own(self._next_state(own, ops.logical_not(finite)))
        if flags is not None:
            head.assign(new_head)
            stats.assign(new_stats)
        if self._needs_host_check() and _concrete(finite):
            self.check_min_scale()

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if _backend() != "jax":
            return super().apply(grads, trainable_variables)
        # JAX: ops.cond is lax.cond, which cannot hold stateful assignments: go functional
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if self._jitted_apply is None:  # eager lax.cond re-traces every call: compile the step once
            import jax

            self._jitted_apply = jax.jit(functools.partial(self.stateless_apply, _host_checks_after=True))
        new_weights, new_state = self._jitted_apply([v.value for v in self.variables], list(grads),
                                                    [v.value for v in variables])
        for v, x in zip(variables, new_weights):
            v.assign(x)
        for v, x in zip(self.variables, new_state):
            v.assign(x)
        if self._needs_host_check() and _concrete(new_state[0]):
            self.check_min_scale()

    # --- stateless apply (JAX fit, and any functional use) ---

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any,
                        _host_checks_after: bool = False) -> Any:
        if not self.built:
            raise ValueError(f"To call `stateless_apply`, {self.__class__.__name__} must be built (i.e. its "
                             "variables must have been created). You can build it via "
                             "`optimizer.build(trainable_variables)`.")
        n = len(self._variables)
        own, inner = list(optimizer_variables[:n]), list(optimizer_variables[n:])
        where = [next(i for i, v in enumerate(self._variables) if v is s) for s in self._state_variables]
        flags = self._finite_flags(grads) if self._monitor is not None else None
        finite = self.check_finite(grads) if flags is None else _all(flags)
        if not _host_checks_after:
            self._guard_traced(finite)
        scale = own[where[1]]
        if flags is not None:
            at = [next(i for i, v in enumerate(self._variables) if v is m) for m in self._monitor_variables]
            own[at[0]], own[at[1]] = self._monitor_values(grads, self._trainable_variables, [own[i] for i in where],
                                                          finite, flags, own[at[1]])

        def step() -> Any:
            new_weights, new_inner = self.inner_optimizer.stateless_apply(
                inner, self._unscale(grads, scale), trainable_variables)
            return list(new_weights), list(new_inner)

        if self._config.skip_nonfinite:
            new_weights, new_inner = ops.cond(finite, step, lambda: (list(trainable_variables), inner))
        else:
            new_weights, new_inner = step()
        for i, x in zip(where, self._next_state([own[i] for i in where], ops.logical_not(finite))):
            own[i] = x
        return new_weights, own + list(new_inner)

    # --- the numerics monitor (see Monitor): statistics of the scaled gradients, in keras.ops ---

    def _build_monitor_variables(self) -> None:
        from keras.src.utils import tracking

        spec = self._monitor
        assert spec is not None

        @tracking.no_automatic_dependency_tracking
        def make() -> None:
            self.monitor_head = self.add_variable(shape=(_HEAD_SIZE,), dtype="float32", aggregation="none",
                                                  initializer="zeros", name="ampbridge_monitor_head")
            self.monitor_stats = self.add_variable(shape=(max(1, len(spec.stats)), _ROW_SIZE), dtype="float32",
                                                   aggregation="none", initializer="zeros",
                                                   name="ampbridge_monitor_stats")
            self._monitor_variables = [self.monitor_head, self.monitor_stats]

        make()

    def _attach_monitor(self, spec: "_MonitorSpec | None") -> None:
        """Start (a spec) or stop (None) computing the monitor's record in every step."""
        if self._monitor_variables and (spec is None or self._monitor is None
                                        or len(spec.stats) != len(self._monitor.stats)):
            for v in self._monitor_variables:  # by identity: Variable.__eq__ compares values
                del self._variables[next(i for i, x in enumerate(self._variables) if x is v)]
            self._monitor_variables = []
        self._monitor = spec
        self._monitor_cache = None
        self._jitted_apply = None  # the monitor is baked into the compiled step
        if spec is not None and self.built and not self._monitor_variables:
            self._build_monitor_variables()

    def _saved_variables(self) -> list[Any]:
        # the monitor's record is scratch space: checkpoints look the same with or without it
        return [v for v in self.variables if not any(v is m for m in self._monitor_variables)]

    def save_own_variables(self, store: Any) -> None:
        for i, variable in enumerate(self._saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        variables = self._saved_variables()
        if len(store.keys()) != len(variables):
            warnings.warn(f"Skipping variable loading for optimizer '{self.name}', because it has "
                          f"{len(variables)} variables whereas the saved optimizer has {len(store.keys())} "
                          "variables.", stacklevel=2)
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def _finite_flags(self, grads: list[Any]) -> list[Any]:
        return [ops.all(ops.isfinite(g)) if g is not None else None for g in grads]

    def _monitor_layout(self, variables: list[Any]) -> Any:
        """Per layer the positions of its gradients in ``grads``; per position its leaf index."""
        key = tuple(id(v) for v in variables)
        if self._monitor_cache is not None and self._monitor_cache[0] == key:
            return self._monitor_cache[1]
        spec = self._monitor
        assert spec is not None
        position = {vid: i for i, vid in enumerate(key)}
        stats = [(compute, tuple(position[v] for v in ids if v in position)) for _, compute, ids in spec.stats]
        leaves = [(position[v], leaf) for v, leaf in spec.leaf_of.items() if v in position]
        layout = (stats, leaves)
        self._monitor_cache = (key, layout)
        return layout

    def _monitor_values(self, grads: list[Any], variables: list[Any], own: list[Any], finite: Any,
                        flags: list[Any], old_stats: Any) -> tuple[Any, Any]:
        """This step's record: the head (step, scale used, found_inf, skipped, the last leaf in
        forward order whose own gradients are non-finite, sampled) and, on sampled steps, the
        per-layer statistics (else the previous ones, untouched)."""
        spec = self._monitor
        assert spec is not None
        stats_layout, leaves = self._monitor_layout(variables)
        scale, steps = ops.cast(own[1], "float32"), own[3]
        found_inf = ops.logical_not(finite)
        skipped = found_inf if self._config.skip_nonfinite else ops.zeros_like(found_inf)
        candidates = [ops.where(flags[pos], -1.0, float(leaf)) for pos, leaf in leaves if flags[pos] is not None]
        param_first = ops.max(ops.stack(candidates)) if candidates else ops.convert_to_tensor(-1.0)
        if _backend() == "torch":  # eager: decide on the host, no sync for ops.cond's predicate
            sampled: Any = spec.host_step % spec.every == 0
            spec.host_step += 1
        else:
            sampled = ops.equal(ops.mod(steps, spec.every), 0)

        def compute() -> Any:
            rows = [_grad_stats([grads[p] for p in positions if grads[p] is not None], scale, compute_dtype,
                                sizes=[int(np.prod(variables[p].shape)) for p in positions if grads[p] is not None])
                    for compute_dtype, positions in stats_layout]
            return ops.stack(rows) if rows else ops.zeros_like(old_stats)

        new_stats = (compute() if sampled else old_stats) if isinstance(sampled, bool) else ops.cond(
            sampled, compute, lambda: old_stats)
        step_hi, step_lo = _split_count(steps)
        head = ops.stack([step_hi, step_lo, scale, ops.cast(found_inf, "float32"), ops.cast(skipped, "float32"),
                          ops.cast(param_first, "float32"), ops.cast(sampled, "float32")])
        return head, new_stats

    # --- serialisation ---

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": {f: getattr(self._config, f) for f in (
                "mode", "initial_scale", "growth_factor", "backoff_factor", "growth_interval",
                "hysteresis", "consecutive_hysteresis", "min_scale", "max_scale", "on_min_scale",
                "skip_nonfinite")},
            "policy": self.policy.to_dict() if self.policy is not None else None,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "LossScaleOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)


def optimizer(inner: Any, policy: Policy | str) -> LossScaleOptimizer:
    """Wrap a Keras optimizer (instance or name) in ampbridge's :class:`LossScaleOptimizer`.

    The loss-scale settings are the policy's (its first phase's, for a schedule), with mode
    ``auto`` resolved against the compute dtype. ``reduce_dtype`` only matters for a
    distributed all-reduce: with a multi-replica distribution active it must equal
    ``param_dtype`` (Keras reduces gradients in the variables' dtype), else it is an error.

    Example:
        >>> import keras, ampbridge
        >>> opt = optimizer(keras.optimizers.Adam(1e-3), ampbridge.preset("mixed_float16"))
        >>> opt.loss_scale_config.mode, opt.initial_scale
        ('dynamic', 65536.0)
    """
    policy, _ = resolve_policy(policy)
    active = _phase0(policy)
    inner = keras.optimizers.get(inner)
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError(f"optimizer() wraps a plain Keras optimizer; received a {type(inner).__name__}, "
                        "which already scales the loss (pass its inner_optimizer)")
    if active.reduce_dtype != active.param_dtype and _replicas() > 1:
        raise UnsupportedOptionError(
            f"reduce_dtype={active.reduce_dtype} with param_dtype={active.param_dtype}: Keras all-reduces "
            "gradients in the variables' dtype; set reduce_dtype to the param_dtype")
    return LossScaleOptimizer(inner, loss_scale=active.resolved_loss_scale, policy=policy)


def _replicas() -> int:
    distribution = keras.distribution.distribution()
    if distribution is not None:
        return max(1, int(np.prod(distribution.device_mesh.shape)))
    if _backend() == "tensorflow":
        import tensorflow as tf

        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    return 1


def load_model(filepath: Any, policy: Policy | str | None = None, **kwargs: Any) -> Any:
    """``keras.saving.load_model`` plus :func:`apply`, so output casts come back too.

    Keras saves each layer's dtype policy and the optimizer (loss-scale state included); the
    casts ampbridge adds to outputs live on the model object, so they are re-applied here from
    ``policy``, or from the policy stored with the model's :class:`LossScaleOptimizer`.

    Example:
        >>> # model.save("run.keras"); model = ampbridge.keras.load_model("run.keras")
    """
    model = keras.saving.load_model(filepath, **kwargs)
    if policy is None:
        policy = getattr(getattr(model, "optimizer", None), "policy", None)
    if policy is not None:
        apply(model, policy, warn=False)
    return model


# --- callbacks --------------------------------------------------------------------------------

def _model_of(callback: Any) -> Any:
    """The callback's model, without the JAX state sync that ``Callback.model`` performs on every
    access (it puts the traced state back into the variables, and the next step re-gathers it:
    callbacks that run every step read ``model._jax_state`` instead)."""
    return callback._model if _backend() == "jax" else callback.model


class LossScaleCallback(keras.callbacks.Callback):
    """Enforces ``on_min_scale = "warn" | "error"`` during a compiled ``fit``.

    After each batch it reads the count of overflows at ``min_scale`` (one host sync per
    step, only when those modes are set) and warns once or raises
    :class:`ampbridge.LossScaleError`.
    """

    def _optimizer(self) -> LossScaleOptimizer | None:
        opt = getattr(_model_of(self), "optimizer", None)
        return opt if isinstance(opt, LossScaleOptimizer) else None

    def on_train_begin(self, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is not None:
            opt.host_checked = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is None or not opt._needs_host_check() or not opt.built:
            return
        jax_state = getattr(_model_of(self), "_jax_state", None)
        if jax_state:
            index = next(i for i, v in enumerate(opt.variables) if v is opt.min_scale_overflows)
            opt.check_min_scale(jax_state["optimizer_variables"][index])
        else:
            opt.check_min_scale()


class PhaseCallback(LossScaleCallback):
    """Runs a policy's ``[[phase]]`` schedule during ``fit``.

    At each epoch (or step, for an ``until_step`` schedule) boundary it re-applies the phase's
    policy to the model (layer dtype policies, pins, output casts; variables re-cast only
    where the param dtype changes), switches the optimizer's loss-scale settings (state carried
    over, or restarted when the phase says ``reset = true`` or the mode changes) and rebuilds
    the traced train function. The inner optimizer's moments are never touched.

    Example:
        >>> import ampbridge
        >>> cb = PhaseCallback(ampbridge.loads('compute_dtype = "float16"\\n[[phase]]\\nuntil_epoch = 1\\n'
        ...                                    'compute_dtype = "float32"'))
        >>> cb.policy.phase_unit
        'epoch'
    """

    def __init__(self, policy: Policy | str):
        super().__init__()
        self.policy = resolve_policy(policy)[0]  # the environment's switch and "auto" included
        self.phase: int | None = -1  # index in force (None: after the last phase); -1: none yet
        self.switches: list[tuple[int, int | None]] = []  # (epoch or step, phase index) at each switch
        self._step = 0
        self._epoch_first_step = 0

    def on_train_begin(self, logs: Any = None) -> None:
        super().on_train_begin(logs)
        opt = self._optimizer()
        modes = {p.policy.resolved_loss_scale.mode for p in self.policy.phases} | {
            self.policy.replace(phases=()).resolved_loss_scale.mode}
        if opt is None and modes != {"none"}:
            raise UnsupportedOptionError(
                f"this schedule needs loss scaling ({', '.join(sorted(modes - {'none'}))}) but the model's "
                f"optimizer is a {type(getattr(self.model, 'optimizer', None)).__name__}; compile with "
                "ampbridge.keras.optimizer(inner, policy)")
        if opt is not None:
            self._step = opt.state.steps  # every step seen, skipped ones included
        elif getattr(self.model, "optimizer", None) is not None:
            self._step = int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_first_step = self._step
        if self.policy.phase_unit != "step":
            self._enter(self.policy.phase_index(epoch=epoch) if self.policy.phases else None, epoch, epoch=epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._step = self._epoch_first_step + batch
        if self.policy.phase_unit == "step":
            self._enter(self.policy.phase_index(step=self._step), self._step, step=self._step)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        super().on_train_batch_end(batch, logs)
        self._step = self._epoch_first_step + batch + 1

    def _enter(self, index: int | None, at: int, **where: int) -> None:
        if index == self.phase:
            return
        first = self.phase == -1
        self.phase = index
        self.switches.append((at, index))
        if getattr(self.model, "_jax_state", None) and not getattr(self.model, "_jax_state_synced", True):
            self.model.jax_state_sync()  # mid-epoch on JAX: put the traced state back first
        active = self.policy.at(**where)
        apply(self.model, active, warn=False)
        opt = self._optimizer()
        if opt is not None:
            reset = index is not None and self.policy.phases[index].reset_loss_scale and not first
            opt.set_loss_scale_config(active.resolved_loss_scale, reset=reset)
        _refresh_compiled(self.model)  # again: the loss-scale settings are baked in too


# --- the numerics monitor -----------------------------------------------------------------------
#
# Where each number comes from (the same on TensorFlow, JAX and torch):
# * per-layer gradient statistics, found_inf, the scale used: the LossScaleOptimizer, which sees
#   the scaled gradients in `apply` / `stateless_apply`, computes them in keras.ops inside the
#   train step and keeps them in two optimizer variables (left out of checkpoints);
# * the forward flags (the first leaf layer whose output went non-finite, in execution order),
#   the backward flags (TensorFlow and torch: the first leaf, in backward execution order, whose
#   input gradient went non-finite) and the step's loss: scalar variables that Keras threads
#   through every backend's train step as non-weight layer state (the slot JAX's stateless
#   calls give seed-generator states), written by ampbridge's `call` wrapper on each leaf and
#   by a wrapper on `model.compute_loss`.
# The host reads all of it once per step, as one array (one transfer).

_HEAD_SIZE = 7  # step (hi, lo), scale used, found_inf, skipped, last leaf with non-finite own grads, sampled
_ROW_SIZE = 12  # max|g|, rms(g) (scaled, finite values), then (hi, lo) counts: zero, nonfinite, underflow,
#                 overflow, elements
_SLOT_NAMES = ("forward", "backward", "loss", "loss_seen")  # the model-side values, in record order
_SPLIT = 4096  # counts travel as float32 pairs (hi * 4096 + lo): exact up to 2**36


def _all(flags: list[Any]) -> Any:
    present = [f for f in flags if f is not None]
    return ops.all(ops.stack(present)) if present else ops.convert_to_tensor(True)


def _split_count(count: Any) -> tuple[Any, Any]:
    count = ops.cast(count, "int32")
    hi = ops.floor_divide(count, _SPLIT)
    return ops.cast(hi, "float32"), ops.cast(ops.subtract(count, ops.multiply(hi, _SPLIT)), "float32")


def _dense(g: Any) -> Any:
    if _backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(g, tf.IndexedSlices):  # embedding gradients
            return tf.convert_to_tensor(g)
    return g


def _grad_stats(grads: list[Any], scale: Any, compute_dtype: str, sizes: list[int] | None = None) -> Any:
    """One layer's row of statistics of its scaled gradients (``_runlog.layer_stats``'s definitions).

    Max and RMS are of the finite scaled values (the host divides by the scale, in float64, as
    the reference does); the RMS is taken relative to (about) the max, so it neither overflows
    nor underflows in float32. "Below the smallest subnormal once unscaled" is tested as
    ``|g| * 2**k < (subnormal * 2**k) * scale``, exact in float32 (powers of two) where the
    bfloat16 and float32 subnormals themselves would be flushed to zero.
    """
    import math

    from .core.dtypes import formats

    if not grads:
        return ops.zeros((_ROW_SIZE,), "float32")
    fmt = formats()[compute_dtype]
    k = max(0, -60 - int(math.log2(fmt.smallest_subnormal)))
    lift, threshold = np.float32(2.0 ** k), ops.multiply(np.float32(fmt.smallest_subnormal * 2.0 ** k), scale)
    top = np.float32(fmt.max)
    flat = [ops.reshape(ops.cast(_dense(g), "float32"), (-1,)) for g in grads]
    absolute = [ops.abs(g) for g in flat]
    finite = [ops.isfinite(g) for g in flat]
    largest = ops.max(ops.stack([ops.max(ops.where(f, a, 0.0)) for a, f in zip(absolute, finite)]))
    # XLA turns a division by a scalar into a multiplication by its reciprocal, which must stay a
    # normal float32 (CPUs flush subnormals): the unit is the max, kept within 2**+-100 (the squares
    # of a / unit then stay below 2**56)
    unit = ops.clip(largest, np.float32(2.0 ** -100), np.float32(2.0 ** 100))

    def total(parts: list[Any]) -> Any:
        return ops.sum(ops.stack(parts))

    def count(masks: list[Any]) -> Any:
        return total([ops.sum(ops.cast(m, "int32")) for m in masks])

    n_finite = count(finite)
    squares = total([ops.sum(ops.where(f, ops.square(ops.divide(a, unit)), 0.0)) for a, f in zip(absolute, finite)])
    rms = ops.multiply(unit, ops.sqrt(ops.divide(squares, ops.cast(ops.maximum(n_finite, 1), "float32"))))
    # the variables' sizes: a densified IndexedSlices has no static shape
    size = sum(sizes) if sizes is not None else sum(int(np.prod(g.shape)) for g in flat)
    zero = count([ops.equal(g, 0.0) for g in flat])
    under = count([ops.logical_and(ops.logical_and(f, ops.not_equal(g, 0.0)),
                                   ops.less(ops.multiply(a, lift), threshold))
                   for g, a, f in zip(flat, absolute, finite)])
    over = count([ops.logical_and(f, ops.greater(a, top)) for a, f in zip(absolute, finite)])
    parts = [largest, rms]
    for c in (zero, ops.subtract(size, n_finite), under, over, size):
        parts.extend(_split_count(c))
    return ops.stack([ops.cast(p, "float32") for p in parts])


def _fetch(parts: list[Any]) -> np.ndarray:
    """Tensors (and variables' values) to one flat float64 host array, in one transfer."""
    backend = _backend()
    if backend == "jax":
        import jax

        host = jax.device_get([p.value if isinstance(p, keras.Variable) else p for p in parts])
        return np.concatenate([np.asarray(h, np.float64).ravel() for h in host])
    if backend == "torch":
        import torch

        flat = torch.cat([ops.convert_to_tensor(p).detach().reshape(-1).float() for p in parts])
        return flat.cpu().numpy().astype(np.float64)
    return _host(ops.concatenate([ops.reshape(ops.cast(p, "float32"), (-1,)) for p in parts])).astype(np.float64)


class _MonitorSpec:
    """What the optimizer needs to compute the record: per stats layer (path, compute dtype,
    ids of its trainable variables), per variable of a leaf layer its index in the log's layer
    list, the sampling period, and (torch, eager) the host's step counter."""

    def __init__(self, every: int, stats: list[tuple[str, str, tuple[int, ...]]], leaf_of: dict[int, int],
                 host_step: int):
        self.every, self.stats, self.leaf_of, self.host_step = every, stats, leaf_of, host_step


class _Slot:
    """A float32 scalar that Keras carries through every backend's train step without it being a
    weight: kept in the model's seed-generator list, which ``Layer.variables`` (so JAX's
    stateless state) includes and ``weights``, ``get_weights`` and saving leave out."""

    def __init__(self, name: str, value: float):
        self.state = keras.Variable(np.float32(value), dtype="float32", trainable=False, autocast=False,
                                    aggregation="none", name=name)


def _live(tensors: list[Any]) -> bool:
    """Whether these are values of a real (possibly traced) step, not symbolic shapes."""
    for t in tensors:
        if keras.backend.is_keras_tensor(t) or getattr(getattr(t, "device", None), "type", None) == "meta":
            return False
        if type(t).__name__ == "ShapeDtypeStruct":
            return False
    return True


def _mark_first(slot: _Slot, bad: Any, index: int) -> None:
    """``slot = index`` if ``bad`` and nothing is marked yet (on the device, no sync)."""
    current = slot.state.value
    if _backend() == "torch":  # eager: one in-place op instead of a chain of Keras dispatches
        import torch

        with torch.no_grad():
            current.masked_fill_(torch.logical_and(current < 0, bad), float(index))
        return
    slot.state.assign(ops.where(ops.logical_and(ops.less(current, 0.0), bad), np.float32(index), current))


def _any_nonfinite(tensors: list[Any]) -> Any:
    if _backend() == "torch":
        import torch

        with torch.no_grad():
            finite = torch.isfinite(tensors[0]).all()
            for t in tensors[1:]:
                finite = finite & torch.isfinite(t).all()
            return ~finite
    return ops.logical_not(ops.all(ops.stack([ops.all(ops.isfinite(t)) for t in tensors])))


def _input_probe(t: Any, slot: _Slot, index: int) -> Any:
    """Identity on ``t`` whose backward marks ``index`` in ``slot`` when the gradient reaching
    ``t`` (this layer's input gradient) is non-finite and nothing was marked before it."""
    backend = _backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def identity(x: Any) -> Any:
            def grad(upstream: Any) -> Any:
                _mark_first(slot, _any_nonfinite([upstream]), index)
                return upstream

            return tf.identity(x), grad

        return identity(t)
    if backend == "torch" and t.requires_grad:
        import torch

        t = t.view_as(t)  # this layer's use of the input only

        def hook(g: Any) -> None:
            _mark_first(slot, _any_nonfinite([g]), index)

        t.register_hook(hook)
    return t


class _LeafProbe:
    """A leaf layer's hooks: mark the first non-finite output (forward) and input gradient."""

    def __init__(self, monitor: "Monitor", index: int):
        self.monitor, self.index = monitor, index

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _backend() == "jax":  # JAX's backward cannot write state: parameter gradients decide there
            return args, kwargs
        floats = [t for t in keras.tree.flatten((args, kwargs)) if _is_float(t)]
        if not floats or not _live(floats):
            return args, kwargs
        slot = self.monitor._slots["backward"]
        return keras.tree.map_structure(lambda t: _input_probe(t, slot, self.index) if _is_float(t) else t,
                                        (args, kwargs))

    def after(self, out: Any) -> None:
        floats = [t for t in keras.tree.flatten(out) if _is_float(t)]
        if not floats or not _live(floats):
            return
        _mark_first(self.monitor._slots["forward"], _any_nonfinite(floats), self.index)


class _RootProbe:
    """The model's hook: a new forward pass starts with nothing marked and no loss seen."""

    def __init__(self, monitor: "Monitor"):
        self.monitor = monitor

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors = [t for t in keras.tree.flatten((args, kwargs)) if hasattr(t, "shape")]
        if tensors and _live(tensors):
            for name, value in (("forward", -1.0), ("backward", -1.0), ("loss_seen", 0.0)):
                self.monitor._slots[name].state.assign(np.float32(value))
        return args, kwargs

    def after(self, out: Any) -> None:
        pass


class Monitor:
    """The numerics log of a Keras model trained with ampbridge's :class:`LossScaleOptimizer`.

    Writes the shared JSON Lines log (``ampbridge.diagnostics.runlog``; read it with ``ampbridge report``):
    a header, then a record for every ``every``-th optimizer step (step 0 included) with each
    layer's gradient statistics, and a record for every step whose gradients were non-finite,
    with ``first_nonfinite`` naming where it started. ``fit`` users pass a
    :class:`MonitorCallback`; a custom loop makes a ``Monitor`` once the model is built (and
    before tracing its train step) and calls :meth:`record` after each optimizer step.

    How it is computed, on every Keras backend: the optimizer sees the scaled gradients and
    computes the statistics in ``keras.ops`` inside the train step (only on sampled steps); an
    ampbridge ``call`` wrapper on each leaf layer marks the first non-finite output in execution
    order, and on TensorFlow and torch the first non-finite input gradient in backward order
    (on JAX the backward pass cannot write state, so the gradient attribution there is the last
    leaf, in forward order, whose own parameter gradients are non-finite); the step's loss comes
    from a wrapper on ``model.compute_loss`` or from :meth:`record`. The host reads it all as
    one array per step (one transfer, one sync: the step's ``found_inf`` decides whether the
    step is logged). ``attribution=False`` drops the per-step forward/backward flags.

    Example (a custom loop on any backend; ``fit`` passes ``callbacks=[MonitorCallback(path)]``):
        >>> import os, tempfile, keras, numpy as np, ampbridge
        >>> policy = ampbridge.preset("mixed_float16").replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=1024))
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
        >>> model = ampbridge.keras.apply(model, policy)
        >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with Monitor(path, model, every=10) as monitor:
        ...     _ = model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)  # or your own loop
        ...     record = monitor.record()
        >>> record["step"], sorted(record["layers"]), record["layers"]["dense"]["zero"]
        (0, ['dense'], 0.0)
    """

    def __init__(self, path: Any, model: Any, optimizer: Any = None, *, every: int = 1, attribution: bool = True):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Monitor: every must be a positive integer (log every N-th step); received "
                             f"every={every!r}")
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"Monitor: expected a Keras model; received {type(model).__qualname__}")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if not isinstance(optimizer, LossScaleOptimizer):
            raise UnsupportedOptionError(
                "Monitor needs the model's optimizer to be ampbridge's LossScaleOptimizer (it sees the scaled "
                "gradients): compile with ampbridge.keras.optimizer(inner, policy), or pass optimizer=; received "
                f"{type(optimizer).__name__}")
        if not model.built:
            raise ValueError("Monitor: build the model first (call it on data, or fit/compile with an Input), "
                             "so every layer it will run exists")
        if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
            raise UnsupportedOptionError(
                f"Monitor: steps_per_execution={model.steps_per_execution} runs several steps between callbacks, "
                "so non-finite steps could not all be logged; compile with steps_per_execution=1")
        if _replicas() > 1:
            raise UnsupportedOptionError("Monitor: a distributed (multi-replica) run is not supported")
        self.path, self.model, self.optimizer = path, model, optimizer
        self.every, self.attribution = every, bool(attribution)
        self.layers: list[str] = []
        self._slots: dict[str, _Slot] = {}
        self._writer: Any = None
        self._attached = False
        self._positions: tuple[list[int], list[int]] | None = None
        self._next_step: int | None = None
        self.attach()

    # --- attaching to the model and optimizer ---

    def _policy(self) -> Policy:
        policy = getattr(self.model, "_ampbridge_policy", None) or self.optimizer.policy
        if policy is None:
            from .core.io import preset

            policy = preset("float32")
        return _phase0(policy)

    def attach(self) -> None:
        """Start monitoring (the constructor does; again after :meth:`detach`). Re-traces the
        model's compiled functions."""
        if self._attached:
            return
        if not self._slots:
            self._slots = {name: _Slot(f"ampbridge_monitor_{name}", value)
                           for name, value in zip(_SLOT_NAMES, (-1.0, -1.0, np.nan, 0.0))}
        self.model._seed_generators.extend(self._slots.values())
        if hasattr(self.model, "compute_loss") and "compute_loss" not in self.model.__dict__:
            inner = self.model.compute_loss

            @functools.wraps(inner)
            def compute_loss(*args: Any, **kwargs: Any) -> Any:
                loss = inner(*args, **kwargs)
                if loss is not None and _live([loss]):
                    self._slots["loss"].state.assign(ops.cast(ops.reshape(loss, ()), "float32"))
                    self._slots["loss_seen"].state.assign(np.float32(1.0))
                return loss

            object.__setattr__(self.model, "compute_loss", compute_loss)
        object.__setattr__(self.model, "_ampbridge_monitor", self)
        self._attached = True
        host_step = self.optimizer.state.steps if self.optimizer.built else 0
        self._refresh(host_step=host_step)
        if self._writer is None:
            from .core.io import policy_to_dict
            from .diagnostics.runlog import RunLogWriter

            policy = self._policy()
            self._writer = RunLogWriter(self.path, framework=f"keras ({_backend()})",
                                        compute_dtype=policy.compute_dtype, layers=self.layers,
                                        policy=policy_to_dict(policy),
                                        min_scale=self.optimizer.loss_scale_config.min_scale,
                                        extra={"every": self.every, "attribution": self.attribution})

    def _refresh(self, host_step: int | None = None) -> None:
        """(Re)build the probes and the optimizer's layout from the model's current Plan (also after
        :func:`apply` changes the policy, e.g. at a phase boundary)."""
        rows = plan(self.model, self._policy(), warn=False)
        by_path = dict(layers(self.model))
        self.layers = [row.path for row in rows if row.path]
        index = {path: i for i, path in enumerate(self.layers)}
        stats, leaf_of = [], {}
        for row in rows:
            layer = by_path[row.path]
            leaf = row.path != "" and not _children(layer)
            own = [v for v in layer._trainable_variables if v.trainable]
            if own:
                stats.append((row.path, row.compute_dtype, tuple(id(v) for v in own)))
            if leaf:
                leaf_of.update({id(v): index[row.path] for v in own})
            probe: Any = _LeafProbe(self, index[row.path]) if leaf and self.attribution else None
            if row.path == "":
                probe = _RootProbe(self)
            if probe is not None:
                _call_wrapper(layer).probe = probe
            else:
                wrapper = layer.__dict__.get(_WRAPPER)
                if wrapper is not None:
                    wrapper.probe = None
                    _drop_idle_wrapper(layer)
        self._positions = None
        previous = self.optimizer._monitor
        steps = host_step if host_step is not None else (previous.host_step if previous is not None else 0)
        self.optimizer._attach_monitor(_MonitorSpec(self.every, stats, leaf_of, steps))
        _refresh_compiled(self.model)

    def detach(self) -> None:
        """Stop monitoring: the model and optimizer run as before (the log stays open)."""
        if not self._attached:
            return
        if getattr(self.model, "_jax_state", None) and not getattr(self.model, "_jax_state_synced", True):
            self.model.jax_state_sync()  # the traced state holds the slots: put it back first
        for _, layer in layers(self.model):
            wrapper = layer.__dict__.get(_WRAPPER)
            if wrapper is not None and isinstance(wrapper.probe, (_LeafProbe, _RootProbe)):
                wrapper.probe = None
                _drop_idle_wrapper(layer)
        for slot in self._slots.values():
            self.model._seed_generators.remove(slot)
        if "compute_loss" in self.model.__dict__:
            del self.model.__dict__["compute_loss"]
        self.model.__dict__.pop("_ampbridge_monitor", None)
        self.optimizer._attach_monitor(None)
        _refresh_compiled(self.model)
        self._attached = False

    def close(self) -> None:
        """Detach and close the log."""
        self.detach()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading a step ---

    def _record_tensors(self, non_trainable_variables: Any, optimizer_variables: Any) -> tuple[Any, Any, list]:
        if self._positions is None:  # found once per attach: walking the model every step costs
            opt_index = {id(v): i for i, v in enumerate(self.optimizer.variables)}
            model_index = {id(v): i for i, v in enumerate(self.model.non_trainable_variables)}
            self._positions = ([opt_index[id(v)] for v in self.optimizer._monitor_variables],
                               [model_index[id(self._slots[n].state)] for n in _SLOT_NAMES])
        opt_at, slot_at = self._positions
        if optimizer_variables is not None:
            head, stats = (optimizer_variables[i] for i in opt_at)
        else:
            head, stats = (v.value for v in self.optimizer._monitor_variables)
        if non_trainable_variables is not None:
            slots = [non_trainable_variables[i] for i in slot_at]
        else:
            slots = [self._slots[n].state.value for n in _SLOT_NAMES]
        return head, stats, slots

    def record(self, loss: Any = None, *, non_trainable_variables: Any = None,
               optimizer_variables: Any = None) -> dict[str, Any] | None:
        """Read the last optimizer step's record (one transfer) and log it if it is sampled or
        non-finite; returns what was logged (a dict as in the log), or None.

        ``loss``: the step's unscaled loss, where it did not go through ``model.compute_loss``
        (a custom loop). ``non_trainable_variables`` / ``optimizer_variables``: the value lists
        a functional JAX step returned (``stateless_call`` / ``stateless_apply``), when they are
        not assigned back to the variables before this call.
        """
        if not self._attached:
            raise ValueError("Monitor.record: the monitor is detached; call attach() first")
        if not self.optimizer._monitor_variables:
            raise ValueError("Monitor.record: no optimizer step has run yet (the optimizer is not built)")
        head, stats, slots = self._record_tensors(non_trainable_variables, optimizer_variables)
        # the step is the one after the last recorded (checked below): the statistics travel only
        # on sampled steps, with the rest, as one array
        expected = self._next_step
        want_stats = expected is None or expected % self.every == 0
        parts = [head] + slots + ([loss] if loss is not None else []) + ([stats] if want_stats else [])
        values = _fetch(parts)
        head_v, rest = values[:_HEAD_SIZE], values[_HEAD_SIZE:]
        forward, backward, slot_loss, loss_seen = rest[:4]
        step = int(head_v[0]) * _SPLIT + int(head_v[1])
        scale, found_inf, skipped = float(head_v[2]), bool(head_v[3]), bool(head_v[4])
        param_first, sampled = int(head_v[5]), bool(head_v[6])
        if expected is not None and step == expected - 1:
            return None  # no optimizer step since the last record: already logged (or not to be)
        self._next_step = step + 1
        if sampled and not want_stats:  # record() was not called after every step: read them now
            stats_v = _fetch([stats])
        else:
            stats_v = rest[5 if loss is not None else 4:]
        if loss is not None:
            step_loss: float | None = float(rest[4])
        else:
            step_loss = float(slot_loss) if loss_seen else None
        if not (sampled or found_inf):
            return None
        stats_by_layer = {}
        if sampled:
            spec = self.optimizer._monitor
            rows = stats_v.reshape(-1, _ROW_SIZE)
            for (path, _, _), row in zip(spec.stats, rows):
                counts = [int(row[i]) * _SPLIT + int(row[i + 1]) for i in range(2, _ROW_SIZE, 2)]
                zero, nonfinite, under, over, size = counts
                if size == 0:
                    continue  # no gradients reached this layer's variables
                finite = size - nonfinite
                stats_by_layer[path] = {
                    "grad_max_abs": float(row[0]) / scale if finite else float("nan"),
                    "grad_rms": float(row[1]) / scale if finite else float("nan"),
                    "zero": zero / size, "nonfinite": nonfinite / size,
                    "underflow": under / size, "overflow": over / size}
        first = None
        if found_inf and self.attribution:
            loss_bad = step_loss is not None and not np.isfinite(step_loss)
            if forward >= 0:
                first = {"path": self.layers[int(forward)], "where": "output"}
            elif loss_bad:
                first = {"path": "", "where": "loss"}
            elif backward >= 0:
                first = {"path": self.layers[int(backward)], "where": "gradient"}
            elif param_first >= 0:
                first = {"path": self.layers[param_first], "where": "gradient"}
            else:
                first = {"path": "", "where": "loss"}
        logged_loss = step_loss if step_loss is not None and np.isfinite(step_loss) else None
        self._writer.step(step, loss=logged_loss, loss_scale=scale, found_inf=found_inf, skipped=skipped,
                          layers=stats_by_layer, first_nonfinite=first)
        return {"step": step, "loss": logged_loss, "loss_scale": scale, "found_inf": found_inf,
                "skipped": skipped, "first_nonfinite": first, "layers": stats_by_layer}


class MonitorCallback(keras.callbacks.Callback):
    """Writes the numerics log (see :class:`Monitor`) during ``fit``.

    ``every``: per-layer statistics on every N-th optimizer step (step 0 included); steps whose
    gradients were non-finite are always logged. One callback writes one log: the model stays
    monitored after ``fit`` returns, so fitting again with the same callback appends to the log
    (step numbers continue) without re-tracing the train step; :meth:`close` detaches the
    monitor (the next ``fit`` re-traces without it) and closes the log.

    Example:
        >>> import os, tempfile, keras, numpy as np, ampbridge
        >>> policy = ampbridge.preset("mixed_float16").replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=1024))
        >>> model = ampbridge.keras.apply(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), policy)
        >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> x, y = np.ones((8, 3)), np.zeros((8, 2))
        >>> sample_weight = np.array([1, 1, np.inf, 1, 1, 1, 1, 1])  # step 1 goes non-finite
        >>> _ = model.fit(x, y, sample_weight=sample_weight, batch_size=2, shuffle=False, verbose=0,
        ...               callbacks=[MonitorCallback(path, every=2)])
        >>> from ampbridge.diagnostics.runlog import read_log
        >>> [(s["step"], s["skipped"], bool(s["layers"])) for s in read_log(path).steps]
        [(0, False, True), (1, True, False), (2, False, True)]
    """

    def __init__(self, path: Any, every: int = 1, *, attribution: bool = True):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MonitorCallback: every must be a positive integer (log every N-th step); "
                             f"received every={every!r}")
        self.path, self.every, self.attribution = path, every, attribution
        self.monitor: Monitor | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        if self.monitor is None:
            self.monitor = Monitor(self.path, self.model, every=self.every, attribution=self.attribution)
        else:
            self.monitor.attach()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.monitor is None:
            return
        state = getattr(_model_of(self), "_jax_state", None)
        if state:
            self.monitor.record(non_trainable_variables=state["non_trainable_variables"],
                                optimizer_variables=state["optimizer_variables"])
        else:
            self.monitor.record()

    def close(self) -> None:
        """Detach the monitor from the model and close the log."""
        if self.monitor is not None:
            self.monitor.close()
