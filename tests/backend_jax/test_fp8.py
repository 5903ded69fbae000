"""FP8 on Flax linen: ``[fp8]`` delayed scaling against the same model written by hand with
``flax.linen.fp8_ops`` (``dot_general_cls=Fp8DirectDotGeneralOp``), trained with
``TrainState.apply_gradients`` (the ``_overwrite_with_gradient`` collection), the scale step
against ``fp8_ops``'s own functions, and what Flax refuses by name."""

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ampbridge
from ampbridge import Fp8Config, Policy
from ampbridge._testing import require
from ampbridge.core.fp8 import delayed_initial, delayed_step, delayed_trajectory

jax = require("jax")
flax = require("flax")
optax = require("optax")
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import ampbridge.jax as abj  # noqa: E402

EXAMPLES = 500 if os.environ.get("AMPBRIDGE_FUZZ") else 40
DELAYED = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=1024))
OP = "Fp8DirectDotGeneralOp_0"


class Net(nn.Module):
    """Dense layers only: a LayerNorm's float32 scale is cast before the call by ampbridge and inside
    it by a hand-written dtype=bfloat16 model (a difference of the mixed-precision path, not of FP8)."""

    fp8: tuple = ()  # the layers written with Flax's fp8 dot_general
    dtype: object = None
    history: int = 1024

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            cls = None
            if name in self.fp8:
                cls = lambda: fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=self.history)  # noqa: E731
            return nn.Dense(features, dtype=self.dtype, dot_general_cls=cls, name=name)

        x = nn.relu(dense(48, "fc1")(x))
        x = nn.relu(dense(32, "fc2")(x))
        return dense(16, "head")(x)


def batches(n=8):
    rng = np.random.default_rng(1)
    return [(jnp.asarray(rng.normal(size=(16, 32)) * 3, jnp.float32), jnp.asarray(rng.normal(size=(16, 16)), jnp.float32))
            for _ in range(n)]


def train(apply_fn, variables, data):
    state = TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.sgd(0.05))

    @jax.jit
    def step(state, x, y):
        def loss_fn(v):
            return jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state.params, losses


@pytest.mark.parametrize("match,names", [(("kind:linear",), ("fc1", "fc2", "head")), (("fc2",), ("fc2",))])
def test_delayed_scaling_trains_bit_identical_to_flax_fp8_ops(match, names):
    data = batches(8)
    native = Net(fp8=names, dtype=jnp.bfloat16)
    variables = native.init(jax.random.key(0), data[0][0])
    assert set(variables[fp8_ops.OVERWRITE_WITH_GRADIENT]) == set(names)
    amp = abj.apply(Net(), DELAYED.replace(fp8=DELAYED.fp8.replace(match=match)))
    mine_init = amp.init(jax.random.key(0), data[0][0])
    assert jax.tree.structure(mine_init) == jax.tree.structure(variables)  # the same variables, fp8 state too
    expected_params, expected = train(native.apply, variables, data)
    got_params, got = train(amp.apply, variables, data)
    assert got == expected
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_params), jax.tree.leaves(expected_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    plan = amp.plan(data[0][0])
    assert {r.path for r in plan if r.fp8} == set(names) and plan["fc2"].fp8_by == "Flax fp8_ops (emulated)"
    # the scales follow the reference: the input history of fc2 replays to its scale
    meta = got_params[fp8_ops.OVERWRITE_WITH_GRADIENT]["fc2"][OP]
    history = [float(v) for v in np.asarray(meta["input_amax_history"])]
    n = len(data)
    amaxes = history[len(history) - (n - 1):] + history[:1]  # roll(-1), [0] = amax: [a_n, 0.., a_1..a_(n-1)]
    assert float(np.asarray(meta["input_scale"])[0]) == delayed_trajectory(amaxes, "e4m3", len(history))[-1].divisor


def test_amax_history_is_carried():
    x = batches(1)[0][0]
    amp = abj.apply(Net(), DELAYED.replace(fp8=Fp8Config(("fc1",), amax_history=16)))
    v = amp.init(jax.random.key(0), x)
    assert v[fp8_ops.OVERWRITE_WITH_GRADIENT]["fc1"][OP]["input_amax_history"].shape == (16,)
    native = Net(fp8=("fc1",), dtype=jnp.bfloat16, history=16)
    assert jax.tree.structure(native.init(jax.random.key(0), x)) == jax.tree.structure(v)


def test_the_float8_row_says_emulated_only_where_the_device_has_no_float8_units(monkeypatch):
    from ampbridge.backends.jax import environment
    from ampbridge.diagnostics.hardware import Device

    x = batches(1)[0][0]
    amp = abj.apply(Net(), DELAYED.replace(fp8=Fp8Config(("fc1",))))
    assert amp.plan(x)["fc1"].fp8_by == "Flax fp8_ops (emulated)"  # this CPU
    monkeypatch.setattr(environment, "device", lambda: Device("cuda", capability=(9, 0)))
    assert abj.apply(Net(), DELAYED.replace(fp8=Fp8Config(("fc1",)))).plan(x)["fc1"].fp8_by == "Flax fp8_ops"


@pytest.mark.parametrize("fp8,says", [
    (Fp8Config(("kind:linear",), amax_compute="most_recent"), 'fp8.amax_compute = "most_recent"'),
    (Fp8Config(("kind:linear",), margin=1), "fp8.margin = 1 is not realised on Flax"),
    (Fp8Config(("kind:linear",), backward="e4m3"), "fp8.backward = 'e4m3' is not realised on Flax"),
    (Fp8Config(("type:Net",)), "'(root)' (Net) in float8, but Flax's fp8_ops replace"),
])
def test_what_flax_fp8_ops_cannot_carry_is_refused_by_name(fp8, says):
    with pytest.raises(ampbridge.UnsupportedOptionError) as info:  # at apply, or at the first call
        abj.apply(Net(), Policy(compute_dtype="bfloat16", fp8=fp8)).init(jax.random.key(0), batches(1)[0][0])
    assert says in str(info.value)


floats = st.floats(0.0, 3.4028234663852886e38, width=32) | st.sampled_from([0.0, math.inf, math.nan])


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(floats, min_size=1, max_size=4), floats, st.sampled_from(["e4m3", "e5m2"]),
       st.floats(2.0 ** -20, 2.0 ** 20, width=32))
