"""jmp policy strings in and out ("params=float32,compute=bfloat16,output=float32", "half", ...).

Holds from_jmp, to_jmp and jmp's dtype names (_JMP_NAMES).
"""

from __future__ import annotations

from ..core.matching import did_you_mean
from ..core.policy import Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .convert import Conversion, _construct, _Reader, _require_concrete, _Writer, loss_scale_view

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
