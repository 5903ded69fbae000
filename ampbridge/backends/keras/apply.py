"""Realising the Plan on a Keras model: layer dtype policies, re-cast variables, output casts
(one ``call`` wrapper per layer, which the monitor's probes share), and building under a policy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
from keras import ops

from ...core.matching import compile_pattern
from ...core.plan import build_plan
from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from . import fp8
from .environment import active_backend, resolve_policy, set_matmul_precision
from .layers import AUTHOR, AUTO, code_caller, describe, kind_of, walk
from .plan import FLOATS, dtype_policy, is_float, same_policy, stream_meetings
from .policy_map import carry_pins


# --- apply ------------------------------------------------------------------------------------

_WRAPPER = "_ampbridge_call"  # the layer's ampbridge call wrapper, kept in its __dict__


def _call_wrapper(layer: Any) -> Any:
    """The one ``call`` wrapper ampbridge puts on a layer instance (made on first use).

    It carries three settings read at every call (so at every trace): ``cast``, the dtype the
    layer's float outputs are cast to (or None), ``probe``, the monitor's hooks on the
    layer's inputs and outputs (or None), and ``promote``: TensorFlow's numpy-style promotion
    on while the layer's own code runs (:func:`_tensorflow_promotion`). An instance attribute: ``Layer.__call__`` runs
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
        with _tensorflow_promotion() if call.promote else contextlib.nullcontext():
            out = inner(*args, **kwargs)
        if call.cast is not None:
            out = keras.tree.map_structure(lambda t: _cast_float(t, call.cast), out)
        if probe is not None:
            probe.after(out)
        return out

    call.cast = None  # type: ignore[attr-defined]
    call.probe = None  # type: ignore[attr-defined]
    call.promote = False  # type: ignore[attr-defined]
    object.__setattr__(layer, _WRAPPER, call)
    object.__setattr__(layer, "call", call)
    return call


def _drop_idle_wrapper(layer: Any) -> None:
    """Remove the wrapper once it has nothing to do (unless someone wrapped ``call`` over it)."""
    wrapper = layer.__dict__.get(_WRAPPER)
    if wrapper is None or wrapper.cast is not None or wrapper.probe is not None or wrapper.promote:
        return
    del layer.__dict__[_WRAPPER]
    if layer.__dict__.get("call") is not wrapper:
        return  # wrapped again from outside: stays in the chain, idle
    inner = wrapper.__wrapped__
    if getattr(inner, "__func__", None) is type(layer).call:
        del layer.__dict__["call"]  # back to the class's own call
    else:
        object.__setattr__(layer, "call", inner)


def set_probe(layer: Any, probe: Any) -> Any:
    """Put the monitor's ``probe`` (its ``before(args, kwargs) -> (args, kwargs)`` and
    ``after(out)`` hooks) on the layer's call wrapper, made if needed; None takes it off (and
    the wrapper, once it has nothing left to do). Returns the wrapper (None once removed): its
    ``probe`` attribute may be switched off and back without another call here.

    Example:
        >>> import keras
        >>> layer = keras.layers.Dense(1)
        >>> class Probe:
        ...     def before(self, args, kwargs): return args, kwargs
        ...     def after(self, out): pass
        >>> probe = Probe()
        >>> set_probe(layer, probe).probe is probe, probe_of(layer) is probe
        (True, True)
        >>> set_probe(layer, None), probe_of(layer), "call" in layer.__dict__
        (None, None, False)
    """
    if probe is not None:
        wrapper = _call_wrapper(layer)
        wrapper.probe = probe
        return wrapper
    wrapper = layer.__dict__.get(_WRAPPER)
    if wrapper is not None:
        wrapper.probe = None
        _drop_idle_wrapper(layer)
    return layer.__dict__.get(_WRAPPER)


def probe_of(layer: Any) -> Any:
    """The probe on the layer's call wrapper (see :func:`set_probe`), or None."""
    return getattr(layer.__dict__.get(_WRAPPER), "probe", None)


def _set_output_cast(layer: Any, dtype: str | None) -> None:
    """Cast the layer's float outputs to ``dtype`` (None: no ampbridge cast)."""
    if dtype is None:
        wrapper = layer.__dict__.get(_WRAPPER)
        if wrapper is not None:
            wrapper.cast = None
            _drop_idle_wrapper(layer)
        return
    _call_wrapper(layer).cast = dtype


