"""The core promise: importing ampbridge and loading a policy imports no framework."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reference.toml"
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax", "numpy")

CODE = f"""
import sys, time
t0 = time.perf_counter()
import ampbridge
t1 = time.perf_counter()
p = ampbridge.load({str(EXAMPLE)!r})
ampbridge.plan([ampbridge.Layer("a.norm", "norm", "LayerNorm")], p)
ampbridge.dumps(p, "yaml"); ampbridge.trajectory(p.resolved_loss_scale, [True, False])
print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))
print(round((t1 - t0) * 1000, 1))
"""


def test_import_and_load_leave_frameworks_out():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    loaded, import_ms = proc.stdout.split("\n")[:2]
    assert loaded == "[]", f"ampbridge imported {loaded}"
    print(f"import ampbridge: {import_ms} ms")


def test_cli_leaves_frameworks_out():
    code = ("import sys; from ampbridge.cli.commands import main; main(['validate', %r]); "
            "print(sorted(m for m in %r if m in sys.modules))" % (str(EXAMPLE), FRAMEWORKS))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
