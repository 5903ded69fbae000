"""DeepSpeed configs in and out: ``fp16``, ``bf16``, ``torch_autocast`` and (through apex) ``amp``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.loss_scale import f32
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem
from . import deepspeed_releases as _rel
from .apex import _APEX_KEYS, _apex, _apex_out
from .convert import (
    _ALL_BUT_MATMUL,
    _SHORT,
    Conversion,
    _construct,
    _dtype_name,
    _get_bool,
    _get_int,
    _get_number,
    _int_if_integral,
    _origins_all_loss_scale,
    _parse_recipe,
    _power_of_two,
    _read_file,
    _Reader,
    _require_concrete,
    _Writer,
    loss_scale_view,
    trainer_dtype,
)

# --- DeepSpeed ----------------------------------------------------------------------------------

#: the old names of the two DynamicLossScaler growth tests (``release=``; ``version=`` replaces it):
#: "modulo" is DeepSpeed 0.17.0 and earlier, "stable_interval" 0.17.1 (PR 6976, e440506) and later
DEEPSPEED_RELEASES = ("modulo", "stable_interval")
#: the DeepSpeed release read when none is given
DEEPSPEED_VERSION = _rel.CURRENT
_GROWTH_NOTE = ("DeepSpeed 0.17.1 and later (PR 6976, commit e440506; and FP16_Optimizer without ZeRO in every "
                "release read) test growth as stable_interval = cur_iter - last_overflow_iter - 1 > 0 and "
                "stable_interval % window == 0, so the first growth after an overflow (and at the start) waits "
                "window + 1 finite steps, later ones window: loss_scale.first_growth_interval = window + 1, exactly")
_FP16_OPT_NOTE = ("without ZeRO, DeepSpeed's fp16 loss scale lives in FP16_Optimizer / FP16_UnfusedOptimizer "
                  "(_update_scale): no hysteresis (fp16.hysteresis is ignored), the stable_interval growth test and "
                  "a clamp at min_loss_scale instead of an error, in every checked release (0.17.0-0.19.8)")

_DS_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads", "fused_mode")
_DS_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                 "bf16_optimizer_states")
_DS_AUTOCAST_KEYS = ("enabled", "dtype", "lower_precision_safe_modules")
#: the top-level DeepSpeed keys ampbridge reads (a near-miss of one of these is reported as a typo)
_DS_READ = ("fp16", "bf16", "bfloat16", "torch_autocast", "amp", "communication_data_type", "data_types",
            "zero_optimization", "seq_parallel_communication_data_type")
#: zero_optimization keys that change numerics ampbridge cannot express (reported as losses when on)
_ZERO_QUANTIZED = {"zero_quantized_gradients": "ZeRO++ all-reduces gradients quantized to int4/int8",
                   "zero_quantized_weights": "ZeRO++ all-gathers weights quantized to int8",
                   "zero_quantized_nontrainable_weights": "ZeRO++ keeps non-trainable weights quantized to int8"}
_DS_OTHER_KNOWN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
                   "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp32_allreduce",
                   "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                   "comms_logger", "checkpoint", "aio", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                   "dump_state", "memory_breakdown", "elasticity", "compression_training", "data_efficiency",
                   "pipeline", "autotuning", "sparse_attention", "eigenvalue", "progressive_layer_drop",
                   "curriculum_learning", "graph_harvesting",
                   "dataloader_drop_last", "nebula", "hybrid_engine", "compile", "use_data_before_expert_parallelism",
                   "timers", "weight_quantization", "tensor_parallel", "disable_allgather")
_AUTO_FILLED = ("the Hugging Face Trainer (and Accelerate) fill in only fp16.enabled, bf16.enabled, amp.enabled and "
                "amp.opt_level")


_PYDANTIC_TRUE = ("1", "on", "t", "true", "y", "yes")
_PYDANTIC_FALSE = ("0", "off", "f", "false", "n", "no")


def _ds_coerce(key: str, v: Any, fractional_floor: bool = False) -> Any:
    """``fp16.<key>`` as DeepSpeed's own config model (``DeepSpeedFP16Config``, precision_config.py of
    0.19.8, pydantic in lax mode) reads it; raises ValueError with what it accepts otherwise."""
    if key == "loss_scale":
        if isinstance(v, bool):
            raise ValueError("a number >= 0 (0: dynamic), not a boolean")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError("a number >= 0 (0: dynamic)") from None
        if not math.isfinite(x) or x < 0:
            raise ValueError("a finite number >= 0 (0: dynamic)")
        return x
    if key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        if isinstance(v, bool) and key in ("loss_scale_window", "min_loss_scale"):
            raise ValueError("an integer, not a boolean")
        if isinstance(v, str):
            v = v.strip()
            if not re.fullmatch(r"[+-]?\d+", v):
                raise ValueError("an integer")
            return int(v)
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if fractional_floor and key == "min_loss_scale" and isinstance(v, float) and math.isfinite(v):
            return v  # 0.19.8 declares it an int; older releases took a fractional floor (ampbridge's writer notes it)
        if not isinstance(v, int):
            raise ValueError("an integer")
        return int(v)
    # the booleans: enabled, auto_cast, consecutive_hysteresis, fp16_master_weights_and_grads
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _PYDANTIC_TRUE + _PYDANTIC_FALSE:
        return v.strip().lower() in _PYDANTIC_TRUE
    raise ValueError("a boolean (true, false, 0, 1, 'yes', 'no', 'on', 'off')")


def _ds_fp16_check(r: _Reader, fp16: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The fp16 section validated as DeepSpeed validates it, whether or not fp16 is enabled (a bad
    ``loss_scale`` stops DeepSpeed even then), and returned with DeepSpeed's coerced values."""
    out: dict[str, Any] = dict(fp16)
    for key in _DS_FP16_KEYS:
        if key not in fp16 or fp16[key] == "auto":  # 'auto': _no_auto and _resolve_enabled say
            continue
        try:
            out[key] = _ds_coerce(key, fp16[key], _rel.parse(version) < _rel.parse("0.19.8"))
        except ValueError as e:
            r.problem(("fp16", key), f"DeepSpeed's config model rejects it: must be {e}", value=fp16[key],
                      accepted=str(e))
            out.pop(key)
    enabled = out.get("enabled", False)
    if enabled is True and out.get("loss_scale", 0.0) == 0:  # DeepSpeed's dynamic-scaling checks
        for key in ("loss_scale_window", "min_loss_scale"):
            if key in out and out[key] <= 0:
                r.problem(("fp16", key), "must be > 0 when dynamic loss scaling is enabled (loss_scale = 0)",
                          value=fp16[key], accepted="an integer > 0")
                out.pop(key)
    return out


