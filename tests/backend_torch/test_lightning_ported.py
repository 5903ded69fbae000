"""Lightning's own MixedPrecision plugin tests (tests/tests_pytorch/plugins/precision/test_amp.py),
run against Lightning's plugin and ampbridge's alike: what users of the plugin rely on must hold for
both. The CUDA-only tests and the autocast-cache ones (newer Lightning than the pinned 2.6.6, where
``forward_context`` is ``autocast_context_manager``) are left out."""

from __future__ import annotations

from unittest.mock import Mock

import pytest

import ampbridge._testing

torch = ampbridge._testing.require("torch")
lightning = ampbridge._testing.require("lightning")
import ampbridge.torch as abt  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from torch import nn  # noqa: E402

PLUGINS = ("lightning", "ampbridge")


def plugin(which: str, layer: nn.Module):
    if which == "lightning":
        return MixedPrecision(precision="bf16-mixed", device="cpu")
    made = abt.lightning_precision("mixed_bfloat16", device_type="cpu")
    made.convert_module(layer)
    return made


@pytest.mark.parametrize("which", PLUGINS)
def test_clip_gradients_is_a_no_op_when_clipping_is_disabled(which):
    optimizer = Mock(spec=torch.optim.Optimizer)
    precision = plugin(which, nn.Linear(2, 1))
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_grad_by_value.reset_mock()
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("which", PLUGINS)
def test_a_gradless_forward_inside_the_context_does_not_break_gradient_tracking(which, grad_mode):
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    precision = plugin(which, layer)
    with precision.forward_context():
        with getattr(torch, grad_mode)():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None and layer.weight.grad is not None


@pytest.mark.parametrize("which", PLUGINS)
def test_the_autocast_context_manager_runs_a_layer_in_bfloat16(which):
    # an inner layer: ampbridge's policy (mixed_bfloat16: output_dtype float32) casts the model's own output
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    precision = plugin(which, model)
    with precision.autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert model[0](torch.randn(1, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
