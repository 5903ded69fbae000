"""benchmarks/gpu.py's FP8 rows: skipped on the CPU with the reason, and their code path (emulated, tiny)
runs here so it cannot rot before a GPU runs it."""

import importlib.util
from pathlib import Path

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
ampbridge._testing.require("torchao.float8", "the FP8 rows of the GPU check")
import ampbridge.torch as abt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _gpu():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_rows_skip_on_cpu_and_run_emulated(monkeypatch):
    gpu = _gpu()
    assert gpu.fp8_skip_reason(torch, "cpu").startswith("skipped: no CUDA device")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 6))
    assert "8.6 has no float8 tensor cores" in gpu.fp8_skip_reason(torch, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert gpu.fp8_skip_reason(torch, "cuda") is None
    parity, speed = gpu.fp8_checks(torch, abt, ampbridge, "cpu", d=32, layers=1, batch=16, rounds=2, steps=1,
                                   parity_steps=3, emulate=True)
    assert parity["identical_params"] and parity["max_loss_diff"] == 0.0
    assert [s["how"] for s in speed] == ["bfloat16", "native", "ampbridge"]
    text = gpu.report([], [], [], [], (parity, speed))
    assert "## (e) FP8" in text and "| ampbridge vs native torchao | 3 | 0 | True |" in text
    assert "skipped: no CUDA" in gpu.report([], [], [], [], gpu.fp8_skip_reason(torch, "cpu"))