def test_the_reference_step_is_flax_fp8_ops(history, amax, fmt, divisor):
    state = delayed_initial(len(history), divisor)
    state = type(state)(state.divisor, tuple(np.float32(history).tolist()))
    q = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt]
    new_scale, new_history = fp8_ops.update_fp8_meta(jnp.float32([amax]), q, jnp.float32([divisor]),
                                                     jnp.float32(history))
    got = delayed_step(state, amax, fmt)
    np.testing.assert_array_equal(np.float32([got.divisor]), np.asarray(new_scale))
    np.testing.assert_array_equal(np.float32(got.history), np.asarray(new_history))


def test_nnx_models_refuse_fp8_by_name():
    from flax import nnx

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ampbridge.UnsupportedOptionError, match=r"\[fp8\] table is not realised on flax.nnx"):
        abj.apply(model, DELAYED)
    abj.apply(model, Policy(compute_dtype="bfloat16"))  # without [fp8] as before


def test_the_compiled_step_is_the_hand_written_fp8_ops_step():
    """The jitted training step of the [fp8] model compiles to the same program as the model written with
    fp8_ops by hand: the same HLO op histogram after XLA's optimisation (nothing added per step)."""
    import collections
    import re

    x, y = batches(1)[0]

    def ops(apply_fn, variables):
        state = TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.sgd(0.05))

        def step(state):
            grads = jax.grad(lambda v: jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2))(state.params)
            return state.apply_gradients(grads=grads)

        text = jax.jit(step).lower(state).compile().as_text()
        return collections.Counter(re.findall(r"= \S+ ([a-z][a-z0-9\-]*)\(", text))

    native = Net(fp8=("fc1", "fc2", "head"), dtype=jnp.bfloat16)
    amp = abj.apply(Net(), DELAYED)
    mine, theirs = ops(amp.apply, amp.init(jax.random.key(0), x)), ops(native.apply, native.init(jax.random.key(0), x))
    assert sum(theirs.values()) > 100 and mine == theirs


def _equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_restored_checkpoint_trains_on_bit_identically():
    """A checkpoint of the variables (parameters and the ``_overwrite_with_gradient`` scales and amax
    histories) written with Flax's own serialization mid-run, restored into a fresh ``abj.apply`` of the
    model, trains on exactly as the run never interrupted (losses, parameters, scales, histories)."""
    from flax import serialization

    policy, data = DELAYED.replace(fp8=Fp8Config(("kind:linear",), amax_history=4)), batches(10)  # the history wraps
    amp = abj.apply(Net(), policy)
    start = amp.init(jax.random.key(0), data[0][0])
    whole, whole_losses = train(amp.apply, start, data)

    first, first_losses = train(amp.apply, start, data[:6])
    blob = serialization.to_bytes(first)
    fresh = abj.apply(Net(), policy)
    template = fresh.init(jax.random.key(1), data[0][0])  # other random weights: all of them are restored
    restored = serialization.from_bytes(template, blob)
    assert _equal(restored, first)
    meta = restored[fp8_ops.OVERWRITE_WITH_GRADIENT]["fc1"][OP]
    assert float(meta["input_scale"].reshape(())) != 1.0 and np.count_nonzero(meta["input_amax_history"]) == 4
    rest, rest_losses = train(fresh.apply, restored, data[6:])
    assert first_losses + rest_losses == whole_losses
    assert _equal(rest, whole)
