"""The JAX monitor's float8 records (Flax linen, ``fp8_ops`` through ``[fp8]``): a spike after a quiet
amax history saturates; the logged amax and scale are the ``_overwrite_with_gradient`` collection's
own (the scale Flax computed and used at the step, the history's newest entry)."""

import functools

import numpy as np
import pytest

from ampbridge import Fp8Config, Policy
from ampbridge._testing import require
from ampbridge.diagnostics.report import format_summary, summarize
from ampbridge.diagnostics.runlog import read_log

jax = require("jax")
require("flax")
optax = require("optax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import ampbridge.jax as abj  # noqa: E402

POLICY = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=4))
SPIKE = 4
OP = "Fp8DirectDotGeneralOp_0"
TENSORS = (("input", "input"), ("weight", "kernel"), ("grad_output", "output_grad"))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(nn.Dense(8, name="fc1")(x))


def batches(n=6):
    rng = np.random.default_rng(0)
    return [(jnp.asarray(rng.normal(size=(4, 4)) * (1000.0 if i == SPIKE else 1.0), jnp.float32),
             jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)) for i in range(n)]


def setup():
    amp = abj.apply(Net(), POLICY)
    variables = amp.init(jax.random.key(0), batches(1)[0][0])
    assert set(variables[fp8_ops.OVERWRITE_WITH_GRADIENT]) == {"fc1", "head"}
    state = TrainState.create(apply_fn=amp.apply, params=variables, tx=abj.optimizer(optax.sgd(1e-4), POLICY))

    @functools.partial(jax.jit, static_argnames="sample")
    def step(state, x, y, sample=False):
        def loss_fn(v):
            return jnp.mean((amp.apply(v, x).astype(jnp.float32) - y) ** 2)

        loss, grads, stats = abj.numerics(amp, loss_fn, state.opt_state, sample=sample)(state.params)
        return state.apply_gradients(grads=grads), stats

    return amp, state, step


def native_trajectory():
    """Per step, per layer and tensor: (the collection's scale, its history's newest entry) after the step."""
    _, state, step = setup()
    out = []
    for x, y in batches():
        state, _ = step(state, x, y)
        meta = state.params[fp8_ops.OVERWRITE_WITH_GRADIENT]
        out.append({p: [(float(meta[p][OP][f"{v}_scale"][0]), float(meta[p][OP][f"{v}_amax_history"][0]))
                        for _, v in TENSORS] for p in ("fc1", "head")})
    return out


def clipped(amax, scale, fp8_max):
    """Whether fp8_ops.quantize (x / scale in the bfloat16 compute dtype, clipped) clips a value of size amax."""
    x = jnp.asarray([amax], jnp.bfloat16)
    q = jnp.float8_e4m3fn if fp8_max == 448.0 else jnp.float8_e5m2
    return bool(fp8_ops.quantize(x, q, jnp.asarray([scale], jnp.float32), jnp.bfloat16)[0].astype(jnp.float32)
                == fp8_max) and bool(x[0] / jnp.asarray(scale, jnp.bfloat16) > fp8_max)


def check(path, every):
    native = native_trajectory()
    log = read_log(path)
    logged = {s["step"]: s for s in log.steps}
    assert sorted(logged) == list(range(0, len(native), every))
    for step, record in logged.items():
        for layer in ("fc1", "head"):
            for (name, _), (scale, amax) in zip(TENSORS, native[step][layer]):
                t = record["fp8"][layer][name]
                assert (t["scale"], t["amax"]) == (scale, amax), (step, layer, name)
                assert t["saturated"] == clipped(amax, scale, t["fp8_max"]), (step, layer, name)
    assert {s: r["fp8"]["fc1"]["input"]["saturated"] for s, r in logged.items()} == {s: s == SPIKE for s in logged}
    # Flax uses the scale it computes at the step: at step 1 that is the first moved one (Keras's is 1 there)
    assert native[0]["fc1"][0][0] == 1.0 != native[1]["fc1"][0][0]
    return log


def test_record_with_the_collection(tmp_path):
    _, state, step = setup()
    path = tmp_path / "run.jsonl"
    with abj.Monitor(str(path), setup()[0], batches(1)[0][0], every=1) as monitor:
        for i, (x, y) in enumerate(batches()):
            state, stats = step(state, x, y, sample=True)
            monitor.record(i, stats, fp8=state.params)
    text = format_summary(summarize(check(path, every=1)))
    assert "float8 saturation, by steps: fc1 (" in text and "fc1 saturated float8 on" in text


def test_wrap_finds_the_collection_in_the_carry(tmp_path):
    amp, state, step = setup()
    path = tmp_path / "run.jsonl"
    with abj.Monitor(str(path), amp, batches(1)[0][0], every=2) as monitor:
        train = monitor.wrap(step, carry=1)
        for x, y in batches():
            state, _ = train(state, x, y)
    check(path, every=2)