def read_fp16_section(fp16: Mapping[str, Any], *, version: str | None = None) -> dict[str, Any]:
    """DeepSpeed's ``fp16`` section as DeepSpeed's config model reads it: validated (PolicyError, one
    line per problem) and coerced (``"128"`` -> 128.0), the keys given only; what ``from_deepspeed``
    reads, enabled or not.

    Example:
        >>> read_fp16_section({"loss_scale": "128", "hysteresis": 2.0})
        {'loss_scale': 128.0, 'hysteresis': 2}
    """
    r = _Reader("deepspeed")
    r.check_keys(fp16, _DS_FP16_KEYS, ("fp16",), "DeepSpeed's fp16 section")
    out = _ds_fp16_check(r, fp16, _rel.resolve(version, None))
    r.raise_if_any()
    return out


def _no_auto(r: _Reader, section: Mapping[str, Any], path: tuple, allowed: Sequence[str]) -> None:
    for key, v in section.items():
        if v == "auto" and key not in allowed:
            r.problem(path + (key,), "'auto' is not filled in for this key", value=v, hint=_AUTO_FILLED)


def _resolve_enabled(r: _Reader, value: Any, key: str, trainer: str | None, wants: str) -> bool:
    if value != "auto":
        return bool(value)
    if trainer is None:
        r.loss(key, "auto", "filled in at launch by the Hugging Face Trainer or Accelerate from their own "
               "precision flag; read as false (a trainer without --fp16/--bf16). Pass auto='fp16' or "
               "'bf16' (ampbridge convert --auto) to say what your trainer uses")
        return False
    r.note(f"{key} = 'auto' read as {'true' if trainer == wants else 'false'}: the trainer's precision is {trainer}")
    return trainer == wants


def from_deepspeed(config: Mapping[str, Any], *, auto: Any = None, version: str | None = None,
                   release: str | None = None, source: str | None = None,
                   _locate: Callable[[tuple], int | None] | None = None) -> Conversion:
    """A DeepSpeed config (the parsed JSON) -> Policy, reading ``fp16``, ``bf16``, ``torch_autocast``, ``amp``.

    - ``fp16``: ``loss_scale`` 0 is dynamic (``initial_scale_power`` default 16,
      ``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1, growth x2 / backoff x0.5,
      ``on_min_scale = "error"``: ZeRO's ``DynamicLossScaler`` raises at the minimum); > 0 is a
      static scale. Parameters are float32 master weights, the module (and its outputs) float16.
      Without ZeRO (FP16_Optimizer) there is no hysteresis and the minimum clamps.
    - ``bf16`` (and float32): no loss scaling; ``skip_nonfinite`` is what the release does at the
      config's ZeRO stage (``deepspeed_releases.skips``: ``check_grad_overflow`` only under ZeRO
      1-2; 0.19.8 skips without ZeRO and under ZeRO 3 whatever it says).
    - ``torch_autocast``: ``torch.autocast`` over float32 parameters (float16 adds torch's
      GradScaler defaults); ``amp``: apex's ``opt_level`` O0-O3 and its overrides.
    - ``"auto"`` values are what the Hugging Face Trainer / Accelerate fill in at launch from their
      own precision flag: pass that flag as ``auto`` ("fp16", "bf16", "no", or a Lightning string).
      Without it, an ``"auto"`` ``enabled`` reads as false and is reported as a loss.
    - ``version``: the DeepSpeed release to read for (default ``DEEPSPEED_VERSION``, 0.19.8).
      ZeRO's ``DynamicLossScaler`` matches ampbridge's reference exactly up to 0.17.0; from 0.17.1
      (PR 6976, e440506) it grows one step later after each overflow, reported as a loss.
      ``release`` is the older switch: "modulo" reads as 0.17.0, "stable_interval" as 0.19.8.
    - With ``auto`` given, a config with no ``fp16``/``bf16`` section gets the one Accelerate's
      ``DeepSpeedPlugin.set_mixed_precision`` adds; one enabling the other dtype is an error, as
      there.

    Example:
        >>> c = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 2}, "zero_optimization": {"stage": 2}},
        ...                    version="0.17.0")
        >>> ls = c.result.loss_scale
        >>> c.result.compute_dtype, ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.on_min_scale, c.exact
        ('float16', 65536.0, 1000, 2, 'error', True)
    """
    r = _Reader("deepspeed", source, _locate)
    version = _rel.resolve(version, release)
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("a DeepSpeed config must be a JSON object", file=source, value=config)])
    trainer = trainer_dtype(auto) if auto is not None else None
    if trainer in ("float16", "bfloat16"):
        config = _accelerate_fill(r, config, trainer)
    _ds_unknown_keys(r, config)
    fp16, bf16, bf16_path, autocast, amp, zero, stage = _ds_sections(r, config, version)
    mode = _ds_mode(r, trainer, fp16, bf16, bf16_path, autocast, amp)
    comm_dtype, data_types = _ds_communication(r, config, zero)
    fp32_accum = _dtype_name(str(data_types.get("grad_accum_dtype"))) == "float32"
    fields, ls = _ds_fields(r, mode, fp16, bf16, bf16_path, autocast, amp, stage, version, fp32_accum)
    default_reduce = {"fp16": "float16", "bf16": "bfloat16"}.get(mode or "", "float32")
    fields["reduce_dtype"] = comm_dtype or default_reduce
    r.origins["reduce_dtype"] = "communication_data_type" + (
        "" if comm_dtype else f" (absent: {mode or 'fp32'}'s default)")
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


