"""jmp's own loss-scale tests, ported: the same scales, periods, factors and expected values, with
jmp's loss-scale objects swapped for ampbridge's JAX loss scaling built from the same settings (issue 38).

Source: google-deepmind/jmp, jmp/_src/loss_scale_test.py as stored in the code index (commit
107217e5d5c09bb14a6f6aeadcf580d8d46ca4f7; the installed jmp is 0.0.4, whose loss_scale.py these tests
describe).

What is swapped: ``jmp.StaticLossScale(s)`` / ``jmp.DynamicLossScale(s, counter, period, factor,
min_loss_scale)`` become :func:`static` / :func:`dynamic`, an :class:`AmpLossScale` holding an
``ampbridge.LossScaleConfig`` (static ``initial_scale = s``; dynamic ``initial_scale = s``,
``growth_interval = period``, ``growth_factor = factor``, ``backoff_factor = 1 / factor``, ``min_scale
= min_loss_scale`` (jmp's default 1; 0 is no floor)) and the state of ``ampbridge.jax`` for it;
``scale`` / ``unscale`` run ``ampbridge.jax.scale_loss`` / ``loss_scale.unscale`` on each leaf; ``adjust(finite)``
is ``ampbridge.backends.jax.loss_scale.next_loss_scale``; ``loss_scale`` / ``counter`` / ``period`` / ``factor`` read the
state's ``scale`` / ``good_steps`` and the settings. ``jmp.all_finite`` becomes the JAX backend's finite
check (``all_finite``, the one its optimizer, ``value_and_grad`` and monitor use). Tests of jmp's own
pytree layout and helpers are listed in NOT_APPLICABLE with the reason.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ampbridge import LossScaleConfig
from ampbridge._testing import require

require("jmp")
import importlib  # noqa: E402

abj = importlib.import_module("ampbridge.backends.jax.loss_scale")

NOT_APPLICABLE = {
    "test_no_op_loss_scale": "asserts that jmp's NoOpLossScale returns the very tree object (assertIs); "
        "ampbridge's mode none multiplies by 1.0 inside the differentiated function (same values, new arrays)",
    "test_static_empty_trees": "asserts that jmp's NoOp/Static classes flatten to no pytree leaves; "
        "ampbridge's state is one PackedLossScale (scale, counters) in every mode",
    "test_dynamic_loss_scale_tree": "asserts jmp's DynamicLossScale pytree layout (leaves [scale, counter]); "
        "ampbridge's is [scale, counters int32[6]]",
    "test_dynamic_loss_scale_adjust_requires_scalar_input": "upstream's body is empty (pass)",
    "test_dynamic_loss_scale_raises_type_error_on_int_loss_scale": "asserts jmp's warning for an integer-typed "
        "scale array; ampbridge's settings are numbers from the policy file, where an integer scale is valid",
    "test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale": "as above, for min_loss_scale",
    "test_select_tree": "jmp.select_tree(pred, a, b) has no ampbridge equivalent taking a predicate "
        "(ampbridge.jax.rollback selects by the loss-scale states)",
    "test_select_tree_rejects_non_scalar": "as above (select_tree)",
}


@pytest.fixture(autouse=True)
def not_applicable(request):
    name = request.node.originalname
    if name in NOT_APPLICABLE:
        pytest.skip(f"not applicable: {NOT_APPLICABLE[name]}")


_STEPS: dict = {}


class AmpLossScale:
    """ampbridge's JAX loss scaling for one config, read as a jmp loss-scale object."""

    def __init__(self, config, state=None):
        self.config = config
        self.state = abj.initial_loss_scale(config) if state is None else state

    def scale(self, tree):
        return jax.tree_util.tree_map(lambda x: abj.scale_loss(x, self.state), tree)

    def unscale(self, tree):
        return abj.unscale(tree, self.state)

    def adjust(self, grads_finite):
        if self.config not in _STEPS:  # one compiled step per config (the settings are static)
            _STEPS[self.config] = jax.jit(lambda state, found_inf: abj.next_loss_scale(self.config, state, found_inf))
        return AmpLossScale(self.config, _STEPS[self.config](self.state, ~grads_finite))

    @property
    def loss_scale(self):
        return self.state.scale

    @property
    def counter(self):
        return self.state.good_steps

    @property
    def period(self):
        return self.config.growth_interval

    @property
    def factor(self):
        return self.config.growth_factor


def static(scale):
    return AmpLossScale(LossScaleConfig(mode="static", initial_scale=float(scale)))


