"""ampbridge.jax.trace: the Plan's rows as one traced forward ran them (linen and NNX)."""

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

import ampbridge
import ampbridge.jax as abj

POLICY = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))


def _same_dtypes(static, traced):
    return [(r.path, r.compute_dtype, r.output_dtype) for r in static.rows] == \
        [(r.path, r.compute_dtype, r.output_dtype) for r in traced.rows]


def test_linen_traced_rows_equal_static_rows():
    model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    x = jnp.ones((2, 3))
    static = abj.plan(model, POLICY, x)
    traced = abj.trace(model, POLICY, x)
    assert _same_dtypes(static, traced)
    assert traced["layers_0"].compute_dtype == "bfloat16" and traced["layers_1"].compute_dtype == "float32"
    assert "traced: dtypes observed in one forward" in traced.notes
    assert not any("traced: ran" in (r.note or "") for r in traced.rows)


def test_nnx_traced_rows_equal_static_rows():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(3, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)
            self.spare = nnx.Linear(8, 8, rngs=rngs)  # not called by __call__

        def __call__(self, x):
            return self.head(self.norm(self.up(x)))

    model = Net(nnx.Rngs(0))
    x = jnp.ones((2, 3))
    static = abj.plan(model, POLICY)
    traced = abj.trace(model, POLICY, x)
    assert _same_dtypes(static, traced)
    assert traced["norm"].compute_dtype == "float32" and traced["up"].output_dtype == "bfloat16"
    assert "did not run in the traced forward" in traced["spare"].note
    assert "did not run" not in (traced["head"].note or "")
    assert model.up.kernel[...].dtype == jnp.float32  # the model itself is untouched


class Upcast(nn.Module):
    """Ignores the compute dtype it is given: its matmul runs in float32."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 4))
        return (x.astype(jnp.float32) @ kernel.astype(jnp.float32)).astype(x.dtype)


def test_upcasting_module_shows_float32_compute():
    model = nn.Sequential([nn.Dense(4), Upcast()])
    x = jnp.ones((2, 3))
    policy = ampbridge.Policy(compute_dtype="bfloat16")
    traced = abj.trace(model, policy, x)
    row = traced["layers_1"]
    assert abj.plan(model, policy, x)["layers_1"].compute_dtype == "bfloat16"
    assert row.compute_dtype == "float32" and row.output_dtype == "bfloat16"
    assert "traced: ran compute float32" in row.note
    assert traced["layers_0"].compute_dtype == "bfloat16"



def test_unpinned_nnx_norm_row_says_it_normalises_in_float32_as_it_runs():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(3, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.up(x))

    policy = ampbridge.Policy(compute_dtype="bfloat16")
    model = Net(nnx.Rngs(0))
    static = abj.plan(model, policy)
    assert "statistics and the normalisation in float32" in static["norm"].note  # as linen's rows say
    traced = abj.trace(model, policy, jnp.ones((2, 3)))
    assert _same_dtypes(static, traced)
    assert "traced: ran" not in (traced["norm"].note or "")  # the static row already said what runs


class _Idle(nnx.Module):  # reads a Linear's kernel directly (as Mamba does its conv1d): its call never runs
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True)
        self.proj = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.fc(x)) @ self.proj.kernel[...]


def test_a_no_op_row_keeps_its_static_row_and_an_idle_rule_warns():
    import pytest

    from ampbridge.core.plan import NO_OP

    model = _Idle(nnx.Rngs(0))
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("proj",))
    with pytest.warns(ampbridge.IdleRuleWarning, match=r"keep_float32\[0\] \(proj\) has no effect"):
        traced = abj.trace(model, policy, jnp.ones((2, 4)))
    assert traced["drop"].note.endswith(NO_OP) and traced["drop"].compute_dtype == "bfloat16"
    assert traced["fc"].note is None and any("has no effect" in n for n in traced.notes)