def _ds_unknown_keys(r: _Reader, config: Mapping[str, Any]) -> None:
    """A top-level key DeepSpeed would ignore silently, close to one ampbridge reads: a likely typo."""
    for key in config:
        if key not in _DS_READ and key not in _DS_OTHER_KNOWN:
            close = difflib.get_close_matches(str(key), _DS_READ, n=1, cutoff=0.75)
            if close:
                r.problem((key,), f"not a DeepSpeed key, and DeepSpeed ignores it silently; did you mean "
                          f"{close[0]!r}?", accepted=", ".join(_DS_READ))


def _ds_sections(r: _Reader, config: Mapping[str, Any], version: str) -> tuple:
    """The sections a precision mode reads, their keys checked, and the ZeRO stage:
    (fp16, bf16, the bf16 section's path, torch_autocast, amp, zero_optimization, stage)."""
    fp16 = r.section(config, "fp16") or {}
    bf16 = r.section(config, "bf16")
    bf16_path: tuple = ("bf16",)
    legacy = r.section(config, "bfloat16")
    if bf16 is None and legacy is not None:
        bf16, bf16_path = legacy, ("bfloat16",)
    elif legacy is not None:
        r.loss("bfloat16", legacy, "DeepSpeed ignores the old 'bfloat16' section when 'bf16' is present")
    bf16 = bf16 or {}
    autocast = r.section(config, "torch_autocast") or {}
    amp = r.section(config, "amp") or {}
    zero = r.section(config, "zero_optimization") or {}
    r.check_keys(fp16, _DS_FP16_KEYS, ("fp16",), "DeepSpeed's fp16 section")
    fp16 = _ds_fp16_check(r, fp16, version)
    r.check_keys(bf16, _DS_BF16_KEYS, bf16_path, "DeepSpeed's bf16 section")
    r.check_keys(autocast, _DS_AUTOCAST_KEYS, ("torch_autocast",), "DeepSpeed's torch_autocast section")
    r.check_keys(amp, _APEX_KEYS, ("amp",), "DeepSpeed's amp section (apex amp.initialize arguments)")
    _no_auto(r, fp16, ("fp16",), ("enabled",))
    _no_auto(r, bf16, bf16_path, ("enabled",))
    _no_auto(r, autocast, ("torch_autocast",), ())
    _no_auto(r, amp, ("amp",), ("enabled", "opt_level"))
    stage = _get_int(r, zero, "stage", ("zero_optimization",), 0, low=0, what="an integer from 0 to 3")
    if isinstance(stage, int) and stage > 3:
        r.problem(("zero_optimization", "stage"), "must be an integer from 0 to 3", value=stage, accepted="0, 1, 2, 3")
    return fp16, bf16, bf16_path, autocast, amp, zero, stage


def _ds_mode(r: _Reader, trainer: str | None, fp16: Mapping[str, Any], bf16: Mapping[str, Any], bf16_path: tuple,
             autocast: Mapping[str, Any], amp: Mapping[str, Any]) -> str | None:
    """The one enabled precision mode ("fp16", "bf16", "torch_autocast", "amp"), or None (float32)."""
    fp16_on = _resolve_enabled(r, _get_bool(r, fp16, "enabled", ("fp16",), False, allow_auto=True, strings=True),
                               "fp16.enabled", trainer, "float16")
    bf16_on = _resolve_enabled(r, _get_bool(r, bf16, "enabled", bf16_path, False, allow_auto=True, strings=True),
                               f"{bf16_path[0]}.enabled", trainer, "bfloat16")
    autocast_on = _get_bool(r, autocast, "enabled", ("torch_autocast",), False, strings=True)
    amp_enabled = _get_bool(r, amp, "enabled", ("amp",), False, allow_auto=True, strings=True)
    if amp_enabled == "auto":
        r.note("amp.enabled = 'auto' read as false: the Hugging Face Trainer enables apex only with "
               "--fp16_backend apex")
        amp_enabled = False
    if autocast_on and bf16_on and _dtype_name(str(autocast.get("dtype", "bf16"))) == "bfloat16":
        # DeepSpeed runs both: the bf16 module (and optimizer) with torch.autocast(bfloat16) around the forward
        autocast_on = False
        r.loss("torch_autocast.enabled", True, "with bf16 also enabled, DeepSpeed runs torch.autocast(bfloat16) over "
               "the bfloat16 module: autocast's float32 ops (softmax, norms, losses) run in float32; ampbridge pins "
               "modules, not ops (read as bf16)")
    enabled = [name for name, on in (("fp16", fp16_on), ("bf16", bf16_on), ("torch_autocast", autocast_on),
                                     ("amp", amp_enabled)) if on]
    if len(enabled) > 1:
        r.problem((enabled[1], "enabled"), f"{' and '.join(enabled)} are both enabled; DeepSpeed accepts one "
                  "mixed-precision mode at a time", accepted="enable one of fp16, bf16, torch_autocast, amp")
    mode = enabled[0] if enabled else None
    for name, section, path in (("fp16", fp16, ("fp16",)), ("bf16", bf16, bf16_path)):
        if mode != name and set(section) - {"enabled"}:
            unused = ", ".join(sorted(set(section) - {"enabled"}))
            r.note(f"{path[0]}: {unused} have no effect: {path[0]} is not enabled")
    return mode