def _output_cast(row: Any, policy: Policy, rules: dict[str, Any]) -> str | None:
    """The dtype a layer's float outputs are cast to, or None: the model's to ``output_dtype``, a
    layer's to the ``output_dtype`` its rule asks for; nothing else (the hand-pinned model's way)."""
    if row.path == "":
        return policy.output_dtype
    rule = rules.get(row.rule)
    return row.output_dtype if rule is not None and rule.output_dtype is not None else None


@contextlib.contextmanager
def _tensorflow_promotion() -> Iterator[None]:
    """TensorFlow's numpy-style promotion of tensor operators while the block runs: ``float16 +
    float32`` gives float32, as jnp and torch promote (TensorFlow refuses it otherwise), so a
    pinned layer's float32 output meeting its caller's float16 stream (``x + residual``) computes
    what it computes on JAX and torch. Traced ops keep the casts it adds, so ``fit``'s compiled
    step (forward and backward) keeps them too. Nested blocks and a mode the user set are left
    as they are; the previous mode is restored after, even on error. The mode is process-wide
    (TensorFlow keeps it in one module global): other threads' ops promote too while it is on.
    """
    # private: tensorflow.python.framework.ops.{get,set}_dtype_conversion_mode, checked on TF 2.21
    # (public only as tf.experimental.numpy.experimental_enable_numpy_behavior: process-wide, no
    # way back, numpy methods added). "legacy" is TF's numpy-style promotion: only Tensor's binary
    # operators (+ - * / @ ...) promote, by np.result_type (Python scalars stay weak). "safe" and
    # "all" route every TF API through TF's new promotion, which cannot type Keras variables (TF's
    # TODO b/286585200): even Dense and LayerNormalization fail inside tf.function there.
    from tensorflow.python.framework.ops import get_dtype_conversion_mode, set_dtype_conversion_mode

    if get_dtype_conversion_mode().name != "OFF":  # on already (an outer block, or the user's)
        yield
        return
    set_dtype_conversion_mode("legacy")
    try:
        yield
    finally:
        set_dtype_conversion_mode("off")


def _set_promotion(by_path: dict[str, Any], callers: set[str]) -> None:
    """Turn TensorFlow's promotion on in ``callers`` (their own code mixes a pinned layer's output
    with their stream) and off everywhere else (a re-apply with another policy)."""
    for path, layer in by_path.items():
        if path in callers:
            _call_wrapper(layer).promote = True
        elif layer.__dict__.get(_WRAPPER) is not None:
            layer.__dict__[_WRAPPER].promote = False
            _drop_idle_wrapper(layer)


def _cast_float(t: Any, dtype: str) -> Any:
    if is_float(t) and keras.backend.standardize_dtype(t.dtype) != dtype:
        return ops.cast(t, dtype)
    return t


def _recast_variables(layer: Any, old_dtype: str, new_dtype: str) -> bool:
    """Re-create the layer's own variables that follow its policy in ``new_dtype``, values kept."""
    changed = False
    for v in layer._trainable_variables + layer._non_trainable_variables:
        if keras.backend.standardize_dtype(v._dtype) != old_dtype or old_dtype not in FLOATS:
            continue  # created with an explicit dtype (int counters, float32 LoRA...): left alone
        value = ops.cast(v.value, new_dtype)
        v._dtype = new_dtype
        v._initialize(value)  # same Variable object: layers, lists and trackers stay valid
        changed = True
    return changed


def _recast_constants(layer: Any) -> None:
    """A built ``Normalization`` caches its mean and variance cast to its compute dtype (Keras does it
    once, when it builds or adapts): cast them to the new one, as building under it would have."""
    if isinstance(layer, keras.layers.Normalization) and getattr(layer, "mean", None) is not None:
        layer.mean = ops.cast(layer.mean, layer.compute_dtype)
        layer.variance = ops.cast(layer.variance, layer.compute_dtype)


def _refresh_torch_params(model: Any) -> None:
    # torch.nn.Module keeps its own ParameterDict of the variables' tensors
    for _, layer in walk(model):
        if "_torch_params" in layer.__dict__ or hasattr(layer, "_torch_params"):
            layer._track_variables()


