"""The policy model: frozen ``Policy``, ``LossScaleConfig``, ``Rule`` and ``Phase``, and how a
plain document (a parsed file, ``to_dict``'s output) becomes one.

Objects validate themselves on construction (aliases such as ``"bf16"`` are normalised) with the
checks of :mod:`ampbridge.core.fields`; the file loader runs the very same checks with file and
line attached.

Example:
    >>> from ampbridge import Policy, LossScaleConfig
    >>> p = Policy(compute_dtype="fp16", keep_float32=["kind:norm"])
    >>> p.compute_dtype, p.reduce_dtype, p.loss_scale.resolve("float16").mode
    ('float16', 'float32', 'dynamic')
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PolicyError, Problem
from .fields import (
    FLOAT32_MAX,
    FP8_DELAYED_ONLY,
    FP8_FIELDS,
    FP8_KEYS,
    LOSS_SCALE_FIELDS,
    LOSS_SCALE_KEYS,
    PHASE_BOUNDS,
    PHASE_KEYS,
    RULE_FIELDS,
    TOP_FIELDS,
    TOP_KEYS,
    Collector,
    KeyPath,
    check_fields,
    check_fp8_consistency,
    check_kinds,
    check_loss_scale_consistency,
    check_pattern_list,
    check_phase_order,
)
from .matching import did_you_mean

__all__ = ["Policy", "LossScaleConfig", "Fp8Config", "Rule", "Phase", "FLOAT32_MAX", "PRESETS"]

#: The built-in presets (Keras policy names where Keras has one).
PRESETS: dict[str, dict[str, Any]] = {
    "float32": {"compute_dtype": "float32", "param_dtype": "float32", "output_dtype": "float32"},
    "mixed_float16": {"compute_dtype": "float16", "param_dtype": "float32", "output_dtype": "float32",
                      "loss_scale": {"mode": "dynamic"}},
    "mixed_bfloat16": {"compute_dtype": "bfloat16", "param_dtype": "float32", "output_dtype": "float32"},
    "bfloat16": {"compute_dtype": "bfloat16", "param_dtype": "bfloat16", "output_dtype": "bfloat16"},
    "float16": {"compute_dtype": "float16", "param_dtype": "float16", "output_dtype": "float16",
                "loss_scale": {"mode": "dynamic"}},
}


# --- the frozen objects -----------------------------------------------------------------------

def _set(obj: Any, **values: Any) -> None:
    for k, v in values.items():
        object.__setattr__(obj, k, v)


@dataclass(frozen=True)
class LossScaleConfig:
    """Loss-scale settings; the algorithm: ``ampbridge/core/loss_scale.py`` (docs/policy.md).

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
    first_growth_interval: int | None = None
    max_consecutive_skips: int | None = None

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
class Fp8Config:
    """The ``[fp8]`` table: which layers' matmuls run in float8, in which formats, scaled how.

    ``match`` empty (the default) means FP8 is off. The scaling is
    :mod:`ampbridge.core.fp8`'s reference algorithm.

    Example:
        >>> Fp8Config(match=["kind:linear"], scaling="current").enabled
        True
    """

    match: tuple[str, ...] = ()
    forward: str = "e4m3"
    backward: str = "e5m2"
    scaling: str = "delayed"
    amax_history: int = 1024
    amax_compute: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        out = Collector()
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values = check_fields(FP8_FIELDS, raw, lambda k: ("fp8", k), out)
        check_pattern_list(values["match"], lambda i: ("fp8", "match", i), out)
        given = [f.name for f in FP8_FIELDS if values[f.name] != f.default]
        check_fp8_consistency(values, given, lambda k: ("fp8", k), out)
        out.raise_if_any()
        _set(self, **values)

    @property
    def enabled(self) -> bool:
        return bool(self.match)

    def replace(self, **changes: Any) -> "Fp8Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every key, but not the delayed-only ones under current scaling (the loader refuses them)."""
        d = {f.name: getattr(self, f.name) for f in FP8_FIELDS}
        d["match"] = list(self.match)
        if self.scaling == "current":
            for key in FP8_DELAYED_ONLY:
                del d[key]
        return d


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
    fp8: Fp8Config = field(default_factory=Fp8Config)
    phases: tuple[Phase, ...] = ()
    version: int = 1
    source: str | None = field(default=None, compare=False, repr=False)
    #: the ``[kinds]`` table: ``((kind, (class name or "re:...", ...)), ...)``; a mapping is accepted
    kinds: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        out = Collector()
        raw = {f.name: getattr(self, f.name) for f in TOP_FIELDS}
        values = check_fields(TOP_FIELDS, raw, lambda k: (k,), out)
        values["kinds"] = check_kinds(self.kinds, lambda p: p, out) if self.kinds else ()
        check_pattern_list(values["keep_float32"], lambda i: ("keep_float32", i), out)
        if values["reduce_dtype"] is None:
            values["reduce_dtype"] = values["param_dtype"]
        overrides = tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.overrides)
        loss_scale = self.loss_scale
        if isinstance(loss_scale, Mapping):
            loss_scale = LossScaleConfig(**loss_scale)
        if not isinstance(loss_scale, LossScaleConfig):
            out.add(("loss_scale",), "must be a LossScaleConfig or a table", value=loss_scale)
        fp8 = self.fp8
        if isinstance(fp8, Mapping):
            fp8 = Fp8Config(**fp8)
        if not isinstance(fp8, Fp8Config):
            out.add(("fp8",), "must be an Fp8Config or a table", value=fp8)
        phases = tuple(self.phases)
        if not all(isinstance(p, Phase) for p in phases):
            out.add(("phase",), "must be a sequence of Phase objects")
        else:
            check_phase_order([(p.unit, p.until) for p in phases], out)
        out.raise_if_any()
        _set(self, overrides=overrides, loss_scale=loss_scale, fp8=fp8, phases=phases, **values)

    # --- derived views ---

    @functools.cached_property
    def rules(self) -> tuple[tuple[str, Rule], ...]:
        """Every pinning rule in the order they apply (later wins): keep_float32, then overrides."""
        # cached: the policy is frozen, and a backend asks once per layer (10,000 Rule checks per plan)
        pins = tuple((f"keep_float32[{i}]", Rule((p,), "float32", "float32", "float32"))
                     for i, p in enumerate(self.keep_float32))
        return pins + tuple((f"override[{i}]", r) for i, r in enumerate(self.overrides))

    @property
    def resolved_loss_scale(self) -> LossScaleConfig:
        """The loss-scale settings with ``mode = "auto"`` resolved against ``compute_dtype``."""
        return self.loss_scale.resolve(self.compute_dtype)

    @property
    def uses_fp8(self) -> bool:
        """Whether the policy or any of its phases puts layers in float8 (an ``[fp8]`` table with a match)."""
        return self.fp8.enabled or any(ph.policy.fp8.enabled for ph in self.phases)

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
        return self.phase_policy(self.phase_index(step=step, epoch=epoch))

    def phase_policy(self, index: int | None) -> "Policy":
        """The policy of phase ``index`` (None: after a closed last phase, the top-level settings),
        without the schedule; ``source`` and ``[kinds]`` are the whole policy's. Every backend's
        phase switch asks this, so a phase's policy is worked out in one place.

        Example:
            >>> import ampbridge
            >>> p = ampbridge.loads('''
            ... compute_dtype = "float16"
            ... [[phase]]
            ... until_step = 5
            ... compute_dtype = "float32"
            ... ''')
            >>> p.phase_policy(0).compute_dtype, p.phase_policy(None).compute_dtype
            ('float32', 'float16')
        """
        if not self.phases:
            return self
        chosen = self.phases[index].policy if index is not None else dataclasses.replace(self, phases=())
        return dataclasses.replace(chosen, source=self.source, kinds=self.kinds)  # [kinds] is not per phase

    def replace(self, **changes: Any) -> "Policy":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The canonical plain-data form (what ``dumps`` writes); phases hold only their changes."""
        return policy_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policy":
        """Build a policy from plain data with the file loader's checks (the inverse of to_dict).

        ``extends`` may name a preset; a file path needs :func:`ampbridge.load` or :func:`ampbridge.loads`.
        """
        out = Collector()
        data = check_document_shape(dict(data) if isinstance(data, Mapping) else data, out)
        base = data.pop("extends", None)
        if base is not None:
            if isinstance(base, str) and base in PRESETS:
                data = _over_preset(PRESETS[base], data)
            else:
                out.add(("extends",), "from_dict resolves a preset; a file in extends needs ampbridge.load or loads",
                        value=base, accepted="a preset (" + ", ".join(PRESETS) + ")")
        policy = build(data, None, out)
        if policy is None or out.problems:
            raise PolicyError(out.problems)
        return policy


# --- from and to plain data ------------------------------------------------------------------

def _over_preset(preset: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` over a preset as ``extends`` merges it: tables key by key, everything else replaced."""
    merged = {**preset, **data}
    if isinstance(preset.get("loss_scale"), dict) and isinstance(data.get("loss_scale"), dict):
        merged["loss_scale"] = {**preset["loss_scale"], **data["loss_scale"]}
    if isinstance(preset.get("fp8"), dict) and isinstance(data.get("fp8"), dict):
        merged["fp8"] = merge_fp8(preset["fp8"], data["fp8"])
    return merged


