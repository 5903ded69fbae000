import warnings

import pytest

import ampbridge
from ampbridge.diagnostics.doctor import doctor, native_dtypes
from ampbridge.diagnostics.hardware import Device, auto_dtype, cpu_flags, resolve_auto
from ampbridge.errors import AmpBridgeWarning


@pytest.mark.parametrize("device,expected", [
    (Device("cuda", "A100", (8, 0)), "bfloat16"),
    (Device("cuda", "H100", (9, 0)), "bfloat16"),
    (Device("cuda", "V100", (7, 0)), "float16"),
    (Device("cuda", "T4", (7, 5)), "float16"),
    (Device("cuda", "P100", (6, 0)), "float32"),
    (Device("tpu", "v4"), "bfloat16"),
    (Device("cpu", cpu_flags=frozenset({"avx2", "avx512_bf16"})), "bfloat16"),
    (Device("cpu", cpu_flags=frozenset({"amx_bf16", "amx_tile"})), "bfloat16"),
    (Device("cpu", cpu_flags=frozenset({"avx2", "f16c"})), "float32"),
    (Device("cpu"), "float32"),
])
def test_auto_choice_by_device(device, expected):
    choice, reason = auto_dtype(device)
    assert choice == expected and reason


def test_resolve_auto_keeps_the_reason_and_warns_on_emulating_cpus():
    p = ampbridge.loads('compute_dtype = "auto"\n[[phase]]\nuntil_step = 5\ncompute_dtype = "float32"\n[[phase]]\ncompute_dtype = "auto"\n')
    resolved, reason = resolve_auto(p, Device("cuda", "T4", (7, 5)))
    assert resolved.compute_dtype == "float16" and resolved.phases[1].policy.compute_dtype == "float16"
    assert resolved.phases[0].policy.compute_dtype == "float32"
    assert "capability 7.x" in reason
    assert resolved.resolved_loss_scale.mode == "dynamic"
    with pytest.warns(AmpBridgeWarning, match="bfloat16 would be emulated and slower"):
        cpu, _ = resolve_auto(p, Device("cpu", cpu_flags=frozenset({"avx2"})))
    assert cpu.compute_dtype == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same, why = resolve_auto(ampbridge.preset("mixed_float16"), Device("cpu"))
    assert why is None and same == ampbridge.preset("mixed_float16")


def test_cpu_flags_from_a_cpuinfo_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor : 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor : 1\nflags : fpu\n")
    assert cpu_flags(f) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_native_dtypes():
    assert native_dtypes(Device("cuda", capability=(8, 6))) == ["float32", "float16", "bfloat16"]
    assert native_dtypes(Device("cpu", cpu_flags=frozenset({"avx512_bf16", "avx512_fp16"}))) == [
        "float32", "bfloat16", "float16"]
    assert native_dtypes(Device("tpu")) == ["float32", "bfloat16"]


def test_doctor_with_faked_probes(monkeypatch):
    import ampbridge.diagnostics.doctor as d

    fake = (("fakefw", "json", lambda: {"version": "1.0", "devices": [Device("cuda", "T4", (7, 5)), Device("cpu")],
                                         "matmul": "tf32 off"}),
            ("missingfw", "no_such_module_xyz", lambda: {}))
    monkeypatch.setattr(d, "PROBES", fake)
    text = doctor()
    assert "fakefw 1.0" in text and "float16" in text and "capability 7.x" in text and "tf32 off" in text
    assert "missingfw: not installed" in text
