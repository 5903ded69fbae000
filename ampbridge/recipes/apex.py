"""NVIDIA apex ``amp.initialize`` arguments (DeepSpeed's ``amp`` section) in and out.

``from_deepspeed`` / ``to_deepspeed`` read and write DeepSpeed's ``amp`` section through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.fields import FLOAT32_MAX
from ..core.matching import did_you_mean
from ..core.policy import Policy
from ..errors import UnsupportedOptionError
from .convert import _SHORT, _dtype_name, _get_bool, _get_int, _get_number, _Reader, _Writer, loss_scale_view

# --- apex amp (DeepSpeed's amp section) ----------------------------------------------------------

_APEX_KEYS = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
              "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale",
              "max_loss_scale")
_BATCHNORM_PINS = ("type:BatchNorm1d", "type:BatchNorm2d", "type:BatchNorm3d", "type:SyncBatchNorm")

_APEX_LEVELS: dict[str, dict[str, Any]] = {
    # apex/amp/frontend.py: the properties each opt_level sets
    "O0": {"cast_model_type": "float32", "patch_torch_functions": False, "keep_batchnorm_fp32": None,
           "master_weights": False, "loss_scale": 1.0},
    "O1": {"cast_model_type": None, "patch_torch_functions": True, "keep_batchnorm_fp32": None,
           "master_weights": None, "loss_scale": "dynamic"},
    "O2": {"cast_model_type": "float16", "patch_torch_functions": False, "keep_batchnorm_fp32": True,
           "master_weights": True, "loss_scale": "dynamic"},
    "O3": {"cast_model_type": "float16", "patch_torch_functions": False, "keep_batchnorm_fp32": False,
           "master_weights": False, "loss_scale": 1.0},
}


def _apex_dtype(r: _Reader, value: Any, path: tuple) -> str | None:
    if value is None:
        return None
    name = _dtype_name(value)
    if name not in ("float16", "float32"):
        r.problem(path, "not a dtype apex amp casts to", value=value, accepted='"torch.float16", "torch.float32"')
    return name


def _apex_level(r: _Reader, amp: Mapping[str, Any], p: tuple) -> tuple[str, dict[str, Any]]:
    """The opt_level and its properties, with the ones the config sets itself."""
    level = amp.get("opt_level", "O1")
    if level == "auto":
        level = "O1"
        r.note("amp.opt_level = 'auto' read as 'O1', the Hugging Face Trainer's default --fp16_opt_level")
    if level not in _APEX_LEVELS:
        r.problem(p + ("opt_level",), "unknown apex opt_level", value=level, accepted="O0, O1, O2, O3",
                  hint=did_you_mean(str(level), tuple(_APEX_LEVELS)))
        level = "O1"
    props = dict(_APEX_LEVELS[level])
    for key in ("patch_torch_functions", "master_weights"):
        if key in amp:
            props[key] = _get_bool(r, amp, key, p, props[key], strings=True)
    if "keep_batchnorm_fp32" in amp:
        props["keep_batchnorm_fp32"] = _get_bool(r, amp, "keep_batchnorm_fp32", p, None, strings=True)
    if "cast_model_type" in amp:
        props["cast_model_type"] = _apex_dtype(r, amp["cast_model_type"], p + ("cast_model_type",))
    if "loss_scale" in amp:
        v = amp["loss_scale"]
        if v == "dynamic":
            props["loss_scale"] = "dynamic"
        else:
            props["loss_scale"] = _get_number(r, amp, "loss_scale", p, 1.0, what='a number > 0 or "dynamic"')
    return level, props


def _apex(r: _Reader, amp: Mapping[str, Any], p: tuple) -> tuple[dict, dict]:
    level, props = _apex_level(r, amp, p)
    outputs = _apex_dtype(r, amp.get("cast_model_outputs"), p + ("cast_model_outputs",))
    num_losses = _get_int(r, amp, "num_losses", p, 1, low=1, what="an integer >= 1")
    if num_losses > 1:
        r.loss("amp.num_losses", num_losses, "apex keeps one loss scaler per loss; ampbridge has one scaler")
    if "verbosity" in amp:
        r.note("amp.verbosity only changes apex's logging")
    min_s = _get_number(r, amp, "min_loss_scale", p, None)
    max_s = _get_number(r, amp, "max_loss_scale", p, 2.0**24)
    if isinstance(max_s, float) and max_s >= FLOAT32_MAX:
        # what to_deepspeed(via="amp") writes for no ceiling: the two part only once the scale passes 2**127
        max_s = None
        r.note("amp.max_loss_scale = float32 max read as no max_scale: apex would then grow past 2**127 to float32 "
               "max, ampbridge stops at 2**127, which needs every gradient below 2**-111 for over a hundred growths")
    half_model = props["cast_model_type"] == "float16"
    compute = "float16" if half_model or props["patch_torch_functions"] else "float32"
    param = "float16" if half_model and not props["master_weights"] else "float32"
    output = outputs or compute
    if outputs is None and compute == "float16":
        r.note(f"apex {level} does not cast the model's outputs (cast_model_outputs unset): they come out in "
               "the dtype of the last op; read as output_dtype=float16")
    if props["patch_torch_functions"]:
        r.note("apex O1 patches torch functions onto its own float16/float32 op lists, much as torch.autocast "
               "does; ampbridge reads it as float16 compute")
    fields = {"compute_dtype": compute, "param_dtype": param, "output_dtype": output}
    if half_model and props["keep_batchnorm_fp32"]:
        fields["keep_float32"] = _BATCHNORM_PINS
        r.origins["keep_float32"] = "amp.keep_batchnorm_fp32"
    r.origins.update(compute_dtype="amp.opt_level", param_dtype="amp.master_weights",
                     output_dtype="amp.cast_model_outputs", **{"loss_scale.mode": "amp.loss_scale",
                                                               "loss_scale.min_scale": "amp.min_loss_scale",
                                                               "loss_scale.max_scale": "amp.max_loss_scale"})
    scale = props["loss_scale"]
    if scale == "dynamic":
        return fields, {"mode": "dynamic", "initial_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                        "growth_interval": 2000, "min_scale": min_s, "max_scale": max_s, "skip_nonfinite": True}
    # apex's static scaler never checks for overflow, so nothing is skipped
    if scale == 1.0:
        return fields, {"mode": "none", "skip_nonfinite": False}
    return fields, {"mode": "static", "initial_scale": scale, "skip_nonfinite": False}


def _apex_out(w: _Writer, p: Policy) -> dict[str, Any]:
    compute = p.compute_dtype
    if compute != "float16":
        raise UnsupportedOptionError(f"compute_dtype={compute!r} cannot be written as apex amp, which computes in "
                                     "float16 only; use via='native' or via='torch_autocast'")
    batchnorm = tuple(sorted(p.keep_float32)) == tuple(sorted(_BATCHNORM_PINS))
    pins = [x for x in p.keep_float32 if not batchnorm]
    if pins:
        w.loss("keep_float32", pins, "apex keeps only BatchNorm layers in float32 (keep_batchnorm_fp32)")
    if p.overrides:
        w.loss("override", [r.to_dict() for r in p.overrides], "apex cannot override layers")
    amp: dict[str, Any] = {"enabled": True}
    if p.param_dtype == "float16":
        amp["opt_level"] = "O3"
        if batchnorm:
            amp["keep_batchnorm_fp32"] = True
    elif batchnorm:
        amp["opt_level"] = "O2"
    else:
        amp["opt_level"] = "O1"
        if p.param_dtype != "float32":
            w.loss("param_dtype", p.param_dtype, "apex keeps float32 or float16 parameters")
    if p.output_dtype != "float16":
        w.loss("output_dtype", p.output_dtype, "apex's cast_model_outputs takes a torch dtype, which a JSON "
               "config cannot hold; the outputs come out in the dtype of the last op")
    amp_reduce = _SHORT[p.reduce_dtype] if p.reduce_dtype != "float32" else None
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, compute)
    level_default = _APEX_LEVELS[amp["opt_level"]]["loss_scale"]
    if view["mode"] == "dynamic":
        if level_default != "dynamic":
            amp["loss_scale"] = "dynamic"
        fixed = {"initial_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                 "hysteresis": 1}
        for key, expected in fixed.items():
            if view[key] != expected:
                w.loss(f"loss_scale.{key}", getattr(ls, key), f"apex's dynamic scaler fixes {key} at {expected}")
        if ls.min_scale is not None:
            amp["min_loss_scale"] = ls.min_scale
            if ls.on_min_scale != "clamp":
                w.loss("loss_scale.on_min_scale", ls.on_min_scale, "apex clamps at min_loss_scale")
        if ls.max_scale != 2.0**24:
            amp["max_loss_scale"] = ls.max_scale if ls.max_scale is not None else FLOAT32_MAX
            if ls.max_scale is None:
                w.note("no max_scale written as apex max_loss_scale = float32 max (apex's default is 2**24)")
        if not ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", False, "apex's dynamic scaler always skips overflowing steps")
    else:
        value = view.get("initial_scale", 1.0)
        if level_default != value:
            amp["loss_scale"] = value
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, "apex's static scaler never checks for overflow")
    out: dict[str, Any] = {"amp": amp}
    if amp_reduce:
        out["communication_data_type"] = amp_reduce
    return out
