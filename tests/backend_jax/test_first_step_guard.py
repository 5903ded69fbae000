"""The first-step guard (issue 22): a finite update applies the inner transformation's updates
(the parameters move), and one whose update is suppressed raises naming the jax/optax versions."""

import importlib
import re

import pytest

from ampbridge._testing import require

jax = require("jax")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
from ampbridge.errors import UnsupportedOptionError  # noqa: E402

ls = importlib.import_module("ampbridge.backends.jax.loss_scale")  # the room (the package's loss_scale is a function)
POLICY = ampbridge.preset("mixed_float16")


def _never_applied(take, updates, inner_state, old_inner_state):
    return jax.tree_util.tree_map(lambda u: jnp.full_like(u, -0.0), updates), old_inner_state


def test_a_finite_update_moves_the_params_by_the_unscaled_gradient():
    tx = ampbridge.jax.optimizer(optax.sgd(0.5), POLICY)
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    scale = ampbridge.jax.loss_scale(state).scale
    updates, state = tx.update({"w": jnp.array([0.25, 0.5]) * scale}, state, params)
    moved = optax.apply_updates(params, updates)
    assert moved["w"].tolist() == [1.0 - 0.125, -2.0 - 0.25]
    assert int(ampbridge.jax.loss_scale(state).steps) == 1 and int(ampbridge.jax.loss_scale(state).skipped) == 0


def test_the_guard_fires_when_a_finite_update_is_suppressed(monkeypatch):
    monkeypatch.setattr(ls, "_keep_or_skip", _never_applied)
    tx = ampbridge.jax.optimizer(optax.adam(0.1), POLICY)
    params = {"w": jnp.ones(3)}
    with pytest.raises(UnsupportedOptionError, match=rf"jax {re.escape(jax.__version__)}, optax"):
        tx.update({"w": jnp.ones(3)}, tx.init(params), params)


def test_a_skipped_first_update_defers_the_check_and_jit_costs_nothing(monkeypatch):
    monkeypatch.setattr(ls, "_keep_or_skip", _never_applied)
    tx = ampbridge.jax.optimizer(optax.sgd(0.1), POLICY)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    jax.jit(tx.update)({"w": jnp.ones(2)}, state, params)  # traced: nothing to read, no error
    _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state, params)  # skipped: proves nothing
    with pytest.raises(UnsupportedOptionError):
        tx.update({"w": jnp.ones(2)}, state, params)
