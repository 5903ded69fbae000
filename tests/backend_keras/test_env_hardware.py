"""The bisect switch (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY) and compute_dtype = "auto" per device."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from ampbridge._testing import require

keras = require("keras")
import ampbridge  # noqa: E402
import ampbridge.diagnostics.environment  # noqa: E402
import ampbridge.diagnostics.hardware as hardware  # noqa: E402
import ampbridge.keras as ak  # noqa: E402
from ampbridge.backends.keras import environment as keras_environment  # noqa: E402
from ampbridge.diagnostics.hardware import Device  # noqa: E402

L = keras.layers
BACKEND = keras.backend.backend()
MIXED = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))


@pytest.fixture(autouse=True)
def _fresh_env(monkeypatch):
    monkeypatch.delenv("AMPBRIDGE_DISABLE", raising=False)
    monkeypatch.delenv("AMPBRIDGE_POLICY", raising=False)
    monkeypatch.setattr(ampbridge.errors, "_warned", set())


def _model(kx):
    kx.seed(0)
    return keras.Sequential([keras.Input((4,)), L.Dense(8, name="dense"), L.LayerNormalization(name="norm"),
                             L.Dense(1, name="head")], name="m")


def _run_dtypes(kx, model):
    """What each layer really emitted and stored, from one forward pass (kx.probe)."""
    records = kx.probe(model)
    model(np.ones((2, 4), "float32"))
    return ({path: rec["outputs"] for path, rec in records.items()},
            {kx.dtype_name(v.value) for v in model.weights})


def _env_warnings(caught):
    return [str(w.message) for w in caught if "AMPBRIDGE_" in str(w.message)]


def test_disable_runs_float32_and_says_so_once(kx, monkeypatch):
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "1")
    model = _model(kx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ak.apply(model, MIXED)
        opt = ak.optimizer(keras.optimizers.SGD(), MIXED)
        plan = ak.plan(model, MIXED)
        ak.apply(model, MIXED)
    said = _env_warnings(caught)
    assert len(said) == 1 and "AMPBRIDGE_DISABLE" in said[0] and "float32" in said[0]
    assert {layer.dtype_policy.name for _, layer in ak.walk(model)} == {"float32"}
    outputs, stored = _run_dtypes(kx, model)
    assert set().union(*outputs.values()) == {"float32"} and stored == {"float32"}
    assert opt.loss_scale_config.mode == "none"
    assert {row.compute_dtype for row in plan} == {"float32"} and any("environment" in n for n in plan.notes)


def test_policy_switch_takes_a_preset_or_a_file(kx, monkeypatch, tmp_path):
    monkeypatch.setenv("AMPBRIDGE_POLICY", "mixed_bfloat16")
    model = _model(kx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ak.apply(model, ampbridge.preset("float32"))
    assert len(_env_warnings(caught)) == 1
    outputs, _ = _run_dtypes(kx, model)
    assert outputs["dense"] == {"bfloat16"} and model.get_layer("dense").dtype_policy.name == "mixed_bfloat16"

    path = tmp_path / "amp.toml"
    path.write_text('compute_dtype = "float16"\nkeep_float32 = ["dense"]\n')
    monkeypatch.setenv("AMPBRIDGE_POLICY", str(path))
    model = _model(kx)
    ak.apply(model, MIXED)
    assert model.get_layer("dense").compute_dtype == "float32"
    assert model.get_layer("head").compute_dtype == "float16"
    assert ak.optimizer(keras.optimizers.SGD(), MIXED).loss_scale_config.mode == "dynamic"


# --- compute_dtype = "auto" ----------------------------------------------------------------------

def _fake_device(monkeypatch, capability, flags=frozenset({"avx2"})):
    """Make this backend's own device detection see a CUDA GPU of ``capability`` (None: a CPU
    with ``flags``)."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a: frozenset(flags))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        gpu = types.SimpleNamespace(name="/physical_device:GPU:0", device_type="GPU")
        monkeypatch.setattr(tf.config, "list_physical_devices",
                            lambda kind=None: [gpu] if capability and kind == "GPU" else [])
        monkeypatch.setattr(tf.config.experimental, "get_device_details",
                            lambda d: {"device_name": "Fake GPU", "compute_capability": capability})
    elif BACKEND == "jax":
        import jax

        fake = (types.SimpleNamespace(platform="gpu", device_kind="Fake GPU",
                                      compute_capability=f"{capability[0]}.{capability[1]}")
                if capability else types.SimpleNamespace(platform="cpu", device_kind="cpu"))
        monkeypatch.setattr(jax, "devices", lambda *a: [fake])
    else:
        import torch

        monkeypatch.setattr(keras.src.backend.torch.core, "get_device", lambda: "cuda" if capability else "cpu")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capability))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)


