"""Hugging Face Accelerate configs in and out (``mixed_precision``, ``GradScalerKwargs``).

Holds from_accelerate and to_accelerate; under ``distributed_type: DEEPSPEED`` the precision is
read through the deepspeed module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..core.matching import did_you_mean
from ..core.policy import Fp8Config, LossScaleConfig, Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .convert import (
    _ALL_BUT_MATMUL,
    _MISSING,
    Conversion,
    _construct,
    _get_int,
    _expect_no_scaling,
    _origins_all_loss_scale,
    _read_grad_scaler_args,
    _Reader,
    _require_concrete,
    _write_grad_scaler_args,
    _Writer,
)
from .deepspeed import _load_config_file, from_deepspeed
from .tool_releases import accelerate as _accelerate_release

# --- Hugging Face Accelerate ----------------------------------------------------------------------

_ACCELERATE_KEYS = (
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "tp_config", "megatron_lm_config", "ipex_config", "mpirun_config", "downcast_bf16",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "parallelism_config",
    # SageMakerConfig
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name", "pytorch_version",
    "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
    # old names Accelerate still converts
    "fp16", "dynamo_backend",
)
_ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def from_accelerate(config: Mapping[str, Any], *, grad_scaler_kwargs: Mapping[str, Any] | None = None,
                    version: str | None = None, release: str | None = None, device: str | None = None,
                    accelerate_version: str | None = None, source: str | None = None,
                    base_dir: str | os.PathLike[str] | None = None,
                    _locate: Callable[[tuple], int | None] | None = None) -> Conversion:
    """An Accelerate config (``accelerate config``'s YAML, parsed) -> Policy.

    ``mixed_precision`` no / fp16 / bf16 runs ``torch.autocast`` over the model's float32
    parameters and converts outputs to float32 (``convert_outputs_to_fp32``); fp16 adds a torch
    GradScaler built from ``grad_scaler_kwargs`` (the fields of ``GradScalerKwargs``, which live in
    code, not in the YAML). Under ``distributed_type: FSDP`` gradients are reduced in the mixed
    dtype (Accelerate's ``MixedPrecision(param_dtype=d, reduce_dtype=d, buffer_dtype=d)``); under
    ``DEEPSPEED`` the precision is DeepSpeed's (its ``deepspeed_config_file`` is read when
    ``base_dir`` locates it; ``version`` (DeepSpeed's) and ``release`` as in :func:`from_deepspeed`).
    ``mixed_precision: no`` and ``distributed_type: NO`` unquoted are YAML 1.1's ``false`` and read
    as "no" / "NO". ``fp8`` runs bfloat16 autocast plus float8 matmuls from ``fp8_config`` (see
    :func:`_read_fp8_config`): ``backend: AO`` torchao's current scaling, ``TE`` Transformer Engine's
    delayed scaling; refused under DEEPSPEED.
    ``device``: "cuda" (the default) or "cpu" (``use_cpu: true`` says cpu too): on CPU Accelerate
    (1.16) runs fp16 with neither autocast nor a GradScaler, so it reads as float32.
    ``accelerate_version``: the release (default ``tool_releases.ACCELERATE_CURRENT``, 1.16.0, the
    only one whose sources were read); any other is read by 1.16.0's rules with a loss saying so.

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
    accelerate_release, unknown = _accelerate_release(accelerate_version)
    if unknown:
        r.loss("accelerate_version", accelerate_release, unknown)
    raw = _read_precision(r, config)
    dist = _read_distributed_type(r, config)
    if config.get("parallelism_config") is not None:
        r.note("parallelism_config sets parallel sizes (dp/tp/cp), no precision")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device={device!r}; accepted: cuda, cpu")
    if config.get("use_cpu") is True and device is None:
        device = "cpu"
        r.note("use_cpu: true: read for the CPU")
    if dist == "DEEPSPEED":
        if raw == "fp8":
            raise UnsupportedOptionError("mixed_precision='fp8' under distributed_type DEEPSPEED cannot be read: "
                                         "the precision is DeepSpeed's, which has no float8 training")
        return _accelerate_deepspeed(r, config, raw, base_dir, version, release)
    fp8 = _read_fp8_config(r, config) if raw == "fp8" else Fp8Config()
    raw, ls = _read_scaler(r, raw, device, dict(grad_scaler_kwargs or {}))
    compute = {"no": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}[raw]
    fields = {"compute_dtype": compute, "param_dtype": "float32", "output_dtype": "float32",
              "reduce_dtype": _read_reduce(r, config, dist, raw, compute)}
    r.origins.setdefault("output_dtype", "Accelerate's convert_outputs_to_fp32")
    r.origins.update(keep_float32="mixed_precision (torch.autocast: no module pins)",
                     overrides="mixed_precision (torch.autocast: no module pins)")
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls), fp8=fp8))
    return r.done(policy, _ALL_BUT_MATMUL | ({"fp8"} if raw == "fp8" else set()))


