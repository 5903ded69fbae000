"""PyTorch Lightning / Fabric ``precision`` values in and out ("16-mixed", "bf16-true", ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.matching import did_you_mean
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from . import tool_releases as _rel
from .convert import (
    _ALL_BUT_MATMUL,
    Conversion,
    _construct,
    _expect_no_scaling,
    _origins_all_loss_scale,
    _read_grad_scaler_args,
    _Reader,
    _require_concrete,
    _write_grad_scaler_args,
    _Writer,
)

# --- Lightning ----------------------------------------------------------------------------------

#: precision -> (compute, param) ; Fabric converts outputs to float32 (convert_output) in every one
_LIGHTNING = {"32-true": ("float32", "float32"), "16-mixed": ("float16", "float32"),
              "bf16-mixed": ("bfloat16", "float32"), "16-true": ("float16", "float16"),
              "bf16-true": ("bfloat16", "bfloat16")}
_LIGHTNING_ALIASES: dict[Any, str] = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true",
                                      32: "32-true", 16: "16-mixed", 64: "64-true"}
_LIGHTNING_ALL = tuple(_LIGHTNING) + ("64-true", "transformer-engine", "transformer-engine-float16")


def from_lightning(precision: Any, *, grad_scaler: Mapping[str, Any] | None = None, device: str | None = None,
                   api: str | None = None, lightning_version: str | None = None) -> Conversion:
    """A Lightning ``precision`` ("16-mixed", "bf16-true", 16, "bf16", ...) -> Policy.

    "-mixed" runs ``torch.autocast`` over float32 parameters ("16-mixed" with a torch GradScaler,
    default arguments unless ``grad_scaler`` gives the ones of a custom
    ``MixedPrecision(..., scaler=GradScaler(**grad_scaler))``); "-true" casts the parameters
    (no loss scaling, nothing skipped). Fabric converts outputs to float32 in every mode.
    "64-true" and the "transformer-engine" (fp8) precisions raise UnsupportedOptionError.

    ``api``: "fabric" or "trainer". Fabric converts outputs to float32 (``convert_output``), read
    exactly; the Trainer returns ``training_step`` outputs as autocast leaves them (bfloat16 from a
    final Linear under "bf16-mixed"), read as the compute dtype with a loss. Not given: read as
    Fabric, and a "-mixed" precision reports the Trainer's difference as a loss on output_dtype.
    ``device``: "cuda" (the default) or "cpu": Lightning 2.6 turns "16-mixed" on CPU into
    "bf16-mixed" (Trainer and Fabric alike), read so.
    ``lightning_version``: the release (default ``tool_releases.LIGHTNING_CURRENT``, 2.6.6). Names a
    release does not accept are errors ("16-mixed" before 2.0.0, "16-true" before 2.1.0, bf16
    before 1.5.0, and before 1.5.0 precision 16 on CPU); outside 1.5.0-2.6.6 a loss says the
    rules are not known there.

    Example:
        >>> p = from_lightning(16).result
        >>> p.compute_dtype, p.param_dtype, p.loss_scale.mode, p.loss_scale.initial_scale
        ('float16', 'float32', 'dynamic', 65536.0)
    """
    r = _Reader("lightning")
    name = _lightning_name(precision)
    v = _lightning_release(r, name, precision, lightning_version)
    if api not in (None, "trainer", "fabric"):
        raise ValueError(f"api={api!r}; accepted: trainer, fabric")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device={device!r}; accepted: cuda, cpu")
    name, grad_scaler = _lightning_device(r, name, precision, grad_scaler, device, v)
    compute, param = _LIGHTNING[name]
    output = _lightning_output(r, name, compute, api)
    r.origins.update(compute_dtype="precision", param_dtype="precision",
                     output_dtype="Fabric's convert_output (float32)" if output == "float32" else
                     "Lightning's Trainer (no output conversion)", keep_float32="precision (no module pins)",
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
    fields = {"compute_dtype": compute, "param_dtype": param, "output_dtype": output, "reduce_dtype": param}
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


def _lightning_name(precision: Any) -> str:
    """Lightning's canonical name of ``precision``; what ampbridge cannot hold is refused by name."""
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
    return name


def _lightning_release(r: Any, name: str, precision: Any, lightning_version: str | None) -> Any:
    """The Lightning release read for (a name it does not accept is refused); notes the alias."""
    v, unknown = _rel.lightning(lightning_version)
    refused = _rel.lightning_name_problem(name, precision, v)
    if refused:
        raise PolicyError([Problem(refused, key="precision", value=precision, accepted="a precision that release "
                                   "accepts, or --lightning-version for the release you run")])
    if unknown:
        r.loss("lightning_version", ".".join(map(str, v)), unknown)
    if name != precision:
        r.note(f"precision={precision!r} is Lightning's alias of {name!r}")
    return v