def merge_fp8(base: Any, over: Mapping[str, Any]) -> dict[str, Any]:
    """``over``'s [fp8] keys laid over ``base``'s; switching to current scaling drops the delayed-only
    keys ``over`` does not set itself (they described the inherited delayed scaling)."""
    merged = {**(base if isinstance(base, dict) else {}), **over}
    if over.get("scaling") == "current":
        for key in FP8_DELAYED_ONLY:
            if key not in over:
                merged.pop(key, None)
    return merged


def check_keys(data: Mapping[str, Any], accepted: tuple[str, ...], path: KeyPath, out: Collector,
                what: str) -> None:
    for key in data:
        if key not in accepted:
            hint = did_you_mean(str(key), accepted)
            if hint is None and key in LOSS_SCALE_KEYS and "loss_scale" in accepted:
                hint = "it belongs in the [loss_scale] table"
            if hint is None and key in FP8_KEYS and key != "match" and "fp8" in accepted:
                hint = "it belongs in the [fp8] table"
            out.add(path + (key,), f"unknown key in {what}" + (f"; {hint}" if hint else ""),
                    accepted=", ".join(accepted))


def check_document_shape(data: Any, out: Collector) -> dict[str, Any]:
    """Unknown keys and table shapes of one document, reported against that document."""
    if not isinstance(data, dict):
        out.add((), "a policy document must be a table/mapping at the top level",
                value=data)
        return {}
    check_keys(data, TOP_KEYS, (), out, "the policy")
    if "loss_scale" in data:
        if isinstance(data["loss_scale"], dict):
            check_keys(data["loss_scale"], LOSS_SCALE_KEYS, ("loss_scale",), out, "[loss_scale]")
        else:
            out.add(("loss_scale",), "must be a table", value=data["loss_scale"],
                    accepted="a [loss_scale] table of " + ", ".join(LOSS_SCALE_KEYS))
    if "fp8" in data:
        _check_fp8_shape(data["fp8"], ("fp8",), out)
    for key, keys, what in (("override", tuple(f.name for f in RULE_FIELDS), "[[override]]"),
                            ("phase", PHASE_KEYS, "[[phase]]")):
        if key not in data:
            continue
        items = data[key]
        if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
            out.add((key,), f"must be an array of tables ({what})", value=items)
            continue
        for i, table in enumerate(items):
            check_keys(table, keys, (key, i), out, f"{what} number {i}")
            if key == "phase":
                for j, rule in enumerate(table.get("override", []) if isinstance(table.get("override"), list) else []):
                    if isinstance(rule, dict):
                        check_keys(rule, tuple(f.name for f in RULE_FIELDS), (key, i, "override", j), out,
                                    "[[phase.override]]")
                ls = table.get("loss_scale")
                if isinstance(ls, dict):
                    check_keys(ls, LOSS_SCALE_KEYS + ("reset",), (key, i, "loss_scale"), out,
                                "[phase.loss_scale]")
                elif ls is not None:
                    out.add((key, i, "loss_scale"), "must be a table", value=ls)
                if "fp8" in table:
                    _check_fp8_shape(table["fp8"], (key, i, "fp8"), out)
    return data


