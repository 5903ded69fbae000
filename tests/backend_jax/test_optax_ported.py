"""optax's own ``apply_if_finite`` tests, ported: the same inner optimizers, gradients and expected
values, with ``optax.apply_if_finite(inner, max_consecutive_errors)`` swapped for ampbridge's (issue 38).

Source: google-deepmind/optax, optax/transforms/_conditionality_test.py as stored in the code index
(commit 341c6c26273545b779d6e8e62bc6d13c621de99c; the installed optax is 0.2.8, whose
``apply_if_finite`` is the one these tests were written for: ``notfinite_count``, ``last_finite``,
``total_notfinite``, an update applied once ``notfinite_count > max_consecutive_errors``).

What is swapped: ``_conditionality.apply_if_finite(inner, N)`` becomes :func:`apply_if_finite`,
``ampbridge.jax.optimizer(inner, recipes.from_optax({"max_consecutive_errors": N}).result)``, i.e.
``LossScaleConfig(mode="none", skip_nonfinite=True, max_consecutive_skips=N)``; the optax state fields the tests read become :func:`field` of ampbridge's
``AmpState``: ``notfinite_count`` is ``nonfinite_streak``, ``last_finite`` is ``nonfinite_streak == 0``
(exact while ``max_consecutive_skips`` is set, as here). ``total_notfinite`` (every non-finite update,
skipped or applied) has no ampbridge counterpart: ampbridge counts the *skipped* ones (``skipped``);
where a test reads it, that assertion is skipped with the reason, after every earlier assertion ran.
chex's variants become parameters (``with_jit`` / ``without_jit``); upstream classes become name prefixes.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampbridge import LossScaleConfig, recipes
from ampbridge._testing import require

optax = require("optax")
import ampbridge.jax as abj  # noqa: E402
from optax._src import alias, base, combine, update  # noqa: E402

NOT_APPLICABLE = {
    "test_ConditionalityTest_apply_if_finite[with_pmap]":
        "chex's with_pmap variant pmaps only the loss function; ampbridge's optimizer under pmap is "
        "test_ConditionalityTest_apply_if_finite_pmap",
    "test_ConditionallyTransformTest[stateless_inner]": "optax.conditionally_transform (run an inner "
        "transformation while a step predicate holds) is no loss-scale behaviour: ampbridge has no equivalent",
    "test_ConditionallyTransformTest[statefull_inner]": "as above (conditionally_transform)",
    "test_ConditionallyMaskTest[stateless_inner]": "optax.conditionally_mask: no loss-scale behaviour, no "
        "ampbridge equivalent",
    "test_ConditionallyMaskTest[statefull_inner]": "as above (conditionally_mask)",
    "test_ConditionallyMaskTest[stateless_inner_with_extra_args]": "as above (conditionally_mask)",
}
TOTAL_NOTFINITE = ("optax's total_notfinite counts every non-finite update, applied or skipped; ampbridge's "
                   "state counts the skipped ones (skipped): no counterpart for this assertion")


@pytest.fixture(autouse=True)
def not_applicable(request):
    name = request.node.name
    key = next((k for k in NOT_APPLICABLE if k == name or (k.endswith("[with_pmap]") and name.startswith(k[:-11])
                                                             and name.endswith("-with_pmap]"))), None)
    if key is not None:
        pytest.skip(f"not applicable: {NOT_APPLICABLE[key]}")


def apply_if_finite(inner, max_consecutive_errors):
    """The swap for ``optax.apply_if_finite``: the settings ``recipes.from_optax`` reads from its arguments."""
    config = recipes.from_optax({"max_consecutive_errors": max_consecutive_errors}).result
    assert config == LossScaleConfig(mode="none", skip_nonfinite=True, max_consecutive_skips=max_consecutive_errors)
    return abj.optimizer(inner, config)


def field(state, name):
    """The swap for reading an ``ApplyIfFiniteState`` field off ampbridge's state."""
    ls = abj.loss_scale(state)
    if name == "notfinite_count":
        return ls.nonfinite_streak
    if name == "last_finite":
        return ls.nonfinite_streak == 0
    if name == "total_notfinite":
        pytest.skip(f"not applicable from here on: {TOTAL_NOTFINITE}")
    raise AttributeError(name)


def _build_sgd():
    return alias.sgd(1.)


def _build_stateful_sgd():
    return alias.sgd(1., momentum=0.)


def _build_sgd_extra_args():
    def init_fn(params):
        del params
        return {'foo': 1}

    def update_fn(grads, state, params=None, *, foo=None, **extra_args):
        del extra_args, foo, params
        return grads, state

    t = base.GradientTransformationExtraArgs(init_fn, update_fn)
    return combine.chain(_build_sgd(), t)


VARIANTS = {"with_jit": jax.jit, "without_jit": lambda f: f, "with_pmap": None}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("opt_builder", [_build_sgd, _build_stateful_sgd, _build_sgd_extra_args],
                         ids=["sgd", "stateful_sgd", "sgd_extra_args"])
