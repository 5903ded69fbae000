"""benchmarks/gpu.py cannot rot: its --dry-run runs every code path of the GPU check on the CPU."""

import torch  # noqa: F401  (torch first, as every torch test)

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_script_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## (a) torch Plan", "## (b) parity", "## (c) speedup"):
        assert heading in text
    # (a): every row of both policies traced, and each ran as the Plan claims (on the CPU here)
    done = re.search(r"(\d+) of (\d+) rows as claimed", text)
    assert done and done.group(1) == done.group(2) and int(done.group(2)) >= 40, text
    assert "| float16 | rmsnorm | RMSNorm | float32 | float32 | yes |" in text
    # (b): torch, JAX and Keras each bit-identical to their native AMP over the dry run's steps
    parity = [line for line in text.splitlines() if re.match(r"\| (torch|jax|keras \(\w+\)) \| cpu \| 3 \|", line)]
    assert len(parity) == 3 and all("| True |" in line for line in parity), parity
    # (c)/(d): a float32 baseline and four mixed variants per framework, each with a speedup
    speed = [line for line in text.splitlines() if re.match(r"\| (torch|jax) \| (float32|ampbridge|native)", line)]
    assert len(speed) == 10, speed
