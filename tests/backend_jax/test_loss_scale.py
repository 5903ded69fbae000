"""The optax loss-scaling transformation: the reference trajectory, skips, state round trips."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

jax = require("jax")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.loss_scale import initial_loss_scale, next_loss_scale, reset_loss_scale, unscale  # noqa: E402
from ampbridge.backends.jax.loss_scale import _mul_exact  # noqa: E402
from ampbridge import LossScaleConfig  # noqa: E402
from ampbridge.core.loss_scale import LossScaler, trajectory  # noqa: E402

CONFIGS = {
    "torch-like": LossScaleConfig(mode="dynamic", growth_interval=7),
    "deepspeed": LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 12, growth_interval=10, hysteresis=2,
                                 min_scale=1.0),
    "consecutive": LossScaleConfig(mode="dynamic", growth_interval=5, hysteresis=3, consecutive_hysteresis=True,
                                   min_scale=0.25),
    "odd-factors": LossScaleConfig(mode="dynamic", initial_scale=1000.0, growth_factor=1.1, backoff_factor=0.3,
                                   growth_interval=3, min_scale=0.001, max_scale=1e6),
    "overflowing-growth": LossScaleConfig(mode="dynamic", initial_scale=3e38, growth_factor=4.0,
                                          growth_interval=2),
    "max-clamped": LossScaleConfig(mode="dynamic", initial_scale=2.0, growth_interval=1, max_scale=100.0,
                                   on_min_scale="warn", min_scale=2.0),
    "no-skip": LossScaleConfig(mode="dynamic", growth_interval=4, skip_nonfinite=False, min_scale=8.0),
    "static": LossScaleConfig(mode="static", initial_scale=128.0),
    "none-no-skip": LossScaleConfig(mode="none", skip_nonfinite=False),
}
FIELDS = ("scale", "good_steps", "hysteresis_left", "steps", "skipped")


def random_flags(n: int, seed: int, *, mild: bool = False) -> np.ndarray:
    """Finite/non-finite steps with calm stretches (growth happens) and overflow bursts."""
    rng = np.random.default_rng(seed)
    levels = [0.0, 0.02, 0.1, 0.2] if mild else [0.0, 0.02, 0.3, 0.9]
    rates = rng.choice(levels, size=n // 250 + 1, p=[0.35, 0.35, 0.2, 0.1])
    return rng.random(n) < np.repeat(rates, 250)[:n]


def synthetic_grads(flag):
    """Gradients that are finite, or hold an inf (or a nan) when ``flag``."""
    bad = jnp.where(flag, jnp.inf, 1.0)
    return {"w": jnp.full((3,), 0.5) * bad, "b": {"c": jnp.where(flag, jnp.nan, 2.0) * jnp.ones((2,))}}


def params0():
    return {"w": jnp.zeros((3,)), "b": {"c": jnp.zeros((2,))}}


def reference_arrays(cfg, flags):
    states = trajectory(cfg, flags)
    return {f: np.array([getattr(s, f) for s in states]) for f in FIELDS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_next_loss_scale_under_scan_in_jit_matches_the_reference(name):
    """The algorithm itself, over 10,000 steps, deep overflow bursts included (scales reach the
    float32 subnormal range and zero where no min_scale stops them)."""
    cfg = CONFIGS[name]
    flags = random_flags(10_000, seed=sum(map(ord, name)))

    @jax.jit
    def run(flags):
        def body(state, flag):
            state = next_loss_scale(cfg, state, flag)
            return state, state

        return jax.lax.scan(body, initial_loss_scale(cfg), flags)[1]

    states = run(jnp.asarray(flags))
    want = reference_arrays(cfg.resolve("float16"), flags)
    assert states.scale.dtype == jnp.float32 and states.good_steps.dtype == jnp.int32
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(states, field)), want[field], err_msg=field)


def test_the_subnormal_range_is_followed_exactly():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=2.0 ** -120, backoff_factor=0.7, growth_interval=1)
    flags = [True] * 40 + [False] * 10 + [True] * 10
    want = trajectory(cfg, flags)
    assert min(s.scale for s in want) < 2.0 ** -126 and want[39].scale > 0  # it does go subnormal
    states = jax.jit(lambda f: jax.lax.scan(
        lambda s, x: (next_loss_scale(cfg, s, x),) * 2, initial_loss_scale(cfg), f)[1])(jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(states.scale), np.array([s.scale for s in want], np.float32))


def test_exact_product_matches_float32_rounding():
    from ampbridge.core.loss_scale import f32

    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.integers(0, 0x7F800000, 3000), rng.integers(0, 0x00800000, 2000),
                         [0, 1, 2, 3, 0x007FFFFF, 0x00800000]]).astype(np.int32).view(np.float32)
    for factor in (0.5, 0.3, 1.1, 2.0, 1e-40, 7.5e30):
        got = np.asarray(jax.jit(jax.vmap(lambda x: _mul_exact(x, factor)))(jnp.asarray(xs)))
        want = np.array([f32(float(x) * f32(factor)) for x in xs], np.float32)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=str(factor))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimizer_trajectory_under_scan_in_jit_matches_the_reference(name):
    """The transformation end to end (unscale, finiteness, skip) on synthetic gradients."""
    cfg = CONFIGS[name]
    # the synthetic gradients are finite only while 1/scale is: without a floor, milder bursts
    flags = random_flags(10_000, seed=sum(map(ord, name)), mild=cfg.min_scale is None)
    want = reference_arrays(cfg.resolve("float16"), flags)
    assert want["scale"].min() > 2.0 ** -100 or cfg.mode != "dynamic"
    # scale_by_schedule counts the updates it makes: a skipped step leaves its count alone
    tx = abj.optimizer(optax.scale_by_schedule(lambda count: -0.1), cfg)
    params = params0()

    @jax.jit
    def run(state, flags):
        def body(state, flag):
            _, new = tx.update(synthetic_grads(flag), state, params)
            skipped = new.inner_state.count == state.inner_state.count
            return new, (abj.loss_scale(new), skipped)

        return jax.lax.scan(body, state, flags)

    final, (states, skipped) = run(tx.init(params), jnp.asarray(flags))
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(states, field)), want[field], err_msg=field)
    np.testing.assert_array_equal(np.asarray(skipped), flags & cfg.skip_nonfinite)
    assert abj.loss_scale(final).to_reference() == trajectory(cfg.resolve("float16"), flags)[-1]


def test_trajectory_one_jitted_step_at_a_time():
    cfg = CONFIGS["deepspeed"]
    flags = random_flags(1500, seed=7)
    tx = abj.optimizer(optax.adam(1e-3), cfg)
    params = params0()
    step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    state = tx.init(params)
    got = []
    for flag in flags:
        state = step(synthetic_grads(bool(flag)), state)
        got.append(abj.loss_scale(state))
    want = trajectory(cfg, flags)
    assert [s.to_reference() for s in got] == want


def test_skipped_step_leaves_params_and_inner_state_bit_identical(bits_equal):
    cfg = LossScaleConfig(mode="dynamic", initial_scale=4.0)
    tx = abj.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), cfg)
    params = {"w": jnp.array([-0.0, 1.5, -2.0]), "b": {"c": jnp.array([0.0, -0.0])}}

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    good = {"w": jnp.array([1.0, 2.0, 3.0]), "b": {"c": jnp.array([0.5, 0.5])}}
    params, state = step(params, state, good)  # a real step first, so the moments are non-trivial
    bad = {"w": jnp.array([1.0, jnp.nan, 3.0]), "b": {"c": jnp.array([jnp.inf, 0.5])}}
    new_params, new_state = step(params, state, bad)
    assert bits_equal(new_params, params)
    assert bits_equal(new_state.inner_state, state.inner_state)
    assert float(new_state.loss_scale.scale) == 2.0 and int(new_state.loss_scale.skipped) == 1
    # a negative zero parameter survives the skipped step as a negative zero
    assert bool(jnp.signbit(new_params["b"]["c"][1]))


def test_unscaled_gradients_reach_the_inner_optimizer():
    tx = abj.optimizer(optax.sgd(1.0), LossScaleConfig(mode="static", initial_scale=8.0))
    state = tx.init({"w": jnp.zeros(2)})
    updates, _ = tx.update({"w": jnp.array([8.0, -16.0])}, state)
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-1.0, 2.0])


def test_half_precision_grads_are_unscaled_in_float32():
    tx = abj.optimizer(optax.sgd(1.0), LossScaleConfig(mode="static", initial_scale=2.0 ** 20))
    g = jnp.array([3.0e4], jnp.float16)  # 3e4 / 2^20 is a float16 subnormal-ish value; float32 keeps it
    updates, _ = tx.update({"w": g}, tx.init({"w": jnp.zeros(1, jnp.float16)}))
    assert updates["w"].dtype == jnp.float16
    assert float(updates["w"][0]) == float(-(jnp.float32(3.0e4) / 2.0 ** 20).astype(jnp.float16))


def test_scale_loss_uses_the_current_scale_in_float32():
    tx = abj.optimizer(optax.sgd(1.0), ampbridge.preset("mixed_float16"))
    state = tx.init({"w": jnp.zeros(2)})
    out = abj.scale_loss(jnp.asarray(2.0, jnp.bfloat16), state)
    assert out.dtype == jnp.float32 and float(out) == 131072.0
    with pytest.warns(ampbridge.AmpBridgeWarning, match="float16 loss"):
        abj.scale_loss(jnp.asarray(1.0, jnp.float16), state)


def test_none_mode_scale_is_one_and_bf16_preset_adds_no_scaling():
    tx = abj.optimizer(optax.sgd(1.0), ampbridge.preset("mixed_bfloat16"))
    state = tx.init({"w": jnp.zeros(2)})
    assert float(abj.loss_scale(state).scale) == 1.0
    updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state)
    assert int(abj.loss_scale(state).skipped) == 1 and float(abj.loss_scale(state).scale) == 1.0


# --- the state as a pytree ------------------------------------------------------------------

def _busy_state():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 14, growth_interval=3, hysteresis=2,
                          min_scale=2.0 ** 13, on_min_scale="warn")
    tx = abj.optimizer(optax.adam(1e-3), cfg)
    params = params0()
    state = tx.init(params)
    for flag in (False, True, True, True, True, False, True, True):
        _, state = tx.update(synthetic_grads(flag), state, params)
    ls = abj.loss_scale(state)
    # every field away from its initial value, so a dropped field shows
    assert int(ls.steps) == 8 and int(ls.skipped) == 6 and int(ls.min_scale_hits) >= 1
    assert int(ls.good_steps) == 0 and int(ls.hysteresis_left) == 1
    return tx, state


def _fields(state):
    ls = abj.loss_scale(state)
    names = ("scale",) + abj.PackedLossScale.COUNTERS
    return [(name, np.asarray(getattr(ls, name)).dtype, np.asarray(getattr(ls, name)).item()) for name in names]


def test_state_survives_tree_map_jit_and_scan():
    tx, state = _busy_state()
    want = _fields(state)
    assert _fields(jax.tree_util.tree_map(lambda x: x, state)) == want
    assert _fields(jax.jit(lambda s: s)(state)) == want
    carried, _ = jax.lax.scan(lambda s, _: (s, None), state, None, length=3)
    assert _fields(carried) == want
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert _fields(jax.tree_util.tree_unflatten(treedef, leaves)) == want


def test_state_survives_flax_serialization():
    from flax import serialization

    tx, state = _busy_state()
    data = serialization.to_bytes(state)
    restored = serialization.from_bytes(tx.init(params0()), data)
    assert _fields(restored) == _fields(state)
    as_dict = serialization.to_state_dict(state)
    assert set(as_dict["loss_scale"]) == {"scale", "counters"}


def test_state_survives_orbax(tmp_path):
    ocp = require("orbax.checkpoint")
    tx, state = _busy_state()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", tx.init(params0()))
    assert _fields(restored) == _fields(state)


def test_loss_scale_is_found_inside_chains_and_wrappers():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=512.0)
    inner = abj.optimizer(optax.adam(1e-3), cfg)
    for tx in (optax.chain(optax.identity(), inner), optax.MultiSteps(inner, every_k_schedule=2),
               optax.inject_hyperparams(lambda: inner)()):
        state = tx.init(params0())
        assert float(abj.loss_scale(state).scale) == 512.0
        assert float(abj.scale_loss(jnp.float32(2.0), state)) == 1024.0
    with pytest.raises(ValueError, match="no ampbridge loss-scale state"):
        abj.loss_scale(optax.adam(1e-3).init(params0()))
    both = optax.chain(inner, inner).init(params0())
    with pytest.raises(ValueError, match="2 ampbridge loss-scale states"):
        abj.loss_scale(both)


def test_multisteps_accumulates_scaled_grads_and_unscales_once():
    cfg = LossScaleConfig(mode="static", initial_scale=4.0)
    tx = optax.MultiSteps(abj.optimizer(optax.sgd(1.0), cfg), every_k_schedule=2)
    params = {"w": jnp.zeros(1)}
    state = tx.init(params)
    u1, state = tx.update({"w": jnp.array([4.0])}, state, params)
    u2, state = tx.update({"w": jnp.array([12.0])}, state, params)
    assert float(u1["w"][0]) == 0.0 and float(u2["w"][0]) == -2.0  # mean(4, 12) / 4


# --- on_min_scale -----------------------------------------------------------------------------

def _min_cfg(on):
    return LossScaleConfig(mode="dynamic", initial_scale=4.0, min_scale=1.0, on_min_scale=on, growth_interval=100)


def test_error_mode_halts_as_the_reference_raises(bits_equal):
    cfg = _min_cfg("error")
    flags = [True, False, True, True, False, False, True]  # 4 -> 2 -> 1 -> raise at the 4th overflow
    scaler = LossScaler(cfg)
    raised_at = None
    for i, f in enumerate(flags):
        try:
            scaler.update(f)
        except ampbridge.LossScaleError:
            raised_at = i
            break
    assert raised_at == 3
    frozen = scaler.state  # the reference state when it raised

    tx = abj.optimizer(optax.sgd(0.5), cfg)
    params = params0()
    step = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p)))
    state = tx.init(params)
    abj.check(state, cfg)
    for i, f in enumerate(flags):
        before = params
        params, state = step(params, state, synthetic_grads(f))
        if i >= raised_at:
            assert bits_equal(params, before), f"step {i} after the error changed the parameters"
    assert abj.loss_scale(state).to_reference() == frozen
    with pytest.raises(ampbridge.LossScaleError, match=r"min_scale=1.0 \(step 3\)"):
        abj.check(state, cfg)


def test_warn_mode_counts_and_check_warns_once():
    cfg = _min_cfg("warn")
    tx = abj.optimizer(optax.sgd(0.5), cfg)
    state = tx.init(params0())
    for f in (True, True, True, True):
        _, state = tx.update(synthetic_grads(f), state, params0())
    assert int(abj.loss_scale(state).min_scale_hits) == 2
    assert abj.loss_scale(state).to_reference() == trajectory(cfg, [True] * 4)[-1]
    with pytest.warns(ampbridge.AmpBridgeWarning, match="stuck at min_scale"):
        abj.check(state, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        abj.check(state, cfg)  # once only


def test_host_callbacks_only_when_asked(inspect):
    params = params0()
    grads = synthetic_grads(False)
    counts = {}
    for label, policy, kw in (("default", ampbridge.preset("mixed_float16"), {}),
                              ("warn", _min_cfg("warn"), {}), ("error", _min_cfg("error"), {}),
                              ("warn+callback", _min_cfg("warn"), {"host_callback": True})):
        tx = abj.optimizer(optax.adam(1e-3), policy, **kw)
        counts[label] = len(inspect.callbacks(lambda g, s: tx.update(g, s, params), grads, tx.init(params)))
    assert counts == {"default": 0, "warn": 0, "error": 0, "warn+callback": 2}  # jaxpr eqn + custom_call


def test_host_callback_warns_from_inside_the_step():
    cfg = _min_cfg("warn")
    tx = abj.optimizer(optax.sgd(0.5), cfg, host_callback=True)
    step = jax.jit(lambda g, s: tx.update(g, s, params0())[1])
    state = tx.init(params0())
    with pytest.warns(ampbridge.AmpBridgeWarning, match=r"min_scale=1.0 \(step 2\)"):
        for f in (True, True, True, True):
            state = step(synthetic_grads(f), state)
        jax.block_until_ready(state)
    with pytest.raises(ampbridge.UnsupportedOptionError, match="on_min_scale"):
        abj.optimizer(optax.sgd(0.5), _min_cfg("clamp"), host_callback=True)


def test_host_callback_error_surfaces_as_a_runtime_error_naming_the_loss_scale_error():
    tx = abj.optimizer(optax.sgd(0.5), _min_cfg("error"), host_callback=True)
    step = jax.jit(lambda g, s: tx.update(g, s, params0())[1])
    state = tx.init(params0())
    with pytest.raises(jax.errors.JaxRuntimeError, match="LossScaleError: loss scale overflowed at min_scale"):
        for _ in range(4):
            state = step(synthetic_grads(True), state)
        jax.block_until_ready(state)


def test_unscale_and_reset_helpers():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=64.0, growth_interval=1)
    tx = abj.optimizer(optax.sgd(1.0), cfg)
    state = tx.init(params0())
    _, state = tx.update(synthetic_grads(False), state, params0())  # grows to 128
    assert float(unscale({"g": jnp.float32(256.0)}, state)["g"]) == 2.0
    _, state = tx.update(synthetic_grads(True), state, params0())
    fresh = reset_loss_scale(state, cfg)
    assert abj.loss_scale(fresh).to_reference() == ampbridge.LossScaleState(
        scale=64.0, good_steps=0, hysteresis_left=1, steps=2, skipped=1)
    assert fresh.inner_state is state.inner_state


def test_docstring_examples_run():
    import doctest
    import importlib
    import pkgutil

    import ampbridge.backends.jax as package

    result = doctest.testmod(abj, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 20 and result.failed == 0
    # names kept in their rooms, out of the facade (next_loss_scale, distributed.pmean_grads, ...):
    # their examples run with the facade's names at hand, as users read them
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for info in pkgutil.iter_modules(package.__path__):
        room = importlib.import_module(f"{package.__name__}.{info.name}")
        for test in doctest.DocTestFinder().find(room, globs=dict(vars(room)) | dict(vars(abj))):
            name = test.name[len(room.__name__) + 1:].split(".")[0]
            obj = vars(room).get(name)
            if name and name not in abj.__all__ and getattr(obj, "__module__", None) == room.__name__ and test.examples:
                runner.run(test)
    rooms = runner.summarize(verbose=False)
    assert rooms.attempted > 5 and rooms.failed == 0
