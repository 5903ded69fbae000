"""Porting recipes: read other tools' AMP settings into a Policy, and write a Policy back out.

Each format has a ``from_X`` (its settings -> :class:`~ampbridge.Policy`, or a
:class:`~ampbridge.LossScaleConfig` for the loss-scale-only formats) and a ``to_X`` (policy ->
the tool's own settings as plain data). Every one returns a :class:`Conversion`: the ``result``
plus ``losses``, each setting the target cannot express, by name and with the reason, so a
conversion never drops a setting silently. ``notes`` record mappings that are exact but not
obvious (Flax's growth interval is one step longer than ampbridge's) and values filled in
because the source says nothing.

==============  ===========================================  =====================================
format          read                                         write
==============  ===========================================  =====================================
deepspeed       ``from_deepspeed(config_dict)``               ``to_deepspeed(policy)`` -> dict
accelerate      ``from_accelerate(config_dict)``              ``to_accelerate(policy)`` -> dict
lightning       ``from_lightning("bf16-mixed")``              ``to_lightning(policy)`` -> dict
keras           ``from_keras("mixed_float16")``               ``to_keras(policy)`` -> dict
jmp             ``from_jmp("p=f32,c=bf16,o=f32")``            ``to_jmp(policy)`` -> str
grad-scaler     ``from_grad_scaler(state_dict_or_kwargs)``    ``to_grad_scaler(policy)`` -> dict
flax            ``from_flax(dynamic_scale_kwargs)``           ``to_flax(policy)`` -> dict | None
fsdp            (write only)                                 ``to_fsdp(policy, plan=None)`` -> dict
==============  ===========================================  =====================================

``load(path)`` / ``loads(text)`` read a file or text and detect its format; ``convert`` goes
from any readable format to any writable one; ``disagreements`` compares a policy with another
tool's settings (what ``ampbridge check`` prints). This module is framework-free: it reads and
writes plain dicts, JSON, YAML and strings.

Example:
    >>> from ampbridge import recipes
    >>> c = recipes.from_lightning("bf16-mixed")
    >>> c.result.compute_dtype, c.result.param_dtype, c.losses
    ('bfloat16', 'float32', ())
    >>> recipes.to_lightning(c.result).result
    {'precision': 'bf16-mixed', 'grad_scaler': None}
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core.dtypes import canonical_dtype
from .core.loss_scale import LossScaleState, f32
from .core.matching import did_you_mean
from .core.fields import FLOAT32_MAX, Collector, key_text
from .core.policy import LossScaleConfig, Policy, Rule
from .errors import PolicyError, Problem, UnsupportedOptionError

__all__ = [
    "Loss",
    "Conversion",
    "Disagreement",
    "READ_FORMATS",
    "WRITE_FORMATS",
    "from_deepspeed",
    "to_deepspeed",
    "from_accelerate",
    "to_accelerate",
    "from_lightning",
    "to_lightning",
    "from_keras",
    "from_keras_loss_scale_optimizer",
    "to_keras",
    "from_jmp",
    "to_jmp",
    "from_grad_scaler",
    "to_grad_scaler",
    "from_flax",
    "to_flax",
    "to_fsdp",
    "detect",
    "load",
    "loads",
    "read",
    "write",
    "disagreements",
    "differences",
    "loss_scale_view",
]

READ_FORMATS = ("ampbridge", "deepspeed", "accelerate", "lightning", "keras", "jmp", "grad-scaler", "flax")
WRITE_FORMATS = ("ampbridge", "deepspeed", "accelerate", "lightning", "keras", "jmp", "grad-scaler", "flax",
                 "fsdp")

#: the releases whose DynamicLossScaler growth test differs (see ``from_deepspeed``)
DEEPSPEED_RELEASES = ("modulo", "stable_interval")
_MODULO = "microsoft/DeepSpeed 0336518 and earlier (growth test (cur_iter - last_overflow_iter) % window == 0)"
_STABLE = ("deepspeedai/DeepSpeed 18fd4c9 and later (growth test stable_interval = cur_iter - last_overflow_iter - 1; "
           "stable_interval > 0 and stable_interval % window == 0)")

_TINY32 = math.ldexp(1.0, -126)  # float32's smallest normal number (Flax's default minimum_scale)


# --- results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Loss:
    """One setting the target cannot express: its name, its value, and why.

    Example:
        >>> str(Loss("loss_scale.max_scale", 1024.0, "DeepSpeed has no ceiling"))
        'loss_scale.max_scale = 1024.0: DeepSpeed has no ceiling'
    """

    setting: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.setting} = {self.value!r}: {self.reason}"


@dataclass(frozen=True)
class Conversion:
    """The outcome of a conversion: ``result`` plus every ``Loss`` (``exact`` when there is none).

    ``notes`` explain exact-but-surprising mappings and values filled in because the source says
    nothing. ``state`` is the loss-scale state a source carries (a GradScaler state dict, a Flax
    DynamicScale's ``fin_steps``/``scale``). ``covers`` names the policy fields the source
    decides (``check`` compares only those); ``origins`` maps a policy field to the source key
    it came from. ``policy, losses = conversion`` unpacks.
    """

    result: Any
    losses: tuple[Loss, ...] = ()
    notes: tuple[str, ...] = ()
    source_format: str = ""
    target_format: str = ""
    state: LossScaleState | None = None
    covers: frozenset[str] = frozenset()
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return not self.losses

    def __iter__(self) -> Iterator[Any]:
        return iter((self.result, self.losses))


@dataclass(frozen=True)
class Disagreement:
    """One field where a policy and another tool's settings differ (``ampbridge check``)."""

    field: str
    policy_value: Any
    other_value: Any
    other_setting: str | None = None
    hint: str | None = None

    def __str__(self) -> str:
        where = f" ({self.other_setting})" if self.other_setting else ""
        text = f"{self.field}: policy {_show(self.policy_value)}, other {_show(self.other_value)}{where}"
        return text + (f"; {self.hint}" if self.hint else "")


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(_show(x) for x in v) + "]" if v else "none"
    if isinstance(v, Rule):
        return json.dumps(v.to_dict())
    return repr(v) if isinstance(v, str) else str(v)


# --- reading helpers ----------------------------------------------------------------------------

_MISSING: Any = dataclasses.MISSING

POLICY_FIELDS = ("compute_dtype", "param_dtype", "output_dtype", "reduce_dtype", "matmul_precision",
                 "keep_float32", "overrides", "loss_scale", "phases")
_ALL_BUT_MATMUL = frozenset(POLICY_FIELDS) - {"matmul_precision", "phases"}


class _Reader:
    """Collects problems (with file and line), losses, notes and origins while a source is read."""

    def __init__(self, fmt: str, source: str | None = None,
                 locate: Callable[[tuple], int | None] | None = None, prefix: tuple = ()):
        self.fmt, self.source, self.prefix = fmt, source, prefix
        self._line = locate or (lambda path: None)
        self.out = Collector(lambda path: (source, self._line(tuple(path))))
        self.losses: list[Loss] = []
        self.notes: list[str] = []
        self.origins: dict[str, str] = {}

    def problem(self, path: tuple, message: str, *, value: Any = _MISSING, accepted: str | None = None,
                hint: str | None = None) -> None:
        self.out.add(self.prefix + tuple(path), message, value=value, accepted=accepted, hint=hint)

    def loss(self, setting: str, value: Any, reason: str) -> None:
        item = Loss(setting, value, reason)
        if item not in self.losses:
            self.losses.append(item)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def check_keys(self, section: Mapping[str, Any], accepted: Sequence[str], path: tuple, what: str) -> None:
        for key in section:
            if key not in accepted:
                hint = did_you_mean(str(key), tuple(accepted))
                self.problem(path + (key,), f"unknown key in {what}" + (f"; {hint}" if hint else ""),
                             accepted=", ".join(accepted))

    def section(self, data: Mapping[str, Any], key: str, path: tuple = ()) -> dict[str, Any] | None:
        if key not in data or data[key] is None:
            return None
        v = data[key]
        if not isinstance(v, Mapping):
            self.problem(path + (key,), "must be a table/object", value=v, accepted="a mapping of settings")
            return None
        return dict(v)

    def raise_if_any(self) -> None:
        if self.out.problems:
            raise PolicyError(self.out.problems)

    def done(self, result: Any, covers: Iterable[str], state: LossScaleState | None = None) -> Conversion:
        self.raise_if_any()
        return Conversion(result, tuple(self.losses), tuple(self.notes), self.fmt, "ampbridge", state,
                          frozenset(covers), dict(self.origins))


def _type_name(v: Any) -> str:
    return type(v).__name__


def _get_bool(r: _Reader, d: Mapping, key: str, path: tuple, default: Any, *, allow_auto: bool = False,
              strings: bool = False) -> Any:
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, bool):
        return v
    if allow_auto and v == "auto":
        return "auto"
    if strings and isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    r.problem(path + (key,), "must be a boolean", value=v,
              accepted="true | false" + (" | \"auto\"" if allow_auto else ""))
    return default


def _get_int(r: _Reader, d: Mapping, key: str, path: tuple, default: Any, *, low: int | None = None,
             what: str = "an integer") -> Any:
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or (low is not None and v < low):
        r.problem(path + (key,), "must be " + what, value=d[key], accepted=what)
        return default
    return v


def _get_number(r: _Reader, d: Mapping, key: str, path: tuple, default: Any, *, positive: bool = True,
                what: str = "a number > 0") -> Any:
    if key not in d:
        return default
    v = d[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0):
        r.problem(path + (key,), "must be " + what, value=v, accepted=what)
        return default
    return float(v)


def _construct(r: _Reader, make: Callable[[], Any]) -> Any:
    """Build a Policy/LossScaleConfig, pointing its problems at the source keys they came from."""
    r.raise_if_any()
    try:
        return make()
    except PolicyError as e:
        problems = []
        for p in e.problems:
            origin = r.origins.get(p.key or "", None)
            message = p.message + (f" (ampbridge {p.key})" if origin and p.key else "")
            problems.append(dataclasses.replace(p, key=origin or p.key, file=r.source, message=message))
        raise PolicyError(problems) from None


