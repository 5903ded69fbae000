"""The format-generic entry points: detect a recipe's format, read or write any format, load files and text.

Holds READ_FORMATS, WRITE_FORMATS, detect, read, write, loads, load and the options each format
takes (_READ_OPTIONS, _WRITE_OPTIONS).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..core.matching import did_you_mean
from ..core.policy import Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .accelerate import from_accelerate, to_accelerate
from .convert import POLICY_FIELDS, Conversion, _parse_recipe, _read_file
from .deepspeed import from_deepspeed, to_deepspeed
from .flax import from_flax, to_flax
from .optax import from_optax, to_optax
from .fp8 import from_torchao, from_transformer_engine, to_torchao, to_transformer_engine
from .fsdp import to_fsdp
from .grad_scaler import from_grad_scaler, to_grad_scaler
from .jmp import _JMP_NAMES, from_jmp, to_jmp
from .keras import _KERAS, from_keras, to_keras
from .lightning import _LIGHTNING_ALIASES, _LIGHTNING_ALL, from_lightning, to_lightning
from .tf_keras import _TF_KERAS_KEYS, from_tf_keras, to_tf_keras

READ_FORMATS = ("ampbridge", "deepspeed", "accelerate", "lightning", "keras", "tf_keras", "jmp", "grad-scaler",
                "flax", "optax", "transformer-engine", "torchao")
WRITE_FORMATS = ("ampbridge", "deepspeed", "accelerate", "lightning", "keras", "tf_keras", "jmp", "grad-scaler",
                 "flax", "optax", "fsdp", "transformer-engine", "torchao")


# --- reading files and text; detecting the format -------------------------------------------------

_READ_OPTIONS: dict[str, tuple[str, ...]] = {
    "ampbridge": (), "deepspeed": ("auto", "version", "release"),
    "accelerate": ("grad_scaler_kwargs", "base_dir", "version", "release", "device", "accelerate_version"),
    "lightning": ("grad_scaler", "device", "api", "lightning_version"), "keras": ("loss_scale_optimizer",), "tf_keras": ("loss_scale_optimizer",), "jmp": ("half",), "grad-scaler": (),
    "flax": (), "optax": (), "transformer-engine": (), "torchao": (),
}
_WRITE_OPTIONS: dict[str, tuple[str, ...]] = {
    "ampbridge": (), "deepspeed": ("via", "version", "release", "stage"), "accelerate": (), "lightning": ("lightning_version",), "keras": (), "tf_keras": (), "jmp": (),
    "grad-scaler": (), "flax": (), "optax": (), "fsdp": ("plan",), "transformer-engine": (), "torchao": (),
}
_DS_MARKERS = {"fp16", "bf16", "bfloat16", "zero_optimization", "torch_autocast", "amp", "train_batch_size",
               "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "communication_data_type",
               "optimizer", "scheduler", "gradient_clipping"}
_ACCELERATE_MARKERS = {"mixed_precision", "compute_environment", "distributed_type"}
_AMPBRIDGE_MARKERS = {"version", "extends", "compute_dtype", "param_dtype", "output_dtype", "reduce_dtype",
                      "matmul_precision", "keep_float32", "override", "loss_scale", "phase", "kinds"}
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
    if keys & {"max_consecutive_errors", "notfinite_count"}:
        found.append("optax")
    if keys and keys <= _SHARED_SCALER and "grad-scaler" not in found and "flax" not in found:
        found += ["grad-scaler", "flax"]
    if (keys & {"dynamic_growth_steps", "inner_optimizer"} and data.get("dynamic", True) is not False) \
            or keys & {"amax_history_length", "source_name"}:
        found.append("keras")
    if "dynamic" in keys and keys & {"dynamic_growth_steps", "inner_optimizer", "initial_scale"}:
        found.append("tf_keras")  # Keras 2's LossScaleOptimizer config always says; with True, Keras 3's may too
    if "dtype_policy" in keys and keys <= set(_TF_KERAS_KEYS):
        found.append("tf_keras")  # what --to tf_keras writes
    if data.get("recipe") in ("DelayedScaling", "Float8CurrentScaling"):
        found.append("transformer-engine")
    if any(k.startswith("cast_config_") for k in keys):
        found.append("torchao")
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
    if format == "tf_keras":
        return from_tf_keras(data, _source=source, _locate=locate, **options)
    if format == "jmp":
        return from_jmp(data, **options)
    if format == "grad-scaler":
        return from_grad_scaler(data)
    if format == "optax":
        return from_optax(data)
    if format == "transformer-engine":
        return from_transformer_engine(data, source=source, _locate=locate)
    if format == "torchao":
        return from_torchao(data, source=source, _locate=locate)
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
        "tf_keras": to_tf_keras, "jmp": to_jmp, "grad-scaler": to_grad_scaler, "flax": to_flax, "optax": to_optax,
        "fsdp": to_fsdp, "transformer-engine": to_transformer_engine, "torchao": to_torchao}
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


def loads(text: str, format: str | None = None, *, source: str | None = None, suffix: str = "",
          **options: Any) -> Conversion:
    """Read a recipe from text (JSON, YAML, TOML or a bare name), detecting the format when not given.

    Example:
        >>> loads('{"bf16": {"enabled": true}}').result.compute_dtype
        'bfloat16'
    """
    from ..core import io as _io

    data, locate, kind = _parse_recipe(text, suffix, source)
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
        from ..core.io import PRESETS, preset

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
    text = _read_file(p)
    return loads(text, format, source=str(p), suffix=p.suffix, **options)
