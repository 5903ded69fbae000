"""torch: ``doctor`` and the Plan row agree on float8 being emulated (this CPU) or native (capability >= 8.9,
the CUDA queries monkeypatched)."""

import pytest

import ampbridge._testing
from ampbridge.diagnostics.doctor import doctor

torch = ampbridge._testing.require("torch")
ampbridge._testing.require("torchao.float8", "the [fp8] table on torch")
from ampbridge.backends.torch import fp8 as torch_fp8  # noqa: E402


def test_cpu_is_emulated():
    text = doctor(["torch"])
    cpu = next(line for line in text.splitlines() if line.startswith("cpu ") and "flags" not in line)
    assert cpu.rstrip().endswith("emulated") and "[fp8]: torchao Float8Linear for current scaling" in text
    assert "ampbridge delayed scaling (emulated) for delayed" in text
    assert torch_fp8.realised_by("cpu") == "torchao Float8Linear (emulated)"


@pytest.mark.parametrize("capability, native", [((9, 0), True), ((8, 9), True), ((8, 6), False)])
def test_cuda_capability_decides(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    row = next(line for line in doctor(["torch"]).splitlines() if line.startswith("cuda FakeGPU"))
    assert ("native (torchao: torch._scaled_mm)" in row) is native
    assert ("(emulated)" in torch_fp8.realised_by("cuda")) is not native
    assert "(emulated)" in torch_fp8.realised_by("cpu")
    assert torch_fp8.realised_by("cuda", "delayed") == "ampbridge delayed scaling (emulated)"  # no float8 GEMM