def _dtype_name(v: Any) -> str | None:
    """A dtype spelling (torch.float16, fp16, bfloat, half ...) -> canonical name, or None."""
    if not isinstance(v, str):
        return None
    key = v.strip().lower()
    for prefix in ("torch.", "jnp.", "np.", "tf."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    key = {"bfloat": "bfloat16", "bfp16": "bfloat16", "float": "float32"}.get(key, key)
    try:
        return canonical_dtype(key)
    except ValueError:
        return None


_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


# --- comparing policies -------------------------------------------------------------------------

def loss_scale_view(cfg: LossScaleConfig, compute_dtype: str) -> dict[str, Any]:
    """The loss-scale settings that change the trajectory, resolved and as float32 values.

    Two configs with equal views give the same scale trajectory and skip the same steps (a
    static scale of 1 is mode ``none``; ``consecutive_hysteresis`` only matters with
    ``hysteresis > 1``; ``on_min_scale`` only with a ``min_scale``).

    Example:
        >>> loss_scale_view(LossScaleConfig(), "bfloat16")
        {'mode': 'none', 'skip_nonfinite': True}
    """
    r = cfg.resolve(compute_dtype if compute_dtype != "auto" else "float32")
    mode = r.mode
    if mode == "static" and f32(r.initial_scale) == 1.0:
        mode = "none"
    view: dict[str, Any] = {"mode": mode, "skip_nonfinite": r.skip_nonfinite}
    if mode == "static":
        view["initial_scale"] = f32(r.initial_scale)
    if mode == "dynamic":
        view.update(initial_scale=f32(r.initial_scale), growth_factor=f32(r.growth_factor),
                    backoff_factor=f32(r.backoff_factor), growth_interval=r.growth_interval,
                    hysteresis=r.hysteresis,
                    min_scale=None if r.min_scale is None else f32(r.min_scale),
                    max_scale=None if r.max_scale is None else f32(r.max_scale))
        if r.hysteresis > 1:
            view["consecutive_hysteresis"] = r.consecutive_hysteresis
        if r.min_scale is not None:
            view["on_min_scale"] = r.on_min_scale
    return view


def differences(a: Policy, b: Policy, fields: Iterable[str] = POLICY_FIELDS) -> list[tuple[str, Any, Any]]:
    """``(field, a's value, b's value)`` for every field (among ``fields``) where two policies differ.

    Loss-scale settings compare through :func:`loss_scale_view` (``loss_scale.<key>``).

    Example:
        >>> import ampbridge
        >>> for d in differences(ampbridge.preset("mixed_float16"), ampbridge.preset("float16")): print(d)
        ('param_dtype', 'float32', 'float16')
        ('output_dtype', 'float32', 'float16')
        ('reduce_dtype', 'float32', 'float16')
    """
    out: list[tuple[str, Any, Any]] = []
    for name in fields:
        if name == "loss_scale":
            va = loss_scale_view(a.loss_scale, a.compute_dtype)
            vb = loss_scale_view(b.loss_scale, b.compute_dtype)
            if va["mode"] != vb["mode"]:
                out.append(("loss_scale.mode", va["mode"], vb["mode"]))
                if va["skip_nonfinite"] != vb["skip_nonfinite"]:
                    out.append(("loss_scale.skip_nonfinite", va["skip_nonfinite"], vb["skip_nonfinite"]))
                continue
            for key in dict.fromkeys(list(va) + list(vb)):
                # settings that only act through another one are not differences of their own
                if key == "on_min_scale" and va.get("min_scale") != vb.get("min_scale"):
                    continue
                if key == "consecutive_hysteresis" and va.get("hysteresis") != vb.get("hysteresis"):
                    continue
                if va.get(key) != vb.get(key):
                    out.append((f"loss_scale.{key}", va.get(key), vb.get(key)))
        elif name == "phases":
            if a.phases != b.phases:
                out.append(("phase", len(a.phases), len(b.phases)))
        elif getattr(a, name) != getattr(b, name):
            out.append((name, getattr(a, name), getattr(b, name)))
    return out


# --- writing helpers ----------------------------------------------------------------------------

class _Writer:
    """Collects the losses and notes of one export."""

    def __init__(self, fmt: str, policy: Policy):
        self.fmt, self.policy = fmt, policy
        self.losses: list[Loss] = []
        self.notes: list[str] = []

    def loss(self, setting: str, value: Any, reason: str) -> None:
        item = Loss(setting, value, reason)
        if item not in self.losses:
            self.losses.append(item)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def done(self, result: Any) -> Conversion:
        return Conversion(result, tuple(self.losses), tuple(self.notes), "ampbridge", self.fmt)

    # the settings most targets cannot hold at all
    def common(self, tool: str, *, pins: bool = False, matmul: bool = False, pins_reason: str = "") -> None:
        p = self.policy
        if p.phases:
            self.loss("phase", len(p.phases), f"{tool} holds one fixed setting, not a precision schedule; "
                      "the top-level settings were written (export a phase with policy.at(epoch=N))")
        if not matmul and p.matmul_precision != "highest":
            self.loss("matmul_precision", p.matmul_precision, f"{tool} has no float32-matmul setting; set "
                      "torch.set_float32_matmul_precision (or your framework's equivalent) yourself")
        if not pins:
            reason = pins_reason or f"{tool} applies one dtype to the whole model; it cannot pin layers"
            if p.keep_float32:
                self.loss("keep_float32", list(p.keep_float32), reason)
            if p.overrides:
                self.loss("override", [r.to_dict() for r in p.overrides], reason)


def _policy_of(obj: Policy | LossScaleConfig, what: str) -> Policy:
    if isinstance(obj, Policy):
        return obj
    if isinstance(obj, LossScaleConfig):
        if obj.mode == "auto":
            raise PolicyError([Problem("loss_scale.mode is 'auto', which needs the compute dtype to resolve",
                                       key="loss_scale.mode", value="auto",
                                       hint=f"pass a Policy to {what}, or config.resolve('float16')")])
        return Policy(compute_dtype="float16", loss_scale=obj)
    raise TypeError(f"{what} takes a Policy or a LossScaleConfig, got {_type_name(obj)}")


def _require_concrete(policy: Policy, tool: str) -> None:
    if policy.compute_dtype == "auto":
        raise UnsupportedOptionError(
            f"compute_dtype='auto' cannot be written for {tool}: 'auto' is resolved on a device, and a recipe "
            "needs a concrete dtype. Resolve it for the device the recipe targets first (ampbridge.diagnostics.hardware."
            "resolve_auto(policy, Device('cuda', capability=(8, 0))) picks bfloat16), or write "
            "policy.replace(compute_dtype='bfloat16') (or 'float16', 'float32').")


def _power_of_two(x: float) -> int | None:
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def _int_if_integral(x: float) -> float | int:
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else x


def _grad_scaler_losses(w: _Writer, ls: LossScaleConfig, tool: str, prefix: str = "loss_scale.") -> None:
    """Losses of a dynamic config written as torch GradScaler arguments (hysteresis 1, no floor)."""
    if ls.hysteresis > 1:
        w.loss(prefix + "hysteresis", ls.hysteresis, f"{tool} backs off on every overflow (no hysteresis)")
    if ls.min_scale is not None:
        w.loss(prefix + "min_scale", ls.min_scale, f"{tool} has no floor: the scale halves below it")
    if ls.max_scale is not None:
        w.loss(prefix + "max_scale", ls.max_scale, f"{tool} has no ceiling below float32's range")
    if not ls.skip_nonfinite:
        w.loss(prefix + "skip_nonfinite", False, f"{tool} always skips a step whose gradients are not finite")


# --- trainer precision (what fills DeepSpeed's "auto") --------------------------------------------

def _trainer_dtype(value: Any, what: str = "auto") -> str:
    """'fp16' / 'bf16' / 'no' / '16-mixed' / 'float16' ... -> the compute dtype the trainer uses."""
    text = str(value).strip().lower() if value is not None and not isinstance(value, bool) else None
    table = {"no": "float32", "fp32": "float32", "32": "float32", "32-true": "float32", "16-mixed": "float16",
             "16": "float16", "bf16-mixed": "bfloat16", "bf16": "bfloat16", "fp16": "float16"}
    if value is False:
        text = "no"
    if text in table:
        return table[text]
    name = _dtype_name(text) if text else None
    if name is None:
        raise ValueError(f"{what}={value!r}: not a trainer precision; accepted: fp16, bf16, no (or float16, "
                         "bfloat16, float32, or a Lightning precision such as '16-mixed')")
    return name


# --- DeepSpeed ----------------------------------------------------------------------------------

_DS_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads", "fused_mode")
_DS_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                 "bf16_optimizer_states")
_DS_AUTOCAST_KEYS = ("enabled", "dtype", "lower_precision_safe_modules")
_APEX_KEYS = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
              "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale",
              "max_loss_scale")
#: the top-level DeepSpeed keys ampbridge reads (a near-miss of one of these is reported as a typo)
_DS_READ = ("fp16", "bf16", "bfloat16", "torch_autocast", "amp", "communication_data_type", "data_types",
            "zero_optimization")
_DS_OTHER_KNOWN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
                   "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp32_allreduce",
                   "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                   "comms_logger", "checkpoint", "aio", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                   "dump_state", "memory_breakdown", "elasticity", "compression_training", "data_efficiency",
                   "pipeline", "autotuning", "sparse_attention", "eigenvalue", "progressive_layer_drop",
                   "curriculum_learning", "seq_parallel_communication_data_type", "graph_harvesting",
                   "dataloader_drop_last", "nebula", "hybrid_engine", "compile", "use_data_before_expert_parallelism",
                   "timers", "weight_quantization", "tensor_parallel", "disable_allgather")
_AUTO_FILLED = ("the Hugging Face Trainer (and Accelerate) fill in only fp16.enabled, bf16.enabled, amp.enabled and "
                "amp.opt_level")
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


def from_deepspeed(config: Mapping[str, Any], *, auto: Any = None, release: str = "stable_interval",
                   source: str | None = None, _locate: Callable[[tuple], int | None] | None = None) -> Conversion:
    """A DeepSpeed config (the parsed JSON) -> Policy, reading ``fp16``, ``bf16``, ``torch_autocast``, ``amp``.

    - ``fp16``: ``loss_scale`` 0 is dynamic (``initial_scale_power`` default 16,
      ``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1, growth x2 / backoff x0.5,
      ``on_min_scale = "error"``: ZeRO's ``DynamicLossScaler`` raises at the minimum); > 0 is a
      static scale. Parameters are float32 master weights, the module (and its outputs) float16.
    - ``bf16``: no loss scaling; ``check_grad_overflow`` is ``skip_nonfinite``.
    - ``torch_autocast``: ``torch.autocast`` over float32 parameters (float16 adds torch's
      GradScaler defaults); ``amp``: apex's ``opt_level`` O0-O3 and its overrides.
    - ``"auto"`` values are what the Hugging Face Trainer / Accelerate fill in at launch from their
      own precision flag: pass that flag as ``auto`` ("fp16", "bf16", "no", or a Lightning string).
      Without it, an ``"auto"`` ``enabled`` reads as false and is reported as a loss.
    - ``release``: the growth timing of DeepSpeed's ``DynamicLossScaler`` changed. ampbridge's
      reference matches ``"modulo"`` (microsoft/DeepSpeed 0336518 and earlier) exactly;
      ``"stable_interval"`` (deepspeedai/DeepSpeed 18fd4c9 and later, the default) grows one step
      later after each overflow, which is reported as a loss.

    Example:
        >>> c = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 2}, "zero_optimization": {"stage": 2}},
        ...                    release="modulo")
        >>> ls = c.result.loss_scale
        >>> c.result.compute_dtype, ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.on_min_scale, c.exact
        ('float16', 65536.0, 1000, 2, 'error', True)
    """
    r = _Reader("deepspeed", source, _locate)
    if release not in DEEPSPEED_RELEASES:
        raise ValueError(f"release={release!r}; accepted: {', '.join(DEEPSPEED_RELEASES)}")
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("a DeepSpeed config must be a JSON object", file=source, value=config)])
    trainer = _trainer_dtype(auto) if auto is not None else None
    for key in config:
        if key not in _DS_READ and key not in _DS_OTHER_KNOWN:
            close = difflib.get_close_matches(str(key), _DS_READ, n=1, cutoff=0.75)
            if close:
                r.problem((key,), f"not a DeepSpeed key, and DeepSpeed ignores it silently; did you mean "
                          f"{close[0]!r}?", accepted=", ".join(_DS_READ))

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

    comm = config.get("communication_data_type")
    comm_dtype = None
    if comm is not None:
        if isinstance(comm, str) and comm.lower() in ("fp32", "fp16", "bf16", "bfp16"):
            comm_dtype = _dtype_name(comm)
        if comm_dtype is None:
            r.problem(("communication_data_type",), "not a DeepSpeed communication data type", value=comm,
                      accepted="fp32, fp16, bf16")
    data_types = r.section(config, "data_types") or {}
    r.check_keys(data_types, ("grad_accum_dtype",), ("data_types",), "DeepSpeed's data_types section")
    if data_types.get("grad_accum_dtype") is not None:
        r.loss("data_types.grad_accum_dtype", data_types["grad_accum_dtype"],
               "ampbridge has no gradient-accumulation dtype (gradients accumulate in the parameter dtype)")

    fields: dict[str, Any] = {}
    ls: dict[str, Any] = {}
    if mode == "fp16":
        fields, ls = _ds_fp16(r, fp16, stage, release)
    elif mode == "bf16":
        fields, ls = _ds_bf16(r, bf16, bf16_path)
    elif mode == "torch_autocast":
        fields, ls = _ds_autocast(r, autocast, stage)
    elif mode == "amp":
        fields, ls = _apex(r, amp, ("amp",))
        if stage:
            r.loss("zero_optimization.stage", stage, "DeepSpeed does not run apex amp with ZeRO")
    else:
        fields = {"compute_dtype": "float32", "param_dtype": "float32", "output_dtype": "float32"}
        ls = {"mode": "none", "skip_nonfinite": False}
        r.origins["compute_dtype"] = "fp16.enabled"
        _origins_all_loss_scale(r, "fp16.enabled (float32: no loss scaling, no overflow check)")
    default_reduce = {"fp16": "float16", "bf16": "bfloat16"}.get(mode or "", "float32")
    fields["reduce_dtype"] = comm_dtype or default_reduce
    r.origins["reduce_dtype"] = "communication_data_type" + (
        "" if comm_dtype else f" (absent: {mode or 'fp32'}'s default)")
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


