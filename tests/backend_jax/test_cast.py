"""ampbridge.jax.cast on plain pytrees (equinox/haiku style): floats only, never in place."""

from __future__ import annotations

import copy

from ampbridge._testing import require

jax = require("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge import Policy  # noqa: E402


def tree():
    return {
        "mlp/~/linear_0": {"w": jnp.ones((2, 2)), "b": np.zeros(2, np.float32)},
        "layer_norm": {"scale": jnp.ones(2, jnp.bfloat16)},
        "ids": jnp.arange(3, dtype=jnp.int16), "mask": jnp.array([True, False]),
        "step": 7, "rate": 0.5, "name": "x", "sentinel": object(), "none": None,
    }


def test_only_floating_arrays_are_cast_and_the_input_is_untouched():
    t = tree()
    snapshot = {k: (copy.copy(v) if not isinstance(v, dict) else dict(v)) for k, v in t.items()}
    out = abj.cast(t, "float16")
    assert out["mlp/~/linear_0"]["w"].dtype == jnp.float16
    assert isinstance(out["mlp/~/linear_0"]["b"], np.ndarray) and out["mlp/~/linear_0"]["b"].dtype == np.float16
    assert out["layer_norm"]["scale"].dtype == jnp.float16
    assert out["ids"].dtype == jnp.int16 and out["mask"].dtype == jnp.bool_
    for key in ("step", "rate", "name", "sentinel", "none"):
        assert out[key] is t[key]
    assert out is not t and out["mlp/~/linear_0"] is not t["mlp/~/linear_0"]
    assert t["mlp/~/linear_0"]["w"].dtype == jnp.float32 and t["layer_norm"]["scale"].dtype == jnp.bfloat16
    assert set(t) == set(snapshot)


@pytest.mark.parametrize("role, want", [("compute", "bfloat16"), ("param", "float32"), ("output", "float16")])
def test_roles_pick_the_policy_dtype(role, want):
    p = Policy(compute_dtype="bf16", param_dtype="fp32", output_dtype="fp16")
    assert abj.cast({"w": jnp.ones(1)}, p, role)["w"].dtype == jnp.dtype(want)
    import importlib

    cast_room = importlib.import_module("ampbridge.backends.jax.cast")  # the role-named helpers' room

    assert getattr(cast_room, f"cast_to_{role}")({"w": jnp.ones(1)}, p)["w"].dtype == jnp.dtype(want)


def test_path_rules_on_a_haiku_style_tree():
    p = Policy(compute_dtype="float16", keep_float32=("layer_norm", "mlp.~.*"))
    out = abj.cast(tree(), p, plan=True)
    assert out["mlp/~/linear_0"]["w"].dtype == jnp.float32  # "mlp/~/linear_0" is the path mlp.~.linear_0
    assert out["layer_norm"]["scale"].dtype == jnp.float32
    params = {"encoder": {"norm": {"scale": jnp.ones(2)}, "dense": {"kernel": jnp.ones(2)}}}
    out = abj.cast(params, Policy(compute_dtype="bf16", keep_float32=("encoder.norm",)), plan=True)
    assert out["encoder"]["norm"]["scale"].dtype == jnp.float32
    assert out["encoder"]["dense"]["kernel"].dtype == jnp.bfloat16


def test_cast_by_a_module_plan_and_tree_plans():
    flax_nn = require("flax.linen")
    model = flax_nn.Sequential([flax_nn.Dense(3), flax_nn.LayerNorm()])
    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    plan = abj.plan(model, policy, jnp.ones((1, 2)))
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 2)))["params"]
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    out = abj.cast(params, policy, plan=plan)
    assert out["layers_0"]["kernel"].dtype == jnp.bfloat16 and out["layers_1"]["scale"].dtype == jnp.float32
    tree_plan = ampbridge.jax.plan({"a": {"b": jnp.ones(3)}}, policy, warn=False)  # kinds: no match in a tree
    assert [r.path for r in tree_plan] == ["", "a"] and tree_plan["a"].param_count == 3


def test_dtype_names():
    assert abj.dtype("half") == jnp.float16 and abj.dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        abj.dtype("fp8")