def refresh_compiled(model: Any) -> None:
    """Rebuild the model's compiled train/test/predict functions (traced again on next use)."""
    # traced train/test/predict functions baked in the old dtypes: rebuild them (lazily traced)
    for kind in ("train", "test", "predict"):
        if getattr(model, f"{kind}_function", None) is not None:
            getattr(model, f"make_{kind}_function")(force=True)


_OBSERVERS = "_ampbridge_apply_observers"  # in the model's __dict__: called after each apply


def observe_apply(model: Any, observer: Callable[[], None]) -> None:
    """Call ``observer()`` after each later :func:`apply` to ``model`` has realised the new Plan
    (before the compiled functions are rebuilt): the numerics monitor re-reads the Plan there.
    :func:`unobserve_apply` stops it; adding the same observer twice calls it once.

    Example:
        >>> import keras, ampbridge
        >>> model, seen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), []
        >>> observe_apply(model, lambda: seen.append(model.layers[0].compute_dtype))
        >>> _ = apply(model, ampbridge.preset("mixed_bfloat16"))
        >>> seen
        ['bfloat16']
    """
    observers = model.__dict__.get(_OBSERVERS)
    if observers is None:
        observers = []
        object.__setattr__(model, _OBSERVERS, observers)
    if observer not in observers:
        observers.append(observer)


def unobserve_apply(model: Any, observer: Callable[[], None]) -> None:
    """Stop calling ``observer`` after :func:`apply` (see :func:`observe_apply`)."""
    observers = model.__dict__.get(_OBSERVERS, [])
    if observer in observers:
        observers.remove(observer)
    if not observers:
        model.__dict__.pop(_OBSERVERS, None)


#: every layer of an applied model -> (its path there, the model's class name, the model)
_APPLIED: "weakref.WeakKeyDictionary[Any, tuple[str, str, Any]]" = weakref.WeakKeyDictionary()


def _refuse_nested(model: Any) -> None:
    """A layer of an applied model takes its dtypes from that model's Plan: a policy applied to the
    layer alone would be silently replaced by the model's next apply (and contradict its Plan)."""
    try:
        owner = _APPLIED.get(model)
    except TypeError:  # not weak-referenceable: never registered
        return
    if owner is not None and owner[2]() is not None and getattr(owner[2](), "_ampbridge_policy", None) is not None:
        raise UnsupportedOptionError(
            f"this layer is {owner[0]!r} of an applied {owner[1]}: apply the policy to that model (rules by path "
            f"reach the layer: match = \"{owner[0]}\"); applying the model again re-applies it cleanly")