def _ds_fp16(r: _Reader, fp16: Mapping[str, Any], stage: int, release: str) -> tuple[dict, dict]:
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
    power = _get_int(r, fp16, "initial_scale_power", p, 16, what="an integer from -126 to 127")
    if not -126 <= power <= 127:
        r.problem(p + ("initial_scale_power",), "2**initial_scale_power must be a float32 number", value=power,
                  accepted="an integer from -126 to 127")
        power = 16
    window = _get_int(r, fp16, "loss_scale_window", p, 1000, low=1, what="an integer >= 1")
    hysteresis = _get_int(r, fp16, "hysteresis", p, 2, low=1, what="an integer >= 1")
    consecutive = _get_bool(r, fp16, "consecutive_hysteresis", p, False)
    min_scale = _get_number(r, fp16, "min_loss_scale", p, 1.0)
    r.origins.update({"loss_scale.initial_scale": "fp16.initial_scale_power",
                      "loss_scale.growth_interval": "fp16.loss_scale_window",
                      "loss_scale.hysteresis": "fp16.hysteresis",
                      "loss_scale.consecutive_hysteresis": "fp16.consecutive_hysteresis",
                      "loss_scale.min_scale": "fp16.min_loss_scale"})
    on_min = "error"
    if stage == 0:
        on_min = "clamp"
        r.loss("zero_optimization.stage", 0,
               "without ZeRO, DeepSpeed scales the loss in FP16_Optimizer, whose growth test is stable_interval "
               "in every release (its first growth after an overflow comes window + 1 finite steps later, "
               "ampbridge's after window), which clamps at min_loss_scale instead of raising (read as "
               "on_min_scale='clamp'), and which ignores hysteresis in older releases (microsoft/DeepSpeed 023f361)")
    elif release == "stable_interval":
        r.loss("fp16.loss_scale_window", window,
               f"DeepSpeed's DynamicLossScaler in {_STABLE} grows one step later after every overflow (and at "
               f"the start): its first growth comes after window + 1 finite steps, later ones every window. "
               f"ampbridge grows after every window finite steps, as {_MODULO} does; pass release='modulo' "
               "(ampbridge convert --deepspeed-release modulo) if you run that release")
    r.note("DeepSpeed keeps its loss scale in a Python float, which may grow past float32's range; ampbridge's "
           "scale stops growing at float32's largest power of two. The two differ only once the scale passes "
           "2**127, which needs every gradient below 2**-111 for over a hundred growth windows")
    return fields, {"mode": "dynamic", "initial_scale": math.ldexp(1.0, power), "growth_factor": 2.0,
                    "backoff_factor": 0.5, "growth_interval": window, "hysteresis": hysteresis,
                    "consecutive_hysteresis": consecutive, "min_scale": min_scale, "on_min_scale": on_min,
                    "skip_nonfinite": True}


def _ds_bf16(r: _Reader, bf16: Mapping[str, Any], p: tuple) -> tuple[dict, dict]:
    master16 = _get_bool(r, bf16, "bf16_master_weights_and_grads", p, False)
    if "immediate_grad_update" in bf16:
        r.loss(f"{p[0]}.immediate_grad_update", bf16["immediate_grad_update"],
               "when DeepSpeed's bf16 optimizer folds each micro-batch's gradients into the float32 master "
               "gradients is not an ampbridge setting")
    if _get_bool(r, bf16, "bf16_optimizer_states", p, False):
        r.loss(f"{p[0]}.bf16_optimizer_states", True, "ampbridge has no optimizer-state dtype")
    skip = _get_bool(r, bf16, "check_grad_overflow", p, False)
    r.origins.update(keep_float32=f"{p[0]}.enabled (casts the whole module)",
                     overrides=f"{p[0]}.enabled (casts the whole module)",
                     **{"loss_scale.mode": f"{p[0]}.enabled (no loss scaling in bf16)"})
    r.origins.update(compute_dtype=f"{p[0]}.enabled", output_dtype=f"{p[0]}.enabled",
                     param_dtype=f"{p[0]}.bf16_master_weights_and_grads",
                     **{"loss_scale.skip_nonfinite": f"{p[0]}.check_grad_overflow"})
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


def _apex_dtype(r: _Reader, value: Any, path: tuple) -> str | None:
    if value is None:
        return None
    name = _dtype_name(value)
    if name not in ("float16", "float32"):
        r.problem(path, "not a dtype apex amp casts to", value=value, accepted='"torch.float16", "torch.float32"')
    return name


def _apex(r: _Reader, amp: Mapping[str, Any], p: tuple) -> tuple[dict, dict]:
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
    outputs = _apex_dtype(r, amp.get("cast_model_outputs"), p + ("cast_model_outputs",))
    num_losses = _get_int(r, amp, "num_losses", p, 1, low=1, what="an integer >= 1")
    if num_losses > 1:
        r.loss("amp.num_losses", num_losses, "apex keeps one loss scaler per loss; ampbridge has one scaler")
    if "verbosity" in amp:
        r.note("amp.verbosity only changes apex's logging")
    min_s = _get_number(r, amp, "min_loss_scale", p, None)
    max_s = _get_number(r, amp, "max_loss_scale", p, 2.0**24)
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


