"""The shared conversion machinery every recipe module builds on: results, reading and writing helpers.

Holds Loss, Conversion, Disagreement; POLICY_FIELDS, _Reader and its typed getters (_get_bool,
_get_int, _get_number, _construct, _dtype_name); loss_scale_view and differences; _Writer and the
writing helpers (_policy_of, _require_concrete, _grad_scaler_losses, _expect_no_scaling); the torch
GradScaler-argument helpers shared by Accelerate, Lightning and grad-scaler; trainer_dtype (a
trainer's precision flag -> compute dtype); _parse_text / _parse_recipe / _read_file (a recipe's text).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.dtypes import canonical_dtype
from ..core.fields import Collector, key_text
from ..core.loss_scale import LossScaleState, f32
from ..core.matching import did_you_mean
from ..core.policy import LossScaleConfig, Policy, Rule
from ..errors import PolicyError, Problem, UnsupportedOptionError

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


class _Findings:
    """The losses and notes of one conversion, each said once, in order (reading and writing alike)."""

    def __init__(self) -> None:
        self.losses: list[Loss] = []
        self.notes: list[str] = []

    def loss(self, setting: str, value: Any, reason: str) -> None:
        item = Loss(setting, value, reason)
        if item not in self.losses:
            self.losses.append(item)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


class _Reader(_Findings):
    """Collects problems (with file and line), losses, notes and origins while a source is read."""

    def __init__(self, fmt: str, source: str | None = None,
                 locate: Callable[[tuple], int | None] | None = None, prefix: tuple = ()):
        super().__init__()
        self.fmt, self.source, self.prefix = fmt, source, prefix
        self._line = locate or (lambda path: None)
        self.out = Collector(lambda path: (source, self._line(tuple(path))))
        self.origins: dict[str, str] = {}

    def problem(self, path: tuple, message: str, *, value: Any = _MISSING, accepted: str | None = None,
                hint: str | None = None) -> None:
        self.out.add(self.prefix + tuple(path), message, value=value, accepted=accepted, hint=hint)

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
    if r.skip_nonfinite and r.max_consecutive_skips is not None:
        view["max_consecutive_skips"] = r.max_consecutive_skips
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
        if r.first_growth_interval not in (None, r.growth_interval):
            view["first_growth_interval"] = r.first_growth_interval
    return view


def differences(a: Policy, b: Policy, fields: Iterable[str] = POLICY_FIELDS) -> list[tuple[str, Any, Any]]:
    """``(field, a's value, b's value)`` for every field (among ``fields``) where two policies differ.

    Loss-scale settings compare through :func:`loss_scale_view` (``loss_scale.<key>``); ``fp8`` (not
    among the defaults) compares the ``[fp8]`` table key by key (``fp8.<key>``).

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
        elif name == "fp8":  # key by key (to_dict leaves out what current scaling does not read)
            fa, fb = a.fp8.to_dict(), b.fp8.to_dict()
            out += [(f"fp8.{k}", fa.get(k), fb.get(k)) for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]
        elif name == "phases":
            if a.phases != b.phases:
                out.append(("phase", len(a.phases), len(b.phases)))
        elif getattr(a, name) != getattr(b, name):
            out.append((name, getattr(a, name), getattr(b, name)))
    return out


# --- writing helpers ----------------------------------------------------------------------------

