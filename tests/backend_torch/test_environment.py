"""The bisect switch (AMPBRIDGE_DISABLE, AMPBRIDGE_POLICY) and compute_dtype = "auto" per device."""

import contextlib

import pytest

import ampbridge
import ampbridge.diagnostics.environment
import ampbridge.diagnostics.hardware
import ampbridge._testing
from ampbridge import AmpBridgeWarning, Policy
from ampbridge.diagnostics.hardware import Device, auto_dtype, cpu_flags

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch import environment as torch_env  # noqa: E402

nn = torch.nn


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("AMPBRIDGE_DISABLE", raising=False)
    monkeypatch.delenv("AMPBRIDGE_POLICY", raising=False)
    ampbridge.errors._warned.clear()
    yield
    ampbridge.errors._warned.clear()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def computed(model, probe, x=None):
    with probe.Probe(model) as seen:
        out = model(torch.randn(3, 4) if x is None else x)
    return {path: seen.computed(path) for path in ("0", "1", "2")}, out


def test_disable_runs_float32_and_says_so_once(monkeypatch, probe):
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "1")
    a, b = net(), net()
    with pytest.warns(AmpBridgeWarning, match=r"ampbridge \(torch\): AMPBRIDGE_DISABLE is set: running in float32") \
            as record:
        amp = abt.apply(a, "bfloat16")
        abt.apply(b, ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",)))
    assert len(record) == 1 and record[0].filename == __file__  # once, pointing at the caller
    assert {p.dtype for p in a.parameters()} == {torch.float32}
    ran, out = computed(a, probe)
    assert ran == {"0": {torch.float32}, "1": {torch.float32}, "2": {torch.float32}} and out.dtype == torch.float32
    assert amp.active_policy == ampbridge.preset("float32") and amp.scaler.config.mode == "none"
    assert any("AMPBRIDGE_DISABLE" in note for note in amp.plan.notes)
    assert abt.plan(net(), "bfloat16")["0"].compute_dtype == "float32"  # the plan says what apply runs

    monkeypatch.setenv("AMPBRIDGE_DISABLE", "0")
    assert abt.apply(net(), "bfloat16").active_policy.compute_dtype == "bfloat16"


def test_policy_variable_swaps_in_a_preset_or_a_file(monkeypatch, tmp_path, probe):
    monkeypatch.setenv("AMPBRIDGE_POLICY", "bfloat16")
    model = net()
    with pytest.warns(AmpBridgeWarning, match="AMPBRIDGE_POLICY=bfloat16: using that policy"):
        amp = abt.apply(model, "mixed_float16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and amp.scaler.config.mode == "none"

    path = tmp_path / "bisect.toml"
    path.write_text('compute_dtype = "float16"\nkeep_float32 = ["kind:norm"]\n')
    monkeypatch.setenv("AMPBRIDGE_POLICY", str(path))
    model = net()
    with pytest.warns(AmpBridgeWarning, match="using that policy instead"):
        amp = abt.apply(model, "float32")
    ran, _ = computed(model, probe)
    assert ran == {"0": {torch.float16}, "1": {torch.float32}, "2": {torch.float16}}
    assert amp.plan["1"].rule == "keep_float32[0]" and amp.scaler.config.mode == "dynamic"


@pytest.mark.parametrize("device,dtype,mode", [
    (Device("cuda", "Fake A100", (8, 0)), "bfloat16", "none"),
    (Device("cuda", "Fake V100", (7, 0)), "float16", "dynamic"),
    (Device("cuda", "Fake P100", (6, 0)), "float32", "none"),
    (Device("cpu", cpu_flags=frozenset({"avx2", "avx512f"})), "float32", "none"),
    (Device("cpu", cpu_flags=frozenset({"avx512_bf16"})), "bfloat16", "none"),
], ids=["cuda-8.0", "cuda-7.0", "cuda-6.0", "cpu-no-bf16", "cpu-avx512-bf16"])
def test_auto_follows_the_device_and_the_plan_says_why(monkeypatch, probe, device, dtype, mode):
    """Faked devices (autocast itself runs on this CPU in the chosen dtype)."""
    monkeypatch.setattr(torch_env, "_device", lambda device_type: device)
    model = net()
    emulated = device.platform == "cpu" and dtype == "float32"
    with pytest.warns(AmpBridgeWarning, match="bfloat16 would be emulated") if emulated else \
            contextlib.nullcontext():
        amp = abt.apply(model, Policy(compute_dtype="auto", keep_float32=("kind:norm",)))
    assert amp.active_policy.compute_dtype == dtype and amp.scaler.config.mode == mode
    assert f"compute_dtype auto -> {dtype}: {auto_dtype(device)[1]}" in amp.plan.notes
    ran, _ = computed(model, probe)
    assert ran["0"] == {abt.native_dtype(dtype)} and ran["1"] == {torch.float32}


def test_auto_detects_this_cpu_and_a_faked_cuda_through_torch(monkeypatch):
    expected, reason = auto_dtype(Device("cpu", cpu_flags=cpu_flags()))
    with pytest.warns(AmpBridgeWarning) if expected == "float32" else contextlib.nullcontext():
        amp = abt.apply(net(), Policy(compute_dtype="auto"))
    assert amp.active_policy.compute_dtype == expected and f"compute_dtype auto -> {expected}: {reason}" in \
        amp.plan.notes
    # the CPU's flags come from /proc/cpuinfo: a CPU without AVX512_BF16/AMX-BF16 resolves to float32
    monkeypatch.setattr(ampbridge.diagnostics.hardware, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    assert torch_env._device("cpu") == Device("cpu", cpu_flags=frozenset({"sse2", "avx2"}))
    # CUDA's capability comes from torch.cuda
    for capability, dtype in (((8, 6), "bfloat16"), ((7, 5), "float16")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        device = torch_env._device("cuda")
        assert device == Device("cuda", "Fake GPU", capability) and auto_dtype(device)[0] == dtype


def test_auto_inside_a_schedule_resolves_per_phase(monkeypatch):
    monkeypatch.setattr(torch_env, "_device", lambda device_type: Device("cuda", "Fake V100", (7, 0)))
    policy = ampbridge.loads('compute_dtype = "float32"\n[[phase]]\nuntil_step = 2\n[[phase]]\n'
                             'compute_dtype = "auto"\n', format="toml")
    model = net()
    amp = abt.apply(model, policy)
    assert amp.active_policy.compute_dtype == "float32"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        amp.step(model(torch.randn(3, 4)).float().mean() * 1e-3, opt)
    assert amp.phase == 1 and amp.active_policy.compute_dtype == "float16" and amp.scaler.config.mode == "dynamic"
    assert any(note.startswith("compute_dtype auto -> float16") for note in amp.plan.notes)
