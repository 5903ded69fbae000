"""A pin equals the native hand-pinned Flax model (issue 37): a residual decoder (embedding, blocks
``x + relu(fc(norm(x)))``, head) written by hand with jmp's casts at every module (haiku's mixed
precision convention: inputs to the module's compute dtype, outputs to its output dtype) and the
pinned modules (norms, embedding, head) built with ``dtype=float32`` under a float32 jmp policy;
trained with jmp's DynamicLossScale and a batch whose huge target overflows the loss (the step is
skipped), beside ``ampbridge.jax.apply`` on the same module written without any dtype:
bit-identical losses, parameters and scales, and every module's output dtype equal to native."""

from __future__ import annotations

from typing import Any

import pytest

from ampbridge._testing import require

jax = require("jax")
jmp = require("jmp")
optax = require("optax")
flax = require("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

STEPS, INJECT = 5, 2
POLICY = ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm", "kind:embedding", "head"),
                          loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=1024.0,
                                                               growth_interval=2, min_scale=1.0))
LOW, PIN = jmp.get_policy("p=f32,c=f16,o=f16"), jmp.get_policy("p=f32,c=f32,o=f32")


def _cast(policy, module_call):
    """jmp's casts around one module call, as haiku's mixed precision puts them."""
    def call(*args):
        return policy.cast_to_output(module_call(*policy.cast_to_compute(args)))
    return call


class Block(nn.Module):
    native: bool = False

    @nn.compact
    def __call__(self, x):
        if not self.native:
            return x + nn.relu(nn.Dense(16, name="fc")(nn.LayerNorm(name="norm")(x)))
        norm = nn.LayerNorm(name="norm", dtype=jnp.float32)
        fc = nn.Dense(16, name="fc", dtype=jnp.float16)
        return x + nn.relu(_cast(LOW, fc)(_cast(PIN, norm)(x)))


class Decoder(nn.Module):
    native: bool = False

    @nn.compact
    def __call__(self, ids):
        pin: dict[str, Any] = {"dtype": jnp.float32} if self.native else {}
        embed = nn.Embed(32, 16, name="embed", **pin)
        blocks = [Block(self.native, name=f"block{i}") for i in range(2)]
        head = nn.Dense(32, name="head", **pin)
        if not self.native:
            x = embed(ids)
            for block in blocks:
                x = block(x)
            return head(x)
        x = _cast(PIN, embed)(ids)
        for block in blocks:
            x = _cast(LOW, block)(x)
        return _cast(PIN, head)(x)


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS):
        ids = jnp.asarray(rng.integers(0, 32, (2, 8)), jnp.int32)
        target = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32) * (1e30 if i == INJECT else 1.0)
        out.append((ids, target))
    return out


def _loss(logits, target):
    return jnp.mean((logits.astype(jnp.float32) - target) ** 2)  # the huge target overflows float32


def test_residual_decoder_trains_bit_identical_to_jmp_hand_pinning(bits_equal, outputs):
    native_model, our_model = Decoder(native=True), Decoder()
    batches = _batches()
    params = our_model.init(jax.random.key(0), batches[0][0])["params"]
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        native_model.init(jax.random.key(0), batches[0][0])["params"])
    inner = optax.sgd(0.01)

    amp = abj.apply(our_model, POLICY)
    tx = abj.optimizer(inner, POLICY)

    @jax.jit
    def ours(p, state, ids, y):
        def scaled(q):
            loss = _loss(amp.apply({"params": q}, ids), y)
            return abj.scale_loss(loss, state), loss
        grads, loss = jax.grad(scaled, has_aux=True)(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    @jax.jit
    def native(p, state, scale, ids, y):
        def scaled(q):
            loss = _loss(native_model.apply({"params": q}, ids), y)
            return scale.scale(loss), loss
        grads, loss = jax.grad(scaled, has_aux=True)(p)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_state = inner.update(grads, state, p)
        p, state = jmp.select_tree(finite, (optax.apply_updates(p, updates), new_state), (p, state))
        return p, state, scale.adjust(finite), loss

    pa, sa = params, tx.init(params)
    pn, sn, scale = params, inner.init(params), jmp.DynamicLossScale(jnp.float32(1024.0), period=2)
    scales = []
    for i, (ids, y) in enumerate(batches):
        scales.append(float(scale.loss_scale))
        assert float(abj.loss_scale(sa).scale) == scales[-1], i
        pa, sa, loss_a = ours(pa, sa, ids, y)
        pn, sn, scale, loss_n = native(pn, sn, scale, ids, y)
        assert bits_equal(loss_a, loss_n), i
        assert bits_equal(pa, pn), f"parameters differ after step {i}"
    assert scales == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0]  # step 2 overflowed: skipped, backed off
    assert int(abj.loss_scale(sa).skipped) == 1

    seen_n = outputs(lambda v, x: native_model.apply(v, x), {"params": pn}, batches[0][0])
    seen_a = outputs(lambda v, x: amp.apply(v, x), {"params": pa}, batches[0][0])
    assert seen_a == seen_n
    assert (seen_a["embed"], seen_a["block0.norm"], seen_a["block0.fc"], seen_a["block0"]) == (
        "float32", "float32", "float16", "float16")


def test_a_pinned_first_layer_gets_the_models_inputs_unrounded():
    """Found by the Flax model fuzzer: the model's own call cast its inputs to float16 before a
    pinned first layer saw them, so 1e5 arrived as inf. Now a layer that receives a model input
    unchanged gets the input itself (torch and Keras hand it float32); the root's own code still
    computes on the cast inputs (test_decode's NNX Codec)."""
    from flax import nnx

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="head")(nn.Dense(4, name="stem")(x))

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.stem, self.head = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.stem(x))

    policy = ampbridge.Policy(compute_dtype="float16", keep_float32=("stem", "head"))
    x = jnp.full((1, 3), 1e5, jnp.float32)
    amp = abj.apply(Linen(), policy)
    out = amp.apply(amp.init(jax.random.key(0), x), x)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    out = abj.apply(Nnx(nnx.Rngs(0)), policy)(x)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
