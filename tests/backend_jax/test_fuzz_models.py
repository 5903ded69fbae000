"""Differential fuzzer for Flax models: random small models under random policies, trained beside the
native hand-pinned model, bit for bit (issue 36; what a pin means: docs/jax.md).

Hypothesis draws a model (an embedding or a Dense stem; 1-3 blocks, each residual or not, with a
LayerNorm or RMSNorm and one or two Dense layers; a head), a compute dtype (float16 or bfloat16) and
pins by kind, path, glob and class. The native model is the same module tree written by hand the
way a jmp/haiku user pins: every module call wrapped in jmp's casts (inputs to the module's compute
dtype, outputs to its output dtype), pinned modules built with ``dtype=float32`` under a float32 jmp
policy (a pinned block pins everything in it), the model's output cast to ``output_dtype``.
ampbridge applies the policy to the module written without any dtype. Three SGD steps (the second
with a target that overflows the loss, so it is skipped under float16's dynamic scaling) must give
bit-identical losses, parameters and loss scales, and every module must hand its caller the dtype
of its jmp policy, which the Plan row says.
"""

from __future__ import annotations

from typing import Any

from ampbridge._testing import fuzz_settings, require

jax = require("jax")
jmp = require("jmp")
optax = require("optax")
require("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

SETTINGS = fuzz_settings(6, 200)
WIDTH, VOCAB = 8, 16
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


class Block(nn.Module):
    norm: str
    dense: int
    residual: bool
    pins: frozenset = frozenset()  # native only: the paths (relative to the block) built float32
    native: Any = None  # native only: (low policy, pinned policy)

    @nn.compact
    def __call__(self, x):
        norm_cls = nn.LayerNorm if self.norm == "layer" else nn.RMSNorm
        mods = [(norm_cls, "norm")] + [(nn.Dense, f"fc{i}") for i in range(self.dense)]
        h = x
        for cls, name in mods:
            kwargs = {} if cls is not nn.Dense else {"features": WIDTH}
            if self.native is None:
                h = cls(name=name, **kwargs)(h)
            else:
                low, pin = self.native
                pinned = name in self.pins
                module = cls(name=name, **({"dtype": jnp.float32} if pinned else {}), **kwargs)
                h = _cast(pin if pinned else low, module)(h)
            if name.startswith("fc") and name != f"fc{self.dense - 1}":
                h = nn.relu(h)
        return x + h if self.residual else h


class Model(nn.Module):
    stem: str
    blocks: tuple
    pins: frozenset = frozenset()
    native: Any = None  # (low policy, pinned policy, root policy)

    @nn.compact
    def __call__(self, x):
        def build(cls, name, **kwargs):
            if self.native is None:
                return cls(name=name, **kwargs)
            low, pin, _ = self.native
            pinned = name in self.pins
            module = cls(name=name, **({"dtype": jnp.float32} if pinned else {}), **kwargs)
            return _cast(pin if pinned else low, module)

        stem = (build(nn.Embed, "embed", num_embeddings=VOCAB, features=WIDTH) if self.stem == "embed"
                else build(nn.Dense, "stem", features=WIDTH))
        h = stem(x)
        for i, (norm, dense, residual) in enumerate(self.blocks):
            name = f"block{i}"
            if self.native is None:
                h = Block(norm, dense, residual, name=name)(h)
                continue
            low, pin, _ = self.native
            pinned = name in self.pins
            inner = frozenset(p.split(".", 1)[1] for p in self.pins if p.startswith(name + "."))
            if pinned:
                inner = frozenset({"norm"} | {f"fc{j}" for j in range(dense)})
            block = Block(norm, dense, residual, inner, (low, pin), name=name)
            h = _cast(pin if pinned else low, block)(h)
        out = build(nn.Dense, "head", features=3)(h)
        if self.native is not None:
            out = self.native[2].cast_to_output(out)
        return out


def _cast(policy, module_call):
    def call(*args):
        return policy.cast_to_output(module_call(*policy.cast_to_compute(args)))
    return call


# "stem" pins a Dense first layer, which must get the model's inputs unrounded (found here: the model's
# own call used to cast them first; test_native_pins.py holds the minimal case)
RULES = ["kind:norm", "kind:embedding", "head", "block0", "block*.fc0", "re:block1\\..*", "type:RMSNorm",
         "type:LayerNorm", "block0.norm", "stem"]


@st.composite
def cases(draw):
    blocks = tuple(draw(st.tuples(st.sampled_from(["layer", "rms"]), st.integers(1, 2), st.booleans()))
                   for _ in range(draw(st.integers(1, 3))))
    return dict(stem=draw(st.sampled_from(["embed", "dense"])), blocks=blocks,
                compute=draw(st.sampled_from(["float16", "bfloat16"])),
                pins=tuple(draw(st.lists(st.sampled_from(RULES), max_size=3, unique=True))),
                seed=draw(st.integers(0, 2 ** 16)))


def _paths(case):
    paths = ["embed" if case["stem"] == "embed" else "stem", "head"]
    for i, (_, dense, _) in enumerate(case["blocks"]):
        paths += [f"block{i}", f"block{i}.norm"] + [f"block{i}.fc{j}" for j in range(dense)]
    return paths


@given(case=cases())
@SETTINGS
def test_random_models_and_pins_train_like_the_hand_pinned_model(case, outputs):
    import warnings

    from ampbridge.errors import AmpBridgeWarning

    compute = case["compute"]
    loss_scale = (ampbridge.LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=2, min_scale=1.0)
                  if compute == "float16" else ampbridge.LossScaleConfig(mode="none"))
    policy = ampbridge.Policy(compute_dtype=compute, keep_float32=case["pins"], loss_scale=loss_scale)
    ours_model = Model(case["stem"], case["blocks"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpBridgeWarning)  # a drawn rule may match nothing here
        amp = abj.apply(ours_model, policy)
        rng = np.random.default_rng(case["seed"])
        x = (jnp.asarray(rng.integers(0, VOCAB, (4,)), jnp.int32) if case["stem"] == "embed"
             else jnp.asarray(rng.normal(size=(4, WIDTH)), jnp.float32))
        variables = amp.init(jax.random.key(case["seed"]), x)
        plan = amp.plan(x)
    pinned = frozenset(r.path for r in plan.rows if r.compute_dtype == "float32" and r.path)
    short = SHORT[compute]
    low, pin = jmp.get_policy(f"p=f32,c={short},o={short}"), jmp.get_policy("p=f32,c=f32,o=f32")
    native = Model(case["stem"], case["blocks"], pinned, (low, pin, jmp.get_policy("p=f32,c=f32,o=f32")))
    params = variables["params"]
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        native.init(jax.random.key(0), x)["params"])

    targets = [jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) * (1e30 if i == 1 else 1.0) for i in range(3)]
    inner = optax.sgd(0.05)
    tx = abj.optimizer(inner, policy)

    def loss_fn(out, y):
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    @jax.jit
    def ours(p, state, y):
        def scaled(q):
            loss = loss_fn(amp.apply({"params": q}, x), y)
            return abj.scale_loss(loss, state), loss
        grads, loss = jax.grad(scaled, has_aux=True)(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    dynamic = compute == "float16"
    scale0 = jmp.DynamicLossScale(jnp.float32(1024.0), period=2) if dynamic else jmp.NoOpLossScale()

    def cast_params(q):  # jmp's cast_to_compute of each module's own policy, on its parameters
        def cast(path, leaf):
            module = ".".join(k.key for k in path[:-1])
            return leaf if module in pinned else low.cast_to_compute(leaf)
        return jax.tree_util.tree_map_with_path(cast, q)

    @jax.jit
    def theirs(p, state, scale, y):
        def scaled(q):
            loss = loss_fn(native.apply({"params": cast_params(q)}, x), y)
            return scale.scale(loss), loss
        grads, loss = jax.grad(scaled, has_aux=True)(p)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_state = inner.update(grads, state, p)
        p, state = jmp.select_tree(finite, (optax.apply_updates(p, updates), new_state), (p, state))
        return p, state, scale.adjust(finite), loss

    pa, sa = params, tx.init(params)
    pn, sn, scale = params, inner.init(params), scale0
    for i, y in enumerate(targets):
        pa, sa, loss_a = ours(pa, sa, y)
        pn, sn, scale, loss_n = theirs(pn, sn, scale, y)
        assert np.array_equal(np.asarray(loss_a), np.asarray(loss_n), equal_nan=True), (i, loss_a, loss_n)
        for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pn)):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), f"step {i}"
        if dynamic:
            assert float(abj.loss_scale(sa).scale) == float(scale.loss_scale), i

    # what each module hands its caller: under jmp's convention, its policy's output dtype (the
    # native wrapper casts after the module returns; ampbridge casts as the module returns)
    seen = outputs(lambda v, z: amp.apply(v, z), {"params": pa}, x)
    rows = {r.path: r for r in plan.rows}
    for path in _paths(case):
        expected = "float32" if path in pinned else compute
        assert seen[path] == expected == rows[path].output_dtype, (path, seen[path], rows[path])
    assert seen[""] == "float32"  # the model's output, in output_dtype
