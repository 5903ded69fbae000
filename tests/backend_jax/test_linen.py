"""Flax linen under a policy: parameters, per-module compute dtypes, the Plan."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.environment import _require  # noqa: E402
from ampbridge import Policy, Rule  # noqa: E402

MIXED = Policy(compute_dtype="float16", param_dtype="bfloat16", keep_float32=("kind:norm", "kind:embedding"),
               overrides=(Rule(("block.attn",), compute_dtype="bfloat16"),
                          Rule(("head",), output_dtype="float32")))
TOKENS = jnp.zeros((2, 8), jnp.int32)


def test_init_creates_params_in_their_rows_param_dtype(demo):
    model = demo[0]
    amp = abj.apply(model, MIXED)
    plan = amp.plan(TOKENS)
    variables = jax.jit(amp.init)(jax.random.key(0), TOKENS)
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]:
        owner = ".".join(k.key for k in path[:-1])
        assert str(leaf.dtype) == plan[owner].param_dtype, owner
    assert plan["block.norm1"].param_dtype == "float32" and plan["block.mlp_in"].param_dtype == "bfloat16"


def test_every_module_computes_in_its_rows_dtype(demo, inspect):
    model, variables = demo[:2]
    amp = abj.apply(model, MIXED)
    plan = amp.plan(TOKENS)
    params = amp.cast_params(variables)
    seen = amp.observe(params, TOKENS)
    assert {o.path for o in seen} == {row.path for row in plan}
    for o in seen:
        row = plan[o.path]
        assert set(o.inputs) <= {row.compute_dtype}, o
        assert set(o.params) <= {row.compute_dtype}, o
        assert set(o.outputs) == {row.output_dtype}, o
    # independently of the interceptor: every matmul in the traced computation, by module scope
    dots = inspect.dot_dtypes(lambda v: amp.apply(v, TOKENS), params)
    assert {path for path, _ in dots} == {"block.attn.query", "block.attn.key", "block.attn.value", "block.attn",
                                          "block.attn.out", "block.mlp_in", "block.mlp_out", "head"}
    for path, dtypes in dots:
        assert set(dtypes) == {plan[path].compute_dtype}, path
    assert jax.eval_shape(lambda v: amp.apply(v, TOKENS), params).dtype == jnp.float32


def test_flax_normalises_in_float32_and_the_plan_says_so(demo, inspect):
    model, variables = demo[:2]
    policy = Policy(compute_dtype="float16")
    amp = abj.apply(model, policy)
    plan = amp.plan(TOKENS)
    assert "float32 (force_float32_reductions)" in plan["block.norm1"].note
    assert plan["block.norm1"].compute_dtype == "float16" and plan["block.mlp_in"].note is None
    reductions = {p: d for p, d in inspect.reduce_dtypes(lambda v: amp.apply(v, TOKENS), variables)}
    assert reductions["block.norm1"] == ("float32",)  # what the note claims
    seen = {o.path: o for o in amp.observe(variables, TOKENS)}
    assert seen["block.norm1"].inputs == ("float16",) and seen["block.norm1"].outputs == ("float16",)


def test_gradients_reach_the_stored_parameters(demo):
    model, variables, batches, loss_fn = demo
    amp = abj.apply(model, MIXED)
    params = jax.jit(amp.init)(jax.random.key(1), TOKENS)["params"]
    x, y = batches[0]
    grads = jax.jit(jax.grad(lambda p: loss_fn(amp.apply({"params": p}, x), y)))(params)
    for (path, g), p in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(params)):
        assert g.dtype == p.dtype, path
        assert bool(jnp.any(g != 0)), f"no gradient reached {path}"


def test_explicit_dtype_attributes_follow_the_plan_too(inspect):
    class Model(nn.Module):  # written the way many Flax models are: dtype fixed to float32
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, dtype=jnp.float32, name="inner")(x)
            return nn.Dense(2, dtype=jnp.float32, param_dtype=jnp.float32, name="out")(x)

    x = jnp.ones((3, 4))
    amp = abj.apply(Model(), Policy(compute_dtype="bfloat16", keep_float32=("out",)))
    v = jax.eval_shape(amp.init, jax.random.key(0), x)
    dots = dict(inspect.dot_dtypes(lambda v: amp.apply(v, x), v))
    assert dots == {"inner": ("bfloat16", "bfloat16"), "out": ("float32", "float32")}


def test_batch_stats_stay_float32_and_update():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(6)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
            return nn.Dense(1)(x)

    x = jax.random.normal(jax.random.key(0), (8, 3))
    amp = abj.apply(Net(), Policy(compute_dtype="float16"))
    v = jax.jit(amp.init, static_argnames="train")(jax.random.key(1), x, train=False)
    assert jax.tree_util.tree_map(lambda a: str(a.dtype), v["batch_stats"]) == {
        "BatchNorm_0": {"mean": "float32", "var": "float32"}}
    out, state = jax.jit(lambda v: amp.apply(v, x, train=True, mutable=["batch_stats"]))(v)
    assert out.dtype == jnp.float32
    stats = state["batch_stats"]["BatchNorm_0"]
    assert stats["mean"].dtype == jnp.float32 and bool(jnp.any(stats["mean"] != 0))
    assert "batch_stats" in amp.plan(x, train=False)["BatchNorm_0"].note


def test_matmul_precision_reaches_the_lowered_dots():
    x = jnp.ones((2, 4))
    for setting, hlo in (("highest", "HIGHEST"), ("high", "HIGH"), ("medium", "DEFAULT")):
        amp = abj.apply(nn.Dense(3), Policy(matmul_precision=setting))
        v = jax.eval_shape(amp.init, jax.random.key(0), x)
        text = jax.jit(lambda v: amp.apply(v, x)).lower(v).as_text()
        assert f"precision = [{hlo}, {hlo}]" in text, setting


def test_setup_modules_other_methods_and_scan():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.LayerNorm(name="norm")(nn.Dense(4, name="dense")(x)), None

    class Encoder(nn.Module):
        def setup(self):
            self.embed = nn.Embed(10, 4)
            self.layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                                  length=2)(name="layers")

        def encode(self, tokens):
            return self.layers(self.embed(tokens), None)[0]

        def __call__(self, tokens):
            return self.encode(tokens).sum(-1)

    policy = Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    amp = abj.apply(Encoder(), policy)
    tokens = jnp.arange(6).reshape(2, 3)
    plan = amp.plan(tokens)
    assert [r.path for r in plan] == ["", "embed", "layers", "layers.dense", "layers.norm"]  # call order
    assert plan["layers.dense"].param_count == 2 * (4 * 4 + 4)
    v = jax.jit(amp.init)(jax.random.key(0), tokens)
    seen = {(o.path, o.method): o for o in amp.observe(v, tokens, method="encode")}
    assert seen[("layers.norm", "__call__")].inputs == ("float32",)
    assert seen[("layers.dense", "__call__")].params == ("bfloat16", "bfloat16")
    assert jax.jit(lambda v: amp.apply(v, tokens, method="encode"))(v).dtype == jnp.float32


# --- the Plan --------------------------------------------------------------------------------

def test_plan_matches_the_shared_conformance_layers(demo):
    from ampbridge.cli.demo.model import LAYERS

    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    overrides=(Rule(("block.attn",), compute_dtype="float32"),))
    flax_plan = abj.plan(demo[0], policy, TOKENS)
    neutral = ampbridge.plan([ampbridge.Layer(path, kind) for path, kind in LAYERS], policy)
    assert flax_plan.framework == "jax"
    assert flax_plan.differences(neutral) == [": only in jax"]  # Flax's plan also has the root module
    assert [r.path for r in flax_plan][1:] == [path for path, _ in LAYERS]
    assert flax_plan["block.attn"].kind == "attention"  # its ampbridge_kind
    assert flax_plan["head"].param_count == 32 * 32 + 32


def test_the_root_row_is_the_model_and_delivers_output_dtype(demo):
    """As in every backend: row "" is the model, its output_dtype the policy's, noted when it casts."""
    amp = abj.apply(demo[0], MIXED)
    plan = amp.plan(TOKENS)
    root = plan[""]
    assert (root.class_name, root.compute_dtype, root.output_dtype) == ("DemoModel", "float16", "float32")
    assert root.note == "model outputs cast to output_dtype float32"
    assert not any("output" in n for n in plan.notes)
    seen = [o for o in amp.observe(amp.cast_params(demo[1]), TOKENS) if o.path == ""]
    assert [o.outputs for o in seen] == [("float32",)]  # what the row says, observed
    same = abj.plan(demo[0], Policy(compute_dtype="bfloat16", output_dtype="bfloat16"), TOKENS)[""]
    assert same.output_dtype == "bfloat16" and same.note is None


