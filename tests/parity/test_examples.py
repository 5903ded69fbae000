"""The per-framework example scripts run as the README shows them."""

import subprocess
import sys
from pathlib import Path

import pytest

from ampbridge._testing import require

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NEEDS = {"train_torch.py": ("torch",), "train_keras.py": ("keras",), "train_flax.py": ("jax", "flax", "optax")}


@pytest.mark.parametrize("script", sorted(NEEDS))
def test_example_trains(script, tmp_path):
    for name in NEEDS[script]:
        require(name)
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--steps", "25"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "head" in proc.stdout and "override[0]" in proc.stdout  # the Plan was printed
    assert "scale" in proc.stdout
