"""The torch backend's docstring examples run, and its public names exist."""

import doctest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402


def test_docstring_examples_run():
    for seed in range(3):  # the examples must not depend on the random initialisation
        torch.manual_seed(seed)
        result = doctest.testmod(abt, optionflags=doctest.ELLIPSIS, extraglobs={"ampbridge": ampbridge})
        assert result.attempted >= 10 and result.failed == 0


def test_public_names_and_the_registry():
    for name in abt.__all__:
        assert hasattr(abt, name), name
    assert ampbridge.torch is abt and abt.owns(torch.nn.Linear(1, 1)) and not abt.owns([1])
    assert abt.native_dtype("bf16") is torch.bfloat16
    assert issubclass(abt.ModelNotSupportedError, (ampbridge.AmpBridgeError, TypeError))


def test_importing_the_backend_leaves_other_frameworks_out():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    code = ("import sys, ampbridge.torch; print(sorted(m for m in ('tensorflow', 'keras', 'jax', 'flax', 'optax') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
