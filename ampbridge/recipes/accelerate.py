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
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .convert import (
    _ALL_BUT_MATMUL,
    _MISSING,
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
    as "no" / "NO"; ``fp8`` raises :class:`~ampbridge.UnsupportedOptionError`.
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
    if raw == "fp8":
        raise UnsupportedOptionError(
            "mixed_precision='fp8' cannot be read: ampbridge policies compute in float32, bfloat16 or float16, "
            "and Accelerate's fp8 runs its matmuls through TransformerEngine/MS-AMP/torchao. Keep the fp8 recipe "
            "in Accelerate, or convert a bf16 variant of it (mixed_precision: bf16)")
    dist = config.get("distributed_type", "NO")
    if dist is False:
        dist = "NO"
        r.note("distributed_type: NO (unquoted) is YAML 1.1's false; read as 'NO', as Accelerate means it")
    if not isinstance(dist, str):
        r.problem(("distributed_type",), "must be a string", value=dist,
                  accepted="NO, MULTI_GPU, FSDP, DEEPSPEED, XLA, ...")
        dist = "NO"
    dist = dist.upper()
    compute = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}[raw]
    kwargs = dict(grad_scaler_kwargs or {})
    if config.get("parallelism_config") is not None:
        r.note("parallelism_config sets parallel sizes (dp/tp/cp), no precision")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device={device!r}; accepted: cuda, cpu")
    if config.get("use_cpu") is True and device is None:
        device = "cpu"
        r.note("use_cpu: true: read for the CPU")
    if dist == "DEEPSPEED":
        return _accelerate_deepspeed(r, config, raw, base_dir, version, release)
    if raw == "fp16" and device == "cpu":
        r.note("mixed_precision 'fp16' on CPU: Accelerate 1.16.0 runs neither autocast nor a GradScaler (native_amp "
               "is off), so the model computes in float32")
        raw, compute, kwargs = "no", "float32", {}
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
    fields = {"compute_dtype": compute, "param_dtype": "float32", "output_dtype": "float32", "reduce_dtype": reduce}
    r.origins.setdefault("output_dtype", "Accelerate's convert_outputs_to_fp32")
    r.origins.update(keep_float32="mixed_precision (torch.autocast: no module pins)",
                     overrides="mixed_precision (torch.autocast: no module pins)")
    policy = _construct(r, lambda: Policy(**fields, loss_scale=LossScaleConfig(**ls)))
    return r.done(policy, _ALL_BUT_MATMUL)


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
    w.common("Accelerate", pins_reason="Accelerate runs torch.autocast, which has per-op lists, not per-module pins")
    name = {"float32": "no", "float16": "fp16", "bfloat16": "bf16"}[p.compute_dtype]
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
