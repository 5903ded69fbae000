"""Issue 41: ``report`` attribution at block boundaries in JAX (Flax linen, through the method
interceptor, and NNX). A residual model with ``kind:norm`` pinned whose overflow comes from a
block's own code (its learned skip projection, run in float16): the log names where the value
first became non-finite (checked against ``nn.intercept_methods`` recording every module's inputs
and outputs), never a module whose inputs were already non-finite, and the advice never repeats a
pin; non-finite model inputs are named as such."""

from __future__ import annotations

import numpy as np
import pytest

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
optax = require("optax")
import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as aj  # noqa: E402
from ampbridge.diagnostics.report import format_summary, summarize  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402

D = 8


class Block(nn.Module):
    """norm -> fc plus a learned skip projection in the block's own code (x @ skip, in its dtype);
    ``inner``: the skip projection feeds fc instead of the sum."""
    inner: bool = False
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        skip = self.param("skip", lambda key, shape: jnp.eye(D), (D, D))
        h = nn.LayerNorm(name="norm")(x)
        x, skip = nn.dtypes.promote_dtype(x, skip, dtype=self.dtype)
        projected = x @ skip
        y = nn.Dense(D, name="fc")(projected if self.inner else h)
        return (h if self.inner else projected) + y


class Encoder(nn.Module):
    inner: bool = False

    @nn.compact
    def __call__(self, x):
        return Block(self.inner, name="b1")(Block(self.inner, name="b0")(x))


class Net(nn.Module):
    inner: bool = False

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, name="head")(Encoder(self.inner, name="encoder")(x))


def _finite(tree):
    return all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(jnp.result_type(a), jnp.floating))


def _origin_by_interceptor(amp, variables, x):
    """The first module, in the order calls finish, whose output is non-finite while its inputs
    were finite (an independent recorder: flax's own method interceptor, outside ampbridge's)."""
    seen = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and context.module.path:
            seen.append((".".join(context.module.path), _finite((args, kwargs)), _finite(out)))
        return out

    with nn.intercept_methods(record):
        amp.apply(variables, x)
    return next(p for p, finite_in, finite_out in seen if finite_in and not finite_out), seen


