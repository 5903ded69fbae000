"""tf.keras 2 (``tf_keras``) dtype-policy names and ``LossScaleOptimizer`` configs in and out (plain data:
no TensorFlow import).

Keras 2 names the same policies as Keras 3 (``mixed_float16``, ``mixed_bfloat16``, single dtypes); its
``LossScaleOptimizer(inner, dynamic=True, initial_scale=2**15, dynamic_growth_steps=2000)`` grows x2 (never
to inf) and halves with a floor of 1 (``_DynamicLossScaleState.update``, tf-keras 2.21): ampbridge's
``min_scale = 1``. ``dynamic=False`` is a fixed scale whose non-finite steps are applied, not skipped.

Holds from_tf_keras, from_tf_keras_loss_scale_optimizer, to_tf_keras.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..core.loss_scale import f32
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem
from .convert import Conversion, _construct, _get_int, _get_number, _Reader, _require_concrete, _Writer, loss_scale_view
from .keras import from_keras, to_keras

_LSO_KEYS = ("name", "inner_optimizer", "dynamic", "initial_scale", "dynamic_growth_steps")
_TF_KERAS_KEYS = ("dtype_policy", "loss_scale_optimizer")  # what to_tf_keras writes
_FLOOR_NOTE = "Keras 2 halves the scale down to 1 and no further: read as min_scale = 1"


def from_tf_keras_loss_scale_optimizer(config: Mapping[str, Any], *, _source: str | None = None,
                                       _locate: Any = None, _prefix: tuple = ()) -> Conversion:
    """A tf_keras ``LossScaleOptimizer.get_config()`` -> LossScaleConfig.

    Example:
        >>> cfg = from_tf_keras_loss_scale_optimizer({"dynamic": True, "initial_scale": 1024.0,
        ...                                          "dynamic_growth_steps": 100}).result
        >>> cfg.mode, cfg.initial_scale, cfg.growth_interval, cfg.min_scale
        ('dynamic', 1024.0, 100, 1.0)
        >>> from_tf_keras_loss_scale_optimizer({"dynamic": False, "initial_scale": 128.0}).result.skip_nonfinite
        False
    """
    r = _Reader("tf_keras", _source, _locate, _prefix)  # the file and where in it, for a one-line error
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("a LossScaleOptimizer config must be a mapping", value=config)])
    r.check_keys(config, _LSO_KEYS, (), "a tf_keras LossScaleOptimizer config")
    dynamic = config.get("dynamic", True)
    if not isinstance(dynamic, bool):
        r.problem(("dynamic",), "must be true or false", value=dynamic, accepted="true, false")
    r.origins["loss_scale.mode"] = "dynamic"
    if dynamic is False:
        if config.get("initial_scale") is None:
            r.problem(("initial_scale",), "Keras 2 requires initial_scale when dynamic is false", value=None,
                      accepted="a positive number")
        if config.get("dynamic_growth_steps") is not None:
            r.problem(("dynamic_growth_steps",), "Keras 2 requires None when dynamic is false",
                      value=config["dynamic_growth_steps"], accepted="null")
        r.raise_if_any()
        scale = _get_number(r, config, "initial_scale", (), None)
        r.origins["loss_scale.initial_scale"] = "initial_scale"
        r.note("Keras 2's fixed loss scale applies non-finite steps (it skips none): skip_nonfinite = false")
        cfg = _construct(r, lambda: LossScaleConfig(mode="static", initial_scale=scale, skip_nonfinite=False))
        return r.done(cfg, ("loss_scale",))
    init = _get_number(r, config, "initial_scale", (), 2.0**15)
    steps = _get_int(r, config, "dynamic_growth_steps", (), 2000, low=1, what="an integer >= 1")
    r.origins.update({"loss_scale.initial_scale": "initial_scale", "loss_scale.growth_interval": "dynamic_growth_steps",
                      "loss_scale.min_scale": "Keras 2's floor"})
    floor = 1.0
    if isinstance(init, float) and 0 < init < 1.0:  # Keras 2 accepts it; its first backoff raises the scale to 1
        floor = init
        r.loss("initial_scale", init, "below Keras 2's floor of 1: Keras 2's first backoff raises the scale to 1, "
               "ampbridge's min_scale cannot exceed the initial scale (read as min_scale = initial_scale)")
    else:
        r.note(_FLOOR_NOTE)
    cfg = _construct(r, lambda: LossScaleConfig(mode="dynamic", initial_scale=init, growth_interval=steps,
                                                min_scale=floor))
    return r.done(cfg, ("loss_scale",))


def from_tf_keras(policy: Any, *, loss_scale_optimizer: Mapping[str, Any] | None = None, _source: str | None = None,
                  _locate: Any = None) -> Conversion:
    """A tf_keras dtype-policy name (with the config of its LossScaleOptimizer, or a config dict alone) -> Policy.

    ``mixed_float16`` without ``loss_scale_optimizer``: what ``Model.compile`` wraps the optimizer in
    (Keras 2's defaults, 2**15 and 2000 steps, floor 1).

    Example:
        >>> p = from_tf_keras("mixed_float16").result
        >>> p.compute_dtype, p.param_dtype, p.loss_scale.initial_scale, p.loss_scale.min_scale
        ('float16', 'float32', 32768.0, 1.0)
    """
    where = {"_source": _source, "_locate": _locate}
    if isinstance(policy, Mapping) and "dtype_policy" in policy:  # what to_tf_keras writes (a file of it)
        r = _Reader("tf_keras", _source, _locate)
        r.check_keys(policy, _TF_KERAS_KEYS, (), "tf_keras settings (what --to tf_keras writes)")
        lso = policy.get("loss_scale_optimizer")
        if lso is not None and loss_scale_optimizer is not None:
            r.problem(("loss_scale_optimizer",), "given twice (in the settings and as an argument)", value=lso)
        if lso is not None and not isinstance(lso, Mapping):
            r.problem(("loss_scale_optimizer",), "must be a LossScaleOptimizer config", value=lso,
                      accepted="a mapping (dynamic, initial_scale, dynamic_growth_steps) or null")
        r.raise_if_any()  # a null optimizer: Model.compile's, as for a bare name
        return _read(policy["dtype_policy"], lso or loss_scale_optimizer, ("loss_scale_optimizer",) if lso else (),
                     **where)
    if isinstance(policy, Mapping):
        return from_tf_keras_loss_scale_optimizer(policy, **where)
    return _read(policy, loss_scale_optimizer, (), **where)


def _read(policy: Any, loss_scale_optimizer: Mapping[str, Any] | None, prefix: tuple, **where: Any) -> Conversion:
    """A policy name and its LossScaleOptimizer config (found under ``prefix`` in the source)."""
    try:
        base = from_keras(policy)  # the same names; Keras 3's reader checks them
    except PolicyError as e:  # said with the file it came from
        raise PolicyError([dataclasses.replace(p, file=p.file or where.get("_source")) for p in e.problems]) from None
    p = base.result
    lso = loss_scale_optimizer
    if lso is None and policy == "mixed_float16":
        lso = {"dynamic": True}
    if lso is None:
        return base
    inner = from_tf_keras_loss_scale_optimizer(lso, _prefix=prefix, **where)
    r = _Reader("tf_keras")
    r.notes.extend(n for n in base.notes if "LossScaleOptimizer" not in n and "2**127" not in n)
    r.notes.extend(inner.notes)
    r.origins.update(base.origins)
    r.origins.update(inner.origins)
    if loss_scale_optimizer is None:
        r.origins["loss_scale.mode"] = "Model.compile (mixed_float16 wraps a LossScaleOptimizer)"
    out = _construct(r, lambda: p.replace(loss_scale=inner.result))
    return r.done(out, set(base.covers) | {"loss_scale"}, inner.state)


def to_tf_keras(policy: Policy) -> Conversion:
    """Policy -> ``{"dtype_policy": name, "loss_scale_optimizer": config | None}``: the arguments of
    ``tf_keras.mixed_precision.LossScaleOptimizer(inner, **config)``; what Keras 2 cannot hold is a loss.

    Example:
        >>> import ampbridge
        >>> c = to_tf_keras(ampbridge.preset("mixed_float16").replace(
        ...     loss_scale=LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=8, min_scale=1.0)))
        >>> c.result["loss_scale_optimizer"], [l.setting for l in c.losses]
        ({'dynamic': True, 'initial_scale': 1024.0, 'dynamic_growth_steps': 8}, ['output_dtype'])
    """
    _require_concrete(policy, "tf.keras 2")
    base = to_keras(policy)  # the dtype policy name and its losses are Keras 3's
    w = _Writer("tf_keras", policy)
    w.losses.extend(l for l in base.losses if not l.setting.startswith("loss_scale"))
    w.notes.extend(n for n in base.notes if "2**127" not in n and "loss_scale_factor" not in n)
    name = base.result["dtype_policy"]
    if policy.uses_fp8:
        w.loss("fp8", policy.fp8.to_dict(), "tf.keras 2 has no float8 training (Keras 3's quantize(\"float8\") "
               "does): the [fp8] layers would run in the compute dtype")
    ls, view = policy.resolved_loss_scale, loss_scale_view(policy.loss_scale, policy.compute_dtype)
    lso = None
    if view["mode"] == "dynamic":
        lso = {"dynamic": True, "initial_scale": f32(ls.initial_scale), "dynamic_growth_steps": ls.growth_interval}
        for key, expected, text in (("growth_factor", 2.0, "x2"), ("backoff_factor", 0.5, "x0.5")):
            if view[key] != expected:
                w.loss(f"loss_scale.{key}", getattr(ls, key), f"Keras 2's LossScaleOptimizer fixes it at {text}")
        if ls.hysteresis > 1:
            w.loss("loss_scale.hysteresis", ls.hysteresis, "Keras 2 backs off on every overflow (no hysteresis)")
        if ls.initial_scale < 1.0:
            w.loss("loss_scale.initial_scale", ls.initial_scale, "Keras 2's first backoff raises a scale below 1 "
                   "to 1 (its floor)")
        if ls.min_scale != 1.0:
            w.loss("loss_scale.min_scale", ls.min_scale, "Keras 2 halves the scale down to 1 and no further")
        if ls.max_scale is not None:
            w.loss("loss_scale.max_scale", ls.max_scale, "Keras 2 has no ceiling (it stops only where x2 is inf)")
        if not ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", False, "Keras 2 skips every step whose gradients are not finite")
    elif view["mode"] == "static":
        lso = {"dynamic": False, "initial_scale": f32(ls.initial_scale), "dynamic_growth_steps": None}
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, "Keras 2's fixed scale applies non-finite steps")
    else:
        if name == "mixed_float16":
            w.loss("loss_scale.mode", view["mode"], "Model.compile() wraps a mixed_float16 model's optimizer in a "
                   "dynamic LossScaleOptimizer")
            if not view["skip_nonfinite"]:
                w.loss("loss_scale.skip_nonfinite", False, "the dynamic LossScaleOptimizer Model.compile() wraps "
                       "a mixed_float16 model's optimizer in skips every non-finite step")
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, "Keras 2 skips non-finite steps only inside a dynamic "
                   "LossScaleOptimizer")
    if (lso is not None or name == "mixed_float16") and ls.on_min_scale != "clamp":  # read back: a scaler
        w.loss("loss_scale.on_min_scale", ls.on_min_scale, "Keras 2's LossScaleOptimizer stops at its floor and says "
               "nothing (clamp)")
    return w.done({"dtype_policy": name, "loss_scale_optimizer": lso})

