"""The policy model: frozen ``Policy``, ``LossScaleConfig``, ``Rule`` and ``Phase``.

One table of fields (``TOP_FIELDS``, ``LOSS_SCALE_FIELDS``, ``RULE_FIELDS``) drives
validation, defaults, the JSON Schema and the canonical dump, so the four never disagree.
Objects validate themselves on construction (aliases such as ``"bf16"`` are normalised), and
the file loader runs the very same checks with file and line attached.

Example:
    >>> from ampbridge import Policy, LossScaleConfig
    >>> p = Policy(compute_dtype="fp16", keep_float32=["kind:norm"])
    >>> p.compute_dtype, p.reduce_dtype, p.loss_scale.resolve("float16").mode
    ('float16', 'float32', 'dynamic')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._dtypes import COMPUTE_DTYPES, DTYPE_ALIASES, STORAGE_DTYPES, canonical_dtype
from ._matching import compile_pattern
from .errors import PolicyError, Problem

__all__ = ["Policy", "LossScaleConfig", "Rule", "Phase", "FLOAT32_MAX"]

FLOAT32_MAX = math.ldexp(2.0 - math.ldexp(1.0, -23), 127)


class Invalid(Exception):
    """A value failed a field check: ``message`` says why, ``accepted`` what would do."""

    def __init__(self, message: str, accepted: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message, self.accepted, self.hint = message, accepted, hint


# --- field checks: each returns the canonical value or raises Invalid -----------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_dtype(v: Any) -> str:
    if not isinstance(v, str):
        raise Invalid("must be a dtype name", ", ".join(STORAGE_DTYPES) + " (or an alias: fp16, bf16, fp32, ...)")
    try:
        return canonical_dtype(v)
    except ValueError:
        hint = None
        if v.strip().lower() == "auto":
            hint = "'auto' is accepted for compute_dtype only"
        elif v.strip().lower().startswith("float8"):
            hint = "float8 formats are listed by 'ampbridge formats' but are not AMP storage dtypes"
        raise Invalid("unknown dtype", ", ".join(STORAGE_DTYPES) + " (aliases: fp16 half f16 bf16 fp32 f32 float single)", hint) from None


def check_compute_dtype(v: Any) -> str:
    if not isinstance(v, str):
        raise Invalid("must be a dtype name", ", ".join(COMPUTE_DTYPES))
    try:
        return canonical_dtype(v, allow_auto=True)
    except ValueError:
        raise Invalid("unknown compute dtype", ", ".join(COMPUTE_DTYPES) + " (aliases: fp16 half f16 bf16 fp32 f32 float single)") from None


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or v not in choices:
            from ._matching import did_you_mean

            hint = did_you_mean(v, choices) if isinstance(v, str) else None
            raise Invalid("not one of the accepted values", " | ".join(choices), hint)
        return v

    check.choices = choices  # type: ignore[attr-defined]
    return check


def check_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Invalid("must be a boolean", "true | false")
    return v


def check_version(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v != 1:
        raise Invalid("unsupported policy file version", "1")
    return 1


def _number(*, low: float | None = None, low_open: bool = False, high: float | None = None,
            high_open: bool = False, what: str) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if not _is_number(v) or not math.isfinite(v):
            raise Invalid("must be a finite number", what)
        x = float(v)
        if low is not None and (x <= low if low_open else x < low):
            raise Invalid("out of range", what)
        if high is not None and (x >= high if high_open else x > high):
            raise Invalid("out of range", what)
        return x

    check.what = what  # type: ignore[attr-defined]
    return check


def _integer(*, low: int, what: str) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise Invalid("must be an integer", what)
        if v < low:
            raise Invalid("out of range", what)
        return int(v)

    check.what = what  # type: ignore[attr-defined]
    return check


def check_pattern(v: Any) -> str:
    if not isinstance(v, str):
        raise Invalid("must be a pattern string", _PATTERN_ACCEPTED)
    try:
        compile_pattern(v)
    except ValueError as e:
        raise Invalid(str(e), None) from None
    return v


def check_patterns(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        raise Invalid("must be a list of patterns", _PATTERN_ACCEPTED, f'write [{v!r}]')
    if not isinstance(v, (list, tuple)):
        raise Invalid("must be a list of patterns", _PATTERN_ACCEPTED)
    return tuple(v)  # each element is checked with its own index by the caller


def check_match(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (list, tuple)) and v:
        return tuple(v)
    raise Invalid("must be a pattern or a non-empty list of patterns", _PATTERN_ACCEPTED)


_DTYPE_SCHEMA = {"type": "string", "enum": sorted(DTYPE_ALIASES)}
_COMPUTE_SCHEMA = {"type": "string", "enum": sorted(DTYPE_ALIASES) + ["auto"]}
_SCALE_SCHEMA = {"type": "number", "exclusiveMinimum": 0}
_PATTERN_SCHEMA = {"type": "string", "minLength": 1}
_PATTERN_ACCEPTED = "a path glob ('lm_head', 'encoder.*.norm', 'decoder.**'), 're:REGEX', 'kind:KIND' or 'type:ClassName'"
_POSITIVE_SCALE = f"a number > 0 and <= float32 max ({FLOAT32_MAX:.8g})"


@dataclass(frozen=True)
class FieldSpec:
    """One key of the policy file: its check, default, and a line of documentation."""

    name: str
    check: Callable[[Any], Any]
    default: Any
    doc: str
    schema: Mapping[str, Any] = field(default_factory=dict)  # JSON Schema of the value
    optional: bool = False  # absent / null is allowed and means "not set"


LOSS_SCALE_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("mode", _choice("auto", "dynamic", "static", "none"), "auto",
              "auto: dynamic for float16 compute, none otherwise",
              {"enum": ["auto", "dynamic", "static", "none"]}),
    FieldSpec("initial_scale", _number(low=0.0, low_open=True, high=FLOAT32_MAX, what=_POSITIVE_SCALE),
              65536.0, "starting scale (the fixed scale in static mode)",
              {**_SCALE_SCHEMA, "maximum": FLOAT32_MAX}),
    FieldSpec("growth_factor", _number(low=1.0, what="a finite number >= 1"), 2.0,
              "multiplier after growth_interval finite steps", {"type": "number", "minimum": 1}),
    FieldSpec("backoff_factor", _number(low=0.0, low_open=True, high=1.0, high_open=True,
                                        what="a number strictly between 0 and 1"), 0.5,
              "multiplier on an overflow", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    FieldSpec("growth_interval", _integer(low=1, what="an integer >= 1"), 2000,
              "consecutive finite steps before growing", {"type": "integer", "minimum": 1}),
    FieldSpec("hysteresis", _integer(low=1, what="an integer >= 1"), 1,
              "overflows tolerated before backing off (DeepSpeed's meaning)", {"type": "integer", "minimum": 1}),
    FieldSpec("consecutive_hysteresis", check_bool, False,
              "refill hysteresis on every finite step, not only at growth", {"type": "boolean"}),
    FieldSpec("min_scale", _number(low=0.0, low_open=True, high=FLOAT32_MAX, what=_POSITIVE_SCALE),
              None, "floor of the scale (absent: no floor)", {**_SCALE_SCHEMA, "maximum": FLOAT32_MAX},
              optional=True),
    FieldSpec("max_scale", _number(low=0.0, low_open=True, high=FLOAT32_MAX, what=_POSITIVE_SCALE),
              None, "ceiling of the scale (absent: no ceiling)", {**_SCALE_SCHEMA, "maximum": FLOAT32_MAX},
              optional=True),
    FieldSpec("on_min_scale", _choice("clamp", "warn", "error"), "clamp",
              "what an overflow at min_scale does", {"enum": ["clamp", "warn", "error"]}),
    FieldSpec("skip_nonfinite", check_bool, True,
              "skip the optimizer step when any gradient is inf/nan", {"type": "boolean"}),
)

RULE_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("match", check_match, None, "pattern or list of patterns",
              {"anyOf": [_PATTERN_SCHEMA, {"type": "array", "items": _PATTERN_SCHEMA, "minItems": 1}]}),
    FieldSpec("compute_dtype", check_dtype, None, "dtype the matched layers compute in", _DTYPE_SCHEMA,
              optional=True),
    FieldSpec("param_dtype", check_dtype, None, "dtype their parameters are stored in", _DTYPE_SCHEMA,
              optional=True),
    FieldSpec("output_dtype", check_dtype, None, "dtype their outputs are delivered in", _DTYPE_SCHEMA,
              optional=True),
)

TOP_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("version", check_version, 1, "policy file format version", {"const": 1}),
    FieldSpec("compute_dtype", check_compute_dtype, "float32", "dtype layers compute in", _COMPUTE_SCHEMA),
    FieldSpec("param_dtype", check_dtype, "float32", "dtype parameters are stored in (master weights)",
              _DTYPE_SCHEMA),
    FieldSpec("output_dtype", check_dtype, "float32", "dtype of the model's outputs", _DTYPE_SCHEMA),
    FieldSpec("reduce_dtype", check_dtype, None, "gradient all-reduce dtype (absent: param_dtype)",
              _DTYPE_SCHEMA, optional=True),
    FieldSpec("matmul_precision", _choice("highest", "high", "medium"), "highest",
              "float32 matmul precision (high: TF32 allowed)", {"enum": ["highest", "high", "medium"]}),
    FieldSpec("keep_float32", check_patterns, (), "layers pinned to float32",
              {"type": "array", "items": _PATTERN_SCHEMA}),
)

#: keys a [[phase]] table may hold besides the top-level settings
PHASE_BOUNDS = ("until_epoch", "until_step")
#: top-level keys that are tables or arrays of tables
TABLE_KEYS = ("override", "loss_scale", "phase")
TOP_KEYS: tuple[str, ...] = tuple(f.name for f in TOP_FIELDS) + ("extends",) + TABLE_KEYS
PHASE_KEYS: tuple[str, ...] = PHASE_BOUNDS + tuple(
    f.name for f in TOP_FIELDS if f.name != "version") + ("override", "loss_scale")
LOSS_SCALE_KEYS: tuple[str, ...] = tuple(f.name for f in LOSS_SCALE_FIELDS)


# --- shared validation ------------------------------------------------------------------------

KeyPath = tuple  # ("loss_scale", "growth_factor"), ("override", 2, "match"), ...


def key_text(path: KeyPath) -> str:
    """``("override", 2, "match")`` -> ``"override[2].match"``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class Collector:
    """Gathers problems with their key paths; ``locate`` turns a path into (file, line)."""

    def __init__(self, locate: Callable[[KeyPath], tuple[str | None, int | None]] | None = None):
        self.problems: list[Problem] = []
        self._locate = locate or (lambda path: (None, None))

    def add(self, path: KeyPath, message: str, *, value: Any = dataclasses.MISSING,
            accepted: str | None = None, hint: str | None = None) -> None:
        file, line = self._locate(path)
        kwargs: dict[str, Any] = {}
        if value is not dataclasses.MISSING:
            kwargs["value"] = value
        problem = Problem(message, key=key_text(path), file=file, line=line, accepted=accepted,
                          hint=hint, **kwargs)
        if problem not in self.problems:
            self.problems.append(problem)

    def raise_if_any(self) -> None:
        if self.problems:
            raise PolicyError(self.problems)


