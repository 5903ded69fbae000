"""``ampbridge doctor`` says whether float8 matmuls run natively or emulated, per framework and device."""

from ampbridge.diagnostics.doctor import FP8_CAPABILITY, doctor, float8_support
from ampbridge.diagnostics.hardware import Device


def test_float8_support_by_device_and_framework():
    assert FP8_CAPABILITY == (8, 9)  # Ada; A100 (8.0) and RTX 30xx (8.6) have no float8 tensor cores
    for fw in ("torch", "jax", "tensorflow"):
        assert float8_support(Device("cpu"), fw) == "emulated"
        assert float8_support(Device("cuda", capability=(8, 6)), fw).startswith("emulated")
        assert float8_support(Device("cuda", capability=(8, 9)), fw).startswith("native")
        assert float8_support(Device("cuda", capability=(9, 0)), fw).startswith("native")
    assert "jit_compile" in float8_support(Device("cuda", capability=(9, 0)), "tensorflow")
    assert float8_support(Device("tpu")).startswith("unknown")


def test_doctor_table_has_a_float8_column(monkeypatch):
    import ampbridge.diagnostics.doctor as d

    fake = (("fakefw", "json", lambda: {"version": "1.0", "devices": [Device("cuda", "H100", (9, 0)),
                                                                      Device("cpu")],
                                         "matmul": "tf32 off", "float8": ("jax", "[fp8]: fake fp8 ops")}),)
    monkeypatch.setattr(d, "PROBES", fake)
    text = doctor()
    h100 = next(line for line in text.splitlines() if line.startswith("cuda H100"))
    cpu = next(line for line in text.splitlines() if line.startswith("cpu ") and "flags" not in line)
    assert "float8 matmul" in text and "native (XLA" in h100 and cpu.rstrip().endswith("emulated")
    assert "[fp8]: fake fp8 ops" in text