def _read_precision(r: _Reader, config: Mapping[str, Any]) -> str:
    """``mixed_precision`` (or the old ``fp16: true``), YAML 1.1's unquoted ``no`` included."""
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
    return raw


def _read_distributed_type(r: _Reader, config: Mapping[str, Any]) -> str:
    dist = config.get("distributed_type", "NO")
    if dist is False:
        dist = "NO"
        r.note("distributed_type: NO (unquoted) is YAML 1.1's false; read as 'NO', as Accelerate means it")
    if not isinstance(dist, str):
        r.problem(("distributed_type",), "must be a string", value=dist,
                  accepted="NO, MULTI_GPU, FSDP, DEEPSPEED, XLA, ...")
        dist = "NO"
    return dist.upper()


def _read_scaler(r: _Reader, raw: str, device: str | None, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The loss-scale fields: a GradScaler from ``grad_scaler_kwargs`` for fp16 on CUDA, none otherwise."""
    if raw == "fp16" and device == "cpu":
        r.note("mixed_precision 'fp16' on CPU: Accelerate 1.16.0 runs neither autocast nor a GradScaler (native_amp "
               "is off), so the model computes in float32")
        raw, kwargs = "no", {}
        r.origins["compute_dtype"] = "mixed_precision ('fp16' on CPU: no autocast)"
    elif raw == "fp16":
        r.note("read for CUDA: on CPU, Accelerate runs mixed_precision 'fp16' as float32 (no autocast, no "
               "GradScaler); pass device='cpu' (--device cpu) for that")
    if kwargs and raw != "fp16":
        r.note(f"grad_scaler_kwargs have no effect with mixed_precision={raw!r}: Accelerate builds a GradScaler "
               "only for fp16")
    ls = {"mode": "none", "skip_nonfinite": False}
    if raw == "fp16":
        ls = _read_grad_scaler_args(r, kwargs, ("grad_scaler_kwargs",), "GradScalerKwargs")
    if raw != "fp16" or not kwargs:
        _origins_all_loss_scale(r, f"mixed_precision {raw!r}" + (" (GradScaler's defaults)" if raw == "fp16" else ""))
    return raw, ls


def _read_reduce(r: _Reader, config: Mapping[str, Any], dist: str, raw: str, compute: str) -> str:
    """The gradient-reduction dtype (FSDP: the mixed dtype) and the TPU-only settings, as losses."""
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
    return reduce


#: fp8_config keys (Accelerate 1.16.0): what `accelerate config` writes and the launcher's own names
_FP8_KEYS = ("backend", "use_autocast_during_eval", "margin", "interval", "fp8_format", "amax_history_len",
             "amax_compute_algo", "amax_history_length", "amax_compute_algorithm", "override_linear_precision",
             "enable_fsdp_float8_all_gather", "pad_inner_dim", "use_mxfp8_block_scaling", "opt_level")
_AO_FILTER = ("Accelerate's AO path converts every nn.Linear except the first and the last, and those with a "
              "dimension not divisible by 16 (filter_first_and_last_linear_layers); ampbridge's [fp8] match names "
              "the layers, read as ['kind:linear']")


def _read_fp8_config(r: _Reader, config: Mapping[str, Any]) -> Fp8Config:
    """``fp8_config`` -> the [fp8] table, as Accelerate 1.16.0's launcher hands it to AORecipeKwargs/TERecipeKwargs."""
    cfg = r.section(config, "fp8_config") or {}
    r.check_keys(cfg, _FP8_KEYS, ("fp8_config",), "fp8_config")
    backend = str(cfg.get("backend", "")).upper() or None
    if backend not in (None, "AO", "TE"):
        r.problem(("fp8_config", "backend"), "not an Accelerate FP8 backend ampbridge reads", value=cfg["backend"],
                  accepted="AO, TE", hint="MS-AMP is gone from Accelerate 1.16" if backend == "MSAMP" else None)
    r.raise_if_any()
    if backend is None:
        r.note("fp8_config names no backend: Accelerate uses torchao when it is installed, else Transformer "
               "Engine; read as AO (torchao)")
    r.note("mixed_precision 'fp8': Accelerate runs the model under bfloat16 autocast, its outputs converted to "
           "float32, with the float8 matmuls inside")
    if backend == "TE":
        return _read_fp8_te(r, cfg)
    r.loss("fp8_config.backend", backend or "AO (not given)", _AO_FILTER)
    for key in ("margin", "interval", "fp8_format", "amax_history_len", "amax_compute_algo", "amax_history_length",
                "amax_compute_algorithm", "override_linear_precision", "use_autocast_during_eval"):
        if key in cfg:
            r.note(f"fp8_config.{key} is a TE setting: Accelerate's AO backend does not read it")
    if cfg.get("enable_fsdp_float8_all_gather", True) and config.get("distributed_type") == "FSDP":
        r.loss("fp8_config.enable_fsdp_float8_all_gather", True, "FSDP2 all-gathers float8 weights; ampbridge's "
               "torch realisation keeps torchao's default (False)")
    if cfg.get("pad_inner_dim", True):
        r.note("fp8_config.pad_inner_dim (Accelerate's default: true) pads the inner matmul dimension with zeros to a "
               "multiple of 16 for torch._scaled_mm: the same products")
    return Fp8Config(match=("kind:linear",), scaling="current")


def _read_fp8_te(r: _Reader, cfg: Mapping[str, Any]) -> Fp8Config:
    from .fp8 import _te_format

    for key, name in (("amax_history_length", "amax_history_len"), ("amax_compute_algorithm", "amax_compute_algo")):
        if key in cfg:
            r.loss(f"fp8_config.{key}", cfg[key], f"Accelerate 1.16.0's launcher exports it as ACCELERATE_FP8_"
                   f"{key.upper()}, which TERecipeKwargs does not read (it reads {name}): TE gets the default")
    if cfg.get("interval", 1) != 1:
        r.loss("fp8_config.interval", cfg["interval"], "ampbridge updates the scale every step (TE 2.x has no interval)")
    olp = cfg.get("override_linear_precision")
    if olp is not None and not (isinstance(olp, (list, tuple)) and len(olp) == 3):
        r.problem(("fp8_config", "override_linear_precision"), "must be three booleans (fprop, dgrad, wgrad)",
                  value=olp, accepted="[false, false, false] and the like")
    elif olp is not None and any(olp):
        r.loss("fp8_config.override_linear_precision", olp,
               "ampbridge runs the forward and both backward matmuls of a float8 layer in float8")
    if cfg.get("use_mxfp8_block_scaling"):
        r.loss("fp8_config.use_mxfp8_block_scaling", True, "MXFP8 block scaling has no ampbridge equivalent; read "
               "as DelayedScaling")
    if cfg.get("use_autocast_during_eval"):
        r.note("fp8_config.use_autocast_during_eval: float8 in evaluation too (ampbridge's [fp8] says nothing "
               "about evaluation)")
    forward, backward = _te_format(r, cfg.get("fp8_format", "HYBRID"), ("fp8_config", "fp8_format"))
    margin = _get_int(r, cfg, "margin", ("fp8_config",), 0, low=0, what="an integer >= 0")
    history = _get_int(r, cfg, "amax_history_len", ("fp8_config",), 1024, low=1, what="an integer >= 1")
    algo = cfg.get("amax_compute_algo", "most_recent")
    if algo not in ("max", "most_recent"):
        r.problem(("fp8_config", "amax_compute_algo"), "not an amax algorithm", value=algo, accepted="max, most_recent")
    if "amax_compute_algo" not in cfg:
        r.note("TERecipeKwargs defaults amax_compute_algo to 'most_recent' (TE's own default is 'max')")
    r.note("Accelerate's TE path swaps nn.Linear (and nn.LayerNorm) for te modules: read as fp8.match = "
           "['kind:linear']")
    r.origins.update({"fp8.margin": "fp8_config.margin", "fp8.amax_history": "fp8_config.amax_history_len",
                      "fp8.amax_compute": "fp8_config.amax_compute_algo"})
    r.raise_if_any()
    return Fp8Config(match=("kind:linear",), forward=forward, backward=backward, scaling="delayed",
                     amax_history=history, amax_compute=algo, margin=margin)


def _write_fp8_config(w: _Writer, p: Policy) -> dict[str, Any]:
    """The ``fp8_config`` section for an enabled [fp8] table (TE for delayed scaling, AO for current)."""
    from .fp8 import _te_format_name, write_fp8_common

    fp8 = p.fp8
    if p.compute_dtype != "bfloat16":
        w.loss("compute_dtype", p.compute_dtype, "Accelerate's fp8 runs the model under bfloat16 autocast")
    if fp8.scaling == "current":
        write_fp8_common(w, fp8, "Accelerate's AO backend", match_note="every nn.Linear but the first and the last; "
                         "AORecipeKwargs(module_filter_func=...) in code")
        if fp8.margin:
            w.loss("fp8.margin", fp8.margin, "torchao's scale has no margin")
        if (fp8.forward, fp8.backward) != ("e4m3", "e5m2"):
            w.loss("fp8.forward", f"{fp8.forward}/{fp8.backward}", "the YAML cannot set torchao's formats (e4m3 "
                   "forward, e5m2 backward); AORecipeKwargs(config=Float8LinearConfig(...)) in code")
        return {"backend": "AO", "pad_inner_dim": False, "enable_fsdp_float8_all_gather": False}
    write_fp8_common(w, fp8, "Accelerate's TE backend", match_note="every nn.Linear and nn.LayerNorm becomes a te "
                     "module")
    w.note("amax_history_len and amax_compute_algo are written under the launcher's names: the ones `accelerate "
           "config` writes (amax_history_length, amax_compute_algorithm) do not reach TERecipeKwargs in 1.16.0")
    return {"backend": "TE", "fp8_format": _te_format_name(w, fp8), "margin": fp8.margin,
            "amax_history_len": fp8.amax_history, "amax_compute_algo": fp8.amax_compute}


def _accelerate_deepspeed(r: _Reader, config: Mapping[str, Any], precision: str,
                          base_dir: str | os.PathLike[str] | None, version: str | None,
                          release: str | None) -> Conversion:
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
        inner = _load_config_file(path, auto=auto, version=version, release=release)
        notes = (f"distributed_type DEEPSPEED: the precision is DeepSpeed's, read from {file} with its 'auto' "
                 f"values filled from mixed_precision={precision!r}",) + inner.notes
    else:
        # Accelerate's DeepSpeedPlugin writes the section when the config has none
        ds: dict[str, Any] = {"zero_optimization": {"stage": ds_section.get("zero_stage", 0)}}
        if precision == "fp16":
            ds["fp16"] = {"enabled": True, "auto_cast": True}
        elif precision == "bf16":
            ds["bf16"] = {"enabled": True}
        inner = from_deepspeed(ds, source=r.source, version=version, release=release)
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
    w.common("Accelerate", fp8=True, pins_reason="Accelerate runs torch.autocast, which has per-op lists, not per-module pins")
    name = {"float32": "no", "float16": "fp16", "bfloat16": "bf16"}[p.compute_dtype]
    if p.fp8.enabled:
        return _to_accelerate_fp8(w, p)
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


def _to_accelerate_fp8(w: _Writer, p: Policy) -> Conversion:
    fp8_config = _write_fp8_config(w, p)
    for key, value in (("param_dtype", p.param_dtype), ("output_dtype", p.output_dtype),
                       ("reduce_dtype", p.reduce_dtype)):
        if value != "float32":
            w.loss(key, value, "Accelerate's fp8 keeps float32 parameters, outputs and reductions")
    _expect_no_scaling(w, p, "Accelerate with mixed_precision='fp8'")
    return w.done({"mixed_precision": "fp8", "grad_scaler_kwargs": None, "fp8_config": fp8_config})