def _ds_communication(r: _Reader, config: Mapping[str, Any], zero: Mapping[str, Any]) -> tuple[str | None, Mapping]:
    """The communication dtype (None: the mode's default) and the data_types section; what ampbridge
    has no setting for (sequence-parallel and quantized communication, grad_accum_dtype) is a loss."""
    comm = config.get("communication_data_type")
    comm_dtype = None
    if comm is not None:
        if isinstance(comm, str) and comm.lower() in ("fp32", "fp16", "bf16"):
            comm_dtype = _dtype_name(comm)
        if comm_dtype is None:
            r.problem(("communication_data_type",), "not a DeepSpeed communication data type", value=comm,
                      accepted="fp32, fp16, bf16")
    seq_comm = config.get("seq_parallel_communication_data_type")
    if seq_comm is not None:
        if not (isinstance(seq_comm, str) and seq_comm.lower() in ("fp32", "fp16", "bf16")):
            r.problem(("seq_parallel_communication_data_type",), "not a DeepSpeed communication data type",
                      value=seq_comm, accepted="fp32, fp16, bf16")
        elif seq_comm.lower() != "fp32":
            r.loss("seq_parallel_communication_data_type", seq_comm, "sequence-parallel all-to-alls in "
                   f"{_dtype_name(seq_comm)}: ampbridge has no sequence-parallel communication dtype")
    for key, what in _ZERO_QUANTIZED.items():
        if zero.get(key) not in (None, False):
            r.loss(f"zero_optimization.{key}", zero[key], f"{what}; ampbridge has no quantized communication")
    data_types = r.section(config, "data_types") or {}
    r.check_keys(data_types, ("grad_accum_dtype",), ("data_types",), "DeepSpeed's data_types section")
    if data_types.get("grad_accum_dtype") is not None:
        r.loss("data_types.grad_accum_dtype", data_types["grad_accum_dtype"],
               "ampbridge has no gradient-accumulation dtype (gradients accumulate in the parameter dtype)")
    return comm_dtype, data_types