@pytest.mark.parametrize("capability,flags,expected", [
    ((8, 0), (), "bfloat16"), ((9, 0), (), "bfloat16"), ((7, 5), (), "float16"), ((6, 1), (), "float32"),
    (None, ("avx2",), "float32"), (None, ("avx512_bf16", "avx2"), "bfloat16"),
], ids=["cuda8.0", "cuda9.0", "cuda7.5", "cuda6.1", "cpu-no-bf16", "cpu-avx512_bf16"])
def test_auto_resolves_for_the_detected_device(kx, monkeypatch, capability, flags, expected):
    model = _model(kx)  # before faking (seeding torch would initialise a CUDA that is not there)
    _fake_device(monkeypatch, capability, flags)
    monkeypatch.setattr(keras_environment, "bfloat16_rounding", lambda: None)  # the faked CPU's kernels are not probed
    dev = ak.device()
    assert dev == (Device("cuda", "Fake GPU", capability) if capability
                   else Device("cpu", dev.name, cpu_flags=frozenset(flags)))
    policy = ampbridge.Policy(compute_dtype="auto", keep_float32=("kind:norm",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ak.plan(model, policy)
    assert plan["dense"].compute_dtype == expected and plan["norm"].compute_dtype == "float32"
    assert len(plan.notes) == 1 and plan.notes[0].startswith(f"compute_dtype auto -> {expected}: ")
    assert (capability is not None and f"capability {capability[0]}.{capability[1]}" in plan.notes[0]) or (
        capability is None and "cpu" in plan.notes[0])
    emulated = [w for w in caught if "would be emulated" in str(w.message)]
    assert len(emulated) == (1 if capability is None and expected == "float32" else 0)
    # what optimizer() builds its loss scaling from (building one would allocate on the fake GPU)
    resolved, notes = ak.resolve_policy(policy, warn=False)
    assert resolved.resolved_loss_scale.mode == ("dynamic" if expected == "float16" else "none")
    assert notes == plan.notes


def test_auto_on_this_machine_runs_its_choice(kx):
    """The real device: apply runs the dtype auto_dtype chose for it (actual tensor dtypes)."""
    dev = ak.device()
    choice, reason = hardware.auto_dtype(dev)
    if dev.platform == "cpu":
        assert dev.cpu_flags == hardware.cpu_flags()
    model = _model(kx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampbridge.AmpBridgeWarning)  # float32 on a CPU says why
        plan = ak.plan(model, ampbridge.Policy(compute_dtype="auto"))
        ak.apply(model, ampbridge.Policy(compute_dtype="auto"))
    assert plan.notes == (f"compute_dtype auto -> {choice}: {reason}",)
    outputs, stored = _run_dtypes(kx, model)
    assert outputs["dense"] == {choice} and model.get_layer("dense").compute_dtype == choice
    assert stored == {"float32"}


# --- how the backend's bfloat16 kernels round ------------------------------------------------------

def _bf16(x):
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)  # round to nearest


def _truncate(x):
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def test_bfloat16_rounding_describes_what_the_backends_matmul_really_does():
    # products of two bfloat16 terms are exact in float32, so each output is that float32 value
    # rounded once to bfloat16, by the kernel's own rule
    rng = np.random.default_rng(0)
    a, b = _bf16(rng.standard_normal((64, 2))), _bf16(rng.standard_normal((2, 64)))
    exact = a @ b
    out = keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.matmul(
        keras.ops.cast(a, "bfloat16"), keras.ops.cast(b, "bfloat16")), "float32"))
    rounding = ak.bfloat16_rounding()
    if BACKEND != "tensorflow":
        assert rounding is None
        rounding = "nearest"  # JAX (XLA) and torch
    expected = _bf16(exact) if rounding == "nearest" else _truncate(exact)
    assert (_bf16(exact) != _truncate(exact)).mean() > 0.3  # the two rules really differ here
    np.testing.assert_array_equal(out, expected)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's own kernels only")
@pytest.mark.parametrize("rounding", ["nearest", "toward zero"])
def test_a_truncating_tensorflow_says_so_for_bfloat16_policies_only(monkeypatch, rounding):
    monkeypatch.setattr(keras_environment, "bfloat16_rounding", lambda: rounding)
    model = _model(types.SimpleNamespace(seed=keras.utils.set_random_seed))
    bf16 = ampbridge.preset("mixed_bfloat16")
    scheduled = ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 5\n[[phase]]\ncompute_dtype = "bfloat16"\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notes = {name: ak.plan(model, p).notes for name, p in
                 (("bf16", bf16), ("bf16 again", bf16), ("f16", MIXED), ("schedule", scheduled))}
    said = [w for w in caught if "round toward zero" in str(w.message)]
    if rounding == "nearest":
        assert not said and not any(notes.values())
    else:
        assert len(said) == 1  # once per process
        assert all(any("jit_compile=True" in n for n in notes[k]) for k in ("bf16", "bf16 again", "schedule"))
        assert not notes["f16"]
