"""FP8 recipes in and out: Transformer Engine recipes, torchao ``Float8LinearConfig``, Keras float8 policies.

Plain data, no framework import. A Transformer Engine recipe is written as its constructor's
arguments plus ``"recipe"`` (the class), e.g. ``{"recipe": "DelayedScaling", "margin": 0,
"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max"}`` (argument names
and defaults of TE 2.18's ``transformer_engine.common.recipe``); torchao's config as the dict form
of ``Float8LinearConfig`` (enums as their values, dtypes as their names; a real config object is
read too). Each reads into the policy's ``[fp8]`` table only (``covers = {"fp8"}``); every setting
the other side cannot hold is a named :class:`Loss` (``fp8.<key>``, or the tool's own key).

Holds from_transformer_engine, to_transformer_engine, from_torchao, to_torchao and the Keras and
Accelerate helpers their modules call (keras_float8_read, keras_float8_write, write_fp8_common).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ..core.policy import Fp8Config, LossScaleConfig, Policy
from ..errors import PolicyError, Problem, UnsupportedOptionError
from .convert import Conversion, _construct, _get_int, _Reader, _Writer

#: the Transformer Engine release whose recipe classes were read (tag v2.18)
TE_VERSION = "2.18"
#: TE Format name -> (forward, backward); TE refuses pure E5M2 for training ("Pure E5M2 training is not supported")
TE_FORMATS = {"HYBRID": ("e4m3", "e5m2"), "E4M3": ("e4m3", "e4m3")}
#: constructor defaults of the two recipes (TE 2.18); the QParams/MMParams fields are not plain data
_TE_DEFAULTS = {
    "DelayedScaling": {"margin": 0, "fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max",
                       "scaling_factor_compute_algo": None, "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False,
                       "backward_override": None},
    "Float8CurrentScaling": {"use_power_2_scales": False, "fp8_format": "HYBRID", "fp8_quant_fwd_inp": None,
                             "fp8_quant_fwd_weight": None, "fp8_quant_bwd_grad": None, "fp8_gemm_fprop": None,
                             "fp8_gemm_dgrad": None, "fp8_gemm_wgrad": None, "fp8_dpa": False, "fp8_mha": False,
                             "backward_override": None},
}
_TE_CARRIED = {"margin", "fp8_format", "amax_history_len", "amax_compute_algo"}
_TE_NOTE_LAYERS = ("a Transformer Engine recipe names no layers: float8 runs in the te.* modules built inside "
                   "fp8_autocast; read as fp8.match = ['kind:linear']")
_ONLY_FP8 = ("{tool} holds only the float8 settings: the rest is read as FP8's usual companion, bfloat16 compute "
             "over float32 parameters and outputs without loss scaling, and is not compared (covers: fp8)")

#: torchao 0.18.0 Float8LinearConfig defaults, as plain data (``dataclasses.fields`` of the real class)
_AO_CAST = ("cast_config_input", "cast_config_weight", "cast_config_grad_output")
_AO_FOR_GRAD = {"cast_config_input_for_grad_weight": "cast_config_input",
                "cast_config_weight_for_grad_input": "cast_config_weight",
                "cast_config_grad_output_for_grad_weight": "cast_config_grad_output"}
_AO_FLAGS = {"gemm_config_output": {"use_fast_accum": True}, "gemm_config_grad_input": {"use_fast_accum": False},
             "gemm_config_grad_weight": {"use_fast_accum": False}, "enable_fsdp_float8_all_gather": False,
             "pad_inner_dim": False, "force_recompute_fp8_weight_in_bwd": False, "round_scales_to_power_of_2": False}
_AO_DTYPES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_AO_KEYS = _AO_CAST + tuple(_AO_FOR_GRAD) + tuple(_AO_FLAGS) + ("emulate",)


def _fp8_only_policy(r: _Reader, tool: str, **fp8: Any) -> Conversion:
    r.note(_ONLY_FP8.format(tool=tool))
    policy = _construct(r, lambda: Policy(compute_dtype="bfloat16", loss_scale=LossScaleConfig(mode="none",
                        skip_nonfinite=False), fp8=Fp8Config(match=("kind:linear",), **fp8)))
    return r.done(policy, ("fp8",))


# --- Transformer Engine -------------------------------------------------------------------------

def _te_format(r: _Reader, value: Any, path: tuple) -> tuple[str, str]:
    if isinstance(value, enum.Enum):
        name: Any = value.name
    else:
        name = value.split(".")[-1].upper() if isinstance(value, str) else value  # "Format.HYBRID" too
    if isinstance(name, str) and name in TE_FORMATS:
        return TE_FORMATS[name]
    r.problem(path, "not a Transformer Engine FP8 training format", value=value, accepted="HYBRID, E4M3",
              hint="TE refuses E5M2 alone for training" if name == "E5M2" else None)
    return TE_FORMATS["HYBRID"]


def from_transformer_engine(recipe: Mapping[str, Any], *, source: str | None = None, _locate: Any = None) -> Conversion:
    """A TE recipe's constructor arguments (``"recipe"``: ``DelayedScaling`` or ``Float8CurrentScaling``) -> Policy.

    Example:
        >>> c = from_transformer_engine({"recipe": "DelayedScaling", "amax_history_len": 16})
        >>> f = c.result.fp8; f.scaling, f.forward, f.backward, f.amax_history, f.amax_compute, c.losses
        ('delayed', 'e4m3', 'e5m2', 16, 'max', ())
    """
    r = _Reader("transformer-engine", source, _locate)
    if not isinstance(recipe, Mapping):
        raise PolicyError([Problem("a Transformer Engine recipe must be a mapping of its constructor arguments",
                                   file=source, value=recipe)])
    kind = recipe.get("recipe")
    if not isinstance(kind, str) or kind not in _TE_DEFAULTS:
        raise PolicyError([Problem("not a Transformer Engine FP8 recipe class", key="recipe", file=source, value=kind,
                                   accepted=", ".join(_TE_DEFAULTS),
                                   hint="MXFP8/NVFP4 block scaling has no ampbridge equivalent" if kind else None)])
    defaults = _TE_DEFAULTS[kind]
    r.check_keys(recipe, ("recipe",) + tuple(defaults), (), f"TE {kind} (TE {TE_VERSION})")
    forward, backward = _te_format(r, recipe.get("fp8_format", defaults["fp8_format"]), ("fp8_format",))
    for key, default in defaults.items():
        if key not in _TE_CARRIED and key in recipe and recipe[key] != default:
            r.loss(key, recipe[key], f"ampbridge's [fp8] has no {key}; its realisations run without it "
                   f"(TE's default {default!r})")
    r.note(_TE_NOTE_LAYERS)
    if kind == "Float8CurrentScaling":
        r.note("TE's current scaling keeps scale 1 for an amax of 0, inf or NaN; ampbridge's (torchao's) floors "
               "the amax at 1e-12 instead (scale 448/1e-12), gives 0 for inf and NaN for NaN")
        return _fp8_only_policy(r, "a TE recipe", forward=forward, backward=backward, scaling="current")
    margin = _get_int(r, recipe, "margin", (), defaults["margin"], low=0, what="an integer >= 0")
    history = _get_int(r, recipe, "amax_history_len", (), defaults["amax_history_len"], low=1, what="an integer >= 1")
    algo = recipe.get("amax_compute_algo", defaults["amax_compute_algo"])
    if algo not in ("max", "most_recent"):
        r.problem(("amax_compute_algo",), "not an amax algorithm ampbridge carries", value=algo,
                  accepted="max, most_recent", hint="a callable cannot be carried")
    r.note("TE multiplies by its scale and clamps an inf scale to the float32 max; Keras and Flax divide by its "
           "reciprocal: the same formula, rounded differently at the edges")
    r.origins.update({"fp8.margin": "margin", "fp8.amax_history": "amax_history_len",
                      "fp8.amax_compute": "amax_compute_algo"})
    return _fp8_only_policy(r, "a TE recipe", forward=forward, backward=backward, scaling="delayed",
                            amax_history=history, amax_compute=algo, margin=margin)


def write_fp8_common(w: _Writer, fp8: Fp8Config, tool: str, *, match_note: str) -> None:
    """The losses every FP8 writer shares: a layer selection other than kind:linear, phases changing [fp8]."""
    if tuple(fp8.match) != ("kind:linear",):
        w.loss("fp8.match", list(fp8.match), f"{tool} chooses the float8 layers itself ({match_note})")
    if any(ph.policy.fp8 != fp8 for ph in w.policy.phases):
        w.loss("phase.fp8", len(w.policy.phases), f"{tool} holds one FP8 setting, not a schedule")


def _te_format_name(w: _Writer, fp8: Fp8Config) -> str:
    name = next((n for n, fb in TE_FORMATS.items() if fb == (fp8.forward, fp8.backward)), None)
    if name is None:
        key = "fp8.forward" if fp8.forward != "e4m3" else "fp8.backward"
        w.loss(key, getattr(fp8, key.split(".")[1]), "TE trains with HYBRID (e4m3 forward, e5m2 backward) or E4M3 "
               "(both e4m3); written as HYBRID")
        name = "HYBRID"
    return name


def _require_fp8(policy: Policy, tool: str) -> Fp8Config:
    if not policy.fp8.enabled:
        raise UnsupportedOptionError(f"the policy runs no layer in float8 ([fp8] match is empty): there is no "
                                     f"{tool} to write; add [fp8] match = [\"kind:linear\"]")
    return policy.fp8


def to_transformer_engine(policy: Policy) -> Conversion:
    """Policy -> a TE recipe's constructor arguments (``DelayedScaling`` or ``Float8CurrentScaling``).

    Build it with ``getattr(recipe, d.pop("recipe"))(**d)``, ``fp8_format`` as ``Format[d["fp8_format"]]``.

    Example:
        >>> import ampbridge
        >>> p = ampbridge.Policy(fp8={"match": ["kind:linear"], "amax_history": 16})
        >>> to_transformer_engine(p).result
        {'recipe': 'DelayedScaling', 'margin': 0, 'fp8_format': 'HYBRID', 'amax_history_len': 16, 'amax_compute_algo': 'max'}
    """
    fp8 = _require_fp8(policy, "Transformer Engine recipe")
    w = _Writer("transformer-engine", policy)
    write_fp8_common(w, fp8, "a TE recipe", match_note="the te.* modules run inside fp8_autocast")
    fmt = _te_format_name(w, fp8)
    w.note("a TE recipe holds only the float8 settings: the dtypes come from your model and autocast")
    if fp8.scaling == "current":
        out: dict[str, Any] = {"recipe": "Float8CurrentScaling", "fp8_format": fmt}
        if fp8.margin:
            w.loss("fp8.margin", fp8.margin, "TE's Float8CurrentScaling has no margin")
    else:
        out = {"recipe": "DelayedScaling", "margin": fp8.margin, "fp8_format": fmt,
               "amax_history_len": fp8.amax_history, "amax_compute_algo": fp8.amax_compute}
    return Conversion(out, tuple(w.losses), tuple(w.notes), "ampbridge", "transformer-engine")


# --- torchao Float8LinearConfig -----------------------------------------------------------------

def _plain(value: Any) -> Any:
    """A torchao config object as plain data: dataclasses -> dicts, enums -> values, torch dtypes -> names."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):  # dataclasses.asdict(config) keeps the enums and dtypes
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if type(value).__module__ == "torch" and str(value).startswith("torch."):
        return str(value)[len("torch."):]
    return value


