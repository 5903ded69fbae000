"""The Flax model zoo under ``keep_float32 = ["kind:norm", "kind:embedding"]``: flaxmodels' linen
ResNet18 (BatchNorm; installed --no-deps by the Makefile, pinned in constraints.txt) and a Gemma-style
decoder written as Gemma writes it (its own ``RMSNorm``, ``Embedder``, ``Attention`` classes, no Flax
base class for them), in linen and in NNX. Random init, tiny, no downloads. (flaxmodels' GPT-2 no longer
runs on this JAX: it calls ``jnp.reshape(newshape=...)``.)

For every model and float16/bfloat16 compute: every norm and embedding module, counted here by class,
is pinned to float32 in the Plan; the dtypes that ran equal the Plan row by row: each module's own
matmuls, convolutions, normalisations (``rsqrt``) and lookups, read from the jaxpr of the applied
model (each op attributed to the innermost module call around it, marked by this test's own probe:
a linen method interceptor, an NNX ``__call__`` wrapper), and the dtype each call returned;
``kind:attention`` matches every attention module.

``pytest -s -k table tests/backend_jax/test_zoo.py`` prints the closing table.
"""

from __future__ import annotations

import re
import warnings

import pytest

from ampbridge._testing import ZOO_HEADER, require, zoo_line
from ampbridge.core.table import render_table

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")
flaxmodels = pytest.importorskip("flaxmodels")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

pytestmark = pytest.mark.slow

POLICY = {"keep_float32": ["kind:norm", "kind:embedding"]}
VOCAB, DIM, HEADS = 32, 16, 2


# --- a Gemma-style decoder, linen ----------------------------------------------------------------

class RMSNorm(nn.Module):  # gemma/modules: its own class, float32 statistics
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class Embedder(nn.Module):
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.input_embedding = self.param("input_embedding", nn.initializers.normal(), (VOCAB, DIM))

    def __call__(self, ids):
        return jnp.asarray(self.input_embedding, self.dtype)[ids] * jnp.sqrt(DIM).astype(self.dtype)


class Attention(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((HEADS, DIM // HEADS), dtype=self.dtype, name=n)(x) for n in ("q", "k", "v"))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(DIM // HEADS).astype(q.dtype)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhts,bshd->bthd", probs, v)
        return nn.DenseGeneral(DIM, axis=(-2, -1), dtype=self.dtype, name="o")(out)


class Block(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x + Attention(dtype=self.dtype, name="attn")(RMSNorm(name="pre_attention_norm")(x))
        h = RMSNorm(name="pre_ffw_norm")(x)
        h = nn.Dense(2 * DIM, dtype=self.dtype, name="up")(h)
        return x + nn.Dense(DIM, dtype=self.dtype, name="down")(jax.nn.gelu(h))


class LinenDecoder(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, ids):
        x = Embedder(dtype=self.dtype, name="embedder")(ids)
        for i in range(2):
            x = Block(dtype=self.dtype, name=f"layer_{i}")(x)
        return RMSNorm(name="final_norm")(x)


# --- the same decoder, NNX -----------------------------------------------------------------------

class NnxRMSNorm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


NnxRMSNorm.__name__ = NnxRMSNorm.__qualname__ = "RMSNorm"


class NnxEmbedder(nnx.Module):
    def __init__(self, rngs):
        self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, DIM)))

    def __call__(self, ids):
        return self.input_embedding[...][ids] * jnp.sqrt(DIM).astype(self.input_embedding[...].dtype)


NnxEmbedder.__name__ = NnxEmbedder.__qualname__ = "Embedder"


class NnxAttention(nnx.Module):
    def __init__(self, rngs):
        self.q, self.k, self.v, self.o = (nnx.Linear(DIM, DIM, rngs=rngs) for _ in range(4))

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).reshape(b, t, HEADS, DIM // HEADS) for p in (self.q, self.k, self.v))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(DIM // HEADS).astype(q.dtype)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        return self.o(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, DIM))


NnxAttention.__name__ = NnxAttention.__qualname__ = "Attention"


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.pre_attention_norm, self.attn = NnxRMSNorm(DIM), NnxAttention(rngs)
        self.pre_ffw_norm = NnxRMSNorm(DIM)
        self.up, self.down = nnx.Linear(DIM, 2 * DIM, rngs=rngs), nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.pre_ffw_norm(x))))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs):
        self.embedder = NnxEmbedder(rngs)
        self.layers = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.final_norm = NnxRMSNorm(DIM)

    def __call__(self, ids):
        x = self.embedder(ids)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


def _ids():
    return jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % VOCAB


def _build(name):
    if name == "resnet18 (flaxmodels, linen)":
        return flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=4), \
            (jnp.ones((1, 32, 32, 3)),), {"train": False}
    if name == "gemma-style (linen)":
        return LinenDecoder(), (_ids(),), {}
    if name == "gemma-style (nnx)":
        return NnxDecoder(nnx.Rngs(0)), (_ids(),), {}
    raise KeyError(name)


