"""The bisect switch (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY) and compute_dtype = "auto" per device."""

from __future__ import annotations

import types
import warnings

import pytest

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.cast import cast_to_compute  # noqa: E402
from ampbridge.backends.jax import environment as jax_environment  # noqa: E402
from ampbridge import Policy  # noqa: E402
from ampbridge.diagnostics import hardware as _hardware  # noqa: E402
from ampbridge.diagnostics.hardware import Device  # noqa: E402

TOKENS = jnp.zeros((2, 8), jnp.int32)


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch):
    monkeypatch.delenv("AMPBRIDGE_DISABLE", raising=False)
    monkeypatch.delenv("AMPBRIDGE_POLICY", raising=False)
    monkeypatch.setattr(ampbridge.errors, "_warned", set())


def computed_dtypes(amp, variables, inspect):
    """Every matmul's operand dtypes and the parameter dtypes, as they actually run."""
    dots = {d for _, dtypes in inspect.dot_dtypes(lambda v: amp.apply(v, TOKENS), variables) for d in dtypes}
    stored = {str(p.dtype) for p in jax.tree_util.tree_leaves(variables)}
    return dots, stored


def test_disable_runs_float32_and_says_so_once(demo, monkeypatch, inspect):
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "1")
    with pytest.warns(ampbridge.AmpBridgeWarning, match="AMPBRIDGE_DISABLE is set: running in float32"):
        amp = abj.apply(demo[0], ampbridge.preset("mixed_bfloat16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not once per model
        again = abj.apply(nn.Dense(2), "mixed_float16")
        model = abj.apply(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "mixed_float16")
    variables = jax.eval_shape(amp.init, jax.random.key(0), TOKENS)
    assert computed_dtypes(amp, variables, inspect) == ({"float32"}, {"float32"})
    plan = amp.plan(TOKENS)
    assert {r.compute_dtype for r in plan} == {"float32"} and any("environment" in n for n in plan.notes)
    assert again.policy == ampbridge.preset("float32") and model.kernel[...].dtype == jnp.float32
    assert model(jnp.ones((1, 3))).dtype == jnp.float32
    tree = {"w": jnp.ones(2), "step": 3}  # plain pytrees (equinox, haiku) follow the switch too
    assert cast_to_compute(tree, ampbridge.preset("mixed_bfloat16"))["w"].dtype == jnp.float32
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "0")  # off means off
    assert cast_to_compute(tree, ampbridge.preset("mixed_bfloat16"))["w"].dtype == jnp.bfloat16
    assert abj.apply(nn.Dense(2), "mixed_float16").policy.compute_dtype == "float16"


@pytest.mark.parametrize("source", ["preset", "file"])
def test_policy_variable_swaps_the_policy(demo, monkeypatch, inspect, tmp_path, source):
    if source == "preset":
        value = "mixed_bfloat16"
    else:
        value = str(tmp_path / "amp.toml")
        (tmp_path / "amp.toml").write_text('compute_dtype = "bfloat16"\nkeep_float32 = ["head"]\n')
    monkeypatch.setenv("AMPBRIDGE_POLICY", value)
    with pytest.warns(ampbridge.AmpBridgeWarning, match=f"AMPBRIDGE_POLICY={value}"):
        amp = abj.apply(demo[0], ampbridge.preset("mixed_float16"))
    plan = amp.plan(TOKENS)
    assert plan["block.mlp_in"].compute_dtype == "bfloat16"
    assert plan["head"].compute_dtype == ("float32" if source == "file" else "bfloat16")
    variables = jax.eval_shape(amp.init, jax.random.key(0), TOKENS)
    dots = dict(inspect.dot_dtypes(lambda v: amp.apply(v, TOKENS), variables))
    assert dots["block.mlp_in"] == ("bfloat16", "bfloat16")
    assert dots["head"] == (("float32",) if source == "file" else ("bfloat16",)) * 2
    assert any("environment" in n for n in plan.notes)


# --- compute_dtype = "auto" -------------------------------------------------------------------

FAKED = {
    "cuda-8.6": (Device("cuda", "NVIDIA A10", (8, 6)), "bfloat16", "capability 8.0+ runs bfloat16 natively"),
    "cuda-7.0": (Device("cuda", "Tesla V100", (7, 0)), "float16", "capability 7.x has float16 tensor cores"),
    "cpu-no-bf16": (Device("cpu", "cpu", cpu_flags=frozenset({"avx2", "fma"})), "float32",
                    "no native bfloat16"),
    "tpu": (Device("tpu", "TPU v4"), "bfloat16", "TPU's native matmul type"),
}


@pytest.mark.parametrize("case", list(FAKED))
def test_auto_follows_the_faked_device_and_the_plan_says_why(demo, monkeypatch, inspect, case):
    device, want, why = FAKED[case]
    monkeypatch.setattr(jax_environment, "device", lambda: device)
    policy = Policy(compute_dtype="auto", keep_float32=("kind:norm",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = abj.apply(demo[0], policy)
    emulated = [w for w in caught if "would be emulated" in str(w.message)]
    assert len(emulated) == (1 if case == "cpu-no-bf16" else 0)
    assert amp.policy.compute_dtype == want
    plan = amp.plan(TOKENS)
    assert plan["block.mlp_in"].compute_dtype == want and plan["block.norm1"].compute_dtype == "float32"
    assert any(f"compute_dtype auto -> {want}" in n and why in n for n in plan.notes), plan.notes
    variables = jax.eval_shape(amp.init, jax.random.key(0), TOKENS)
    assert dict(inspect.dot_dtypes(lambda v: amp.apply(v, TOKENS), variables))["head"] == (want, want)


def test_auto_on_this_machine():
    device = jax_environment.device()
    want, why = _hardware.auto_dtype(device)
    assert device.platform == jax.devices()[0].platform.replace("gpu", "cuda")
    if device.platform == "cpu":
        assert device.cpu_flags == _hardware.cpu_flags()
        assert want == ("bfloat16" if _hardware.BF16_CPU_FLAGS & device.cpu_flags else "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = abj.plan(nn.Dense(2), Policy(compute_dtype="auto"), jnp.ones((1, 3)))
    assert plan[""].compute_dtype == want and any(why in n for n in plan.notes)


def test_the_device_description_comes_from_jax(monkeypatch):
    """CUDA capability from the JAX device's ``compute_capability``; CPU flags from /proc/cpuinfo."""
    def fake(**attrs):
        return lambda *a, **k: [types.SimpleNamespace(**attrs)]

    monkeypatch.setattr(jax, "devices", fake(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0"))
    assert jax_environment.device() == Device("cuda", "NVIDIA H100", (9, 0))
    monkeypatch.setattr(jax, "devices", fake(platform="gpu", device_kind="Tesla T4", compute_capability="7.5"))
    assert _hardware.auto_dtype(jax_environment.device())[0] == "float16"
    monkeypatch.setattr(jax, "devices", fake(platform="cpu", device_kind="cpu"))
    monkeypatch.setattr(_hardware, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert jax_environment.device() == Device("cpu", "cpu", None, frozenset({"avx512f", "amx_bf16"}))
    assert _hardware.auto_dtype(jax_environment.device())[0] == "bfloat16"