def _ao_cast(r: _Reader, key: str, cfg: Any) -> str | None:
    if not isinstance(cfg, Mapping):
        r.problem((key,), "must be a CastConfig (scaling_type, scaling_granularity, target_dtype)", value=cfg)
        return None
    for field, accepted, what in (("scaling_type", ("dynamic", "disabled"), "casts every matmul operand of a "
                                   "float8 layer with dynamic (current) scaling"),
                                  ("scaling_granularity", ("tensorwise", "axiswise"), "scales per tensor (tensorwise)")):
        value = cfg.get(field, accepted[0])
        if not isinstance(value, str) or value not in accepted:
            r.problem((key, field), f"not a torchao {field}", value=value, accepted=", ".join(accepted))
        elif value != accepted[0]:
            r.loss(f"{key}.{field}", value, f"ampbridge {what}")
    dtype = cfg.get("target_dtype")
    if not isinstance(dtype, str) or dtype not in _AO_DTYPES:
        r.problem((key, "target_dtype"), "not a float8 dtype ampbridge carries", value=dtype,
                  accepted=", ".join(_AO_DTYPES))
        return None
    return _AO_DTYPES[dtype]


def from_torchao(config: Any, *, source: str | None = None, _locate: Any = None) -> Conversion:
    """A torchao ``Float8LinearConfig`` (the object, or its dict form as plain data) -> Policy (current scaling).

    Example:
        >>> c = from_torchao({"cast_config_grad_output": {"scaling_type": "dynamic",
        ...     "scaling_granularity": "tensorwise", "target_dtype": "float8_e4m3fn"}})
        >>> c.result.fp8.scaling, c.result.fp8.forward, c.result.fp8.backward, c.losses
        ('current', 'e4m3', 'e4m3', ())
    """
    r = _Reader("torchao", source, _locate)
    data = _plain(config)
    if not isinstance(data, Mapping):
        raise PolicyError([Problem("a Float8LinearConfig must be the object or a mapping of its fields",
                                   file=source, value=config)])
    r.check_keys(data, _AO_KEYS, (), "torchao Float8LinearConfig (0.18.0)")
    default_cast = {"scaling_type": "dynamic", "scaling_granularity": "tensorwise"}
    fmts = {k: _ao_cast(r, k, data.get(k) or {**default_cast, "target_dtype": "float8_e5m2" if "grad" in k
                                                else "float8_e4m3fn"}) for k in _AO_CAST}
    for key, base in _AO_FOR_GRAD.items():
        if data.get(key) is not None and data[key] != (data.get(base) or data[key]):
            r.loss(key, data[key], f"ampbridge casts a tensor the same way for every matmul it enters ({base})")
    if fmts["cast_config_input"] and fmts["cast_config_weight"] not in (None, fmts["cast_config_input"]):
        r.loss("cast_config_weight.target_dtype", (data.get("cast_config_weight") or {}).get("target_dtype",
                                                                                          "float8_e4m3fn"),
               "ampbridge's fp8.forward is one format for activations and weights; read as the input's")
    if data.get("pad_inner_dim"):
        r.note("pad_inner_dim pads the inner matmul dimension with zeros to a multiple of 16 for "
               "torch._scaled_mm: the same products")
    for key, default in _AO_FLAGS.items():
        if key in data and data[key] != default and key != "pad_inner_dim":
            r.loss(key, data[key], f"ampbridge's torch realisation uses torchao's default ({default!r})")
    if data.get("emulate"):
        r.note("emulate is not carried: ampbridge emulates float8 where the hardware has no float8 matmul "
               "(off CUDA, or below compute capability 8.9) and runs it natively elsewhere")
    return _fp8_only_policy(r, "a Float8LinearConfig", forward=fmts["cast_config_input"] or "e4m3",
                            backward=fmts["cast_config_grad_output"] or "e5m2", scaling="current")