def _ds_fields(r: _Reader, mode: str | None, fp16: Mapping[str, Any], bf16: Mapping[str, Any], bf16_path: tuple,
               autocast: Mapping[str, Any], amp: Mapping[str, Any], stage: Any, version: str,
               fp32_accum: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Policy fields and loss-scale fields of the enabled mode."""
    fields: dict[str, Any] = {}
    ls: dict[str, Any] = {}
    if mode == "fp16":
        fields, ls = _ds_fp16(r, fp16, stage, version)
    elif mode == "bf16":
        fields, ls = _ds_bf16(r, bf16, bf16_path, stage, version, fp32_accum)
    elif mode == "torch_autocast":
        fields, ls = _ds_autocast(r, autocast, stage)
    elif mode == "amp":
        fields, ls = _apex(r, amp, ("amp",))
        if stage:
            r.loss("zero_optimization.stage", stage, "DeepSpeed does not run apex amp with ZeRO")
    else:
        fields = {"compute_dtype": "float32", "param_dtype": "float32", "output_dtype": "float32"}
        skip, why, unchecked = _rel.skips(version, "fp32", stage, None)
        ls = {"mode": "none", "skip_nonfinite": skip}
        r.origins["compute_dtype"] = "fp16.enabled"
        _origins_all_loss_scale(r, "fp16.enabled (float32: no loss scaling)")
        r.origins["loss_scale.skip_nonfinite"] = f"zero_optimization.stage ({why})"
        if unchecked:
            r.loss("zero_optimization.stage", stage, unchecked)
        r.note(f"skip_nonfinite for DeepSpeed {version}: {_rel.cell_source(version)}")
    return fields, ls


def _accelerate_fill(r: _Reader, config: Mapping[str, Any], trainer: str) -> Mapping[str, Any]:
    """What Accelerate's DeepSpeedPlugin.set_mixed_precision does to a config before DeepSpeed sees it."""
    want, other = ("fp16", "bf16") if trainer == "float16" else ("bf16", "fp16")
    section = config.get(other)
    if isinstance(section, Mapping) and str(section.get("enabled", "False")).lower() == "true":
        r.problem((other, "enabled"), f"the trainer's precision is {want} and this config enables {other}: Accelerate "
                  f"raises (`--mixed_precision` arg cannot be set to `{want}` when `{other}` is set in the DeepSpeed "
                  "config file)", value=section.get("enabled"), accepted=f"'auto' or false, or a {other} trainer")
    if want in config or (want == "bf16" and "bfloat16" in config):
        return config
    added = {"enabled": True, "auto_cast": True} if want == "fp16" else {"enabled": True}
    r.note(f"no {want} section: Accelerate's DeepSpeedPlugin.set_mixed_precision adds {want} = {added} for a "
           f"{want} trainer (the Hugging Face Trainer goes through it too)")
    return {**config, want: added}


def _ds_fp16(r: _Reader, fp16: Mapping[str, Any], stage: int, version: str) -> tuple[dict, dict]:
    p = ("fp16",)
    master16 = _get_bool(r, fp16, "fp16_master_weights_and_grads", p, False)
    if _get_bool(r, fp16, "auto_cast", p, False):
        r.note("fp16.auto_cast casts the module's floating-point inputs to float16 (as the float16 "
               "compute dtype does)")
    if "fused_mode" in fp16:
        r.note("fp16.fused_mode picks DeepSpeed's fused or unfused FP16_Optimizer; the loss-scale settings "
               "ampbridge reads are the same in both")
    fields = {"compute_dtype": "float16", "param_dtype": "float16" if master16 else "float32",
              "output_dtype": "float16"}
    whole = "fp16.enabled (casts the whole module)"
    r.origins.update(keep_float32=whole, overrides=whole, **{
        "loss_scale.mode": "fp16.loss_scale (0: dynamic)",
        "loss_scale.skip_nonfinite": "fp16.enabled (DeepSpeed skips every overflowing fp16 step)"})
    r.origins.update(compute_dtype="fp16.enabled", output_dtype="fp16.enabled",
                     param_dtype="fp16.fp16_master_weights_and_grads")
    static = _get_number(r, fp16, "loss_scale", p, 0.0, positive=False, what="a number >= 0 (0: dynamic)")
    if isinstance(static, float) and static < 0:
        r.problem(p + ("loss_scale",), "must be a number >= 0 (0: dynamic)", value=static)
    if static:
        r.origins["loss_scale.initial_scale"] = "fp16.loss_scale"
        return fields, {"mode": "static", "initial_scale": static, "skip_nonfinite": True}
    return fields, _ds_fp16_dynamic(r, fp16, stage, version)


def _ds_fp16_dynamic(r: _Reader, fp16: Mapping[str, Any], stage: int, version: str) -> dict[str, Any]:
    """The dynamic loss scale of ``fp16`` (no static ``loss_scale``): hysteresis only under ZeRO,
    the first growth one step late where the release's stable_interval test says so."""
    p = ("fp16",)
    power = _get_int(r, fp16, "initial_scale_power", p, 16, what="an integer from -126 to 127")
    if not -126 <= power <= 127:
        r.problem(p + ("initial_scale_power",), "2**initial_scale_power must be a float32 number", value=power,
                  accepted="an integer from -126 to 127")
        power = 16
    window = _get_int(r, fp16, "loss_scale_window", p, 1000, low=1, what="an integer >= 1")
    hysteresis = _get_int(r, fp16, "hysteresis", p, 2, low=1, what="an integer >= 1")
    if stage == 0:
        if "hysteresis" in fp16 or "consecutive_hysteresis" in fp16:
            r.note("fp16.hysteresis and consecutive_hysteresis have no effect without ZeRO (FP16_Optimizer)")
        hysteresis = 1
    consecutive = _get_bool(r, fp16, "consecutive_hysteresis", p, False)
    min_scale = _get_number(r, fp16, "min_loss_scale", p, 1.0)
    r.origins.update({"loss_scale.initial_scale": "fp16.initial_scale_power",
                      "loss_scale.growth_interval": "fp16.loss_scale_window",
                      "loss_scale.hysteresis": "fp16.hysteresis",
                      "loss_scale.consecutive_hysteresis": "fp16.consecutive_hysteresis",
                      "loss_scale.min_scale": "fp16.min_loss_scale"})
    on_min = "error"
    first: dict[str, int] = {}
    if stage == 0:
        on_min = "clamp"
        r.note(_FP16_OPT_NOTE)
        r.origins["loss_scale.hysteresis"] = "zero_optimization.stage (0: FP16_Optimizer has no hysteresis)"
    if stage == 0 or _rel.grows_late(version):
        # the stable_interval test: window + 1 finite steps before the first growth, then every window
        first["first_growth_interval"] = window + 1
        r.origins["loss_scale.first_growth_interval"] = (
            "fp16.loss_scale_window + 1 (" + ("FP16_Optimizer, no ZeRO" if stage == 0 else
                                               f"DeepSpeed {version}'s DynamicLossScaler") + ": stable_interval test)")
        r.note(_GROWTH_NOTE)
    r.note("DeepSpeed keeps its loss scale in a Python float, which may grow past float32's range; ampbridge's "
           "scale stops growing at float32's largest power of two. The two differ only once the scale passes "
           "2**127, which needs every gradient below 2**-111 for over a hundred growth windows")
    return {"mode": "dynamic", "initial_scale": math.ldexp(1.0, power), "growth_factor": 2.0,
            "backoff_factor": 0.5, "growth_interval": window, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive, "min_scale": min_scale, "on_min_scale": on_min,
            "skip_nonfinite": True, **first}


def _ds_bf16(r: _Reader, bf16: Mapping[str, Any], p: tuple, stage: int, version: str,
             fp32_accum: bool) -> tuple[dict, dict]:
    master16 = _get_bool(r, bf16, "bf16_master_weights_and_grads", p, False)
    if "immediate_grad_update" in bf16:
        r.loss(f"{p[0]}.immediate_grad_update", bf16["immediate_grad_update"],
               "when DeepSpeed's bf16 optimizer folds each micro-batch's gradients into the float32 master "
               "gradients is not an ampbridge setting")
    if _get_bool(r, bf16, "bf16_optimizer_states", p, False):
        r.loss(f"{p[0]}.bf16_optimizer_states", True, "ampbridge has no optimizer-state dtype")
    check = _get_bool(r, bf16, "check_grad_overflow", p, None)
    skip, why, unchecked = _rel.skips(version, "bf16", stage, check, fp32_accum)
    if unchecked:
        r.loss("zero_optimization.stage", stage, unchecked)
    r.note(f"skip_nonfinite for DeepSpeed {version}: {_rel.cell_source(version)}")
    if check is not None and bool(check) != skip:
        r.note(f"{p[0]}.check_grad_overflow = {str(bool(check)).lower()} has no effect here: {why} "
               f"(DeepSpeed {version})")
    r.origins.update(keep_float32=f"{p[0]}.enabled (casts the whole module)",
                     overrides=f"{p[0]}.enabled (casts the whole module)",
                     **{"loss_scale.mode": f"{p[0]}.enabled (no loss scaling in bf16)"})
    r.origins.update(compute_dtype=f"{p[0]}.enabled", output_dtype=f"{p[0]}.enabled",
                     param_dtype=f"{p[0]}.bf16_master_weights_and_grads",
                     **{"loss_scale.skip_nonfinite": f"zero_optimization.stage and {p[0]}.check_grad_overflow "
                        f"({why})"})
    return ({"compute_dtype": "bfloat16", "param_dtype": "bfloat16" if master16 else "float32",
             "output_dtype": "bfloat16"}, {"mode": "none", "skip_nonfinite": skip})


def _ds_autocast(r: _Reader, ac: Mapping[str, Any], stage: int) -> tuple[dict, dict]:
    p = ("torch_autocast",)
    raw = ac.get("dtype")
    if raw is None:
        dtype = "float16"
        r.note("torch_autocast.dtype absent: torch.autocast then uses its device default, float16 on CUDA")
    else:
        dtype = _dtype_name(raw) if isinstance(raw, str) else None
        if dtype is None or dtype == "float32":
            r.problem(p + ("dtype",), "not an autocast dtype", value=raw, accepted="bfloat16, float16 (bf16, fp16)")
            dtype = "bfloat16"
    modules = ac.get("lower_precision_safe_modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        r.problem(p + ("lower_precision_safe_modules",), "must be a list of class paths", value=modules,
                  accepted='a list such as ["torch.nn.Linear"]')
    elif modules != []:
        shown = modules if modules is not None else ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d",
                                                     "torch.nn.Conv3d"]
        r.loss("torch_autocast.lower_precision_safe_modules", shown,
               f"DeepSpeed all-reduces the gradients of these module classes in {dtype} and the rest in float32; "
               "ampbridge has one reduce_dtype for the whole model (read as float32)")
    r.note("DeepSpeed does not cast outputs under torch_autocast: they come out in the dtype of the model's "
           f"last op ({dtype} for a final Linear); read as output_dtype={dtype}")
    r.origins.update(compute_dtype="torch_autocast.dtype", output_dtype="torch_autocast.dtype",
                     keep_float32="torch_autocast (no module pins)", overrides="torch_autocast (no module pins)")
    fields = {"compute_dtype": dtype, "param_dtype": "float32", "output_dtype": dtype}
    if dtype == "bfloat16":
        return fields, {"mode": "none", "skip_nonfinite": False}
    if stage:
        r.loss("zero_optimization.stage", stage,
               "with float16 torch_autocast under ZeRO the loss is scaled by the ZeRO optimizer's own scaler, "
               "whose settings this config does not show; read as torch GradScaler's defaults (what DeepSpeed "
               "uses without ZeRO)")
    r.origins["loss_scale.mode"] = "torch_autocast.dtype"
    return fields, {"mode": "dynamic", "initial_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                    "growth_interval": 2000, "skip_nonfinite": True}


def to_deepspeed(policy: Policy, *, via: str = "native", version: str | None = None, release: str | None = None,
                 stage: int | None = None) -> Conversion:
    """Policy -> the precision part of a DeepSpeed config (merge it into your ds_config.json).

    ``via``: ``"native"`` (DeepSpeed's own ``fp16``/``bf16`` modes, the default),
    ``"torch_autocast"`` (``torch.autocast`` over float32 parameters) or ``"amp"`` (apex).
    ``version`` / ``release`` as in :func:`from_deepspeed` (from 0.17.1 the growth timing is
    ``first_growth_interval = growth_interval + 1``; any other is a loss).
    ``stage``: the ZeRO stage the config will run with (None: any), which decides whether DeepSpeed
    skips non-finite bf16 and float32 steps; a ``skip_nonfinite`` some stage cannot honour is a loss.

    Example:
        >>> import ampbridge
        >>> c = to_deepspeed(ampbridge.preset("float16").replace(loss_scale=ampbridge.LossScaleConfig(
        ...     mode="dynamic", growth_interval=1000, hysteresis=2, min_scale=1.0, on_min_scale="error")),
        ...     version="0.17.0", stage=2)
        >>> c.exact
        True
        >>> c.result["zero_optimization"]
        {'stage': 2}
        >>> for key, value in c.result["fp16"].items(): print(key, value)
        enabled True
        loss_scale 0
        initial_scale_power 16
        loss_scale_window 1000
        hysteresis 2
        consecutive_hysteresis False
        min_loss_scale 1
        fp16_master_weights_and_grads True
    """
    if via not in ("native", "torch_autocast", "amp"):
        raise ValueError(f"via={via!r}; accepted: native, torch_autocast, amp")
    version = _rel.resolve(version, release)
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}; accepted: 0, 1, 2, 3 or None")
    _require_concrete(policy, "DeepSpeed")
    w = _Writer("deepspeed", policy)
    p = policy
    compute = p.compute_dtype
    if via == "native" or compute == "float32":
        if via != "native":
            w.note(f"float32 compute written as DeepSpeed's plain float32 mode (nothing for {via} to do)")
        w.common("DeepSpeed", pins_reason="DeepSpeed's fp16/bf16 modes cast the whole module; they cannot "
                 "keep layers in float32 (ampbridge's torch backend can)" if compute != "float32" else "")
        out = _ds_native(w, p, version, stage)
        if stage is not None:  # the stage the numerics above were written for travels with them
            out["zero_optimization"] = {"stage": stage}
        return w.done(out)
    if via == "torch_autocast":
        w.common("DeepSpeed", pins_reason="torch.autocast has per-op lists, not per-module pins")
        return w.done(_ds_autocast_out(w, p))
    w.common("DeepSpeed", pins=True)
    return w.done(_apex_out(w, p))