KIND_CASES = {
    "BatchNorm": (lambda: nn.BatchNorm(use_running_average=True), "norm"),
    "LayerNorm": (lambda: nn.LayerNorm(), "norm"), "GroupNorm": (lambda: nn.GroupNorm(num_groups=2), "norm"),
    "RMSNorm": (lambda: nn.RMSNorm(), "norm"), "InstanceNorm": (lambda: nn.InstanceNorm(), "norm"),
    "Dense": (lambda: nn.Dense(4), "linear"), "DenseGeneral": (lambda: nn.DenseGeneral((2, 2)), "linear"),
    "Einsum": (lambda: nn.Einsum((4, 4), "...i,ij->...j"), "linear"),
    "Conv": (lambda: nn.Conv(4, (3,)), "conv"), "ConvTranspose": (lambda: nn.ConvTranspose(4, (3,)), "conv"),
    "ConvLocal": (lambda: nn.ConvLocal(4, (3,)), "conv"),
    "MultiHeadDotProductAttention": (lambda: nn.MultiHeadDotProductAttention(num_heads=2), "attention"),
    "MultiHeadAttention": (lambda: nn.MultiHeadAttention(num_heads=2), "attention"),
    "SelfAttention": (lambda: nn.SelfAttention(num_heads=2), "attention"),
    "LSTMCell": (lambda: nn.RNN(nn.LSTMCell(4)), "recurrent"), "GRUCell": (lambda: nn.RNN(nn.GRUCell(4)), "recurrent"),
    "OptimizedLSTMCell": (lambda: nn.RNN(nn.OptimizedLSTMCell(4)), "recurrent"),
    "SimpleCell": (lambda: nn.RNN(nn.SimpleCell(4)), "recurrent"), "MGUCell": (lambda: nn.RNN(nn.MGUCell(4)), "recurrent"),
}


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
@pytest.mark.parametrize("name", list(KIND_CASES))
def test_kinds_of_flax_classes(name):
    make, kind = KIND_CASES[name]
    module = make()
    x = jnp.ones((2, 4, 4))
    plan = abj.plan(module, Policy(), x)
    assert plan[""].kind == kind, plan
    if isinstance(module, nn.RNN):
        assert plan["cell"].kind == "recurrent"