def test_ConditionalityTest_apply_if_finite(opt_builder, variant):
    one = jnp.array(1.)
    nan = jnp.array(jnp.nan)

    def fn(p, x):
        return p * x

    params = jnp.array(0.)
    opt = apply_if_finite(opt_builder(), 2)
    state = opt.init(params)
    grads_fn = jax.grad(VARIANTS[variant](fn))
    grads = grads_fn(params, one)
    updates, state = opt.update(grads, state, params)
    params = update.apply_updates(params, updates)
    assert -1. == float(jax.tree.flatten(params)[0][0])
    assert bool(field(state, 'last_finite'))
    for step in range(2):
        grads = grads_fn(params, nan)
        updates, state = opt.update(grads, state, params)
        params = update.apply_updates(params, updates)
        assert -1. == float(jax.tree.flatten(params)[0][0])
        assert not bool(field(state, 'last_finite'))
        assert step + 1 == int(field(state, 'notfinite_count'))
    grads = grads_fn(params, one)
    updates, state = opt.update(grads, state, params)
    params = update.apply_updates(params, updates)
    assert -2. == float(jax.tree.flatten(params)[0][0])
    assert bool(field(state, 'last_finite'))
    for step in range(2):
        grads = grads_fn(params, nan)
        updates, state = opt.update(grads, state, params)
        params = update.apply_updates(params, updates)
        assert -2. == float(jax.tree.flatten(params)[0][0])
        assert not bool(field(state, 'last_finite'))
        assert step + 1 == int(field(state, 'notfinite_count'))
    grads = grads_fn(params, nan)
    updates, state = opt.update(grads, state, params)
    params = update.apply_updates(params, updates)
    assert bool(jnp.isnan(jax.tree.flatten(params)[0][0]))
    assert 5 == int(field(state, 'total_notfinite'))


def test_ConditionalityTest_apply_if_finite_pmap():
    half = jnp.ones([1]) / 2.
    two = jnp.ones([1]) * 2.  # Causes a NaN in arctanh

    def fn(p, x):
        return jnp.arctanh(x) * p

    opt = apply_if_finite(alias.sgd(1.), 2)

    def fn_update(params, opt_state, x):
        grads = jax.grad(fn)(params, x)
        grads = jax.lax.psum(grads, axis_name='i')
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = update.apply_updates(params, updates)
        return new_params, new_opt_state
    fn_update = jax.pmap(fn_update, axis_name='i')

    params = jnp.array(0.)
    opt_state = opt.init(params)
    params = jax.tree.map(lambda x: x[None], params)
    opt_state = jax.tree.map(lambda x: x[None], opt_state)
    params, opt_state = fn_update(params, opt_state, half)
    assert bool(field(opt_state, 'last_finite'))
    for step in range(2):
        params, opt_state = fn_update(params, opt_state, two)
        assert not bool(field(opt_state, 'last_finite'))
        assert step + 1 == field(opt_state, 'notfinite_count').item()
    params, opt_state = fn_update(params, opt_state, half)
    assert bool(field(opt_state, 'last_finite'))
    for step in range(2):
        params, opt_state = fn_update(params, opt_state, two)
        assert not bool(field(opt_state, 'last_finite'))
        assert step + 1 == field(opt_state, 'notfinite_count').item()
    _, opt_state = fn_update(params, opt_state, two)
    assert 5 == field(opt_state, 'total_notfinite').item()


@pytest.mark.parametrize("name", ["stateless_inner", "statefull_inner"])
def test_ConditionallyTransformTest(name):
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


@pytest.mark.parametrize("name", ["stateless_inner", "statefull_inner", "stateless_inner_with_extra_args"])
def test_ConditionallyMaskTest(name):
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


# --- ampbridge's own checks: the swap is not vacuous ----------------------------------------------

EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 30


_STEPS: dict = {}


def _steps(limit):
    """Jitted update steps of optax.apply_if_finite and ampbridge for one limit (compiled once)."""
    if limit not in _STEPS:
        theirs, ours = optax.apply_if_finite(optax.sgd(1.), limit), apply_if_finite(optax.sgd(1.), limit)

        def step(opt):
            def run(p, s, g):
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s
            return jax.jit(run)
        _STEPS[limit] = (theirs, step(theirs), ours, step(ours))
    return _STEPS[limit]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 4), st.lists(st.booleans(), min_size=1, max_size=16))
def test_the_real_optax_agrees_step_for_step(limit, nonfinite):
    """Random gradient streams through optax.apply_if_finite and ampbridge (the property behind
    max_consecutive_skips): the same parameters after every step, NaN included, and
    notfinite_count == nonfinite_streak."""
    theirs_opt, theirs_step, ours_opt, ours_step = _steps(limit)
    p1 = p2 = jnp.array(0.)
    s1, s2 = theirs_opt.init(p1), ours_opt.init(p2)
    for bad in nonfinite:
        g = jnp.array(jnp.nan if bad else 1.)
        (p1, s1), (p2, s2) = theirs_step(p1, s1, g), ours_step(p2, s2, g)
        assert jnp.array_equal(p1, p2, equal_nan=True)
        assert int(s1.notfinite_count) == int(field(s2, "notfinite_count"))
        p1, p2 = jnp.where(jnp.isnan(p1), 0., p1), jnp.where(jnp.isnan(p2), 0., p2)  # keep going after a NaN