class _Writer(_Findings):
    """Collects the losses and notes of one export."""

    def __init__(self, fmt: str, policy: Policy):
        super().__init__()
        self.fmt, self.policy = fmt, policy
        self.realised: set[str] = set()  # loss-scale keys a writer wrote exactly (see done)

    def done(self, result: Any) -> Conversion:
        # the two settings few tools have: a loss unless the writer realised or already named them
        p = self.policy
        view = loss_scale_view(p.loss_scale, p.compute_dtype if p.compute_dtype != "auto" else "float32")
        named = {loss.setting for loss in self.losses}
        for key, what in (("first_growth_interval", "waits a different number of finite steps before the first "
                           "growth (at the start and after each overflow) than between growths"),
                          ("max_consecutive_skips", "applies a non-finite step after that many skipped in a row")):
            if key in view and key not in self.realised and not named & {f"loss_scale.{key}", "loss_scale"}:
                self.loss(f"loss_scale.{key}", view[key], f"{self.fmt} has no such setting: ampbridge {what}; "
                          f"{self.fmt} does not")
        return Conversion(result, tuple(self.losses), tuple(self.notes), "ampbridge", self.fmt)

    def loss_scale_only(self, given: Policy | LossScaleConfig, tool: str) -> None:
        """A format that holds the loss scale only: what else a whole policy sets is named as lost."""
        if isinstance(given, Policy):
            self.common(tool, pins_reason=f"{tool} holds the loss scale only; ampbridge's apply with the policy "
                        "file realises the layers' settings")

    # the settings most targets cannot hold at all
    def common(self, tool: str, *, pins: bool = False, matmul: bool = False, pins_reason: str = "",
               fp8: bool = False) -> None:
        p = self.policy
        if not fp8 and p.uses_fp8:
            self.loss("fp8", p.fp8.to_dict(), f"{tool} has no float8 setting: the [fp8] layers would run in the "
                      "compute dtype (write it for transformer-engine, torchao, keras or accelerate)")
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
        if p.kinds:
            self.loss("kinds", {k: list(v) for k, v in p.kinds}, f"{tool} has no [kinds] table: it names no "
                      "layer kinds" if pins else reason + " (so no [kinds] table either)")


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




def _expect_no_scaling(w: _Writer, p: Policy, tool: str) -> None:
    view = loss_scale_view(p.loss_scale, p.compute_dtype)
    if view["mode"] != "none":
        w.loss("loss_scale.mode", view["mode"], f"{tool} does not scale the loss")
    if view["skip_nonfinite"]:
        w.loss("loss_scale.skip_nonfinite", True, f"{tool} applies every optimizer step; it does not check for "
               "non-finite gradients")


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
    for key, factor in (("growth_factor", growth), ("backoff_factor", backoff)):
        if isinstance(factor, float) and isinstance(init, float) and 0.0 < factor != f32(factor):
            _double_factor_loss(r, prefix + key, factor, init)
    return {"mode": "dynamic", "initial_scale": init, "growth_factor": growth, "backoff_factor": backoff,
            "growth_interval": interval, "skip_nonfinite": True}


def _double_factor_loss(r: _Reader, key: str, factor: float, init: float) -> None:
    """torch's _amp_update_scale_ multiplies the float32 scale by the factor as a double, then rounds;
    ampbridge by the factor's float32 value. Name the first growth (or backoff) from ``init`` where they part."""
    mine = theirs = f32(init)
    for n in range(1, 100_000):
        mine, theirs = f32(mine * f32(factor)), f32(theirs * factor)
        if mine != theirs:
            kind = "growth" if factor > 1 else "backoff"
            r.loss(key, factor, f"not a float32 number: torch multiplies the float32 scale by the double {factor!r}, "
                   f"ampbridge by float32 {f32(factor)!r}; from init_scale {init!r} the scales part at {kind} number "
                   f"{n} ({theirs!r} in torch, {mine!r} here)")
            return
        if not math.isfinite(mine) or mine == 0.0 or not math.isfinite(theirs) or theirs == 0.0:
            return


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


# --- trainer precision (what fills DeepSpeed's "auto") --------------------------------------------

def trainer_dtype(value: Any, what: str = "auto") -> str:
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


# --- reading a recipe's text --------------------------------------------------------------------

_JMP_LIKE = re.compile(r"^\w+=\w+(,\w+=\w+)*$")
_TOML_ASSIGN = re.compile(r"^\s*[\w.\"'-]+\s*=")


def _parse_text(text: str, suffix: str, source: str | None) -> tuple[Any, Callable[[tuple], int | None], str]:
    """Parse a recipe's text: (data, key path -> line, how it was parsed: json|yaml|toml|name)."""
    from ..core import io as _io

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


def _read_file(p: Path) -> str:
    """A recipe file's text; a missing or unreadable file is a PolicyError naming it (the policy
    loader's reading, shared)."""
    from ..core.io import read_text

    return read_text(p)


def _parse_recipe(text: str, suffix: str, source: str | None) -> tuple[Any, Callable[[tuple], int | None], str]:
    """``_parse_text``, refusing an empty text."""
    if not text.strip():
        raise PolicyError([Problem("empty: no settings to read", file=source)])
    return _parse_text(text, suffix, source)
