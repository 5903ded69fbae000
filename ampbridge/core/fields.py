"""Each policy key's check, default and schema, and the collector that gathers problems.

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

from ..errors import PolicyError, Problem
from .dtypes import COMPUTE_DTYPES, DTYPE_ALIASES, STORAGE_DTYPES, canonical_dtype
from .matching import compile_pattern

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
            from .matching import did_you_mean

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


#: the largest step count a backend can hold: JAX's and torch's loss-scale counters are int32
INT32_MAX = 2 ** 31 - 1


def _integer(*, low: int, what: str, high: int = INT32_MAX) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise Invalid("must be an integer", what)
        if not low <= v <= high:
            raise Invalid("out of range", what)
        return int(v)

    check.what = what  # type: ignore[attr-defined]
    return check


def _is_plain_path(v: str) -> bool:
    """A dotted path with no wildcard or prefix, every segment non-empty: valid without compiling."""
    return (bool(v.strip()) and "*" not in v and "?" not in v and ":" not in v and ".." not in v
            and not v.startswith(".") and not v.endswith("."))


def check_pattern(v: Any) -> str:
    if not isinstance(v, str):
        raise Invalid("must be a pattern string", _PATTERN_ACCEPTED)
    if _is_plain_path(v):  # the common case, checked without compiling (a policy may list a million)
        return v
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
    FieldSpec("growth_interval", _integer(low=1, what=f"an integer from 1 to {INT32_MAX} (int32 counters)"), 2000,
              "consecutive finite steps before growing", {"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
    FieldSpec("hysteresis", _integer(low=1, what=f"an integer from 1 to {INT32_MAX} (int32 counters)"), 1,
              "overflows tolerated before backing off (DeepSpeed's meaning)",
              {"type": "integer", "minimum": 1, "maximum": INT32_MAX}),
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
    FieldSpec("first_growth_interval", _integer(low=1, what=f"an integer from 1 to {INT32_MAX} (int32 counters)"),
              None, "finite steps before the first growth, at the start and after each non-finite step "
              "(absent: growth_interval)", {"type": "integer", "minimum": 1, "maximum": INT32_MAX}, optional=True),
    FieldSpec("max_consecutive_skips", _integer(low=0, what=f"an integer from 0 to {INT32_MAX}"),
              None,
              "after this many non-finite steps skipped in a row, non-finite steps are applied until a "
              "finite one (absent: always skip)", {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
              optional=True),
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

#: the float8 formats, by their short names (float8_e4m3fn and float8_e5m2 in the frameworks)
FP8_FORMATS = ("e4m3", "e5m2")
#: the largest amax history a policy may ask for (the frameworks keep it as a float32 vector per tensor)
FP8_MAX_HISTORY = 1 << 20
#: the largest margin: the scale is divided by 2**margin, and float32 has 127 binades above 1
FP8_MAX_MARGIN = 64

FP8_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("match", check_patterns, (), "layers whose matmuls run in float8 (pins and keep_float32 win; "
              "empty: FP8 off)", {"type": "array", "items": _PATTERN_SCHEMA}),
    FieldSpec("forward", _choice(*FP8_FORMATS), "e4m3", "format of activations and weights",
              {"enum": list(FP8_FORMATS)}),
    FieldSpec("backward", _choice(*FP8_FORMATS), "e5m2", "format of output gradients",
              {"enum": list(FP8_FORMATS)}),
    FieldSpec("scaling", _choice("delayed", "current"), "delayed",
              "delayed: scale from an amax history of past steps; current: from this step's amax",
              {"enum": ["delayed", "current"]}),
    FieldSpec("amax_history", _integer(low=1, high=FP8_MAX_HISTORY, what=f"an integer from 1 to {FP8_MAX_HISTORY}"),
              1024, "steps of amax kept per tensor (delayed scaling only)",
              {"type": "integer", "minimum": 1, "maximum": FP8_MAX_HISTORY}),
    FieldSpec("amax_compute", _choice("max", "most_recent"), "max",
              "amax taken from the history: its max, or the latest entry (delayed scaling only)",
              {"enum": ["max", "most_recent"]}),
    FieldSpec("margin", _integer(low=0, high=FP8_MAX_MARGIN, what=f"an integer from 0 to {FP8_MAX_MARGIN}"), 0,
              "the scale leaves 2**margin of headroom below the format's max",
              {"type": "integer", "minimum": 0, "maximum": FP8_MAX_MARGIN}),
)
FP8_KEYS: tuple[str, ...] = tuple(f.name for f in FP8_FIELDS)
#: [fp8] keys that only delayed scaling reads
FP8_DELAYED_ONLY = ("amax_history", "amax_compute")


def check_fp8_consistency(values: Mapping[str, Any], given: "Iterable[str]", where: Callable[[str], KeyPath],
                          out: "Collector") -> None:
    """Delayed-only keys set (``given``) under ``scaling = "current"`` are an error, not ignored."""
    if values.get("scaling") != "current":
        return
    for key in FP8_DELAYED_ONLY:
        if key in given:
            out.add(where(key), 'is read by delayed scaling only, and scaling = "current"',
                    value=values.get(key), accepted=f'no {key}, or scaling = "delayed"')


#: keys a [[phase]] table may hold besides the top-level settings
PHASE_BOUNDS = ("until_epoch", "until_step")
#: top-level keys that are tables or arrays of tables
TABLE_KEYS = ("override", "loss_scale", "phase", "kinds", "fp8")
TOP_KEYS: tuple[str, ...] = tuple(f.name for f in TOP_FIELDS) + ("extends",) + TABLE_KEYS
PHASE_KEYS: tuple[str, ...] = PHASE_BOUNDS + tuple(
    f.name for f in TOP_FIELDS if f.name != "version") + ("override", "loss_scale", "fp8")
LOSS_SCALE_KEYS: tuple[str, ...] = tuple(f.name for f in LOSS_SCALE_FIELDS)


KINDS_DOC = ("classes given a portable kind, explicitly: kind = [class name or 're:REGEX' on the class name]; "
             "beats the backends' own tables and inference; 'none' takes a kind away")


def kinds_schema() -> dict[str, Any]:
    from .matching import KINDS

    names = {"type": "array", "items": {"type": "string", "minLength": 1}}
    return {"type": "object", "additionalProperties": False, "description": KINDS_DOC,
            "properties": {k: dict(names) for k in KINDS + ("none",)}}


def check_kinds(raw: Any, where: "Callable[[KeyPath], KeyPath]", out: "Collector") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The ``[kinds]`` table as ``((kind, (class name or 're:...', ...)), ...)`` in the table's order."""
    import re

    from .matching import KINDS, did_you_mean

    accepted_kinds = KINDS + ("none",)
    if isinstance(raw, tuple) and all(isinstance(e, tuple) and len(e) == 2 for e in raw):
        raw = dict(raw)
    if not isinstance(raw, Mapping):
        out.add(where(("kinds",)), "must be a table of kind = [class names]", value=raw,
                accepted='[kinds] with lines such as norm = ["LlamaRMSNorm", "re:.*RMSNorm$"]')
        return ()
    result, owner = [], {}
    for kind, names in raw.items():
        if kind not in accepted_kinds:
            hint = did_you_mean(str(kind), accepted_kinds)
            out.add(where(("kinds", kind)), "unknown kind in [kinds]" + (f"; {hint}" if hint else ""),
                    accepted=", ".join(accepted_kinds))
            continue
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            out.add(where(("kinds", kind)), "must be a list of class names", value=names,
                    accepted="class names or 're:REGEX' (a full match on the class name)",
                    hint=f"write [{names!r}]" if isinstance(names, str) else None)
            continue
        good = []
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name.strip():
                out.add(where(("kinds", kind, i)), "must be a non-empty class name", value=name,
                        accepted="a class name or 're:REGEX'")
                continue
            if name.startswith("re:"):
                try:
                    re.compile(name[3:])
                except re.error as e:
                    out.add(where(("kinds", kind, i)), f"not a valid regular expression: {e}", value=name)
                    continue
            elif name in owner and owner[name] != kind:
                out.add(where(("kinds", kind, i)), f"{name!r} is already listed under {owner[name]!r}", value=name,
                        accepted="each class name under one kind")
                continue
            else:
                owner[name] = kind
            good.append(name)
        result.append((str(kind), tuple(good)))
    return tuple(result)


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
    if values.get("max_consecutive_skips") is not None and values.get("skip_nonfinite") is False:
        out.add(where("max_consecutive_skips"), "max_consecutive_skips limits skipping, and "
                "skip_nonfinite = false skips nothing", value=values["max_consecutive_skips"],
                accepted="no max_consecutive_skips, or skip_nonfinite = true")
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