def _skip_loss(w: _Writer, mode: str, want: bool, version: str, stage: int | None, check: bool | None) -> None:
    """A loss naming the ZeRO stages whose DeepSpeed ``version`` does not do ``skip_nonfinite = want``."""
    stages = (stage,) if stage is not None else (0, 1, 2, 3)
    wrong = [z for z in stages if _rel.skips(version, mode, z, check)[0] != want]
    unknown = [z for z in stages if z not in wrong and _rel.skips(version, mode, z, check)[2]]
    if unknown:
        names = ", ".join("no ZeRO" if z == 0 else f"ZeRO {z}" for z in unknown)
        w.loss("loss_scale.skip_nonfinite", want, f"not known for DeepSpeed {version} under {names}: "
               + _rel.skips(version, mode, unknown[0], check)[2])
    if wrong:
        names = ", ".join("no ZeRO" if z == 0 else f"ZeRO {z}" for z in wrong)
        w.loss("loss_scale.skip_nonfinite", want, f"DeepSpeed {version} {'does not skip' if want else 'skips'} "
               f"non-finite {mode} steps under {names} (--deepspeed-version; zero_optimization.stage decides)")


def _ds_native(w: _Writer, p: Policy, version: str, stage: int | None = None) -> dict[str, Any]:
    compute = p.compute_dtype
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, compute)
    out: dict[str, Any] = {}
    if compute == "float32":
        out = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
        if p.param_dtype != "float32":
            w.loss("param_dtype", p.param_dtype, "DeepSpeed keeps float32 parameters when neither fp16 nor bf16 "
                   "is enabled")
        if p.output_dtype != "float32":
            w.loss("output_dtype", p.output_dtype, "DeepSpeed does not cast outputs: a float32 model returns float32")
        if view["mode"] != "none":
            w.loss("loss_scale.mode", ls.mode, "DeepSpeed scales the loss only in its fp16 mode")
        _skip_loss(w, "fp32", bool(view["skip_nonfinite"]), version, stage, None)
        default_reduce = "float32"
    elif compute == "float16":
        section: dict[str, Any] = {"enabled": True}
        _ds_fp16_scale(w, ls, view, section, version, stage)
        if stage == 0 and view["mode"] == "dynamic" and ls.hysteresis != 1:
            w.loss("loss_scale.hysteresis", ls.hysteresis, "FP16_Optimizer (no ZeRO) has no hysteresis")
        elif stage is None and view["mode"] == "dynamic" and ls.hysteresis != 1:
            # a config without zero_optimization runs at stage 0, where hysteresis is ignored without a word
            w.loss("loss_scale.hysteresis", ls.hysteresis, "honoured only under ZeRO (zero_optimization.stage >= 1), "
                   "and no stage was given, so none is written: DeepSpeed's default stage 0 (FP16_Optimizer) has "
                   "no hysteresis; give the stage (stage=, --zero-stage) or merge into a config with ZeRO")
        if stage == 0 and view["mode"] == "dynamic" and ls.min_scale is not None and ls.on_min_scale != "clamp":
            w.loss("loss_scale.on_min_scale", ls.on_min_scale, "FP16_Optimizer (no ZeRO) clamps at min_loss_scale")
        if p.param_dtype == "float16":
            section["fp16_master_weights_and_grads"] = True
            w.note("fp16_master_weights_and_grads keeps float16 master weights; DeepSpeed allows it only with "
                   "DeepSpeedCPUAdam (ZeRO-Offload)")
        elif p.param_dtype != "float32":
            w.loss("param_dtype", p.param_dtype, "DeepSpeed's fp16 mode keeps float32 or float16 master weights")
        if p.output_dtype != "float16":
            w.loss("output_dtype", p.output_dtype, "DeepSpeed's fp16 mode runs the whole module in float16, so its "
                   "outputs are float16; cast them yourself")
        out["fp16"] = section
        default_reduce = "float16"
    else:
        section = {"enabled": True}
        if p.param_dtype == "bfloat16":
            section["bf16_master_weights_and_grads"] = True
        elif p.param_dtype != "float32":
            w.loss("param_dtype", p.param_dtype, "DeepSpeed's bf16 mode keeps float32 or bfloat16 master weights")
        if p.output_dtype != "bfloat16":
            w.loss("output_dtype", p.output_dtype, "DeepSpeed's bf16 mode runs the whole module in bfloat16, so its "
                   "outputs are bfloat16; cast them yourself")
        if view["mode"] != "none":
            w.loss("loss_scale.mode", ls.mode, "DeepSpeed's bf16 mode has no loss scaling")
        section["check_grad_overflow"] = bool(view["skip_nonfinite"])
        _skip_loss(w, "bf16", bool(view["skip_nonfinite"]), version, stage, bool(view["skip_nonfinite"]))
        if _rel.parse(version) < _rel.parse("0.19.2"):
            w.note(f"bf16.check_grad_overflow is not a key of DeepSpeed {version}'s config (checked: 0.17.0 has "
                   "none, 0.19.2 has it); drop it there")
        out["bf16"] = section
        default_reduce = "bfloat16"
    if p.reduce_dtype != default_reduce:
        out["communication_data_type"] = _SHORT[p.reduce_dtype]
    return out


