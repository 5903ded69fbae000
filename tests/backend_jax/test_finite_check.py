"""The finite check over every leaf shape, order and position: a non-finite gradient anywhere skips the step.

Regression for the repacked loss-scale state, whose check let a scalar, size-1 or empty last leaf decide
alone (``lax.reduce`` may drop its start value for one element or none): inf went into the parameters.
"""

from __future__ import annotations

import itertools

import pytest

from ampbridge._testing import require

jax = require("jax")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402

import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.loss_scale import all_finite  # noqa: E402

SHAPES = [(), (1,), (0,), (3,), (2, 2)]


def _tree(shapes, bad_leaf, bad_value):
    leaves = []
    for i, shape in enumerate(shapes):
        leaf = jnp.ones(shape, jnp.float32)
        if i == bad_leaf and leaf.size:
            leaf = leaf.reshape(-1).at[-1].set(bad_value).reshape(shape)
        leaves.append(leaf)
    return {f"l{i}": leaf for i, leaf in enumerate(leaves)}


ORDERS = list(itertools.permutations(SHAPES))[::7]  # 18 of the 120 leaf orders; the fuzzer draws the rest


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join("x".join(map(str, s)) or "s" for s in o))
@pytest.mark.parametrize("bad_value", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
def test_every_nonempty_leaf_position_skips(order, bad_value):
    tx = abj.optimizer(optax.sgd(0.1), "mixed_float16")
    params = _tree(order, None, 0.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for bad_leaf, shape in enumerate(order):
        grads = _tree(order, bad_leaf, bad_value)
        expect_finite = 0 in shape or shape == (0,)
        assert bool(all_finite(grads)) is expect_finite
        for fn in (tx.update, update):
            updates, new_state = fn(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(new_params))
            if not expect_finite:  # skipped: parameters unchanged, scale halved
                assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree_util.tree_leaves(new_params),
                                                                       jax.tree_util.tree_leaves(params)))
                assert float(new_state.loss_scale.scale) == 32768.0
                assert int(new_state.loss_scale.skipped) == 1


def test_all_finite_equals_jmp():
    jmp = pytest.importorskip("jmp")
    for shape in SHAPES:
        for bad in (None, jnp.inf):
            tree = [jnp.ones((3,)), jnp.full(shape, jnp.float32(1.0) if bad is None else bad)]
            assert bool(all_finite(tree)) == bool(jmp.all_finite(tree))
