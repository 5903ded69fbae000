"""The first-step guard (issue 22): a finite step moves the weights, and a scaler whose finite step
never reaches ``optimizer.step`` raises naming the torch version instead of training silently."""

import torch  # noqa: I001  (first: see tests/conftest.py)

import re

import pytest

import ampbridge
from ampbridge.backends.torch.loss_scale import GradScaler
from ampbridge.errors import UnsupportedOptionError


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    scaler = GradScaler(ampbridge.LossScaleConfig(mode="dynamic", initial_scale=1024.0), "cpu")
    return model, torch.optim.SGD(model.parameters(), lr=0.1), scaler, twin


def _step(model, opt, scaler, x, factor=1.0):
    opt.zero_grad()
    scaler.scale(model(x).square().mean() * factor).backward()
    scaler.step(opt)
    scaler.update()


def test_a_finite_step_moves_the_weights_as_plain_sgd_does():
    model, opt, scaler, twin = _setup()
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    before = model.weight.detach().clone()
    _step(model, opt, scaler, x)
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).square().mean().backward()
    plain.step()
    assert not torch.equal(model.weight, before)
    # a power-of-two scale unscales exactly: the same weights as unscaled SGD, bit for bit
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)
    assert scaler.loss_scale_state().steps == 1 and scaler.loss_scale_state().skipped == 0


def test_the_guard_fires_when_a_finite_step_never_reaches_the_optimizer(monkeypatch):
    model, opt, scaler, _ = _setup()
    monkeypatch.setattr(GradScaler, "_maybe_opt_step", lambda self, optimizer, state, *a, **k: None)
    before = model.weight.detach().clone()
    with pytest.raises(UnsupportedOptionError, match=rf"on torch {re.escape(torch.__version__)}.*supports torch"):
        _step(model, opt, scaler, torch.ones(3, 4))
    assert torch.equal(model.weight, before)


def test_a_skipped_first_step_defers_the_check_to_the_next(monkeypatch):
    model, opt, scaler, _ = _setup()
    _step(model, opt, scaler, torch.ones(3, 4), factor=float("inf"))  # skipped: proves nothing
    assert scaler.loss_scale_state().skipped == 1
    monkeypatch.setattr(GradScaler, "_maybe_opt_step", lambda self, optimizer, state, *a, **k: None)
    with pytest.raises(UnsupportedOptionError):
        _step(model, opt, scaler, torch.ones(3, 4))


def test_once_checked_the_optimizer_keeps_no_hook():
    model, opt, scaler, _ = _setup()
    _step(model, opt, scaler, torch.ones(3, 4))
    fired = []
    opt.register_step_post_hook(lambda *_: fired.append(1))
    _step(model, opt, scaler, torch.ones(3, 4))
    assert fired == [1] and scaler._step_verified