def _ds_fp16_scale(w: _Writer, ls: LossScaleConfig, view: Mapping[str, Any], section: dict, version: str,
                   stage: int | None = None) -> None:
    if view["mode"] in ("none", "static"):
        section["loss_scale"] = _int_if_integral(f32(ls.initial_scale) if view["mode"] == "static" else 1.0)
        if view["mode"] == "none":
            w.note("loss_scale.mode = none written as DeepSpeed's static scale 1 (the same numerics)")
        if not ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", False, "DeepSpeed's fp16 mode always skips a step with "
                   "non-finite gradients")
        return
    section["loss_scale"] = 0
    power = _power_of_two(f32(ls.initial_scale))
    if power is None or not -126 <= power <= 127:
        power = max(-126, min(127, round(math.log2(ls.initial_scale))))
        while ls.min_scale is not None and math.ldexp(1.0, power) < ls.min_scale:
            power += 1
        w.loss("loss_scale.initial_scale", ls.initial_scale, "DeepSpeed starts at 2**initial_scale_power; "
               f"written as the nearest power of two at or above min_scale, 2**{power}")
    section["initial_scale_power"] = power
    section["loss_scale_window"] = ls.growth_interval
    section["hysteresis"] = ls.hysteresis
    section["consecutive_hysteresis"] = ls.consecutive_hysteresis
    if ls.min_scale is None:
        floor = min(1, _int_if_integral(math.ldexp(1.0, power)))
        if floor != 1:
            section["min_loss_scale"] = floor
        w.loss("loss_scale.min_scale", None, f"DeepSpeed always has a floor: min_loss_scale = {floor}"
               + (" (its default)" if floor == 1 else " (the initial scale, below DeepSpeed's default of 1)"))
    else:
        section["min_loss_scale"] = _int_if_integral(ls.min_scale)
        if ls.on_min_scale != "error":
            w.loss("loss_scale.on_min_scale", ls.on_min_scale, "DeepSpeed's ZeRO loss scaler raises when an "
                   "overflow hits min_loss_scale (on_min_scale='error'); without ZeRO it clamps")
    floor = section.get("min_loss_scale", 1)
    if not float(floor).is_integer() and _rel.parse(version) >= _rel.parse("0.19.8"):
        section["min_loss_scale"] = max(1, math.ceil(floor))
        w.loss("loss_scale.min_scale", ls.min_scale, f"DeepSpeed {version}'s config model takes an integer "
               f"min_loss_scale (a fraction is refused): written as {section['min_loss_scale']}")
    elif not float(floor).is_integer():
        w.note("DeepSpeed's config model (deepspeedai/DeepSpeed precision_config.py) declares min_loss_scale an "
               "int; a fractional floor needs an older release")
    for key, expected, text in (("growth_factor", 2.0, "x2"), ("backoff_factor", 0.5, "x0.5")):
        if f32(getattr(ls, key)) != expected:
            w.loss(f"loss_scale.{key}", getattr(ls, key), f"DeepSpeed's scale_factor is fixed: {text}")
    if ls.max_scale is not None:
        w.loss("loss_scale.max_scale", ls.max_scale, "DeepSpeed's loss scale has no ceiling")
    if not ls.skip_nonfinite:
        w.loss("loss_scale.skip_nonfinite", False, "DeepSpeed always skips a step with non-finite gradients")
    _ds_growth_timing(w, ls, view, version, stage)
    w.note("the fp16 loss-scale settings are those of ZeRO's DynamicLossScaler (zero_optimization.stage >= 1); "
           + _FP16_OPT_NOTE)


