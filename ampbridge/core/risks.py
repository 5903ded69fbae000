"""Settings that lose precision or protection without a word: named, so nobody meets them in a run.

Each is legal (a user may want it), so it is a warning, not an error: ``ampbridge validate`` prints
it, and every backend's ``apply`` warns it once (:class:`ampbridge.errors.LossyPolicyWarning`).

Example:
    >>> from ampbridge import Policy
    >>> [r.key for r in lossy_settings(Policy(compute_dtype="float16", loss_scale={"mode": "none"}))]
    ['loss_scale.mode']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: float16's smallest subnormal and largest finite value: what a gradient outside leaves behind
_F16_TINY, _F16_MAX = "2^-24 (6e-8)", "65504"


@dataclass(frozen=True)
class Risk:
    """One lossy combination: the key that decides it, its value, where (top level or a phase) and
    what is lost."""

    key: str
    value: Any
    where: str
    loss: str

    def __str__(self) -> str:
        return f"{self.where}{self.key} = {self.value!r}: {self.loss}"


def _float16_places(policy: Any) -> list[str]:
    places = [key for key in ("compute_dtype", "param_dtype") if getattr(policy, key) == "float16"]
    places += [f"override[{i}]" for i, r in enumerate(policy.overrides)
               if "float16" in (r.compute_dtype, r.param_dtype)]
    return places


def _risks_of(policy: Any, where: str) -> list[Risk]:
    risks: list[Risk] = []
    scaling = policy.resolved_loss_scale
    unscaled = scaling.mode == "none"
    float16 = _float16_places(policy)
    if unscaled and float16:
        risks.append(Risk(
            "loss_scale.mode", policy.loss_scale.mode, where,
            f"float16 runs ({', '.join(float16)}) with no loss scaling: gradients below {_F16_TINY} flush to "
            f"zero and above {_F16_MAX} overflow; use mode 'dynamic'"
            + (" (mode 'auto' scales only when the top-level compute_dtype is float16)"
               if policy.loss_scale.mode == "auto" else "")))
    if unscaled and policy.reduce_dtype == "float16":
        risks.append(Risk(
            "reduce_dtype", "float16", where,
            f"gradients are all-reduced in float16 with no loss scaling: values below {_F16_TINY} are zeroed "
            f"on the wire and above {_F16_MAX} overflow; use reduce_dtype 'bfloat16' or 'float32', or a loss scale"))
    if scaling.mode == "dynamic" and not scaling.skip_nonfinite:
        risks.append(Risk(
            "loss_scale.skip_nonfinite", False, where,
            "a step whose gradients overflow is applied: inf/NaN reach the parameters while the scale backs off"))
    return risks


def lossy_settings(policy: Any) -> tuple[Risk, ...]:
    """Every lossy combination of ``policy`` and of each of its phases (each said once)."""
    risks = _risks_of(policy, "")
    seen = {(r.key, r.value, r.loss) for r in risks}
    for i, phase in enumerate(policy.phases):
        for r in _risks_of(phase.policy, f"phase[{i}]: "):
            if (r.key, r.value, r.loss) not in seen:
                seen.add((r.key, r.value, r.loss))
                risks.append(r)
    return tuple(risks)