def check_fields(specs: Iterable[FieldSpec], raw: Mapping[str, Any], where: Callable[[str], KeyPath],
                 out: Collector) -> dict[str, Any]:
    """Check the keys of ``raw`` that ``specs`` describe; return canonical values (absent: default)."""
    values: dict[str, Any] = {}
    for spec in specs:
        if spec.name not in raw or (raw[spec.name] is None and spec.optional):
            values[spec.name] = spec.default
            continue
        v = raw[spec.name]
        try:
            values[spec.name] = spec.check(v)
        except Invalid as e:
            out.add(where(spec.name), e.message, value=v, accepted=e.accepted, hint=e.hint)
            values[spec.name] = spec.default
    return values


def check_loss_scale_consistency(values: Mapping[str, Any], where: Callable[[str], KeyPath],
                                 out: Collector) -> None:
    lo, hi, init = values.get("min_scale"), values.get("max_scale"), values.get("initial_scale")
    if lo is not None and hi is not None and lo > hi:
        out.add(where("min_scale"), "min_scale is greater than max_scale", value=lo,
                accepted=f"a value <= max_scale ({hi})")
    if values.get("mode") in ("auto", "dynamic") and init is not None:
        if lo is not None and init < lo:
            out.add(where("initial_scale"), "initial_scale is below min_scale", value=init,
                    accepted=f"a value >= min_scale ({lo})")
        if hi is not None and init > hi:
            out.add(where("initial_scale"), "initial_scale is above max_scale", value=init,
                    accepted=f"a value <= max_scale ({hi})")