def to_torchao(policy: Policy) -> Conversion:
    """Policy -> the dict form of a torchao ``Float8LinearConfig`` (its three ``CastConfig`` fields).

    Example:
        >>> import ampbridge
        >>> d = to_torchao(ampbridge.Policy(fp8={"match": ["kind:linear"], "scaling": "current"})).result
        >>> d["cast_config_input"]["target_dtype"], d["cast_config_grad_output"]["target_dtype"]
        ('float8_e4m3fn', 'float8_e5m2')
    """
    fp8 = _require_fp8(policy, "torchao Float8LinearConfig")
    w = _Writer("torchao", policy)
    write_fp8_common(w, fp8, "a Float8LinearConfig", match_note="convert_to_float8_training(module_filter_fn=...) "
                     "in code")
    if fp8.scaling == "delayed":
        w.loss("fp8.scaling", "delayed", "torchao 0.18 has tensorwise dynamic (current) scaling only; written as "
               f"current (amax_history {fp8.amax_history}, amax_compute {fp8.amax_compute!r} dropped)")
    if fp8.margin:
        w.loss("fp8.margin", fp8.margin, "torchao's scale has no margin")
    names = {v: k for k, v in _AO_DTYPES.items()}

    def cast(fmt: str) -> dict[str, str]:
        return {"scaling_type": "dynamic", "scaling_granularity": "tensorwise", "target_dtype": names[fmt]}
    out = {"cast_config_input": cast(fp8.forward), "cast_config_weight": cast(fp8.forward),
           "cast_config_grad_output": cast(fp8.backward)}
    return Conversion(out, tuple(w.losses), tuple(w.notes), "ampbridge", "torchao")


