"""The Plan of a Flax model (linen traced with example inputs, NNX walked) or of a pytree of
arrays: the core's rules plus what Flax itself does per module.

Holds: plan.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ...core.plan import Plan, build_plan
from ...core.policy import Policy
from .apply import Applied
from .environment import FRAMEWORK, phase_policy, resolve_policy
from .layers import tree_layers
from .linen import linen_plan
from .nnx import nnx_plan


def plan(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True, **kwargs: Any) -> Plan:
    """The Plan of a Flax model (linen needs example inputs, traced only) or a pytree of arrays.

    Paths join the module tree's names with ``.`` (``encoder.layers_0.norm``; NNX lists give
    ``layers.0``). A pytree's inner nodes become layers without kind or class, so only path rules
    match them.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn, ampbridge
        >>> p = plan(nn.Sequential([nn.Dense(4), nn.LayerNorm()]),  # or ampbridge.plan(...)
        ...          ampbridge.Policy(compute_dtype="bf16", keep_float32=("kind:norm",)), jnp.ones((1, 3)))
        >>> p["layers_1"].compute_dtype, p["layers_0"].compute_dtype
        ('float32', 'bfloat16')
    """
    if isinstance(model, Applied):
        return model.plan(*example_inputs, warn=warn, **kwargs)
    resolved, notes = resolve_policy(policy, warn=warn)
    resolved = phase_policy(resolved)
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None and isinstance(model, linen.Module):
        return linen_plan(model, resolved, example_inputs, warn=warn, notes=notes, **kwargs)
    if nnx is not None and isinstance(model, nnx.Module):
        return nnx_plan(model, resolved, warn=warn, notes=notes)
    if isinstance(model, Mapping):
        return build_plan(tree_layers(model), resolved, framework=FRAMEWORK, warn=warn, notes=notes)
    raise TypeError(f"ampbridge.jax.plan: cannot plan a {type(model).__qualname__}; accepted: a "
                    "flax.linen.Module (with example inputs), a flax.nnx.Module, or a dict of arrays")