def _check_fp8_shape(table: Any, path: KeyPath, out: Collector) -> None:
    if isinstance(table, dict):
        check_keys(table, FP8_KEYS, path, out, "[fp8]")
    else:
        out.add(path, "must be a table", value=table, accepted="an [fp8] table of " + ", ".join(FP8_KEYS))


def build_settings(raw: Mapping[str, Any], where: Callable[[KeyPath], KeyPath], out: Collector) -> dict[str, Any]:
    """Check the non-schedule settings of ``raw`` and return Policy keyword arguments."""
    values = check_fields(TOP_FIELDS, raw, lambda k: where((k,)), out)
    check_pattern_list(values["keep_float32"], lambda i: where(("keep_float32", i)), out)
    ls_raw = raw.get("loss_scale", {})
    ls_values = check_fields(LOSS_SCALE_FIELDS, ls_raw if isinstance(ls_raw, dict) else {},
                             lambda k: where(("loss_scale", k)), out)
    check_loss_scale_consistency(ls_values, lambda k: where(("loss_scale", k)), out)
    fp8_raw = raw.get("fp8", {}) if isinstance(raw.get("fp8"), dict) else {}
    fp8_values = check_fields(FP8_FIELDS, fp8_raw, lambda k: where(("fp8", k)), out)
    check_pattern_list(fp8_values["match"], lambda i: where(("fp8", "match", i)), out)
    check_fp8_consistency(fp8_values, fp8_raw, lambda k: where(("fp8", k)), out)
    rules: list[Rule] = []
    overrides = raw.get("override", [])
    if not isinstance(overrides, list):
        overrides = []  # the shape error is already reported
    for i, rule in enumerate(overrides):
        if not isinstance(rule, dict):
            continue
        r_values = check_fields(RULE_FIELDS, rule, lambda k, i=i: where(("override", i, k)), out)
        if "match" not in rule:
            out.add(where(("override", i)), "an override needs a match key", accepted="match = PATTERN")
            continue
        if r_values["match"] is None:
            continue
        check_pattern_list(r_values["match"], lambda j, i=i: where(("override", i, "match", j)), out)
        if all(r_values[k] is None for k in ("compute_dtype", "param_dtype", "output_dtype")):
            out.add(where(("override", i)), "an override must set at least one of compute_dtype, "
                    "param_dtype, output_dtype")
            continue
        rules.append(r_values)  # type: ignore[arg-type]
    values["overrides"] = rules
    values["loss_scale"] = ls_values
    values["fp8"] = fp8_values
    return values


