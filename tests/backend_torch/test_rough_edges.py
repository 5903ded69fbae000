"""Rough edges found in real use, each refused by name or fixed (issue 43)."""

from __future__ import annotations

import pytest

from ampbridge._testing import require

torch = require("torch")

import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch.environment import cpu_lstm_runs  # noqa: E402
from ampbridge.backends.torch.apply import ModelNotSupportedError  # noqa: E402


def test_wrap_ddp_on_a_plain_module_says_what_it_takes():
    with pytest.raises(TypeError, match="wrap_ddp takes the TorchAmp that ampbridge.torch.apply returns; "
                                        "received a Linear"):
        abt.wrap_ddp(torch.nn.Linear(2, 2))


def test_apply_to_a_ddp_model_is_refused_by_name(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(ModelNotSupportedError, match="apply\\(\\) was given a DistributedDataParallel.*wrap_ddp"):
            abt.apply(ddp, "mixed_bfloat16")
        amp = abt.apply(torch.nn.Linear(2, 2), "mixed_bfloat16")  # the way round that keeps the agreement
        assert isinstance(abt.wrap_ddp(amp), torch.nn.parallel.DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def test_the_cpu_lstm_checks_take_a_torch_dtype_too():
    assert abt.cpu_lstm_takes_float32_inputs(torch.bfloat16) == abt.cpu_lstm_takes_float32_inputs("bfloat16")
    assert abt.cpu_lstm_takes_float32_inputs(torch.float16) == abt.cpu_lstm_takes_float32_inputs("float16")
    assert cpu_lstm_runs(torch.float32, torch.float32)


def test_the_demo_says_which_frameworks_it_leaves_out(monkeypatch, capsys):
    """A demo that trains fewer frameworks than it could says so (it once dropped JAX silently
    where jmp was missing): the note names each left out and its extra."""
    from ampbridge.cli.commands import main
    from ampbridge.cli.demo import run as demo

    monkeypatch.setattr(demo, "installed_frameworks", lambda: ["torch"])
    assert main(["demo", "--steps", "4"]) == 0
    out, err = capsys.readouterr()
    assert "training 4 steps in torch;" in out
    assert "note: not installed here, so not trained: keras, jax, tf_keras (pip install 'ampbridge[keras]' " \
           "'ampbridge[jax]' 'ampbridge[tf-keras]')" in err
