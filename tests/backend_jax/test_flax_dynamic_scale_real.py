"""The real Flax ``DynamicScale`` (flax.training.dynamic_scale, Flax 0.12.8, which ships no test of
its own for it) against ``recipes.from_flax`` run through ``ampbridge.jax``: the same scale after
every step of random finite/non-finite sequences, and the one designed difference of
``value_and_grad``'s returned loss (docs/porting.md, section 6)."""

from __future__ import annotations

import random

import pytest

from ampbridge import recipes
from ampbridge._testing import require

require("flax")
import importlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import dynamic_scale  # noqa: E402

abj = importlib.import_module("ampbridge.backends.jax.loss_scale")


@pytest.mark.parametrize("kwargs", [{"growth_interval": 3, "scale": 4.0},
                                    {"growth_interval": 0, "scale": 2.0 ** 10, "minimum_scale": 1.0},
                                    {"growth_interval": 5, "scale": 2.0 ** 15, "growth_factor": 3.0,
                                     "backoff_factor": 0.25, "minimum_scale": None}])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_scale_follows_flax_step_for_step(kwargs, seed):
    rng = random.Random(seed)
    ds = dynamic_scale.DynamicScale(**kwargs)
    cfg = recipes.from_flax(kwargs).result.resolve("float16")
    state = abj.initial_loss_scale(cfg)
    flax_step = jax.jit(lambda ds, p: ds.value_and_grad(lambda q: q ** 2)(p))
    our_step = jax.jit(lambda state, found_inf: abj.next_loss_scale(cfg, state, found_inf))
    grown = backed = 0
    for step in range(120):
        bad = rng.random() < 0.2
        before = float(ds.scale)
        ds, is_fin, _, _ = flax_step(ds, jnp.float32(jnp.inf if bad else 1.0))
        state = our_step(state, ~is_fin)
        assert float(state.scale) == float(ds.scale), step
        grown, backed = grown + (float(ds.scale) > before), backed + (float(ds.scale) < before)
    assert grown and backed


def test_value_and_grad_loss_differs_by_design_on_a_float16_loss():
    """Flax scales a float16 loss in float16 (a Python-float scale is weakly typed): above 65504 it
    returns a NaN loss; ampbridge returns the loss as computed. Both find the step non-finite (the
    scale, as the float16 loss's cotangent, overflows float16 either way: ampbridge warns)."""
    fn = lambda p: (p * 3.0).astype(jnp.float16)  # noqa: E731
    _, is_fin, theirs, _ = dynamic_scale.DynamicScale(scale=2.0 ** 100).value_and_grad(fn)(jnp.float32(1.0))
    tx = abj.optimizer(optax.sgd(1.0), recipes.from_flax({"scale": 2.0 ** 100}).result)
    with pytest.warns(Warning, match="float16 loss"):
        ours, grads = abj.value_and_grad(fn, tx.init(jnp.float32(1.0)))(jnp.float32(1.0))
    assert not bool(is_fin) and bool(jnp.isnan(theirs))
    assert float(ours) == 3.0 and not bool(abj.all_finite(grads))