def apply(model: Any, policy: Policy | str, *, warn: bool = True) -> Any:
    """Make every layer of ``model`` run its Plan row; returns the model (changed in place).

    Each layer's ``dtype_policy`` becomes its row's (compute, param) pair; a built layer whose
    variable dtype changes has its variables re-created in the new dtype with the same values;
    a layer whose rule sets ``output_dtype`` and the model itself (to ``output_dtype``) get their
    float outputs cast, nothing else: a composite layer returns what its own code computes, as
    in the hand-pinned model (native Keras casts each layer's inputs, never its outputs). On TensorFlow, a layer whose own code meets a pinned layer's output of
    another dtype (a Plan row saying so) runs with TensorFlow's numpy-style promotion of tensor
    operators, as JAX and torch promote (:func:`_tensorflow_promotion`). Layers not yet built are set up now and
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
    _refuse_nested(model)
    policy, _ = resolve_policy(policy, warn=warn)
    active = policy.at(step=0, epoch=0)
    set_matmul_precision(active.matmul_precision)  # first: it is the setting that can be refused
    described, by_path = describe(model)
    requested = build_plan(described, active, framework="keras", warn=warn)
    optimizer_built = bool(getattr(getattr(model, "optimizer", None), "built", False))
    streams = stream_meetings(active, by_path)  # rows whose output meets their caller's stream of another dtype
    callers = {code_caller(row.path, by_path) for row in requested if streams(row) is not None}
    _set_promotion(by_path, {c for c in callers if c is not None} if active_backend() == "tensorflow" else set())
    recast = False
    rules = dict(active.rules)
    for row in requested:
        recast |= _apply_row(by_path[row.path], row, model, policy, rules, optimizer_built)
    recast |= fp8.realise(model, active, requested, by_path)  # after the dtype policies: float8 keeps them
    if recast and active_backend() == "torch":
        _refresh_torch_params(model)
    _register_applied(model, policy, by_path)
    for observer in list(model.__dict__.get(_OBSERVERS, ())):
        observer()  # the monitor: the rows' compute dtypes decide its underflow/overflow thresholds
    refresh_compiled(model)
    return model


def _apply_row(layer: Any, row: Any, model: Any, policy: Policy, rules: dict, optimizer_built: bool) -> bool:
    """Give one layer its row's dtype policy and output cast; True where its variables were re-created."""
    if getattr(layer.dtype_policy, "quantization_mode", None) is not None:
        if (layer.compute_dtype, layer.variable_dtype) != (row.compute_dtype, row.param_dtype):
            raise UnsupportedOptionError(
                f"layer {row.path or '(model)'!r} is quantized ({layer.dtype_policy.name}); ampbridge "
                f"cannot give it compute_dtype={row.compute_dtype}, param_dtype={row.param_dtype}")
        return False
    recast = False
    new = dtype_policy(row.compute_dtype, row.param_dtype)
    old_variable_dtype = layer.variable_dtype
    current = layer.dtype_policy
    if isinstance(current, keras.dtype_policies.DTypePolicyMap) and layer.path:
        current = current[layer.path]  # the layer's own entry (or the map's default)
    if not same_policy(current, new):
        if layer.built and old_variable_dtype != row.param_dtype and (
                layer._trainable_variables or layer._non_trainable_variables):
            if optimizer_built:
                raise UnsupportedOptionError(
                    f"param_dtype={row.param_dtype} for layer {row.path or '(model)'!r}: its variables "
                    f"are {old_variable_dtype} and the model's optimizer is already built on them; "
                    "apply the policy before compiling/training, or build the model under "
                    "ampbridge.keras.scope(policy)")
            recast = _recast_variables(layer, old_variable_dtype, row.param_dtype)
        layer.dtype_policy = new
        _recast_constants(layer)
    # only the model's outputs and a rule's output_dtype are cast: native Keras casts nothing at
    # a layer's output, so a composite emits what its own code computes (keras-hub BERT's
    # post-norm encoder: its pinned norm's float32), as the hand-pinned model does
    _set_output_cast(layer, _output_cast(row, policy, rules))
    if not layer.built:
        _rebuild_hook(layer, model, policy)
    return recast


def _register_applied(model: Any, policy: Policy, by_path: dict) -> None:
    # each layer remembers its model (a nested apply is refused); the model carries its policy
    for path, layer in by_path.items():
        if path:
            _APPLIED[layer] = (path, type(model).__name__, weakref.ref(model))
    try:
        object.__setattr__(model, "_ampbridge_policy", policy)
        _attach_policy_asset(model)
        carry_pins(model)  # plain Keras rebuilds a keras-hub backbone's pins from its saved config
    except AttributeError:  # pragma: no cover - exotic layer classes
        pass


POLICY_ASSET = "ampbridge_policy.json"


def _attach_policy_asset(model: Any) -> None:
    """Make ``model.save`` write the model's policy into the file's assets, for
    :func:`ampbridge.keras.load_model` (``save_assets`` is the hook Keras's saving calls on
    every object that has one; an instance attribute here, calling the class's own first)."""
    if "save_assets" in model.__dict__:
        return
    own = getattr(model, "save_assets", None)
    ref = weakref.ref(model)

    def save_assets(dir_path: Any) -> None:
        if own is not None:
            own(dir_path)
        owner = ref()
        policy = getattr(owner, "_ampbridge_policy", None)
        if policy is not None:
            # the author's dtypes too: a layer made from a saved config cannot tell them apart
            fixed = {path: list(layer.__dict__[AUTHOR]) for path, layer in walk(owner)
                     if layer.__dict__.get(AUTHOR) is not None}
            auto = sorted({layer.name for _, layer in walk(owner) if layer.__dict__.get(AUTO) == layer.name})
            with open(os.path.join(str(dir_path), POLICY_ASSET), "w", encoding="utf-8") as f:
                json.dump({"format": 1, "policy": policy.to_dict(), "set_by_the_model": fixed,
                           "automatic_names": auto}, f)

    object.__setattr__(model, "save_assets", save_assets)


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
    policy = resolve_policy(policy)[0].at(step=0, epoch=0)
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