# --- Keras QuantizedFloat8DTypePolicy -----------------------------------------------------------

#: Keras's QuantizedFloat8DTypePolicy.default_amax_history_length
KERAS_AMAX_HISTORY = 1024


def keras_float8_read(r: _Reader, config: Mapping[str, Any]) -> tuple[str, Fp8Config]:
    """A ``QuantizedFloat8DTypePolicy`` config (``mode``, ``source_name``, ``amax_history_length``) -> (source, fp8)."""
    if "config" in config and config.get("class_name") == "QuantizedFloat8DTypePolicy":
        config = config["config"]
    if not isinstance(config, Mapping):
        raise PolicyError([Problem("a QuantizedFloat8DTypePolicy config must be a mapping", key="config",
                                   value=config, accepted="mode, source_name, amax_history_length")])
    r.check_keys(config, ("mode", "source_name", "amax_history_length", "name"), (),
                 "a Keras QuantizedFloat8DTypePolicy config")
    name = str(config.get("name", ""))
    source = config.get("source_name") or (name.split("_from_", 1)[1] if "_from_" in name else "float32")
    if config.get("mode", "float8") != "float8":
        r.problem(("mode",), "not float8", value=config.get("mode"), accepted="float8")
    history = _get_int(r, config, "amax_history_length", (), KERAS_AMAX_HISTORY, low=1, what="an integer >= 1")
    r.origins["fp8.amax_history"] = "amax_history_length"
    r.note("model.quantize('float8') quantizes every Dense and EinsumDense (filters= narrows it): read as "
           "fp8.match = ['kind:linear'], delayed scaling, e4m3 forward and e5m2 backward (Keras fixes them)")
    r.raise_if_any()
    return str(source), Fp8Config(match=("kind:linear",), amax_history=history)


def keras_float8_write(w: _Writer, fp8: Fp8Config, source: str) -> dict[str, Any]:
    """The ``QuantizedFloat8DTypePolicy(**config)`` arguments for an enabled [fp8] table; losses for the rest."""
    write_fp8_common(w, fp8, "a Keras float8 policy", match_note="model.quantize('float8', filters=...) in code")
    for key, keras_value, what in (("scaling", "delayed", "delayed scaling only"),
                                   ("amax_compute", "max", "the max of the history only"),
                                   ("margin", 0, "no margin"), ("forward", "e4m3", "e4m3 forward"),
                                   ("backward", "e5m2", "e5m2 backward")):
        if getattr(fp8, key) != keras_value:
            w.loss(f"fp8.{key}", getattr(fp8, key), f"Keras's float8 has {what}")
    history = fp8.amax_history if fp8.scaling == "delayed" else KERAS_AMAX_HISTORY
    return {"mode": "float8", "source_name": source, "amax_history_length": history}