def _run(amp, policy, params, x, path, steps=3):
    tx = aj.optimizer(optax.sgd(1e-3), policy)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: jnp.mean(amp.apply({"params": p}, x).astype(jnp.float32) ** 2)  # noqa: E731
        loss, grads, stats = aj.numerics(amp, loss_fn, opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    with aj.Monitor(path, amp, x) as monitor:
        for _ in range(steps):
            params, opt_state, stats = step(params, opt_state)
            monitor.record(None, stats)
    return read_log(path)


@pytest.mark.parametrize("inner", [False, True], ids=["skip-into-sum", "skip-into-fc"])
def test_report_names_the_block_where_the_value_first_went_nonfinite(tmp_path, inner):
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    amp = aj.apply(Net(inner), policy)
    x = np.ones((2, 3, D), np.float32)
    x[0, 1] = 1000.0  # one position of the data large; finite in float16
    params = amp.init(jax.random.key(0), x)["params"]
    params["encoder"]["b0"]["skip"] = 100.0 * jnp.eye(D)  # 1e3 -> 1e5 in float16, past its 65504
    expected, seen = _origin_by_interceptor(amp, {"params": params}, x)
    assert expected == "encoder.b0"  # the block's own code; every leaf in it stayed finite
    # what leaf-only attribution named: a leaf fed non-finite inputs (the next block's pinned norm, or fc)
    assert ("encoder.b0.fc" if inner else "encoder.b1.norm", False, False) in seen

    log = _run(amp, policy, params, x, tmp_path / "run.jsonl")
    assert [s["first_nonfinite"] for s in log.steps] == [{"path": expected, "where": "output"}] * 3
    assert log.header["pinned"] == {"encoder.b0.norm": "keep_float32[0]", "encoder.b1.norm": "keep_float32[0]"}
    summary = summarize(log)
    assert list(summary.overflow_origins) == [expected]
    assert 'keep_float32 = ["encoder.b0"]' in format_summary(summary)
    assert not any(f'"{p}"' in a for a in summary.advice for p in log.header["pinned"])


def test_nonfinite_model_inputs_are_named_as_such(tmp_path):
    policy = ampbridge.preset("mixed_float16")
    amp = aj.apply(nn.Sequential([nn.Dense(4), nn.Dense(1)]), policy)
    x = np.ones((2, 4), np.float32)
    x[0, 0] = np.inf
    params = amp.init(jax.random.key(0), np.ones((2, 4), np.float32))["params"]
    log = _run(amp, policy, params, x, tmp_path / "run.jsonl", steps=1)
    assert log.steps[0]["first_nonfinite"] == {"path": "", "where": "input"}
    assert any("the model's inputs" in a for a in summarize(log).advice)


class Scale(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * 1e6


def test_a_cast_at_a_modules_entry_is_the_modules_own(tmp_path):
    """A pinned module's float32 output beyond float16's range, cast at the next module's entry:
    that module is named (its inputs are checked as its caller made them), not the model's inputs."""
    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("layers_1",))
    amp = aj.apply(nn.Sequential([nn.Dense(4), Scale(), nn.Dense(1)]), policy)
    x = np.ones((2, 4), np.float32)
    params = amp.init(jax.random.key(0), x)["params"]
    log = _run(amp, policy, params, x, tmp_path / "run.jsonl", steps=1)
    assert log.steps[0]["first_nonfinite"] == {"path": "layers_2", "where": "output"}


def test_nnx_names_the_block_where_the_value_first_went_nonfinite(tmp_path):
    """The same residual model in NNX: the block's own skip projection (its parameter, cast to
    float16 with the block) overflows; the blocks record their sublayers' inputs and outputs."""
    nnx = require("flax.nnx")
    seen = []

    class NBlock(nnx.Module):
        def __init__(self, name, scale, rngs):
            self.name = name
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.fc = nnx.Linear(D, D, rngs=rngs)
            self.skip = nnx.Param(scale * jnp.eye(D))

        def __call__(self, x):
            h = self.norm(x)
            y = self.fc(h)
            out = x @ self.skip[...] + y
            if not isinstance(out, jax.core.Tracer):
                seen.extend([(self.name + ".norm", _finite(x), _finite(h)), (self.name + ".fc", _finite(h), _finite(y)),
                             (self.name, _finite(x), _finite(out))])
            return out

    class NEncoder(nnx.Module):
        def __init__(self, rngs):
            self.b0 = NBlock("encoder.b0", 100.0, rngs)
            self.b1 = NBlock("encoder.b1", 1.0, rngs)

        def __call__(self, x):
            return self.b1(self.b0(x))

    class NNet(nnx.Module):
        def __init__(self, rngs):
            self.encoder = NEncoder(rngs)
            self.head = nnx.Linear(D, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(self.encoder(x))

    policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    model = aj.apply(NNet(nnx.Rngs(0)), policy)
    x = np.ones((2, 3, D), np.float32)
    x[0, 1] = 1000.0
    model(x)
    assert next(p for p, finite_in, finite_out in seen if finite_in and not finite_out) == "encoder.b0"
    assert ("encoder.b1.norm", False, False) in seen
    opt = nnx.Optimizer(model, aj.optimizer(optax.sgd(1e-3), policy), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        _, grads, stats = aj.numerics(model, loss_fn, opt)(model)
        opt.update(model, grads)
        return stats

    with aj.Monitor(tmp_path / "run.jsonl", model) as monitor:
        monitor.record(None, step(model, opt))
    log = read_log(tmp_path / "run.jsonl")
    assert log.steps[0]["first_nonfinite"] == {"path": "encoder.b0", "where": "output"}
    assert log.header["pinned"] == {"encoder.b0.norm": "keep_float32[0]", "encoder.b1.norm": "keep_float32[0]"}