def to_deepspeed(policy: Policy, *, via: str = "native", release: str = "stable_interval") -> Conversion:
    """Policy -> the precision part of a DeepSpeed config (merge it into your ds_config.json).

    ``via``: ``"native"`` (DeepSpeed's own ``fp16``/``bf16`` modes, the default),
    ``"torch_autocast"`` (``torch.autocast`` over float32 parameters) or ``"amp"`` (apex).
    ``release`` as in :func:`from_deepspeed`: with ``"stable_interval"`` the growth timing is a loss.

    Example:
        >>> import ampbridge
        >>> c = to_deepspeed(ampbridge.preset("float16").replace(loss_scale=ampbridge.LossScaleConfig(
        ...     mode="dynamic", growth_interval=1000, hysteresis=2, min_scale=1.0, on_min_scale="error")),
        ...     release="modulo")
        >>> c.exact
        True
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
    if release not in DEEPSPEED_RELEASES:
        raise ValueError(f"release={release!r}; accepted: {', '.join(DEEPSPEED_RELEASES)}")
    _require_concrete(policy, "DeepSpeed")
    w = _Writer("deepspeed", policy)
    p = policy
    compute = p.compute_dtype
    if via == "native" or compute == "float32":
        if via != "native":
            w.note(f"float32 compute written as DeepSpeed's plain float32 mode (nothing for {via} to do)")
        w.common("DeepSpeed", pins_reason="DeepSpeed's fp16/bf16 modes cast the whole module; they cannot "
                 "keep layers in float32 (ampbridge's torch backend can)" if compute != "float32" else "")
        return w.done(_ds_native(w, p, release))
    if via == "torch_autocast":
        w.common("DeepSpeed", pins_reason="torch.autocast has per-op lists, not per-module pins")
        return w.done(_ds_autocast_out(w, p))
    w.common("DeepSpeed", pins=True)
    return w.done(_apex_out(w, p))


def _ds_native(w: _Writer, p: Policy, release: str) -> dict[str, Any]:
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
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, "DeepSpeed checks gradients for overflow only in its fp16 mode")
        default_reduce = "float32"
    elif compute == "float16":
        section: dict[str, Any] = {"enabled": True}
        _ds_fp16_scale(w, ls, view, section, release)
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
        if view["skip_nonfinite"]:
            section["check_grad_overflow"] = True
            w.note("bf16.check_grad_overflow (skip non-finite steps) exists in newer DeepSpeed releases "
                   "(deepspeedai/DeepSpeed); older ones reject the key and never skip a bf16 step")
        out["bf16"] = section
        default_reduce = "bfloat16"
    if p.reduce_dtype != default_reduce:
        out["communication_data_type"] = _SHORT[p.reduce_dtype]
    return out


def _ds_fp16_scale(w: _Writer, ls: LossScaleConfig, view: Mapping[str, Any], section: dict, release: str) -> None:
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
    if not float(section.get("min_loss_scale", 1)).is_integer():
        w.note("DeepSpeed's config model (deepspeedai/DeepSpeed precision_config.py) declares min_loss_scale an "
               "int; a fractional floor needs an older release")
    for key, expected, text in (("growth_factor", 2.0, "x2"), ("backoff_factor", 0.5, "x0.5")):
        if f32(getattr(ls, key)) != expected:
            w.loss(f"loss_scale.{key}", getattr(ls, key), f"DeepSpeed's scale_factor is fixed: {text}")
    if ls.max_scale is not None:
        w.loss("loss_scale.max_scale", ls.max_scale, "DeepSpeed's loss scale has no ceiling")
    if not ls.skip_nonfinite:
        w.loss("loss_scale.skip_nonfinite", False, "DeepSpeed always skips a step with non-finite gradients")
    if release == "stable_interval":
        w.loss("loss_scale.growth_interval", ls.growth_interval,
               f"DeepSpeed's DynamicLossScaler in {_STABLE} grows one step later after every overflow (and at the "
               f"start) than ampbridge, which matches {_MODULO}")
    w.note("the fp16 loss-scale settings are those of ZeRO's DynamicLossScaler (zero_optimization.stage >= 1); "
           "without ZeRO, FP16_Optimizer grows one step later after each overflow and clamps at min_loss_scale")


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


# --- torch GradScaler arguments (shared by Accelerate, Lightning, DeepSpeed autocast) -------------

_GRAD_SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
_GRAD_SCALER_STATE = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_GRAD_SCALER_DEFAULTS = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                         "growth_interval": 2000, "enabled": True}


def _read_grad_scaler_args(r: _Reader, kw: Mapping[str, Any], path: tuple, what: str) -> dict[str, Any]:
    """GradScaler(...) / GradScalerKwargs(...) arguments -> LossScaleConfig fields (checked as torch does)."""
    r.check_keys(kw, _GRAD_SCALER_ARGS, path, what)
    enabled = _get_bool(r, kw, "enabled", path, True)
    init = _get_number(r, kw, "init_scale", path, 65536.0)
    growth = _get_number(r, kw, "growth_factor", path, 2.0, what="a number > 1")
    backoff = _get_number(r, kw, "backoff_factor", path, 0.5, what="a number strictly between 0 and 1")
    interval = _get_int(r, kw, "growth_interval", path, 2000, low=1, what="an integer >= 1")
    if isinstance(growth, float) and growth <= 1.0:
        r.problem(path + ("growth_factor",), "torch requires growth_factor > 1", value=growth, accepted="a number > 1")
    if isinstance(backoff, float) and backoff >= 1.0:
        r.problem(path + ("backoff_factor",), "torch requires backoff_factor < 1", value=backoff,
                  accepted="a number strictly between 0 and 1")
    prefix = key_text(path) + "." if path else ""
    r.origins.update({"loss_scale.initial_scale": prefix + "init_scale",
                      "loss_scale.growth_factor": prefix + "growth_factor",
                      "loss_scale.backoff_factor": prefix + "backoff_factor",
                      "loss_scale.growth_interval": prefix + "growth_interval", "loss_scale.mode": prefix + "enabled"})
    if not enabled:
        # a disabled GradScaler passes the loss through and steps the optimizer unconditionally
        return {"mode": "none", "skip_nonfinite": False}
    return {"mode": "dynamic", "initial_scale": init, "growth_factor": growth, "backoff_factor": backoff,
            "growth_interval": interval, "skip_nonfinite": True}


def _origins_all_loss_scale(r: _Reader, origin: str) -> None:
    for key in ("mode", "initial_scale", "growth_factor", "backoff_factor", "growth_interval", "skip_nonfinite"):
        r.origins[f"loss_scale.{key}"] = origin


def _write_grad_scaler_args(w: _Writer, p: Policy, tool: str, *, defaults_as_none: bool = False) -> dict | None:
    """The loss-scale settings as torch GradScaler arguments (float32-rounded factors), with the losses."""
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    if view["mode"] == "none":
        if view["skip_nonfinite"]:
            w.loss("loss_scale.skip_nonfinite", True, f"{tool} without loss scaling steps on every batch; a "
                   "disabled GradScaler does not check gradients")
        return {"enabled": False}
    args: dict[str, Any] = {"init_scale": f32(ls.initial_scale), "growth_factor": f32(ls.growth_factor),
                            "backoff_factor": f32(ls.backoff_factor), "growth_interval": ls.growth_interval,
                            "enabled": True}
    for key in ("growth_factor", "backoff_factor"):
        if args[key] != getattr(ls, key):
            w.note(f"loss_scale.{key} = {getattr(ls, key)!r} written as its float32 value {args[key]!r}, the "
                   "factor ampbridge applies (torch multiplies a float32 scale by the double you give it)")
    if view["mode"] == "static":
        args.update(growth_factor=2.0, backoff_factor=0.5, growth_interval=2**31 - 1)
        w.loss("loss_scale.mode", "static", f"{tool}'s GradScaler has no static mode; written as a scaler that "
               "starts at initial_scale and never grows (growth_interval 2**31-1), but it still halves on overflow")
        if not ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", False, "torch GradScaler always skips a step with non-finite gradients")
        return args
    if args["growth_factor"] <= 1.0:
        args.update(growth_factor=2.0, growth_interval=2**31 - 1)
        w.loss("loss_scale.growth_factor", ls.growth_factor, "torch GradScaler requires growth_factor > 1; written "
               "as a scaler that never grows (growth_factor 2, growth_interval 2**31-1)")
        w.loss("loss_scale.growth_interval", ls.growth_interval, "written as 2**31-1 so that growth_factor 2 never "
               "applies (a growth factor of 1 cannot be written for torch)")
    _grad_scaler_losses(w, ls, f"torch GradScaler ({tool})")
    if defaults_as_none and args == _GRAD_SCALER_DEFAULTS:
        return None
    return args


# --- Hugging Face Accelerate ----------------------------------------------------------------------

_ACCELERATE_KEYS = (
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "tp_config", "megatron_lm_config", "ipex_config", "mpirun_config", "downcast_bf16",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config",
    # SageMakerConfig
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name", "pytorch_version",
    "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
    # old names Accelerate still converts
    "fp16", "dynamo_backend",
)
_ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def from_accelerate(config: Mapping[str, Any], *, grad_scaler_kwargs: Mapping[str, Any] | None = None,
                    release: str = "stable_interval", source: str | None = None,
                    base_dir: str | os.PathLike[str] | None = None,
                    _locate: Callable[[tuple], int | None] | None = None) -> Conversion:
    """An Accelerate config (``accelerate config``'s YAML, parsed) -> Policy.

    ``mixed_precision`` no / fp16 / bf16 runs ``torch.autocast`` over the model's float32
    parameters and converts outputs to float32 (``convert_outputs_to_fp32``); fp16 adds a torch
    GradScaler built from ``grad_scaler_kwargs`` (the fields of ``GradScalerKwargs``, which live in
    code, not in the YAML). Under ``distributed_type: FSDP`` gradients are reduced in the mixed
    dtype (Accelerate's ``MixedPrecision(param_dtype=d, reduce_dtype=d, buffer_dtype=d)``); under
    ``DEEPSPEED`` the precision is DeepSpeed's (its ``deepspeed_config_file`` is read when
    ``base_dir`` locates it; ``release`` as in :func:`from_deepspeed`). ``mixed_precision: no`` unquoted is YAML 1.1's ``false`` and reads
    as ``"no"``; ``fp8`` raises :class:`~ampbridge.UnsupportedOptionError`.

    Example:
        >>> c = from_accelerate({"distributed_type": "MULTI_GPU", "mixed_precision": "fp16"},
        ...                     grad_scaler_kwargs={"init_scale": 1024.0})
        >>> c.result.compute_dtype, c.result.loss_scale.initial_scale, c.result.output_dtype
        ('float16', 1024.0, 'float32')
    """
    r = _Reader("accelerate", source, _locate)
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("an Accelerate config must be a mapping", file=source, value=config)])
    r.check_keys(config, _ACCELERATE_KEYS, (), "an Accelerate config")
    raw = config.get("mixed_precision", _MISSING)
    if raw is _MISSING or raw is None:
        raw = "fp16" if config.get("fp16") is True else "no"
        r.origins["compute_dtype"] = "fp16" if config.get("fp16") is True else "mixed_precision (absent: no)"
    else:
        r.origins["compute_dtype"] = "mixed_precision"
    if raw is False:
        raw = "no"
        r.note("mixed_precision: no (unquoted) is YAML 1.1's false; read as 'no', as Accelerate means it")
    if raw not in _ACCELERATE_PRECISIONS:
        hint = did_you_mean(str(raw), _ACCELERATE_PRECISIONS)
        if isinstance(raw, str) and raw.lower() in _ACCELERATE_PRECISIONS:
            hint = f"Accelerate spells it in lower case: {raw.lower()!r}"
        r.problem(("mixed_precision",), "not an Accelerate mixed_precision", value=raw,
                  accepted=", ".join(_ACCELERATE_PRECISIONS), hint=hint)
        r.raise_if_any()
    if raw == "fp8":
        raise UnsupportedOptionError(
            "mixed_precision='fp8' cannot be read: ampbridge policies compute in float32, bfloat16 or float16, "
            "and Accelerate's fp8 runs its matmuls through TransformerEngine/MS-AMP/torchao. Keep the fp8 recipe "
            "in Accelerate, or convert a bf16 variant of it (mixed_precision: bf16)")
    dist = config.get("distributed_type", "NO")
    if not isinstance(dist, str):
        r.problem(("distributed_type",), "must be a string", value=dist,
                  accepted="NO, MULTI_GPU, FSDP, DEEPSPEED, XLA, ...")
        dist = "NO"
    dist = dist.upper()
    compute = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}[raw]
    kwargs = dict(grad_scaler_kwargs or {})
    if dist == "DEEPSPEED":
        return _accelerate_deepspeed(r, config, raw, base_dir, release)
    if kwargs and raw != "fp16":
        r.note(f"grad_scaler_kwargs have no effect with mixed_precision={raw!r}: Accelerate builds a GradScaler "
               "only for fp16")
    ls = {"mode": "none", "skip_nonfinite": False}
    if raw == "fp16":
        ls = _read_grad_scaler_args(r, kwargs, ("grad_scaler_kwargs",), "GradScalerKwargs")
    if raw != "fp16" or not kwargs:
        _origins_all_loss_scale(r, f"mixed_precision {raw!r}" + (" (GradScaler's defaults)" if raw == "fp16" else ""))
    reduce = "float32"
    if dist == "FSDP":
        reduce = compute
        r.origins["reduce_dtype"] = "distributed_type (FSDP: MixedPrecision reduce_dtype = the mixed dtype)"
        if raw == "fp16":
            r.note("under FSDP Accelerate uses ShardedGradScaler, torch's GradScaler algorithm over shards")
    if dist == "XLA" and raw == "bf16":
        r.loss("distributed_type", "XLA", "on TPU Accelerate realises bf16 through the XLA_USE_BF16 / "
               "XLA_DOWNCAST_BF16 environment variables (every float32 tensor held as bfloat16), not autocast; "
               "read as autocast-style mixed bfloat16")
    if config.get("downcast_bf16") not in (None, False, "no"):
        r.loss("downcast_bf16", config.get("downcast_bf16"), "a TPU-only storage downcast ampbridge cannot express")
    fields = {"compute_dtype": compute, "param_dtype": "float32", "output_dtype": "float32", "reduce_dtype": reduce}
    r.origins.setdefault("output_dtype", "Accelerate's convert_outputs_to_fp32")
    r.origins.update(keep_float32="mixed_precision (torch.autocast: no module pins)",
                     overrides="mixed_precision (torch.autocast: no module pins)")
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


def _accelerate_deepspeed(r: _Reader, config: Mapping[str, Any], precision: str,
                          base_dir: str | os.PathLike[str] | None, release: str) -> Conversion:
    ds_section = r.section(config, "deepspeed_config") or {}
    file = ds_section.get("deepspeed_config_file")
    r.raise_if_any()
    auto = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}[precision]
    if file:
        path = Path(base_dir or ".") / str(file)
        if not path.is_file():
            raise PolicyError([Problem(f"the DeepSpeed config file it names is not there ({path})",
                                       key="deepspeed_config.deepspeed_config_file", file=r.source, value=file,
                                       hint="read the DeepSpeed file itself with from_deepspeed(..., auto='"
                                       + precision + "')")])
        inner = load(path, format="deepspeed", auto=auto, release=release)
        notes = (f"distributed_type DEEPSPEED: the precision is DeepSpeed's, read from {file} with its 'auto' "
                 f"values filled from mixed_precision={precision!r}",) + inner.notes
    else:
        # Accelerate's DeepSpeedPlugin writes the section when the config has none
        ds: dict[str, Any] = {"zero_optimization": {"stage": ds_section.get("zero_stage", 0)}}
        if precision == "fp16":
            ds["fp16"] = {"enabled": True, "auto_cast": True}
        elif precision == "bf16":
            ds["bf16"] = {"enabled": True}
        inner = from_deepspeed(ds, source=r.source, release=release)
        notes = ("distributed_type DEEPSPEED without a deepspeed_config_file: read as the DeepSpeed config "
                 f"Accelerate's DeepSpeedPlugin builds ({json.dumps(ds)}), DeepSpeed's defaults filling the rest",) \
            + inner.notes
    return dataclasses.replace(inner, source_format="accelerate", notes=tuple(r.notes) + notes,
                               losses=tuple(r.losses) + inner.losses)


def to_accelerate(policy: Policy) -> Conversion:
    """Policy -> ``{"mixed_precision": ..., "grad_scaler_kwargs": ...}`` for Accelerate.

    ``mixed_precision`` goes in the YAML config (or ``Accelerator(mixed_precision=...)``);
    ``grad_scaler_kwargs`` (None when torch's defaults do) go in code:
    ``Accelerator(kwargs_handlers=[GradScalerKwargs(**kwargs)])``.

    Example:
        >>> import ampbridge
        >>> to_accelerate(ampbridge.preset("mixed_bfloat16").replace(
        ...     loss_scale=ampbridge.LossScaleConfig(skip_nonfinite=False))).result
        {'mixed_precision': 'bf16', 'grad_scaler_kwargs': None}
    """
    _require_concrete(policy, "Accelerate")
    w = _Writer("accelerate", policy)
    p = policy
    w.common("Accelerate", pins_reason="Accelerate runs torch.autocast, which has per-op lists, not per-module pins")
    name = {"float32": "no", "float16": "fp16", "bfloat16": "bf16"}[p.compute_dtype]
    if p.param_dtype != "float32":
        w.loss("param_dtype", p.param_dtype, "Accelerate's mixed precision keeps the model's float32 parameters; "
               "a lower-precision model is your own model.to(dtype)")
    if p.output_dtype != "float32":
        w.loss("output_dtype", p.output_dtype, "Accelerate converts model outputs to float32 (convert_outputs_to_fp32)")
    if p.reduce_dtype != "float32":
        w.loss("reduce_dtype", p.reduce_dtype, "under DDP gradients are reduced in the parameter dtype, float32 (under "
               "distributed_type FSDP, Accelerate reduces them in the mixed-precision dtype)")
    kwargs = None
    if name == "fp16":
        kwargs = _write_grad_scaler_args(w, p, "Accelerate", defaults_as_none=True)
        if kwargs == {"enabled": False}:
            w.note("GradScalerKwargs(enabled=False): float16 autocast without loss scaling")
    else:
        _expect_no_scaling(w, p, f"Accelerate with mixed_precision={name!r}")
    return w.done({"mixed_precision": name, "grad_scaler_kwargs": kwargs})


def _expect_no_scaling(w: _Writer, p: Policy, tool: str) -> None:
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    if view["mode"] != "none":
        w.loss("loss_scale.mode", view["mode"], f"{tool} does not scale the loss")
    if view["skip_nonfinite"]:
        w.loss("loss_scale.skip_nonfinite", True, f"{tool} applies every optimizer step; it does not check for "
               "non-finite gradients")


# --- Lightning ----------------------------------------------------------------------------------

#: precision -> (compute, param) ; Fabric converts outputs to float32 (convert_output) in every one
_LIGHTNING = {"32-true": ("float32", "float32"), "16-mixed": ("float16", "float32"),
              "bf16-mixed": ("bfloat16", "float32"), "16-true": ("float16", "float16"),
              "bf16-true": ("bfloat16", "bfloat16")}
_LIGHTNING_ALIASES: dict[Any, str] = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true",
                                      32: "32-true", 16: "16-mixed", 64: "64-true"}
_LIGHTNING_ALL = tuple(_LIGHTNING) + ("64-true", "transformer-engine", "transformer-engine-float16")


def from_lightning(precision: Any, *, grad_scaler: Mapping[str, Any] | None = None) -> Conversion:
    """A Lightning ``precision`` ("16-mixed", "bf16-true", 16, "bf16", ...) -> Policy.

    "-mixed" runs ``torch.autocast`` over float32 parameters ("16-mixed" with a torch GradScaler,
    default arguments unless ``grad_scaler`` gives the ones of a custom
    ``MixedPrecision(..., scaler=GradScaler(**grad_scaler))``); "-true" casts the parameters
    (no loss scaling, nothing skipped). Fabric converts outputs to float32 in every mode.
    "64-true" and the "transformer-engine" (fp8) precisions raise UnsupportedOptionError.

    Example:
        >>> p = from_lightning(16).result
        >>> p.compute_dtype, p.param_dtype, p.loss_scale.mode, p.loss_scale.initial_scale
        ('float16', 'float32', 'dynamic', 65536.0)
    """
    r = _Reader("lightning")
    name = _LIGHTNING_ALIASES.get(precision, precision)
    if isinstance(precision, bool) or not isinstance(name, str) or name not in _LIGHTNING_ALL:
        hint = did_you_mean(str(precision), _LIGHTNING_ALL + ("16", "32", "64", "bf16"))
        raise PolicyError([Problem("not a Lightning precision", key="precision", value=precision,
                                   accepted=", ".join(_LIGHTNING_ALL) + ", and 16, 32, 64, '16', '32', '64', 'bf16'",
                                   hint=hint)])
    if name == "64-true":
        raise UnsupportedOptionError("precision='64-true' cannot be read: ampbridge policies hold float32, "
                                     "bfloat16 and float16, not float64")
    if name.startswith("transformer-engine"):
        raise UnsupportedOptionError(f"precision={name!r} cannot be read: it runs fp8 matmuls through NVIDIA "
                                     "TransformerEngine, and ampbridge policies compute in float32, bfloat16 or "
                                     "float16 (the closest is 'bf16-mixed')")
    if name != precision:
        r.note(f"precision={precision!r} is Lightning's alias of {name!r}")
    compute, param = _LIGHTNING[name]
    r.origins.update(compute_dtype="precision", param_dtype="precision",
                     output_dtype="Fabric's convert_output (float32)", keep_float32="precision (no module pins)",
                     overrides="precision (no module pins)")
    ls: dict[str, Any] = {"mode": "none", "skip_nonfinite": False}
    if name == "16-mixed":
        ls = _read_grad_scaler_args(r, dict(grad_scaler or {}), ("grad_scaler",), "a GradScaler's arguments")
    elif grad_scaler:
        r.problem(("grad_scaler",), f"precision={name!r} uses no GradScaler", value=dict(grad_scaler),
                  accepted="grad_scaler only with '16-mixed'")
    if name != "16-mixed" or not grad_scaler:
        defaults = " (torch GradScaler's defaults)" if name == "16-mixed" else ""
        _origins_all_loss_scale(r, f"precision {name!r}{defaults}")
    fields = {"compute_dtype": compute, "param_dtype": param, "output_dtype": "float32", "reduce_dtype": param}
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


def to_lightning(policy: Policy) -> Conversion:
    """Policy -> ``{"precision": "16-mixed", "grad_scaler": None | GradScaler arguments}``.

    ``grad_scaler`` (None when torch's defaults do) is for a custom plugin:
    ``Trainer(plugins=[MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler(**grad_scaler))])``.

    Example:
        >>> import ampbridge
        >>> to_lightning(ampbridge.preset("mixed_float16")).result
        {'precision': '16-mixed', 'grad_scaler': None}
    """
    _require_concrete(policy, "Lightning")
    w = _Writer("lightning", policy)
    p = policy
    w.common("Lightning", pins_reason="Lightning's precision plugins apply one dtype (or torch.autocast's op "
             "lists) to the whole model; they cannot pin layers")
    key = (p.compute_dtype, p.param_dtype)
    name = next((n for n, v in _LIGHTNING.items() if v == key), None)
    if name is None:
        name = {"float32": "32-true", "float16": "16-mixed", "bfloat16": "bf16-mixed"}[p.compute_dtype]
        w.loss("param_dtype", p.param_dtype, f"Lightning stores parameters in float32 or the compute dtype; "
               f"written as {name!r}")
    if p.output_dtype != "float32":
        w.loss("output_dtype", p.output_dtype, "Lightning (Fabric) converts outputs to float32 in every precision")
    if p.reduce_dtype != _LIGHTNING[name][1]:
        w.loss("reduce_dtype", p.reduce_dtype, "under DDP Lightning reduces gradients in the parameter dtype")
    scaler = None
    if name == "16-mixed":
        scaler = _write_grad_scaler_args(w, p, "Lightning", defaults_as_none=True)
        if scaler == {"enabled": False}:
            w.note("'16-mixed' with a disabled GradScaler: MixedPrecision('16-mixed', device, "
                   "scaler=GradScaler(enabled=False))")
    else:
        _expect_no_scaling(w, p, f"Lightning precision {name!r}")
    return w.done({"precision": name, "grad_scaler": scaler})


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


def from_keras(policy: Any, *, loss_scale_optimizer: Mapping[str, Any] | None = None,
               loss_scale_factor: float | None = None) -> Conversion:
    """A Keras dtype-policy name (or a LossScaleOptimizer config dict) -> Policy.

    ``mixed_float16`` / ``mixed_bfloat16``: compute in half, float32 variables; a dtype name
    (``float32``, ``float16``, ``bfloat16``): both. Keras layers return their compute dtype, so
    ``output_dtype`` is the compute dtype. For ``mixed_float16``, ``Model.compile`` wraps the
    optimizer in a ``LossScaleOptimizer`` (2**15, 2000 steps) unless ``loss_scale_optimizer``
    gives the config of the one you use; ``loss_scale_factor`` is a static scale set on the
    optimizer (Keras then skips nothing). A dict is read as a LossScaleOptimizer config alone.

    Example:
        >>> p = from_keras("mixed_float16").result
        >>> p.compute_dtype, p.param_dtype, p.output_dtype, p.loss_scale.initial_scale
        ('float16', 'float32', 'float16', 32768.0)
    """
    if isinstance(policy, Mapping):
        return from_keras_loss_scale_optimizer(policy)
    r = _Reader("keras")
    if not isinstance(policy, str) or policy not in _KERAS:
        if isinstance(policy, str) and ("_from_" in policy or policy.startswith(("int", "uint", "float8", "gptq",
                                                                                 "awq"))):
            raise UnsupportedOptionError(f"Keras dtype policy {policy!r} is a quantized policy; ampbridge policies "
                                         "hold float32, bfloat16 and float16 only")
        if policy == "float64":
            raise UnsupportedOptionError("Keras dtype policy 'float64' cannot be read: ampbridge policies hold "
                                         "float32, bfloat16 and float16, not float64")
        raise PolicyError([Problem("not a Keras dtype policy name", key="dtype_policy", value=policy,
                                   accepted=", ".join(_KERAS),
                                   hint=did_you_mean(str(policy), tuple(_KERAS)))])
    compute, variable = _KERAS[policy]
    r.origins.update(compute_dtype="dtype_policy", param_dtype="dtype_policy",
                     output_dtype="dtype_policy (layers return their compute dtype)")
    if compute != "float32":
        r.note("Keras layers return their compute dtype, so the model's outputs are "
               f"{compute} unless its last layer uses dtype='float32'; read as output_dtype={compute}")
    loss_scale = LossScaleConfig(mode="none", skip_nonfinite=False)
    covers = set(_ALL_BUT_MATMUL)
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
    policy_obj = _construct(r, lambda: Policy(compute_dtype=compute, param_dtype=variable, output_dtype=compute,
                                              loss_scale=loss_scale))
    return r.done(policy_obj, covers, state)


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
    w.common("a Keras dtype policy", pins_reason="one Keras dtype policy covers the model; per-layer pins need "
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
    return w.done({"dtype_policy": name, "loss_scale_optimizer": lso, "loss_scale_factor": factor})


# --- jmp --------------------------------------------------------------------------------------------

#: jmp's dtype names (jmp/_src/policy.py dtype_to_names), "half" aside
_JMP_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
              "full": "float32", "f32": "float32", "float32": "float32", "f64": "float64", "float64": "float64"}
_JMP_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype", "compute": "compute_dtype",
             "o": "output_dtype", "output": "output_dtype"}
_JMP_ACCEPTED_DTYPES = "half, full, float16 (f16), bfloat16 (bf16), float32 (f32)"


def _jmp_dtype(value: str, item: str, text: str, half: str, r: _Reader) -> str:
    if value == "half":
        r.note(f"jmp's 'half' is bfloat16 on TPU and float16 elsewhere; read as {half} (pass half='bfloat16' "
               "for a TPU recipe)")
        return half
    if value not in _JMP_NAMES:
        hint = did_you_mean(value, tuple(_JMP_NAMES) + ("half",))
        raise PolicyError([Problem(f"unknown dtype {value!r} in item {item!r} of jmp policy {text!r}", key="jmp",
                                   value=value, accepted=_JMP_ACCEPTED_DTYPES, hint=hint)])
    if _JMP_NAMES[value] == "float64":
        raise UnsupportedOptionError(f"jmp policy {text!r} uses float64 ({item!r}); ampbridge policies hold "
                                     "float32, bfloat16 and float16")
    return _JMP_NAMES[value]


def from_jmp(text: str, *, half: str = "float16") -> Conversion:
    """A jmp policy string -> Policy, with jmp's defaults (params float32, compute follows params,
    output follows compute).

    Accepts ``params=float32,compute=bfloat16,output=float32``, the short keys ``p``/``c``/``o``,
    or a bare dtype for all three (``half``, ``full``, ``bf16`` ...). jmp's ``half`` depends on the
    device: it reads as ``half`` (float16 unless told). Every malformed item is an error naming it.
    A jmp policy holds no loss scale (jmp's LossScale objects are separate): ``loss_scale`` stays
    at ampbridge's default and is not part of the conversion.

    Example:
        >>> p = from_jmp("c=bf16").result
        >>> p.param_dtype, p.compute_dtype, p.output_dtype
        ('float32', 'bfloat16', 'bfloat16')
    """
    if half not in ("float16", "bfloat16"):
        raise ValueError(f"half={half!r}; accepted: float16, bfloat16")
    r = _Reader("jmp")
    if not isinstance(text, str) or not text:
        raise PolicyError([Problem("a jmp policy must be a non-empty string", key="jmp", value=text,
                                   accepted="'params=float32,compute=bfloat16,output=float32', 'c=bf16', 'half', ...")])
    got: dict[str, str] = {}
    if "=" in text:
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or "=" in value or not value:
                raise PolicyError([Problem(f"malformed item {item!r} in jmp policy {text!r}: expected key=dtype",
                                           key="jmp", value=item, accepted="params|p, compute|c, output|o = "
                                           + _JMP_ACCEPTED_DTYPES)])
            if key not in _JMP_KEYS:
                hint = "jmp does not strip spaces" if key.strip() in _JMP_KEYS else did_you_mean(key, tuple(_JMP_KEYS))
                raise PolicyError([Problem(f"unknown key {key!r} in item {item!r} of jmp policy {text!r}", key="jmp",
                                           value=key, accepted="params (p), compute (c), output (o)", hint=hint)])
            name = _JMP_KEYS[key]
            if name in got:
                raise PolicyError([Problem(f"{name.split('_')[0]} is given twice in jmp policy {text!r}", key="jmp",
                                           value=item)])
            got[name] = _jmp_dtype(value, item, text, half, r)
        param = got.get("param_dtype", "float32")
        compute = got.get("compute_dtype", param)
        output = got.get("output_dtype", compute)
    else:
        param = compute = output = _jmp_dtype(text, text, text, half, r)
    r.origins.update(compute_dtype="compute", param_dtype="params", output_dtype="output")
    policy = _construct(r, lambda: Policy(compute_dtype=compute, param_dtype=param, output_dtype=output))
    return r.done(policy, ("compute_dtype", "param_dtype", "output_dtype"))


def to_jmp(policy: Policy) -> Conversion:
    """Policy -> a jmp policy string (``jmp.get_policy`` reads it back).

    Example:
        >>> import ampbridge
        >>> to_jmp(ampbridge.preset("mixed_bfloat16")).result
        'params=float32,compute=bfloat16,output=float32'
    """
    _require_concrete(policy, "jmp")
    w = _Writer("jmp", policy)
    p = policy
    w.common("a jmp policy", pins_reason="a jmp policy string is one policy for the whole model (haiku's "
             "mixed_precision.set_policy takes one per module class)")
    if p.reduce_dtype != p.param_dtype:
        w.loss("reduce_dtype", p.reduce_dtype, "jmp has no reduce dtype: gradients come out in the parameter dtype")
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    if view != {"mode": "none", "skip_nonfinite": False}:
        w.loss("loss_scale", p.loss_scale.mode, "a jmp policy string holds no loss scale; build a "
               "jmp.DynamicLossScale/StaticLossScale (or use ampbridge.jax.optimizer)")
    return w.done(f"params={p.param_dtype},compute={p.compute_dtype},output={p.output_dtype}")


# --- torch GradScaler -------------------------------------------------------------------------------

def from_grad_scaler(settings: Mapping[str, Any] | None = None, *,
                     state_dict: Mapping[str, Any] | None = None) -> Conversion:
    """torch ``GradScaler`` constructor arguments and/or ``state_dict()`` -> LossScaleConfig (+ state).

    Arguments: ``init_scale`` (2**16), ``growth_factor`` (2), ``backoff_factor`` (0.5),
    ``growth_interval`` (2000), ``enabled``. A state dict (``scale``, the factors,
    ``growth_interval``, ``_growth_tracker``) gives the config with ``initial_scale`` = the saved
    scale, and ``Conversion.state`` with ``good_steps = _growth_tracker`` (resume from it). A
    positional dict with ``scale`` or ``_growth_tracker`` is read as a state dict; an empty state
    dict is a disabled scaler's.

    Example:
        >>> c = from_grad_scaler(state_dict={"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        ...                                  "growth_interval": 100, "_growth_tracker": 7})
        >>> c.result.initial_scale, c.result.growth_interval, c.state.good_steps
        (1024.0, 100, 7)
    """
    if settings is not None and state_dict is None and isinstance(settings, Mapping) and (
            "scale" in settings or "_growth_tracker" in settings):
        settings, state_dict = None, settings
    r = _Reader("grad-scaler")
    args = dict(settings or {})
    if settings is not None and not isinstance(settings, Mapping):
        raise PolicyError([Problem("GradScaler arguments must be a mapping", value=settings)])
    fields = _read_grad_scaler_args(r, args, (), "torch GradScaler's arguments")
    state = None
    if state_dict is not None:
        if not isinstance(state_dict, Mapping):
            raise PolicyError([Problem("a GradScaler state dict must be a mapping", value=state_dict)])
        if not state_dict:
            r.note("an empty state dict is a disabled GradScaler's")
            fields = {"mode": "none", "skip_nonfinite": False}
        else:
            path = ("state_dict",)
            r.check_keys(state_dict, _GRAD_SCALER_STATE, path, "a GradScaler state dict")
            missing = [k for k in _GRAD_SCALER_STATE if k not in state_dict]
            if missing:
                r.problem(path, f"a GradScaler state dict has all of {', '.join(_GRAD_SCALER_STATE)}; missing "
                          f"{', '.join(missing)}")
            as_args = {"init_scale": state_dict.get("scale", 65536.0),
                       **{k: state_dict[k] for k in ("growth_factor", "backoff_factor", "growth_interval")
                          if k in state_dict}}
            fields = _read_grad_scaler_args(r, as_args, path, "a GradScaler state dict")
            tracker = _get_int(r, state_dict, "_growth_tracker", path, 0, low=0, what="an integer >= 0")
            r.origins.update({"loss_scale.initial_scale": "state_dict.scale"})
            r.raise_if_any()
            state = LossScaleState(scale=f32(fields["initial_scale"]), good_steps=tracker, hysteresis_left=1)
            r.note("the state dict's scale is the current scale: it becomes initial_scale, and the state "
                   "(Conversion.state) has good_steps = _growth_tracker; steps and skipped are not in a GradScaler "
                   "state dict and start at 0")
    cfg = _construct(r, lambda: LossScaleConfig(**fields))
    return r.done(cfg, ("loss_scale",), state)


def to_grad_scaler(policy: Policy | LossScaleConfig) -> Conversion:
    """Policy (or a resolved LossScaleConfig) -> torch ``GradScaler(**kwargs)`` arguments.

    Factors are written as their float32 values, which is what ampbridge applies, so the
    trajectory is the same step for step.

    Example:
        >>> to_grad_scaler(LossScaleConfig(mode="dynamic", growth_interval=100)).result
        {'init_scale': 65536.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 100, 'enabled': True}
    """
    p = _policy_of(policy, "to_grad_scaler")
    w = _Writer("grad-scaler", p)
    args = _write_grad_scaler_args(w, p, "torch")
    return w.done(args)


# --- Flax DynamicScale ------------------------------------------------------------------------------

_FLAX_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale", "minimum_scale")
_FLAX_NOTE_CAP = ("Flax caps a growth at float32 max (min(scale * growth_factor, float32 max)); ampbridge skips a "
                  "growth that would overflow float32. They differ only once the scale passes float32 max / "
                  "growth_factor (3.4e38 / 2)")


def from_flax(kwargs: Mapping[str, Any]) -> Conversion:
    """``flax.training.dynamic_scale.DynamicScale`` arguments -> LossScaleConfig (+ state).

    Flax grows when ``fin_steps == growth_interval`` *before* counting the current step, so its
    scale grows on the (N+1)-th finite step: Flax ``growth_interval`` N is ampbridge's N + 1, and
    ``fin_steps`` is ``good_steps``. ``minimum_scale`` defaults to float32's smallest normal
    (None: no floor); ``growth_factor = backoff_factor = 1`` is a static scale.

    Example:
        >>> c = from_flax({"growth_interval": 2000, "scale": 2.0**15, "fin_steps": 5})
        >>> c.result.growth_interval, c.result.initial_scale, c.state.good_steps
        (2001, 32768.0, 5)
    """
    r = _Reader("flax")
    if not isinstance(kwargs, Mapping):
        raise PolicyError([Problem("DynamicScale arguments must be a mapping", value=kwargs)])
    r.check_keys(kwargs, _FLAX_KEYS, (), "Flax DynamicScale's arguments")
    growth = _get_number(r, kwargs, "growth_factor", (), 2.0, what="a number >= 1")
    backoff = _get_number(r, kwargs, "backoff_factor", (), 0.5, what="a number in (0, 1), or 1 with growth_factor 1")
    interval = _get_int(r, kwargs, "growth_interval", (), 2000, low=0, what="an integer >= 0")
    fin = _get_int(r, kwargs, "fin_steps", (), 0, low=0, what="an integer >= 0")
    scale = _get_number(r, kwargs, "scale", (), 65536.0)
    minimum = _TINY32
    if "minimum_scale" in kwargs:
        minimum = None if kwargs["minimum_scale"] is None else _get_number(r, kwargs, "minimum_scale", (), _TINY32)
    else:
        r.note("minimum_scale absent: Flax's default is float32's smallest normal number (1.1754944e-38)")
    r.origins.update({"loss_scale.growth_interval": "growth_interval", "loss_scale.initial_scale": "scale",
                      "loss_scale.min_scale": "minimum_scale", "loss_scale.growth_factor": "growth_factor",
                      "loss_scale.backoff_factor": "backoff_factor"})
    r.raise_if_any()
    r.note("Flax returns is_fin and leaves skipping to the caller (jnp.where(is_fin, new, old), as its docstring "
           "does); read as skip_nonfinite=True")
    if growth == 1.0 and backoff == 1.0:
        r.note("growth_factor = backoff_factor = 1: the scale never moves, a static scale")
        cfg = _construct(r, lambda: LossScaleConfig(mode="static", initial_scale=scale))
        return r.done(cfg, ("loss_scale",), LossScaleState(scale=f32(scale)))
    r.note(f"Flax grows on the (growth_interval + 1)-th finite step: growth_interval {interval} is ampbridge's "
           f"{interval + 1}")
    r.note(_FLAX_NOTE_CAP)
    cfg = _construct(r, lambda: LossScaleConfig(
        mode="dynamic", initial_scale=scale, growth_factor=growth, backoff_factor=backoff,
        growth_interval=interval + 1, min_scale=minimum))
    return r.done(cfg, ("loss_scale",), LossScaleState(scale=f32(scale), good_steps=fin))


def to_flax(policy: Policy | LossScaleConfig) -> Conversion:
    """Policy (or a resolved LossScaleConfig) -> ``DynamicScale(**kwargs)`` arguments, or None (no scaling).

    Example:
        >>> to_flax(LossScaleConfig(mode="dynamic", growth_interval=2000)).result
        {'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 1999, 'scale': 65536.0, 'minimum_scale': None}
    """
    p = _policy_of(policy, "to_flax")
    w = _Writer("flax", p)
    ls = p.resolved_loss_scale
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    skip = "skip it (jnp.where(is_fin, new, old))" if ls.skip_nonfinite else "apply it anyway"
    if view["mode"] == "none":
        w.note("no loss scaling: no DynamicScale")
        if ls.skip_nonfinite:
            w.loss("loss_scale.skip_nonfinite", True, "without a DynamicScale nothing reports is_fin; check the "
                   "gradients yourself (optax.apply_if_finite, or ampbridge.jax.optimizer)")
        return w.done(None)
    w.note(f"on a step whose gradients are not finite the caller should {skip}")
    if not ls.skip_nonfinite:
        w.loss("loss_scale.skip_nonfinite", False, "DynamicScale's arguments do not say whether to skip: its "
               "documented use (jnp.where(is_fin, new, old)) skips; applying non-finite steps is your loop's choice")
    if view["mode"] == "static":
        return w.done({"growth_factor": 1.0, "backoff_factor": 1.0, "growth_interval": 2000,
                       "scale": f32(ls.initial_scale), "minimum_scale": None})
    if ls.hysteresis > 1:
        w.loss("loss_scale.hysteresis", ls.hysteresis, "Flax's DynamicScale backs off on every overflow")
    if ls.max_scale is not None:
        w.loss("loss_scale.max_scale", ls.max_scale, "Flax's only ceiling is float32 max")
    if ls.min_scale is not None and ls.on_min_scale != "clamp":
        w.loss("loss_scale.on_min_scale", ls.on_min_scale, "Flax clamps at minimum_scale")
    w.note(_FLAX_NOTE_CAP)
    return w.done({"growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
                   "growth_interval": ls.growth_interval - 1, "scale": f32(ls.initial_scale),
                   "minimum_scale": ls.min_scale})


# --- FSDP (the framework-free part: dtype names and the modules that need their own wrap) ------------

def to_fsdp(policy: Policy, plan: Any = None) -> Conversion:
    """Policy -> FSDP2 ``MixedPrecisionPolicy`` / FSDP1 ``MixedPrecision`` settings as plain data.

    The torch helper builds the torch objects from this; nothing here imports torch.
    ``result`` is ``{"root": GROUP, "pinned": [GROUP, ...]}``: ``root`` configures the root
    ``fully_shard(model, mp_policy=...)`` / ``FSDP(model, mixed_precision=...)``; each ``pinned``
    group is a set of modules (a ``keep_float32`` entry or an ``[[override]]``, in rule order,
    later wins) that must be wrapped on their own with their own settings, because FSDP casts
    per wrapped unit. Every GROUP is a dict::

        label          "root", "keep_float32[0]", "override[1]", ...
        patterns       the rule's ampbridge patterns ("kind:norm", "lm_head", ...); () for root
        paths          given a Plan: the module paths to wrap (the topmost layers the rule decides
                       whose dtypes differ from what encloses them); else None
        compute_dtype  the dtype the group computes in
        param_dtype    the dtype its parameters must hold before wrapping (FSDP keeps that as the
                       sharded copy, the master weights)
        output_dtype   the dtype its outputs leave in
        fsdp2          MixedPrecisionPolicy(**fsdp2): param_dtype (the compute dtype FSDP casts
                       the unsharded parameters to), reduce_dtype, output_dtype, cast_forward_inputs
        fsdp1          MixedPrecision(**fsdp1): param_dtype, reduce_dtype, buffer_dtype,
                       keep_low_precision_grads, cast_forward_inputs, cast_root_forward_inputs,
                       module_classes_to_ignore (pass as _module_classes_to_ignore=(): ampbridge,
                       not FSDP1's BatchNorm default, decides which modules stay in float32)
        fsdp1_output_dtype  FSDP1 has no output cast: when this differs from the group's compute
                       dtype, cast the outputs with a forward hook

    All dtypes are canonical names ("bfloat16"). ``reduce_dtype`` is the policy's everywhere;
    buffers follow the compute dtype. Loss scaling is separate (``to_grad_scaler`` gives the
    arguments of torch's ``ShardedGradScaler``, which takes the same ones).

    Example:
        >>> import ampbridge
        >>> c = to_fsdp(ampbridge.preset("mixed_bfloat16").replace(keep_float32=("kind:norm",)))
        >>> c.result["root"]["fsdp2"]
        {'param_dtype': 'bfloat16', 'reduce_dtype': 'float32', 'output_dtype': 'float32', 'cast_forward_inputs': True}
        >>> [(g["label"], g["patterns"], g["fsdp2"]["param_dtype"]) for g in c.result["pinned"]]
        [('keep_float32[0]', ('kind:norm',), 'float32')]
    """
    _require_concrete(policy, "FSDP")
    p = policy
    w = _Writer("fsdp", p)
    if p.phases:
        w.loss("phase", len(p.phases), "FSDP's mixed precision is fixed when the model is wrapped; the top-level "
               "settings were written (wrap again with policy.at(epoch=N) to change phase)")
    if p.matmul_precision != "highest":
        w.note(f"matmul_precision={p.matmul_precision!r} is torch.set_float32_matmul_precision, outside FSDP")
    if loss_scale_view(p.loss_scale, p.compute_dtype)["mode"] != "none":
        w.note("loss scaling is separate from FSDP: use torch's ShardedGradScaler with to_grad_scaler()'s arguments")

    def group(label: str, patterns: tuple[str, ...], compute: str, param: str, output: str, root: bool) -> dict:
        return {
            "label": label, "patterns": patterns, "paths": None,
            "compute_dtype": compute, "param_dtype": param, "output_dtype": output,
            "fsdp2": {"param_dtype": compute, "reduce_dtype": p.reduce_dtype, "output_dtype": output,
                      "cast_forward_inputs": True},
            "fsdp1": {"param_dtype": compute, "reduce_dtype": p.reduce_dtype, "buffer_dtype": compute,
                      "keep_low_precision_grads": False, "cast_forward_inputs": not root,
                      "cast_root_forward_inputs": True, "module_classes_to_ignore": ()},
            "fsdp1_output_dtype": output,
        }

    root = group("root", (), p.compute_dtype, p.param_dtype, p.output_dtype, True)
    pinned = []
    for label, rule in p.rules:
        compute = rule.compute_dtype or p.compute_dtype
        pinned.append(group(label, tuple(rule.match), compute, rule.param_dtype or p.param_dtype,
                            rule.output_dtype or compute, False))
    if plan is not None:
        _fsdp_paths(plan, root, pinned)
    return w.done({"root": root, "pinned": pinned})


def _fsdp_paths(plan: Any, root: dict, pinned: list[dict]) -> None:
    by_label = {g["label"]: g for g in pinned}
    for g in pinned:
        g["paths"] = []
    chosen: dict[str, tuple[str, str, str]] = {}
    rows = sorted((r for r in plan.rows if r.rule != "default" and r.inherited_from is None),
                  key=lambda r: (r.path.count(".") if r.path else -1, r.path))
    for row in rows:
        dtypes = (row.compute_dtype, row.param_dtype, row.output_dtype)
        enclosing = next((chosen[a] for a in sorted(chosen, key=len, reverse=True)
                          if a == "" or row.path.startswith(a + ".")), None)
        # a default row's output is its compute dtype; the root's own output is the policy's
        around = enclosing or (root["compute_dtype"], root["param_dtype"], root["compute_dtype"])
        if dtypes != around and row.rule in by_label:
            chosen[row.path] = dtypes
            by_label[row.rule]["paths"].append(row.path)
    for g in pinned:
        g["paths"] = tuple(g["paths"])


# --- reading files and text; detecting the format -------------------------------------------------

_READ_OPTIONS: dict[str, tuple[str, ...]] = {
    "ampbridge": (), "deepspeed": ("auto", "release"), "accelerate": ("grad_scaler_kwargs", "base_dir", "release"),
    "lightning": ("grad_scaler",), "keras": ("loss_scale_optimizer",), "jmp": ("half",), "grad-scaler": (),
    "flax": (),
}
_WRITE_OPTIONS: dict[str, tuple[str, ...]] = {
    "ampbridge": (), "deepspeed": ("via", "release"), "accelerate": (), "lightning": (), "keras": (), "jmp": (),
    "grad-scaler": (), "flax": (), "fsdp": ("plan",),
}
_DS_MARKERS = {"fp16", "bf16", "bfloat16", "zero_optimization", "torch_autocast", "amp", "train_batch_size",
               "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "communication_data_type",
               "optimizer", "scheduler", "gradient_clipping"}
_ACCELERATE_MARKERS = {"mixed_precision", "compute_environment", "distributed_type"}
_AMPBRIDGE_MARKERS = {"version", "extends", "compute_dtype", "param_dtype", "output_dtype", "reduce_dtype",
                      "matmul_precision", "keep_float32", "override", "loss_scale", "phase"}
_SHARED_SCALER = {"growth_factor", "backoff_factor", "growth_interval", "scale"}


def _candidates(data: Any) -> list[str]:
    if isinstance(data, bool):
        return []
    if isinstance(data, (str, int)):
        names = []
        if data in _LIGHTNING_ALL or data in _LIGHTNING_ALIASES:
            names.append("lightning")
        if isinstance(data, str) and (data in _KERAS or "_from_" in data):
            names.append("keras")
        if isinstance(data, str) and ("=" in data or data in _JMP_NAMES or data == "half"):
            names.append("jmp")
        return names
    if not isinstance(data, Mapping):
        return []
    keys = {str(k) for k in data}
    if isinstance(data.get("tool"), Mapping) and "ampbridge" in data["tool"]:
        return ["ampbridge"]
    found = []
    if keys & _DS_MARKERS:
        found.append("deepspeed")
    if keys & _ACCELERATE_MARKERS:
        found.append("accelerate")
    if keys & {"_growth_tracker", "init_scale", "enabled"}:
        found.append("grad-scaler")
    if keys & {"fin_steps", "minimum_scale"}:
        found.append("flax")
    if keys and keys <= _SHARED_SCALER and "grad-scaler" not in found and "flax" not in found:
        found += ["grad-scaler", "flax"]
    if keys & {"dynamic_growth_steps", "inner_optimizer"}:
        found.append("keras")
    if keys & _AMPBRIDGE_MARKERS and not found:
        found.append("ampbridge")
    return found


def detect(data: Any, *, source: str | None = None) -> str:
    """The format of parsed data (a dict from JSON/YAML, or a bare name), from its keys or its value.

    A bare name that two formats read differently (``"bf16"``: Lightning's bf16-mixed, jmp's
    all-bfloat16) is an error asking for the format, as is a dict of loss-scale keys that both a
    GradScaler state and Flax's DynamicScale hold (their growth intervals differ by one).

    Example:
        >>> detect({"fp16": {"enabled": "auto"}}), detect({"mixed_precision": "bf16"}), detect("16-mixed")
        ('deepspeed', 'accelerate', 'lightning')
    """
    found = _candidates(data)
    if len(found) == 1:
        return found[0]
    if isinstance(data, (str, int)) and len(found) > 1:
        readings = {}
        for fmt in found:
            try:
                pol = read(data, fmt).result
                readings[fmt] = (pol.compute_dtype, pol.param_dtype, pol.output_dtype)
            except (PolicyError, UnsupportedOptionError):
                continue
        if len(set(readings.values())) <= 1:
            return found[0]
        text = "; ".join(f"{fmt}: compute {c}, params {p}, outputs {o}" for fmt, (c, p, o) in readings.items())
        raise PolicyError([Problem(f"{data!r} means different things in {', '.join(readings)} ({text})",
                                   file=source, value=data, accepted=", ".join(readings),
                                   hint="say which with --from (format=...)")])
    if len(found) > 1:
        hint = "say which with --from (format=...)"
        if set(found) >= {"grad-scaler", "flax"}:
            hint += "; a GradScaler's growth_interval N is Flax's N - 1"
        raise PolicyError([Problem(f"these settings could be {' or '.join(found)}", file=source,
                                   accepted=", ".join(found), hint=hint)])
    raise PolicyError([Problem("cannot tell which tool's settings these are", file=source,
                               value=data if not isinstance(data, Mapping) else sorted(map(str, data))[:8],
                               accepted="a DeepSpeed config (fp16/bf16/zero_optimization...), an Accelerate "
                               "config (mixed_precision...), a Lightning/Keras/jmp precision name, GradScaler or "
                               "Flax DynamicScale settings, or an ampbridge policy",
                               hint="say which with --from (format=...)")])


def read(data: Any, format: str, **options: Any) -> Conversion:
    """Read parsed data of a known format (``format`` in :data:`READ_FORMATS`).

    Example:
        >>> read("p=f32,c=f16", "jmp").result.output_dtype
        'float16'
    """
    _check_options(format, options, _READ_OPTIONS, READ_FORMATS, "read")
    locate = options.pop("_locate", None)
    source = options.pop("_source", None)
    if format == "ampbridge":
        if isinstance(data, Policy):
            policy = data
        elif isinstance(data, Mapping):
            policy = Policy.from_dict(data)
        else:
            raise PolicyError([Problem("an ampbridge policy must be a table", file=source, value=data)])
        return Conversion(policy, source_format="ampbridge", target_format="ampbridge",
                          covers=frozenset(POLICY_FIELDS))
    if format == "deepspeed":
        return from_deepspeed(data, source=source, _locate=locate, **options)
    if format == "accelerate":
        return from_accelerate(data, source=source, _locate=locate, **options)
    if format == "lightning":
        return from_lightning(data, **options)
    if format == "keras":
        return from_keras(data, **options)
    if format == "jmp":
        return from_jmp(data, **options)
    if format == "grad-scaler":
        return from_grad_scaler(data)
    return from_flax(data)


def write(policy: Policy, format: str, **options: Any) -> Conversion:
    """Write a policy as ``format`` (in :data:`WRITE_FORMATS`); ``ampbridge`` returns the policy itself.

    Example:
        >>> import ampbridge
        >>> write(ampbridge.preset("float32"), "lightning").result["precision"]
        '32-true'
    """
    _check_options(format, options, _WRITE_OPTIONS, WRITE_FORMATS, "write")
    table: dict[str, Callable[..., Conversion]] = {
        "deepspeed": to_deepspeed, "accelerate": to_accelerate, "lightning": to_lightning, "keras": to_keras,
        "jmp": to_jmp, "grad-scaler": to_grad_scaler, "flax": to_flax, "fsdp": to_fsdp}
    if format == "ampbridge":
        return Conversion(policy, source_format="ampbridge", target_format="ampbridge")
    return table[format](policy, **options)


def _check_options(fmt: str, options: Mapping[str, Any], table: Mapping[str, tuple[str, ...]],
                   formats: tuple[str, ...], what: str) -> None:
    if fmt not in formats:
        hint = did_you_mean(str(fmt), formats)
        raise ValueError(f"unknown format {fmt!r} to {what}; accepted: {', '.join(formats)}"
                         + (f" ({hint})" if hint else ""))
    extra = [k for k in options if k not in table[fmt] and not k.startswith("_")]
    if extra:
        raise TypeError(f"format {fmt!r} takes no option {', '.join(extra)}; it takes: "
                        f"{', '.join(table[fmt]) or 'none'}")


_JMP_LIKE = re.compile(r"^\w+=\w+(,\w+=\w+)*$")
_TOML_ASSIGN = re.compile(r"^\s*[\w.\"'-]+\s*=")


def _parse_text(text: str, suffix: str, source: str | None) -> tuple[Any, Callable[[tuple], int | None], str]:
    """Parse a recipe's text: (data, key path -> line, how it was parsed: json|yaml|toml|name)."""
    from .core import io as _io

    stripped = text.strip()
    kind = {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}.get(suffix.lower())
    lines = [ln for ln in stripped.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if kind is None:
        one = lines[0].strip() if len(lines) == 1 else None
        if stripped.startswith(("{", "[")) and not stripped.startswith("[tool"):
            kind = "json"
        elif one is not None and ":" not in one and ("=" not in one or _JMP_LIKE.match(one)):
            kind = "name"  # "16-mixed", "mixed_float16", "p=f32,c=bf16"
        elif any(ln.lstrip().startswith("[") or _TOML_ASSIGN.match(ln) for ln in lines):
            kind = "toml"
        else:
            kind = "yaml"
    if kind == "name":
        value: Any = lines[0].strip().strip("'\"") if stripped else ""
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        return value, (lambda path: None), "name"
    if kind == "toml":
        return None, (lambda path: None), "toml"
    data, locate = _io._parse(text, kind, source)
    return data, locate, kind


def loads(text: str, format: str | None = None, *, source: str | None = None, suffix: str = "",
          **options: Any) -> Conversion:
    """Read a recipe from text (JSON, YAML, TOML or a bare name), detecting the format when not given.

    Example:
        >>> loads('{"bf16": {"enabled": true}}').result.compute_dtype
        'bfloat16'
    """
    from .core import io as _io

    if not text.strip():
        raise PolicyError([Problem("empty: no settings to read", file=source)])
    data, locate, kind = _parse_text(text, suffix, source)
    if kind == "toml":
        if format not in (None, "ampbridge"):
            raise PolicyError([Problem(f"a TOML file is an ampbridge policy, not {format} settings", file=source)])
        root = ("tool", "ampbridge") if source and Path(source).name == "pyproject.toml" else ()
        if root:
            policy = _io._loads_with_origins(text, "toml", source, Path(source).parent, root)[0]
        else:
            policy = _io.loads(text, "toml", source=source,
                               base_dir=Path(source).parent if source else None)
        return Conversion(policy, source_format="ampbridge", target_format="ampbridge",
                          covers=frozenset(POLICY_FIELDS))
    fmt = format or detect(data, source=source)
    if fmt == "ampbridge" and kind in ("json", "yaml"):
        policy = _io.loads(text, kind, source=source, base_dir=Path(source).parent if source else None)
        return Conversion(policy, source_format="ampbridge", target_format="ampbridge",
                          covers=frozenset(POLICY_FIELDS))
    if fmt == "ampbridge" and kind == "name":
        from .core.io import PRESETS, preset

        if data in PRESETS:
            return Conversion(preset(data), source_format="ampbridge", target_format="ampbridge",
                              covers=frozenset(POLICY_FIELDS))
    if fmt == "accelerate" and source and "base_dir" not in options:
        options["base_dir"] = Path(source).parent
    return read(data, fmt, _locate=locate, _source=source, **options)


def load(path: str | os.PathLike[str], format: str | None = None, **options: Any) -> Conversion:
    """Read a recipe file (``ds_config.json``, ``accelerate.yaml``, ``amp.toml``, a text file
    holding a precision name ...), detecting the format when not given.

    Example:
        >>> import json, tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "ds_config.json"
        >>> _ = f.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128}}))
        >>> load(f).result.loss_scale.mode
        'static'
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError([Problem("no such file", file=str(p))]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError([Problem(f"cannot read the file: {e}", file=str(p))]) from None
    return loads(text, format, source=str(p), suffix=p.suffix, **options)


# --- comparing a policy with another tool's settings ------------------------------------------------

_AUTOCAST_HINT = ("torch.autocast still runs its float32-list ops (layer_norm, softmax, ...) in float32 on CUDA, "
                  "but it pins no module")


def disagreements(policy: Policy, other: Conversion) -> list[Disagreement]:
    """Every field the other tool's settings decide (``other.covers``) where they differ from ``policy``.

    Example:
        >>> import ampbridge
        >>> ds = from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, release="modulo")
        >>> [d.field for d in disagreements(ampbridge.preset("mixed_bfloat16"), ds)][:2]
        ['compute_dtype', 'output_dtype']
    """
    result = other.result
    if isinstance(result, LossScaleConfig):
        result = policy.replace(loss_scale=result, phases=())
    if not isinstance(result, Policy):
        raise TypeError(f"disagreements needs a conversion to a Policy or LossScaleConfig, got {_type_name(result)}")
    fields = [f for f in POLICY_FIELDS if f in other.covers]
    out = []
    for name, mine, theirs in differences(policy.replace(phases=()), result.replace(phases=()), fields):
        origin = other.origins.get(name) or other.origins.get(name.split(".")[0])
        if origin is None and name.startswith("loss_scale."):
            origin = other.origins.get("loss_scale.mode")
        hint = None
        if name in ("keep_float32", "overrides") and other.source_format in ("accelerate", "lightning"):
            hint = _AUTOCAST_HINT
        if name == "compute_dtype" and mine == "auto":
            hint = "'auto' is resolved by the backend on a device"
        out.append(Disagreement("override" if name == "overrides" else name, mine, theirs, origin, hint))
    return out