def _lightning_device(r: Any, name: str, precision: Any, grad_scaler: Mapping[str, Any] | None,
                      device: str | None, v: Any) -> tuple[str, Mapping[str, Any] | None]:
    """'16-mixed' on CPU is Lightning's 'bf16-mixed' (without a GradScaler)."""
    if name == "16-mixed" and device == "cpu" and _rel.lightning_cpu_16_problem(v):
        raise PolicyError([Problem(str(_rel.lightning_cpu_16_problem(v)), key="precision", value=precision,
                                   accepted="device='cuda', or Lightning 1.5.0 or later")])
    if name == "16-mixed" and device == "cpu":
        if grad_scaler:
            r.problem(("grad_scaler",), "on CPU Lightning runs '16-mixed' as 'bf16-mixed', without a GradScaler",
                      value=dict(grad_scaler), accepted="no grad_scaler with device='cpu'")
        r.note("precision '16-mixed' on CPU: Lightning (1.5.0 and later, PR 10033) switches to 'bf16-mixed' (fp16 "
               "AMP is not supported on CPU); read so")
        return "bf16-mixed", None
    if name == "16-mixed":
        r.note("read for CUDA: on CPU (accelerator='cpu') Lightning switches '16-mixed' to 'bf16-mixed'; pass "
               "device='cpu' (--device cpu) for that")
    return name, grad_scaler


def _lightning_output(r: Any, name: str, compute: str, api: str | None) -> str:
    """The output dtype: Fabric converts outputs to float32, the Trainer does not."""
    if api is None and name.endswith("-mixed"):
        r.loss("output_dtype", "float32", f"Fabric converts outputs to float32; Lightning's Trainer does not under "
               f"{name!r} ({compute} from a final Linear): pass api='fabric' or 'trainer' (--lightning-api)")
    elif api == "trainer" and name.endswith("-mixed"):
        r.loss("output_dtype", compute, f"Lightning's Trainer does not convert training_step outputs under {name!r}: "
               f"they come out in the dtype of the model's last op ({compute} for a final Linear, float32 after a "
               "float32 op such as softmax); Fabric converts them to float32 (api='fabric')")
        return compute
    elif api == "trainer" and name.endswith("-true"):
        r.note(f"Lightning's Trainer returns {name!r} outputs in the model's dtype ({compute}); Fabric converts them "
               "to float32 (api='fabric')")
        return compute
    return "float32"


def to_lightning(policy: Policy, *, lightning_version: str | None = None) -> Conversion:
    """Policy -> ``{"precision": "16-mixed", "grad_scaler": None | GradScaler arguments}``.

    ``lightning_version`` (default 2.6.6): before 2.0.0 the precision is written as 1.x spelled it
    (16, 32, "bf16"); before 2.1.0 "16-true"/"bf16-true" do not exist (written "-mixed", a loss on
    param_dtype); before 1.5.0 bfloat16 cannot be written at all.

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
        w.loss("output_dtype", p.output_dtype, "Fabric converts outputs to float32 in every precision; Lightning's "
               "Trainer leaves them as the model's last op makes them")
    elif p.compute_dtype != "float32":
        w.note("output_dtype float32 is Fabric's (it converts outputs); Lightning's Trainer does not convert them")
    v, unknown = _rel.lightning(lightning_version)
    if unknown:
        w.loss("lightning_version", ".".join(map(str, v)), unknown)
    if v < (1, 5, 0) and p.compute_dtype == "bfloat16":
        raise UnsupportedOptionError(f"Lightning {'.'.join(map(str, v))} has no bfloat16 precision (it came in "
                                     "1.5.0, PR 9049): write for a later --lightning-version, or float16")
    if v < (2, 1, 0) and name in ("16-true", "bf16-true"):
        name = name.replace("-true", "-mixed")
        w.loss("param_dtype", p.param_dtype, f"Lightning before 2.1.0 has no true half precision (PR 18193): "
               f"written as {name!r}, float32 parameters")
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
    if v < (2, 0, 0):
        old = {"32-true": 32, "16-mixed": 16, "bf16-mixed": "bf16"}[name]
        w.note(f"Lightning before 2.0.0 spells {name!r} as precision={old!r} (the names changed in PR 16783)")
        return w.done({"precision": old, "grad_scaler": scaler})
    return w.done({"precision": name, "grad_scaler": scaler})