def dynamic(loss_scale, counter=None, period=2000, factor=2, min_loss_scale=None):
    floor = 1.0 if min_loss_scale is None else float(np.asarray(min_loss_scale))
    config = LossScaleConfig(mode="dynamic", initial_scale=float(np.asarray(loss_scale)), growth_interval=int(period),
                             growth_factor=float(factor), backoff_factor=1.0 / float(factor),
                             min_scale=floor or None)
    state = abj.initial_loss_scale(config)
    if counter is not None:
        state = state.replace(good_steps=int(np.asarray(counter)))
    return AmpLossScale(config, state)


def test_no_op_loss_scale():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


@pytest.mark.parametrize("cls,scale", [(static, 2), (static, 3), (static, 4), (dynamic, 2.), (dynamic, 3.),
                                       (dynamic, 4.)],
                         ids=["StaticLossScale(2)", "StaticLossScale(3)", "StaticLossScale(4)",
                              "DynamicLossScale(2)", "DynamicLossScale(3)", "DynamicLossScale(4)"])
def test_static_loss_scale(cls, scale):
    loss_scale = cls(scale)
    tree = {"a": jnp.array(1.)}
    scaled_tree = {"a": jnp.array(1. * scale)}
    assert loss_scale.scale(tree) == scaled_tree
    assert loss_scale.unscale(scaled_tree) == tree


@pytest.mark.parametrize("create", ["NoOpLossScale", "StaticLossScale"])
def test_static_empty_trees(create):
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


def test_dynamic_loss_scale_no_warnings():
    with warnings.catch_warnings(record=True) as logged_warnings:
        warnings.simplefilter("always")
        dynamic(2. ** 15)
    assert not logged_warnings


def test_dynamic_loss_scale_tree():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
    grads_finite = jnp.bool_(True)
    loss_scale = dynamic(jnp.float32(10), jnp.int32(0), period, factor)
    for i in range(1, period):
        loss_scale = loss_scale.adjust(grads_finite)
        assert loss_scale.loss_scale == 10
        assert loss_scale.counter == i
        assert loss_scale.period == period
        assert loss_scale.factor == factor
    loss_scale = loss_scale.adjust(grads_finite)
    assert loss_scale.loss_scale == 10 * factor
    assert loss_scale.counter == 0
    assert loss_scale.period == period
    assert loss_scale.factor == factor


@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor):
    grads_finite = jnp.bool_(False)
    init = np.float32(10)
    loss_scale = dynamic(jnp.asarray(init), jnp.int32(0), period, factor)
    assert init / (factor ** 100) < 1, "should cover max(1, S)"
    for i in range(100):
        loss_scale = loss_scale.adjust(grads_finite)
        np.testing.assert_allclose(loss_scale.loss_scale, max(1, init / (factor ** (i + 1))), rtol=1e-5)
        assert loss_scale.counter == 0
        assert loss_scale.period == period
        assert loss_scale.factor == factor


@pytest.mark.parametrize("period,factor,min_loss_scale", [(20, 2, .3125), (30, 3, .37), (5., 2., 0.)])
def test_dynamic_loss_scale_explicit_min_loss_scale(period, factor, min_loss_scale):
    grads_finite = jnp.bool_(False)
    init = np.float32(10)
    loss_scale = dynamic(jnp.asarray(init), jnp.int32(0), period, factor, jnp.asarray(min_loss_scale))
    assert init / (factor**100) < 1, "should cover max(1, S)"
    for i in range(100):
        loss_scale = loss_scale.adjust(grads_finite)
        np.testing.assert_allclose(loss_scale.loss_scale, max(min_loss_scale, init / (factor**(i + 1))), rtol=1e-5)
        assert loss_scale.counter == 0
        assert loss_scale.period == period
        assert loss_scale.factor == factor


def test_dynamic_loss_scale_adjust_requires_scalar_input():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


def test_dynamic_loss_scale_raises_type_error_on_int_loss_scale():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


def test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
    all_finite = abj.all_finite
    assert all_finite(None)
    assert all_finite({})
    assert not all_finite({"a": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_select_tree():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


def test_select_tree_rejects_non_scalar():
    raise AssertionError("unreachable: listed in NOT_APPLICABLE")  # pragma: no cover


# --- ampbridge's own check: the swap is not vacuous -----------------------------------------------

def test_the_real_jmp_agrees_step_for_step():
    """jmp's own DynamicLossScale and the swapped object over one mixed sequence: the same scale
    (to float32) and counter after every adjust."""
    import jmp

    theirs, ours = jmp.DynamicLossScale(jnp.float32(2.0 ** 10), period=3, factor=2), dynamic(2.0 ** 10, period=3)
    for finite in [True] * 7 + [False, False, True, True, True, False] + [True] * 5:
        theirs, ours = theirs.adjust(jnp.bool_(finite)), ours.adjust(jnp.bool_(finite))
        assert float(theirs.loss_scale) == float(ours.loss_scale)
        assert int(theirs.counter) == int(ours.counter)
