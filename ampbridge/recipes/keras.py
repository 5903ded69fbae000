"""Keras dtype-policy names and ``LossScaleOptimizer`` configs in and out (plain data: no Keras import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.loss_scale import f32
from ..core.matching import did_you_mean
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .fp8 import keras_float8_read, keras_float8_write
from .convert import (
    _ALL_BUT_MATMUL,
    Conversion,
    _construct,
    _get_int,
    _get_number,
    _grad_scaler_losses,
    _Reader,
    _require_concrete,
    _Writer,
    loss_scale_view,
)

# --- Keras ----------------------------------------------------------------------------------------

#: DTypePolicy name -> (compute, variable) dtype
_KERAS = {"float32": ("float32", "float32"), "float16": ("float16", "float16"), "bfloat16": ("bfloat16", "bfloat16"),
          "mixed_float16": ("float16", "float32"), "mixed_bfloat16": ("bfloat16", "float32")}
_KERAS_LSO_KEYS = ("name", "inner_optimizer", "initial_scale", "dynamic_growth_steps", "dynamic",
                   # base-optimizer arguments old LossScaleOptimizer configs carry at their defaults
                   "weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema", "ema_momentum",
                   "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")
_KERAS_LSO_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
                            "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
                            "loss_scale_factor": None, "gradient_accumulation_steps": None}
_KERAS_NOTE_INF = ("Keras doubles its float32 scale with no overflow guard, so growing past 2**127 makes it inf "
                   "(and training stalls); ampbridge's scale stops growing there. They differ only once the scale "
                   "passes 2**127")


def from_keras_loss_scale_optimizer(config: Mapping[str, Any]) -> Conversion:
    """A Keras ``LossScaleOptimizer.get_config()`` -> LossScaleConfig (growth x2, backoff x0.5, fixed).

    Keras 3 defaults: ``initial_scale`` 2**15, ``dynamic_growth_steps`` 2000; its step counter
    maps to ``good_steps`` (the scale grows when it reaches ``dynamic_growth_steps - 1``, on the
    N-th finite step, as ampbridge's does).

    Example:
        >>> cfg = from_keras_loss_scale_optimizer({"initial_scale": 1024.0, "dynamic_growth_steps": 100}).result
        >>> cfg.mode, cfg.initial_scale, cfg.growth_interval, cfg.growth_factor
        ('dynamic', 1024.0, 100, 2.0)
    """
    r = _Reader("keras")
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("a LossScaleOptimizer config must be a mapping", value=config)])
    r.check_keys(config, _KERAS_LSO_KEYS, (), "a Keras LossScaleOptimizer config")
    if config.get("dynamic", True) is not True:
        r.problem(("dynamic",), "Keras 3's LossScaleOptimizer is always dynamic", value=config["dynamic"],
                  accepted="true", hint="a static scale is loss_scale_factor on the inner optimizer")
    for key, default in _KERAS_LSO_BASE_DEFAULTS.items():
        if key in config and config[key] != default:
            r.problem((key,), "Keras's LossScaleOptimizer does not take this argument (set it on the inner "
                      "optimizer)", value=config[key], accepted=repr(default))
    init = _get_number(r, config, "initial_scale", (), 2.0**15)
    steps = _get_int(r, config, "dynamic_growth_steps", (), 2000, low=1, what="an integer >= 1")
    r.origins.update({"loss_scale.initial_scale": "initial_scale",
                      "loss_scale.growth_interval": "dynamic_growth_steps"})
    r.note(_KERAS_NOTE_INF)
    cfg = _construct(r, lambda: LossScaleConfig(mode="dynamic", initial_scale=init, growth_interval=steps))
    return r.done(cfg, ("loss_scale",))


def _is_float8(policy: Any) -> bool:
    if isinstance(policy, str):
        return policy.startswith("float8_from_")
    return isinstance(policy, Mapping) and (policy.get("class_name") == "QuantizedFloat8DTypePolicy"
                                            or bool({"amax_history_length", "source_name", "mode"} & set(policy)))


def _from_keras_float8(policy: Any, lso: Mapping[str, Any] | None, factor: float | None) -> Conversion:
    r = _Reader("keras")
    source, fp8 = keras_float8_read(r, {"name": policy} if isinstance(policy, str) else policy)
    inner = from_keras(source, loss_scale_optimizer=lso, loss_scale_factor=factor)
    return Conversion(inner.result.replace(fp8=fp8), inner.losses + tuple(r.losses), tuple(r.notes) + inner.notes,
                      "keras", "ampbridge", inner.state, inner.covers | {"fp8"}, {**inner.origins, **r.origins})


def _check_keras_name(policy: Any) -> None:
    """A Keras dtype-policy name ampbridge reads; a quantized or float64 one is refused by name."""
    if isinstance(policy, str) and policy in _KERAS:
        return
    if isinstance(policy, str) and ("_from_" in policy or policy.startswith(("int", "uint", "float8", "gptq", "awq"))):
        raise UnsupportedOptionError(f"Keras dtype policy {policy!r} is a quantized policy; ampbridge policies "
                                     "hold float32, bfloat16 and float16 only")
    if policy == "float64":
        raise UnsupportedOptionError("Keras dtype policy 'float64' cannot be read: ampbridge policies hold "
                                     "float32, bfloat16 and float16, not float64")
    raise PolicyError([Problem("not a Keras dtype policy name", key="dtype_policy", value=policy,
                               accepted=", ".join(_KERAS),
                               hint=did_you_mean(str(policy), tuple(_KERAS)))])


def from_keras(policy: Any, *, loss_scale_optimizer: Mapping[str, Any] | None = None,
               loss_scale_factor: float | None = None) -> Conversion:
    """A Keras dtype-policy name (or a LossScaleOptimizer config dict) -> Policy.

    ``mixed_float16`` / ``mixed_bfloat16``: compute in half, float32 variables; a dtype name
    (``float32``, ``float16``, ``bfloat16``): both. Keras layers return their compute dtype, so
    ``output_dtype`` is the compute dtype. For ``mixed_float16``, ``Model.compile`` wraps the
    optimizer in a ``LossScaleOptimizer`` (2**15, 2000 steps) unless ``loss_scale_optimizer``
    gives the config of the one you use; ``loss_scale_factor`` is a static scale set on the
    optimizer (Keras then skips nothing). A dict is read as a LossScaleOptimizer config alone.

    A float8 policy (``"float8_from_mixed_bfloat16"``, or a ``QuantizedFloat8DTypePolicy`` config
    with ``amax_history_length``) reads as its source policy plus an ``[fp8]`` table.

    Example:
        >>> p = from_keras("mixed_float16").result
        >>> p.compute_dtype, p.param_dtype, p.output_dtype, p.loss_scale.initial_scale
        ('float16', 'float32', 'float16', 32768.0)
        >>> from_keras("float8_from_mixed_bfloat16").result.fp8.amax_history
        1024
    """
    if _is_float8(policy):
        return _from_keras_float8(policy, loss_scale_optimizer, loss_scale_factor)
    if isinstance(policy, Mapping):
        return from_keras_loss_scale_optimizer(policy)
    r = _Reader("keras")
    _check_keras_name(policy)
    compute, variable = _KERAS[policy]
    r.origins.update(compute_dtype="dtype_policy", param_dtype="dtype_policy",
                     output_dtype="dtype_policy (layers return their compute dtype)")
    if compute != "float32":
        r.note("Keras layers return their compute dtype, so the model's outputs are "
               f"{compute} unless its last layer uses dtype='float32'; read as output_dtype={compute}")
    covers = set(_ALL_BUT_MATMUL)
    loss_scale, state = _keras_loss_scale(r, policy, loss_scale_optimizer, loss_scale_factor)
    policy_obj = _construct(r, lambda: Policy(compute_dtype=compute, param_dtype=variable, output_dtype=compute,
                                              loss_scale=loss_scale))
    return r.done(policy_obj, covers, state)


def _keras_loss_scale(r: _Reader, policy: str, loss_scale_optimizer: Mapping[str, Any] | None,
                      loss_scale_factor: float | None) -> tuple[LossScaleConfig, Any]:
    """The loss scaling a Keras model under ``policy`` trains with (and a LossScaleOptimizer's state)."""
    loss_scale = LossScaleConfig(mode="none", skip_nonfinite=False)
    state = None
    if loss_scale_optimizer is not None and loss_scale_factor is not None:
        raise PolicyError([Problem("give loss_scale_optimizer or loss_scale_factor, not both (a LossScaleOptimizer "
                                   "clears its inner optimizer's loss_scale_factor)", key="loss_scale_factor",
                                   value=loss_scale_factor)])
    if loss_scale_factor is not None:
        if policy == "mixed_float16":
            r.loss("loss_scale_factor", loss_scale_factor, "Model.compile() wraps a mixed_float16 model's optimizer in "
                   "a LossScaleOptimizer, which clears loss_scale_factor; read as the static scale it was meant to be")
        factor = _get_number(r, {"loss_scale_factor": loss_scale_factor}, "loss_scale_factor", (), 1.0)
        r.raise_if_any()
        loss_scale = LossScaleConfig(mode="static", initial_scale=factor, skip_nonfinite=False)
        r.origins["loss_scale.mode"] = "loss_scale_factor"
    elif loss_scale_optimizer is not None:
        inner = from_keras_loss_scale_optimizer(loss_scale_optimizer)
        loss_scale, state = inner.result, inner.state
        r.notes.extend(inner.notes)
        r.origins.update(inner.origins)
    elif policy == "mixed_float16":
        loss_scale = LossScaleConfig(mode="dynamic", initial_scale=2.0**15, growth_interval=2000)
        r.note("mixed_float16: Model.compile() wraps the optimizer in LossScaleOptimizer(initial_scale=2**15, "
               "dynamic_growth_steps=2000); a custom training loop must wrap it itself")
        r.note(_KERAS_NOTE_INF)
        r.origins["loss_scale.mode"] = "Model.compile (mixed_float16 wraps a LossScaleOptimizer)"
    return loss_scale, state


def to_keras(policy: Policy) -> Conversion:
    """Policy -> ``{"dtype_policy": name, "loss_scale_optimizer": config | None, "loss_scale_factor": S | None}``.

    ``loss_scale_optimizer`` are ``LossScaleOptimizer(inner, **config)`` arguments;
    ``loss_scale_factor`` (a static scale) goes to the inner optimizer.

    Example:
        >>> import ampbridge
        >>> c = to_keras(ampbridge.preset("mixed_float16"))
        >>> c.result["dtype_policy"], c.result["loss_scale_optimizer"], [l.setting for l in c.losses]
        ('mixed_float16', {'initial_scale': 65536.0, 'dynamic_growth_steps': 2000}, ['output_dtype'])
    """
    _require_concrete(policy, "Keras")
    w = _Writer("keras", policy)
    p = policy
    w.common("a Keras dtype policy", fp8=True, pins_reason="one Keras dtype policy covers the model; per-layer pins need "
             "dtype= on each layer (ampbridge.keras.apply does that)")
    name = next((n for n, v in _KERAS.items() if v == (p.compute_dtype, p.param_dtype)), None)
    if name is None:
        name = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}[p.compute_dtype]
        w.loss("param_dtype", p.param_dtype, f"a Keras dtype policy stores variables in float32 or the compute "
               f"dtype; written as {name!r}")
    if p.output_dtype != p.compute_dtype:
        w.loss("output_dtype", p.output_dtype, "a Keras dtype policy has no output dtype: layers return their compute "
               "dtype; give the last layer dtype='float32' (or a final Activation('linear', dtype='float32'))")
    if p.reduce_dtype != _KERAS[name][1]:
        w.loss("reduce_dtype", p.reduce_dtype, "Keras reduces gradients in the variable dtype")
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    lso = factor = None
    if view["mode"] == "dynamic":
        lso = {"initial_scale": f32(ls.initial_scale), "dynamic_growth_steps": ls.growth_interval}
        for key, expected, text in (("growth_factor", 2.0, "x2"), ("backoff_factor", 0.5, "x0.5")):
            if view[key] != expected:
                w.loss(f"loss_scale.{key}", getattr(ls, key), f"Keras's LossScaleOptimizer fixes it at {text}")
        _grad_scaler_losses(w, ls, "Keras's LossScaleOptimizer")
        w.note(_KERAS_NOTE_INF)
    else:
        if name == "mixed_float16":
            w.loss("loss_scale.mode", view["mode"], "Model.compile() always wraps a mixed_float16 model's optimizer "
                   "in a dynamic LossScaleOptimizer")
            if not view["skip_nonfinite"]:
                w.loss("loss_scale.skip_nonfinite", False, "that LossScaleOptimizer skips every non-finite step")
        if view["mode"] == "static":
            factor = view["initial_scale"]
            w.note("a static scale is the inner optimizer's loss_scale_factor")
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, "Keras skips non-finite steps only inside a LossScaleOptimizer")
    out = {"dtype_policy": name, "loss_scale_optimizer": lso, "loss_scale_factor": factor}
    if p.fp8.enabled:  # QuantizedFloat8DTypePolicy(**out["float8"]) on the layers model.quantize("float8") picks
        out["float8"] = keras_float8_write(w, p.fp8, name)
    return w.done(out)