#: per model, by hand from its code: the classes of its norm, embedding and attention modules
EXPECTED = {
    "resnet18 (flaxmodels, linen)": ({"BatchNorm"}, set(), set()),
    "gemma-style (linen)": ({"RMSNorm"}, {"Embedder"}, {"Attention"}),
    "gemma-style (nnx)": ({"RMSNorm"}, {"Embedder"}, {"Attention"}),
}
MODELS = list(EXPECTED)
DTYPES = ["float16", "bfloat16"]
RESULTS: dict = {}
MARK = "probe:"  # this test's named scopes: "probe:<path>"


# --- the probe: which module ran which ops, and what each call returned ------------------------

def _floats(tree):
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}


class LinenProbe:
    """A linen method interceptor: each call runs inside a named scope ``probe:<path>``; the floats it
    returns are recorded. It is the innermost interceptor (ampbridge's, entered later, wraps it), so
    it sees the module's own return; ampbridge's output cast is read from the jaxpr (the
    ``convert_element_type`` right after the call, in the caller's scope)."""

    def __init__(self):
        self.returned: dict[str, set] = {}

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        path = ".".join(str(p) for p in context.module.path)
        with jax.named_scope(MARK + path):
            out = next_fun(*args, **kwargs)
        self.returned.setdefault(path, set()).update(_floats(out))
        return out


def _nnx_probe(model):
    """Swap each NNX module's class for a subclass (outermost: over ampbridge's) whose ``__call__`` runs
    in a named scope ``probe:<path>`` and records the floats it returns."""
    returned: dict[str, set] = {}
    for keypath, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Module) or "__call__" not in dir(type(module)):
            continue
        path = ".".join(str(k) for k in keypath)
        cls = type(module)

        def __call__(self, *args, _path=path, **kwargs):
            with jax.named_scope(MARK + _path):
                out = super(type(self), self).__call__(*args, **kwargs)
            returned.setdefault(_path, set()).update(_floats(out))
            return out

        object.__setattr__(module, "__class__", type(cls.__name__, (cls,), {"__call__": __call__,
                                                                             "__module__": cls.__module__}))
    return returned


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _eqns(inner if hasattr(inner, "eqns") else inner.jaxpr)


def _owner(eqn):
    marks = [s[len(MARK):] for s in str(eqn.source_info.name_stack).split("/") if s.startswith(MARK)]
    return marks[-1] if marks else None


#: the ops that say what a module computes in, per kind (None: every module)
MAIN = {"dot_general": None, "conv_general_dilated": None, "rsqrt": "norm", "gather": "embedding"}


def _ran(jaxpr):
    """path -> dtypes of the main ops that module ran itself (not its submodules)."""
    ran: dict[str, list] = {}
    for eqn in _eqns(jaxpr):
        owner = _owner(eqn)
        if owner is not None and eqn.primitive.name in MAIN:
            ran.setdefault(owner, []).append((eqn.primitive.name, str(eqn.outvars[0].aval.dtype)))
    return ran


def _mismatches(plan, ran, returned, final):
    problems, checked = [], 0
    for row in plan.rows:
        label = f"{row.path or '(model)'} ({row.class_name})"
        ops = [dtype for prim, dtype in ran.get(row.path, ()) if MAIN[prim] in (None, row.kind)]
        want = {row.compute_dtype}
        if row.note and re.search(r"normalisation (runs )?in float32", row.note):
            want |= {"float32"}  # Flax's norm statistics and normalisation; the row says so
        if ops and set(ops) - want:
            problems.append(f"{label}: plan compute {row.compute_dtype}, its ops ran in {sorted(set(ops))}")
        if row.path in final and final[row.path] - {row.output_dtype}:
            problems.append(f"{label}: plan output {row.output_dtype}, delivered {sorted(final[row.path])}")
        checked += bool(ops) or row.path in final
    return checked, problems


