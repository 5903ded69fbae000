"""Casting pytrees (equinox, haiku, a params dict): floating leaves only, whole trees or per Plan
row of the module owning each leaf.

Holds: cast, cast_to_compute, cast_to_param, cast_to_output, _cast_leaf, cast_tree, cast_model_inputs,
uncast_model_inputs, _row_for.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ...core.matching import join_path
from ...core.plan import Plan, PlanRow, build_plan
from ...core.policy import Policy
from .. import common as _common
from .environment import FRAMEWORK, is_float_array, phase_policy, dtype, resolve_policy
from .layers import key_name, tree_layers


def _cast_leaf(x: Any, to: np.dtype) -> Any:
    if is_float_array(x) and x.dtype != to:
        return x.astype(to)
    return x


def cast_tree(tree: Any, to: np.dtype) -> Any:
    return jax.tree_util.tree_map(lambda x: _cast_leaf(x, to), tree)


def cast_model_inputs(tree: Any, to: np.dtype, originals: dict[int, tuple[Any, Any]]) -> Any:
    """The model's own call casts its inputs (the root's code computes in the compute dtype) and
    remembers each cast leaf's original, so that :func:`uncast_model_inputs` can hand a layer that
    receives a model input unchanged the input itself, as torch (a module under
    ``autocast(enabled=False)``) and Keras (a float32 layer) do: a pinned first layer then sees 1e5,
    not float16's inf."""
    def cast(x: Any) -> Any:
        y = _cast_leaf(x, to)
        if y is not x:
            originals[id(y)] = (y, x)  # the cast leaf kept alive with its id: no reuse while remembered
        return y

    return jax.tree_util.tree_map(cast, tree)


def uncast_model_inputs(tree: Any, originals: dict[int, tuple[Any, Any]], compute: np.dtype) -> Any:
    """Each leaf that is (the very object) one of the model's cast inputs, back to the original,
    for a layer that computes in another dtype than the cast (where it is the same, the cast leaf
    is what the layer's own cast would give: kept, so the planning memo still keys on it)."""
    if not originals:
        return tree

    def original(x: Any) -> Any:
        hit = originals.get(id(x))
        return hit[1] if hit is not None and hit[0] is x and x.dtype != compute else x

    return jax.tree_util.tree_map(original, tree)


def _row_for(plan: Plan, path: str) -> PlanRow | None:
    while True:
        if path in plan:
            return plan[path]
        if not path:
            return None
        path = path.rsplit(".", 1)[0] if "." in path else ""


def cast(tree: Any, policy: Policy | str | Any, to: str = "compute", *,
         plan: Plan | bool | None = None) -> Any:
    """Cast the floating leaves of a pytree; ints, bools and non-array leaves pass through.

    ``policy`` is a Policy (``to`` picks its ``"compute"``, ``"param"`` or ``"output"`` dtype)
    or a dtype (a name such as ``"bf16"``, or a JAX dtype). With ``plan`` (a Plan, or True to
    plan the tree's own key paths against the policy's path rules), each leaf takes the row of the
    module that owns it: a leaf ``encoder/norm/scale`` follows the row of ``encoder.norm``. A new
    tree is returned; the input is never modified.

    Example:
        >>> import jax.numpy as jnp, ampbridge
        >>> p = ampbridge.Policy(compute_dtype="bf16", keep_float32=("norm",))
        >>> tree = {"dense": {"w": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}, "step": 3}
        >>> out = cast(tree, p, plan=True)
        >>> out["dense"]["w"].dtype, out["norm"]["scale"].dtype, out["step"]
        (dtype(bfloat16), dtype('float32'), 3)
    """
    roles = {"compute": "compute_dtype", "param": "param_dtype", "output": "output_dtype"}
    if to not in roles:
        raise ValueError(f"cast: to={to!r} is not accepted; accepted: {', '.join(roles)}")
    if not isinstance(policy, Policy):
        if plan:
            raise ValueError("cast: plan= needs a Policy, not a dtype")
        return cast_tree(tree, dtype(policy))
    policy = phase_policy(_common.environment(policy, FRAMEWORK)[0])  # the bisect switch reaches pytrees too
    if policy.compute_dtype == "auto":
        policy = resolve_policy(policy, warn=False)[0]
    if not plan:
        return cast_tree(tree, dtype(getattr(policy, roles[to])))
    if plan is True:  # kind:/type: rules cannot match a bare tree; no unmatched-rule warnings
        plan = build_plan(tree_layers(tree), policy, framework=FRAMEWORK, warn=False)
    role = roles[to]

    def leaf(keypath: tuple, x: Any) -> Any:
        row = _row_for(plan, join_path(*[key_name(k) for k in keypath[:-1]]))
        target = getattr(row, role) if row is not None else getattr(policy, role)
        return _cast_leaf(x, dtype(target))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def cast_to_compute(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "compute")`` (jmp's name)."""
    return cast(tree, policy, "compute")


def cast_to_param(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "param")`` (jmp's name)."""
    return cast(tree, policy, "param")


def cast_to_output(tree: Any, policy: Policy) -> Any:
    """``cast(tree, policy, "output")`` (jmp's name)."""
    return cast(tree, policy, "output")