def test_embed_kind_and_declared_kinds():
    class Attn(nn.Module):
        ampbridge_kind = "attention"

        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(10, 4, name="embed")(tokens)
            norm = nn.LayerNorm(name="odd")
            object.__setattr__(norm, "ampbridge_kind", "softmax")  # an instance may declare one too
            return norm(Attn(name="attn")(x))

    plan = abj.plan(Model(), Policy(compute_dtype="bfloat16", keep_float32=("kind:softmax",)), jnp.zeros(3, jnp.int32))
    assert (plan["embed"].kind, plan["attn"].kind, plan["attn.Dense_0"].kind, plan["odd"].kind) == (
        "embedding", "attention", "linear", "softmax")
    assert plan["odd"].compute_dtype == "float32"


def test_softmax_note_for_forced_float32_attention():
    mha = nn.MultiHeadDotProductAttention(num_heads=2, force_fp32_for_softmax=True)
    plan = abj.plan(mha, Policy(compute_dtype="bfloat16"), jnp.ones((1, 3, 4)))
    assert "softmax in float32" in plan[""].note


def test_unmatched_rules_warn():
    policy = Policy(keep_float32=("lm_haed",))
    with pytest.warns(ampbridge.UnmatchedRuleWarning, match="lm_haed"):
        abj.plan(nn.Dense(2), policy, jnp.ones((1, 2)))
    amp = abj.apply(nn.Dense(2), policy)
    with warnings.catch_warnings():  # said once per policy and model, however often it is planned
        warnings.simplefilter("error")
        jax.eval_shape(amp.init, jax.random.key(0), jnp.ones((1, 2)))
    amp = abj.apply(nn.Dense(2), policy.replace(compute_dtype="bfloat16"))  # another policy: said again
    with pytest.warns(ampbridge.UnmatchedRuleWarning, match="lm_haed"):
        jax.eval_shape(amp.init, jax.random.key(0), jnp.ones((1, 2)))


def test_clear_errors():
    with pytest.raises(TypeError, match="pass example inputs"):
        abj.plan(nn.Dense(2), Policy())
    with pytest.raises(TypeError, match="flax.linen.Module or a flax.nnx.Module"):
        abj.apply(object(), Policy())
    with pytest.raises(ampbridge.BackendUnavailableError, match=r"pip install 'ampbridge\[jax\]'"):
        _require("flax_that_is_not_installed", "apply")
    with pytest.raises(ValueError, match="accepted: compute, param, output"):
        abj.cast({}, Policy(), to="params")


def test_the_registry_dispatches_flax_modules_here(demo, monkeypatch):
    from ampbridge.core import registry as _registry

    # only the JAX entry: the other adapters live on other branches until they are merged
    monkeypatch.setattr(_registry, "BACKENDS", {"jax": _registry.BACKENDS["jax"]})
    monkeypatch.setattr(_registry, "_cache", {})
    plan = ampbridge.plan(demo[0], "mixed_float16", TOKENS)
    assert plan.framework == "jax" and plan["head"].compute_dtype == "float16"


def test_owns():
    assert abj.owns(nn.Dense(2)) and abj.owns(abj.apply(nn.Dense(2), Policy()))
    assert not abj.owns({"w": jnp.ones(2)}) and not abj.owns([1])  # pytrees: abj.plan(tree, policy)