def construct(values: dict[str, Any], **extra: Any) -> Policy:
    kwargs = dict(values, **extra)
    kwargs["overrides"] = tuple(Rule(**r) for r in values["overrides"])
    kwargs["loss_scale"] = LossScaleConfig(**values["loss_scale"])
    kwargs["fp8"] = Fp8Config(**values["fp8"])
    return Policy(**kwargs)


def build(data: Mapping[str, Any], source: str | None, out: Collector) -> Policy | None:
    """The Policy of a merged plain document (``extends`` resolved), or None when ``out`` holds problems."""
    base_settings = {k: v for k, v in data.items() if k not in ("phase", "extends", "kinds")}
    values = build_settings(base_settings, lambda p: p, out)
    phases_raw = data.get("phase", [])
    phase_values: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if isinstance(phases_raw, list):
        for i, table in enumerate(phases_raw):
            if not isinstance(table, dict):
                continue
            settings = {k: v for k, v in base_settings.items() if k != "version"}
            for k, v in table.items():
                if k in PHASE_BOUNDS:
                    continue
                if k == "loss_scale" and isinstance(v, dict):
                    ls = dict(settings.get("loss_scale", {}) if isinstance(settings.get("loss_scale"), dict) else {})
                    ls.update({sk: sv for sk, sv in v.items() if sk != "reset"})
                    settings["loss_scale"] = ls
                elif k == "fp8" and isinstance(v, dict):  # [phase.fp8] lays its keys over [fp8]
                    settings["fp8"] = merge_fp8(settings.get("fp8"), v)
                else:
                    settings[k] = v

            def where(path: KeyPath, i: int = i, table: dict = table) -> KeyPath:
                head = path[0]
                if head in ("loss_scale", "fp8") and len(path) > 1:
                    own = isinstance(table.get(head), dict) and path[1] in table[head]
                    return ("phase", i) + tuple(path) if own else tuple(path)
                return ("phase", i) + tuple(path) if head in table else tuple(path)

            p_values = build_settings(settings, where, out)
            bounds: dict[str, Any] = {}
            for b in PHASE_BOUNDS:
                if b in table:
                    v = table[b]
                    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                        out.add(("phase", i, b), "must be an integer >= 1", value=v, accepted="an integer >= 1")
                    else:
                        bounds[b] = v
            if len(bounds) == 2:
                out.add(("phase", i), "a phase ends at until_epoch or until_step, not both")
                bounds.pop("until_step")
            reset = table.get("loss_scale", {}).get("reset", False) if isinstance(table.get("loss_scale"), dict) else False
            if not isinstance(reset, bool):
                out.add(("phase", i, "loss_scale", "reset"), "must be a boolean", value=reset, accepted="true | false")
                reset = False
            bounds["reset_loss_scale"] = reset
            phase_values.append((p_values, bounds))
    check_phase_order([(("epoch" if "until_epoch" in b else "step" if "until_step" in b else None),
                        b.get("until_epoch", b.get("until_step"))) for _, b in phase_values], out)
    kinds = check_kinds(data["kinds"], lambda p: p, out) if data.get("kinds") is not None else ()
    if out.problems:
        return None
    phases = tuple(Phase(policy=construct(pv, kinds=kinds), **b) for pv, b in phase_values)
    return construct(values, phases=phases, source=source, kinds=kinds)