def _ds_growth_timing(w: _Writer, ls: LossScaleConfig, view: Mapping[str, Any], version: str,
                      stage: int | None) -> None:
    """DeepSpeed's first growth comes after window + 1 finite steps (0.17.1+, and FP16_Optimizer
    always), else after window: exact when first_growth_interval says the same, a loss otherwise."""
    window = ls.growth_interval
    late = stage == 0 or _rel.grows_late(version)
    want = window + 1 if late else window
    have = view.get("first_growth_interval", window)
    w.realised.add("first_growth_interval")
    if have != want:
        who = "FP16_Optimizer (no ZeRO)" if stage == 0 else f"DeepSpeed {version}'s DynamicLossScaler"
        w.loss("loss_scale.first_growth_interval", have, f"{who} grows first after loss_scale_window"
               f"{' + 1' if late else ''} = {want} finite steps (at the start and after each overflow); the scales "
               f"part at the first growth")
    if late:
        w.note(_GROWTH_NOTE)


def _ds_autocast_out(w: _Writer, p: Policy) -> dict[str, Any]:
    compute = p.compute_dtype
    section: dict[str, Any] = {"enabled": True, "dtype": compute}
    if p.param_dtype != "float32":
        w.loss("param_dtype", p.param_dtype, "DeepSpeed's torch_autocast keeps float32 parameters")
    if p.output_dtype != compute:
        w.loss("output_dtype", p.output_dtype, "DeepSpeed does not cast outputs under torch_autocast: they come "
               "out in the dtype of the model's last op")
    if p.reduce_dtype == "float32":
        section["lower_precision_safe_modules"] = []
    else:
        w.loss("reduce_dtype", p.reduce_dtype, "DeepSpeed's torch_autocast reduces in the autocast dtype only the "
               "gradients of lower_precision_safe_modules (Linear and Conv by default), the rest in float32")
    view = loss_scale_view(p.loss_scale, compute)
    if compute == "bfloat16":
        expected = {"mode": "none", "skip_nonfinite": False}
        reason = "DeepSpeed's bfloat16 torch_autocast neither scales the loss nor skips steps"
    else:
        expected = loss_scale_view(LossScaleConfig(mode="dynamic"), compute)
        reason = "DeepSpeed's float16 torch_autocast uses torch.amp.GradScaler() with its defaults"
    for key in dict.fromkeys(list(view) + list(expected)):
        if view.get(key) != expected.get(key):
            w.loss(f"loss_scale.{key}", view.get(key), f"{reason} ({key} = {expected.get(key)!r})")
    return {"torch_autocast": section}


def _load_config_file(path: str | os.PathLike[str], **options: Any) -> Conversion:
    """A DeepSpeed config file -> Policy, as ``load(path, format="deepspeed", **options)`` reads it
    (Accelerate's ``deepspeed_config_file`` is read with it)."""
    p = Path(path)
    text = _read_file(p)
    data, locate, kind = _parse_recipe(text, p.suffix, str(p))
    if kind == "toml":
        raise PolicyError([Problem("a TOML file is an ampbridge policy, not deepspeed settings", file=str(p))])
    return from_deepspeed(data, source=str(p), _locate=locate, **options)
