"""ampbridge: one mixed-precision policy, realised natively in PyTorch, Keras and JAX.

``import ampbridge`` imports no framework; ``ampbridge.torch``, ``ampbridge.keras``,
``ampbridge.tf_keras`` and ``ampbridge.jax`` are imported when first used.

Example:
    >>> import ampbridge
    >>> policy = ampbridge.preset("mixed_bfloat16")
    >>> plan = ampbridge.plan([ampbridge.Layer("head", "linear", "Linear", 10)], policy)
    >>> plan["head"].compute_dtype
    'bfloat16'
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .core.dtypes import COMPUTE_DTYPES, STORAGE_DTYPES, FloatFormat, canonical_dtype, formats
from .core.io import PRESETS, as_policy, dump, dumps, load, loads, preset
from .core.loss_scale import LossScaler, LossScaleState, initial_state, next_state, trajectory
from .core.matching import KINDS, compile_pattern, join_path
from .core.plan import Layer, Plan, PlanRow, build_plan, layers_from_data
from .core.policy import Fp8Config, LossScaleConfig, Phase, Policy, Rule
from .errors import (
    AmpBridgeError,
    AmpBridgeWarning,
    BackendUnavailableError,
    BroadRuleWarning,
    IdleRuleWarning,
    LossScaleError,
    PolicyError,
    Problem,
    UnknownBackendError,
    UnmatchedRuleWarning,
    UnsupportedOptionError,
)

__version__ = "0.1.0"

__all__ = [
    "AmpBridgeError",
    "AmpBridgeWarning",
    "BackendUnavailableError",
    "BroadRuleWarning",
    "IdleRuleWarning",
    "COMPUTE_DTYPES",
    "FloatFormat",
    "KINDS",
    "Layer",
    "Fp8Config",
    "LossScaleConfig",
    "LossScaleError",
    "LossScaleState",
    "LossScaler",
    "PRESETS",
    "Phase",
    "Plan",
    "PlanRow",
    "Policy",
    "PolicyError",
    "Problem",
    "Rule",
    "STORAGE_DTYPES",
    "UnknownBackendError",
    "UnmatchedRuleWarning",
    "UnsupportedOptionError",
    "build_plan",
    "canonical_dtype",
    "compile_pattern",
    "dump",
    "dumps",
    "formats",
    "initial_state",
    "join_path",
    "layers_from_data",
    "load",
    "loads",
    "next_state",
    "plan",
    "preset",
    "trajectory",
]

_ADAPTERS = ("torch", "keras", "tf_keras", "jax")


def plan(model: Any, policy: Policy | str, *args: Any, **kwargs: Any) -> Plan:
    """The Plan of any supported model (or a list of :class:`Layer`) under a policy.

    ``policy`` may be a Policy, a preset name or a policy file path. Extra arguments go to the
    backend (Flax needs example inputs: ``plan(module, policy, x)``).
    """
    if isinstance(policy, (str, os.PathLike)):
        policy = as_policy(policy)
    if isinstance(model, (list, tuple)) and all(isinstance(x, Layer) for x in model):
        return build_plan(model, policy, **kwargs)
    from .core.registry import backend_module, detect_backend

    name = detect_backend(model)
    if name is None:
        raise UnknownBackendError(
            f"no installed backend recognises a {type(model).__module__}.{type(model).__qualname__}; "
            "accepted: a torch.nn.Module, a Keras (3, or 2 as tf_keras) model or layer, a Flax module, or a list of ampbridge.Layer"
        )
    return backend_module(name).plan(model, policy, *args, **kwargs)


def __getattr__(name: str) -> Any:
    # PEP 562: ampbridge.torch / .keras / .jax import their framework only when first touched
    if name in _ADAPTERS:
        return importlib.import_module(f"ampbridge.{name}")
    if name == "recipes":
        return importlib.import_module("ampbridge.recipes")
    raise AttributeError(f"module 'ampbridge' has no attribute {name!r}")