_SETTING_KEYS = tuple(f.name for f in TOP_FIELDS if f.name != "version")


def _settings_dict(p: Policy) -> dict[str, Any]:
    d: dict[str, Any] = {k: getattr(p, k) for k in _SETTING_KEYS}
    d["keep_float32"] = list(p.keep_float32)
    d["loss_scale"] = p.loss_scale.to_dict()
    d["fp8"] = p.fp8.to_dict()
    d["override"] = [r.to_dict() for r in p.overrides]
    return d


def policy_to_dict(p: Policy) -> dict[str, Any]:
    """Canonical plain data for a policy: every setting, phases holding only their changes."""
    d: dict[str, Any] = {"version": p.version}
    base = _settings_dict(p)
    d.update(base)
    if not d["override"]:
        del d["override"]
    if p.fp8 == Fp8Config() and not any(ph.policy.fp8 != p.fp8 for ph in p.phases):
        del d["fp8"]  # FP8 untouched: files without it stay as they were
    if p.kinds:
        d["kinds"] = {kind: list(names) for kind, names in p.kinds}
    if p.phases:
        phases = []
        for ph in p.phases:
            entry: dict[str, Any] = {}
            if ph.unit:
                entry[f"until_{ph.unit}"] = ph.until
            mine = _settings_dict(ph.policy)
            for k in _SETTING_KEYS + ("override",):
                if k in ("loss_scale", "fp8"):
                    continue
                if mine[k] != base[k]:
                    entry[k] = mine[k]
            ls = {k: v for k, v in mine["loss_scale"].items() if base["loss_scale"].get(k) != v}
            if ph.reset_loss_scale:
                ls["reset"] = True
            if ls:
                entry["loss_scale"] = ls
            fp8 = {k: v for k, v in mine["fp8"].items() if base["fp8"].get(k) != v}
            if fp8:
                entry["fp8"] = fp8
            phases.append(entry)
        d["phase"] = phases
    return d