def check_pattern_list(patterns: Iterable[Any], where: Callable[[int], KeyPath], out: Collector) -> None:
    for i, pattern in enumerate(patterns):
        try:
            check_pattern(pattern)
        except Invalid as e:
            has_accepted = "accepted" in e.message
            out.add(where(i), e.message, value=pattern,
                    accepted=None if has_accepted else (e.accepted or _PATTERN_ACCEPTED))


# --- the frozen objects -----------------------------------------------------------------------

def _set(obj: Any, **values: Any) -> None:
    for k, v in values.items():
        object.__setattr__(obj, k, v)


@dataclass(frozen=True)
class LossScaleConfig:
    """Loss-scale settings; see DESIGN.md "Loss scaling: the reference algorithm".

    Example:
        >>> LossScaleConfig(growth_interval=100).resolve("float16").mode
        'dynamic'
    """

    mode: str = "auto"
    initial_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float | None = None
    max_scale: float | None = None
    on_min_scale: str = "clamp"
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        out = Collector()
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values = check_fields(LOSS_SCALE_FIELDS, raw, lambda k: ("loss_scale", k), out)
        check_loss_scale_consistency(values, lambda k: ("loss_scale", k), out)
        out.raise_if_any()
        _set(self, **values)

    def resolve(self, compute_dtype: str) -> "LossScaleConfig":
        """Resolve ``mode = "auto"``: dynamic when computing in float16, none otherwise."""
        if self.mode != "auto":
            return self
        return dataclasses.replace(self, mode="dynamic" if compute_dtype == "float16" else "none")

    def replace(self, **changes: Any) -> "LossScaleConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in LOSS_SCALE_FIELDS
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Rule:
    """One override: the layers ``match`` selects, and the dtypes it sets (None: policy's).

    Example:
        >>> Rule("decoder.**.attn", compute_dtype="fp32").match
        ('decoder.**.attn',)
    """

    match: tuple[str, ...]
    compute_dtype: str | None = None
    param_dtype: str | None = None
    output_dtype: str | None = None

    def __post_init__(self) -> None:
        out = Collector()
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values = check_fields(RULE_FIELDS, raw, lambda k: ("override", k), out)
        if values["match"] is not None:
            check_pattern_list(values["match"], lambda i: ("override", "match", i), out)
        if all(values[k] is None for k in ("compute_dtype", "param_dtype", "output_dtype")):
            out.add(("override",), "an override must set at least one of compute_dtype, "
                    "param_dtype, output_dtype")
        out.raise_if_any()
        _set(self, **values)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"match": self.match[0] if len(self.match) == 1 else list(self.match)}
        for k in ("compute_dtype", "param_dtype", "output_dtype"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass(frozen=True)
class Phase:
    """One entry of a precision schedule: the settings in force until a step or epoch.

    ``policy`` is the complete policy while the phase lasts (top-level keys with the
    phase's keys laid over them). ``until_epoch``/``until_step`` is exclusive; a phase with
    neither lasts for ever and must be the last one.
    """

    policy: "Policy"
    until_epoch: int | None = None
    until_step: int | None = None
    reset_loss_scale: bool = False

    def __post_init__(self) -> None:
        if self.until_epoch is not None and self.until_step is not None:
            raise PolicyError([Problem("a phase ends at until_epoch or until_step, not both",
                                       key="phase")])
        for name in PHASE_BOUNDS:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise PolicyError([Problem("must be an integer >= 1", key=f"phase.{name}", value=v)])
        if self.policy.phases:
            raise PolicyError([Problem("a phase cannot hold phases of its own", key="phase")])

    @property
    def unit(self) -> str | None:
        return "epoch" if self.until_epoch is not None else "step" if self.until_step is not None else None

    @property
    def until(self) -> int | None:
        return self.until_epoch if self.until_epoch is not None else self.until_step


def check_phase_order(bounds: "Iterable[tuple[str | None, int | None]]", out: Collector) -> None:
    """Check a schedule's ``(unit, until)`` pairs: one unit, increasing ends, only the last open."""
    bounds = list(bounds)
    units = [u for u, _ in bounds if u]
    if len(set(units)) > 1:
        first = next(i for i, (u, _) in enumerate(bounds) if u and u != units[0])
        out.add(("phase", first), "phases mix until_epoch and until_step; use one unit for the "
                "whole schedule", accepted="until_epoch in every phase, or until_step in every phase")
        return
    previous = 0
    for i, (unit, until) in enumerate(bounds):
        if until is None:
            if i != len(bounds) - 1:
                out.add(("phase", i), "only the last phase may leave out until_epoch/until_step "
                        "(every other phase needs an end)")
            continue
        if until <= previous:
            out.add(("phase", i, f"until_{unit}"), "phases must be in order and must not overlap: "
                    f"this phase ends at or before the previous one ({previous})", value=until,
                    accepted=f"an integer > {previous}")
        previous = until


@dataclass(frozen=True)
class Policy:
    """A complete, validated mixed-precision policy (frozen; compare and hash by value).

    Example:
        >>> p = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm", "lm_head"))
        >>> [label for label, _ in p.rules]
        ['keep_float32[0]', 'keep_float32[1]']
    """

    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    output_dtype: str = "float32"
    reduce_dtype: str | None = None
    matmul_precision: str = "highest"
    keep_float32: tuple[str, ...] = ()
    overrides: tuple[Rule, ...] = ()
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    phases: tuple[Phase, ...] = ()
    version: int = 1
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        out = Collector()
        raw = {f.name: getattr(self, f.name) for f in TOP_FIELDS}
        values = check_fields(TOP_FIELDS, raw, lambda k: (k,), out)
        check_pattern_list(values["keep_float32"], lambda i: ("keep_float32", i), out)
        if values["reduce_dtype"] is None:
            values["reduce_dtype"] = values["param_dtype"]
        overrides = tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.overrides)
        loss_scale = self.loss_scale
        if isinstance(loss_scale, Mapping):
            loss_scale = LossScaleConfig(**loss_scale)
        if not isinstance(loss_scale, LossScaleConfig):
            out.add(("loss_scale",), "must be a LossScaleConfig or a table", value=loss_scale)
        phases = tuple(self.phases)
        if not all(isinstance(p, Phase) for p in phases):
            out.add(("phase",), "must be a sequence of Phase objects")
        else:
            check_phase_order([(p.unit, p.until) for p in phases], out)
        out.raise_if_any()
        _set(self, overrides=overrides, loss_scale=loss_scale, phases=phases, **values)

    # --- derived views ---

    @property
    def rules(self) -> tuple[tuple[str, Rule], ...]:
        """Every pinning rule in the order they apply (later wins): keep_float32, then overrides."""
        pins = tuple((f"keep_float32[{i}]", Rule((p,), "float32", "float32", "float32"))
                     for i, p in enumerate(self.keep_float32))
        return pins + tuple((f"override[{i}]", r) for i, r in enumerate(self.overrides))

    @property
    def resolved_loss_scale(self) -> LossScaleConfig:
        """The loss-scale settings with ``mode = "auto"`` resolved against ``compute_dtype``."""
        return self.loss_scale.resolve(self.compute_dtype)

    @property
    def phase_unit(self) -> str | None:
        """``"epoch"`` or ``"step"`` when the policy has a schedule, else None."""
        return next((p.unit for p in self.phases if p.unit), None)

    def phase_index(self, *, step: int | None = None, epoch: int | None = None) -> int | None:
        """Index of the phase in force, or None when no phase is (no schedule, or past the last)."""
        if not self.phases:
            return None
        unit = self.phase_unit
        value = epoch if unit == "epoch" else step
        if unit is None:
            return 0
        if value is None:
            raise ValueError(f"this policy's phases are scheduled by {unit}; pass {unit}=")
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{unit} must be an integer >= 0, got {value!r}")
        for i, p in enumerate(self.phases):
            if p.until is None or value < p.until:
                return i
        return None

    def at(self, *, step: int | None = None, epoch: int | None = None) -> "Policy":
        """The policy in force at a step or epoch: the phase's settings, without the schedule.

        Example:
            >>> import ampbridge
            >>> p = ampbridge.loads('''
            ... compute_dtype = "float16"
            ... [[phase]]
            ... until_epoch = 2
            ... compute_dtype = "float32"
            ... ''')
            >>> p.at(epoch=1).compute_dtype, p.at(epoch=2).compute_dtype
            ('float32', 'float16')
        """
        if not self.phases:
            return self
        i = self.phase_index(step=step, epoch=epoch)
        chosen = self.phases[i].policy if i is not None else dataclasses.replace(self, phases=())
        return dataclasses.replace(chosen, source=self.source)

    def replace(self, **changes: Any) -> "Policy":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The canonical plain-data form (what ``dumps`` writes); phases hold only their changes."""
        from ._io import policy_to_dict

        return policy_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policy":
        """Build a policy from plain data with the file loader's checks (the inverse of to_dict)."""
        from ._io import policy_from_dict

        return policy_from_dict(data)