def _run(name, compute, pins=True):
    model, args, kwargs = _build(name)
    norms, embeddings, attentions = EXPECTED[name]
    policy = ampbridge.Policy(compute_dtype=compute, **(POLICY if pins else {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if name.endswith("(nnx)"):
            applied = abj.apply(model, policy)
            plan = abj.plan(applied, policy, warn=False)
            returned = _nnx_probe(applied)
            graphdef, state = nnx.split(applied)

            def forward(state, *a):
                return nnx.merge(graphdef, state)(*a, **kwargs)

            jaxpr = jax.make_jaxpr(forward)(state, *args)
            out = jax.eval_shape(forward, state, *args)
            by_class = {".".join(str(k) for k in kp): type(m).__name__ for kp, m in nnx.iter_graph(applied)
                        if isinstance(m, nnx.Module)}
        else:
            applied = abj.apply(model, policy)
            # shapes and dtypes only: the jaxpr below needs no values (nothing is computed, nothing compiled)
            variables = jax.eval_shape(lambda: applied.init(jax.random.key(0), *args, **kwargs))
            plan = applied.plan(*args, warn=False, **kwargs)
            probe = LinenProbe()

            def forward(variables, *a):
                with nn.intercept_methods(probe):
                    return applied.apply(variables, *a, **kwargs)

            jaxpr = jax.make_jaxpr(forward)(variables, *args)
            out = jax.eval_shape(forward, variables, *args)
            returned = probe.returned
            by_class = {r.path: r.class_name for r in plan.rows}
    said = [str(w.message) for w in caught if issubclass(w.category, ampbridge.UnmatchedRuleWarning)]
    allowed = [] if embeddings or not pins else ["keep_float32[1] (kind:embedding) matches no layer of the model (a typo?)"]
    ran = _ran(jaxpr.jaxpr)
    # what each call delivered: NNX's probe is outermost (after ampbridge's cast); linen's innermost, so
    # the delivered dtype is the module's own return cast by ampbridge: the row's output unless it says otherwise
    final = returned if name.endswith("(nnx)") else {}
    final[""] = _floats(out)
    checked, mismatches = _mismatches(plan, ran, final, final)
    expected_pinned = {p for p, c in by_class.items() if c in norms | embeddings}
    unpinned = sorted(p for p in expected_pinned if plan[p].rule == "default" or plan[p].compute_dtype != "float32"
                      or plan[p].param_dtype != "float32")
    attention_plan = abj.plan(applied if name.endswith("(nnx)") else model,
                              ampbridge.Policy(compute_dtype=compute, keep_float32=("kind:attention",)),
                              *([] if name.endswith("(nnx)") else args), warn=False,
                              **({} if name.endswith("(nnx)") else kwargs))
    attention_paths = {p for p, c in by_class.items() if c in attentions}
    matched_attention = {r.path for r in attention_plan.rows if r.pattern == "kind:attention" and r.inherited_from is None}
    kinds: dict = {}
    for r in plan.rows:
        if r.kind:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return dict(plan=plan, layers=len(plan.rows), kinds=kinds, said=said, allowed=allowed,
                pinned=sum(r.rule.startswith("keep_float32") for r in plan.rows), expected_pinned=expected_pinned,
                unpinned=unpinned, mismatches=mismatches, checked=checked, ran=ran,
                attention_paths=attention_paths, matched_attention=matched_attention)


def _result(name, compute, pins=True):
    key = (name, compute, pins)
    if key not in RESULTS:
        RESULTS[key] = _run(name, compute, pins)
    return RESULTS[key]


@pytest.mark.parametrize("compute", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_zoo_plan_pins_and_runs(name, compute):
    got = _result(name, compute)
    assert got["said"] == got["allowed"], got["said"]
    assert got["expected_pinned"], f"{name}: the hand-written class lists found no norm or embedding"
    assert not got["unpinned"], f"{name}: norm/embedding modules not pinned: {got['unpinned']}"
    assert not got["mismatches"], "\n".join(got["mismatches"])
    assert got["checked"] >= len(got["expected_pinned"]), got["checked"]  # the probe saw the model run
    # each row says how its kind was decided (Gemma's own classes: by their names)
    plan = got["plan"]
    assert all(plan[p].kind_source for p in got["expected_pinned"]), [plan[p] for p in got["expected_pinned"]]
    if "gemma" in name:
        assert plan["final_norm"].kind_text == "norm (class name)" and plan["embedder"].kind_text == "embedding (class name)"
        assert plan["layers.0.attn" if "nnx" in name else "layer_0.attn"].kind_text == "attention (class name)"
    # the pinned modules really normalised / looked up in float32
    for path in got["expected_pinned"]:
        ops = [d for prim, d in got["ran"].get(path, ()) if prim in ("rsqrt", "gather")]
        assert ops and set(ops) == {"float32"}, (path, got["ran"].get(path))
    assert got["matched_attention"] == got["attention_paths"], (
        f"kind:attention matched {sorted(got['matched_attention'] ^ got['attention_paths'])} wrongly")


@pytest.mark.parametrize("name", MODELS)
def test_zoo_unpinned_rows_say_what_runs(name):
    """With no rule, every row's ops run in the compute dtype the row says (Flax's own float32 statistics
    where the row notes them)."""
    got = _result(name, "bfloat16", pins=False)
    assert not got["mismatches"], "\n".join(got["mismatches"])


def test_zoo_table():
    """The closing table (run with -s to see it): every model, float16 and bfloat16."""
    lines = []
    for name in MODELS:
        for compute in DTYPES:
            got, bare = _result(name, compute), _result(name, "bfloat16", pins=False)
            lines.append(zoo_line(name, compute, got, bare))
            assert not got["mismatches"] and not got["unpinned"] and not bare["mismatches"]
    print()
    print(render_table(ZOO_HEADER, lines))
