"""Comparing a policy with another tool's settings (what ``ampbridge check`` prints).

Holds disagreements.
"""

from __future__ import annotations

from ..core.policy import LossScaleConfig, Policy
from .convert import POLICY_FIELDS, Conversion, Disagreement, _type_name, differences

# --- comparing a policy with another tool's settings ------------------------------------------------

_AUTOCAST_HINT = ("torch.autocast still runs its float32-list ops (layer_norm, softmax, ...) in float32 on CUDA, "
                  "but it pins no module")


def disagreements(policy: Policy, other: Conversion) -> list[Disagreement]:
    """Every field the other tool's settings decide (``other.covers``) where they differ from ``policy``.

    Example:
        >>> import ampbridge
        >>> from ampbridge.recipes import from_deepspeed
        >>> ds = from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, release="modulo")
        >>> [d.field for d in disagreements(ampbridge.preset("mixed_bfloat16"), ds)][:2]
        ['compute_dtype', 'output_dtype']
    """
    result = other.result
    if isinstance(result, LossScaleConfig):
        result = policy.replace(loss_scale=result, phases=())
    if not isinstance(result, Policy):
        raise TypeError(f"disagreements needs a conversion to a Policy or LossScaleConfig, got {_type_name(result)}")
    fields = [f for f in (*POLICY_FIELDS, "fp8") if f in other.covers]  # fp8: only an FP8 recipe decides it
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
