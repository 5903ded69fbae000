"""DeepSpeed's own loss-scale tests, ported: the same configs, gradients and expected values, with
DeepSpeed's engine swapped for ampbridge's (issue 38).

Sources (deepspeedai/DeepSpeed at edaa7221267243c7be7fb49c5d5f5c4fb97b4641, master after v0.19.5,
version.txt 0.19.6; the stored mirror has no v0.19.8 tag. Its deepspeed/runtime/fp16/loss_scaler.py
``update_scale`` and precision_config.py equal the installed 0.19.8's, logging aside):

- ``D``: tests/unit/runtime/half_precision/test_dynamic_loss_scale.py (no ZeRO: FP16_Optimizer with
  Adam, FP16_UnfusedOptimizer with Lamb);
- ``Z``: tests/unit/runtime/half_precision/test_zero_optim_overflow.py (ZeRO 1 and 2, offload or not,
  fp16 and bf16);
- ``P1``: tests/unit/runtime/test_precision_config_dynamic_scale.py;
- ``P2``: tests/unit/runtime/test_precision_config_loss_scale.py.

What is swapped: ``deepspeed.initialize(config=...)`` becomes :func:`initialize`, which converts the
same config with ``ampbridge.recipes.from_deepspeed`` (asserting the conversion is exact) and trains a
float32 ``Linear`` with ``ampbridge.torch.GradScaler`` built from the converted policy; the optimizer
object the tests read (``optim.loss_scale_config`` / ``optim.loss_scaler``: ``cur_scale``,
``cur_iter``, ``scale_window``, ``min_loss_scale``, ``dynamic_loss_scale``) reads ampbridge's
loss-scale state (scale, steps) and the converted settings (growth_interval, min_scale, mode), and
``model.skipped_steps`` its ``skipped``. In ``P1``/``P2``, ``DeepSpeedFP16Config(**kw)`` becomes
:func:`fp16_config`: ``recipes.deepspeed.read_fp16_section`` (the reader's validation, with
DeepSpeed's defaults filled in) plus a whole ``from_deepspeed`` conversion, and pydantic's
``ValidationError`` becomes ``ampbridge.PolicyError``. Each test keeps upstream's name, parameters
and assertions; upstream classes become name prefixes. ``world_size = 2`` runs as one process (the
loss scaler is per rank and agreed; ``agree_across`` covers the all-reduce) and ``offload_optimizer``
moves the optimizer, not the scaler: both keep their parameters here.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

import ampbridge
from ampbridge import PolicyError, recipes
from ampbridge._testing import require

torch = require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.recipes.deepspeed import read_fp16_section  # noqa: E402

ValidationError = PolicyError  # the swap for pydantic's error in P1/P2

#: upstream tests with no ampbridge equivalent, and why (each is collected and skipped with it)
NOT_APPLICABLE = {
    "test_P1_fp16_dynamic_scale_ignored_with_static_loss_scale":
        "asserts that an unused loss_scale_window/min_loss_scale is stored on DeepSpeed's config object; "
        "ampbridge's conversion keeps only the settings that run (that the section is accepted is checked "
        "in test_deepspeed_fp16_validation.py)",
    "test_P1_fp16_dynamic_scale_ignored_when_fp16_disabled":
        "asserts that an unused value is stored on DeepSpeed's config object (as above)",
}

FP16_DEFAULTS = {"enabled": False, "auto_cast": False, "loss_scale": 0.0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
                 "fp16_master_weights_and_grads": False}


@pytest.fixture(autouse=True)
def not_applicable(request):
    name = request.node.originalname
    if name in NOT_APPLICABLE:
        pytest.skip(f"not applicable: {NOT_APPLICABLE[name]}")


# --- the swapped objects ----------------------------------------------------------------------------

class _Optim:
    """What the tests read off DeepSpeed's optimizer, read off ampbridge's scaler and policy."""

    def __init__(self, engine):
        self._engine = engine
        self.loss_scale_config = self.loss_scaler = self

    @property
    def cur_scale(self):
        return self._engine.scaler.loss_scale_state().scale

    @property
    def cur_iter(self):
        return self._engine.scaler.loss_scale_state().steps

    @property
    def scale_window(self):
        return self._engine.loss_scale.growth_interval

    @property
    def min_loss_scale(self):
        return self._engine.loss_scale.min_scale

    @property
    def dynamic_loss_scale(self):
        return self._engine.loss_scale.mode == "dynamic"


class _Engine:
    """A float32 Linear trained with ampbridge.torch.GradScaler from the converted config."""

    def __init__(self, config_dict, hidden_dim):
        conversion = recipes.from_deepspeed(config_dict)
        assert conversion.exact, conversion.losses
        self.policy = conversion.result
        self.loss_scale = self.policy.resolved_loss_scale
        torch.manual_seed(0)
        self.module = torch.nn.Linear(hidden_dim, hidden_dim)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=config_dict["optimizer"]["params"]["lr"])
        self.scaler = abt.GradScaler(self.loss_scale, "cpu")
        self.scaler.scale(torch.ones(()))  # the scale lives from the start, as DeepSpeed's (D sets gradients only)
        self.device = "cpu"

    def parameters(self):
        return self.module.parameters()

    def __call__(self, x, y):
        return torch.nn.functional.mse_loss(self.module(x.float()), y.float())

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def skipped_steps(self):
        return self.scaler.loss_scale_state().skipped


def initialize(config, model, model_parameters):
    """The swap for ``deepspeed.initialize``: (engine, optimizer, None, None)."""
    engine = _Engine(config, model.hidden_dim)
    return engine, _Optim(engine), None, None


def SimpleModel(hidden_dim):  # noqa: N802 (upstream's name)
    return types.SimpleNamespace(hidden_dim=hidden_dim, parameters=lambda: [])


def random_dataloader(model, total_samples, hidden_dim, device, dtype):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(1, hidden_dim, generator=gen), torch.randn(1, hidden_dim, generator=gen))
            for _ in range(total_samples)]


def safe_set_full_grad(p, grad):
    p.grad = grad


def has_inf_or_nan(x):
    float_x = x.float()
    return float_x.isnan().logical_or(float_x.isinf()).float().max()


def fp16_config(**kw):
    """The swap for ``DeepSpeedFP16Config(**kw)``."""
    section = read_fp16_section(kw)
    recipes.from_deepspeed({"fp16": kw, "zero_optimization": {"stage": 2}})
    return types.SimpleNamespace(**{**FP16_DEFAULTS, **section})


# --- D: test_dynamic_loss_scale.py ------------------------------------------------------------------

def run_model_step_d(model, gradient_list):
    for value in gradient_list:
        for p in model.parameters():
            p.grad = torch.empty_like(p, dtype=p.dtype)
            p.grad.fill_(value)
        model.step()


def _d_config(optimizer, power, extra=None):
    return {"train_batch_size": 1, "steps_per_print": 1, "optimizer": {"type": optimizer, "params": {"lr": 0.00015}},
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": power, "loss_scale_window": 2,
                     **(extra or {})}}


@pytest.mark.parametrize("cls,optimizer", [("TestFused", "Adam"), ("TestUnfused", "Lamb")])
def test_D_no_overflow(cls, optimizer):
    model, optim, _, _ = initialize(config=_d_config(optimizer, 8), model=SimpleModel(1), model_parameters=None)
    expected_loss_scale = 2**8
    expected_scale_window = 2
    assert optim.loss_scale_config.dynamic_loss_scale == True  # noqa: E712 (upstream's assertion)
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    assert optim.loss_scale_config.scale_window == expected_scale_window
    for i, value in enumerate(np.random.uniform(-0.1, 0.1, 10)):
        run_model_step_d(model, [value])
        assert optim.loss_scale_config.cur_scale == expected_loss_scale
        assert optim.loss_scale_config.cur_iter == (i + 1)
        if optim.loss_scale_config.cur_iter % expected_scale_window == 0:
            expected_loss_scale *= 2


@pytest.mark.parametrize("cls,optimizer,min_loss_scale", [("TestFused", "Adam", None), ("TestUnfused", "Lamb", 2.0)])
def test_D_all_overflow(cls, optimizer, min_loss_scale):
    extra = {} if min_loss_scale is None else {"min_loss_scale": min_loss_scale}
    model, optim, _, _ = initialize(config=_d_config(optimizer, 4, extra), model=SimpleModel(1), model_parameters=None)
    expected_loss_scale = 2**4
    expected_min_loss_scale = 1 if min_loss_scale is None else min_loss_scale
    assert optim.loss_scale_config.dynamic_loss_scale == True  # noqa: E712
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    if min_loss_scale is not None:  # TestUnfused's extra assertion
        assert optim.loss_scale_config.min_loss_scale == expected_min_loss_scale
    overflow_gradients = [float('inf'), float('-inf')] + [float('nan')] * 6
    for i, value in enumerate(overflow_gradients):
        run_model_step_d(model, [value])
        expected_loss_scale = max(expected_loss_scale / 2, expected_min_loss_scale)
        assert optim.loss_scale_config.cur_scale == expected_loss_scale
        assert optim.loss_scale_config.cur_iter == (i + 1)


@pytest.mark.parametrize("cls,optimizer", [("TestFused", "Adam"), ("TestUnfused", "Lamb")])
def test_D_some_overflow(cls, optimizer):
    model, optim, _, _ = initialize(config=_d_config(optimizer, 8), model=SimpleModel(1), model_parameters=None)
    expected_loss_scale = 2**8
    expected_scale_window = 2
    expected_iteration = 0
    assert optim.loss_scale_config.dynamic_loss_scale == True  # noqa: E712
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    assert optim.loss_scale_config.scale_window == expected_scale_window
    overflow_gradients = [float('inf'), float('nan')]
    expected_iteration += len(overflow_gradients)
    run_model_step_d(model, overflow_gradients)
    expected_loss_scale /= (2**len(overflow_gradients))
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    assert optim.loss_scale_config.cur_iter == expected_iteration
    normal_gradients = np.random.uniform(-0.1, 0.1, expected_scale_window + 1)
    expected_iteration += len(normal_gradients)
    run_model_step_d(model, normal_gradients)
    expected_loss_scale *= 2
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    assert optim.loss_scale_config.cur_iter == expected_iteration
    overflow_gradients = [float('inf')]
    expected_iteration += len(overflow_gradients)
    run_model_step_d(model, overflow_gradients)
    expected_loss_scale /= (2**len(overflow_gradients))
    assert optim.loss_scale_config.cur_scale == expected_loss_scale
    assert optim.loss_scale_config.cur_iter == expected_iteration


# --- Z: test_zero_optim_overflow.py -----------------------------------------------------------------

def run_model_step(model, x_sample, y_label, grad_value):
    loss = model(x_sample, y_label)
    model.backward(loss)
    for p in model.parameters():
        grad = torch.empty_like(p, dtype=p.dtype)
        grad.fill_(grad_value)
        safe_set_full_grad(p, grad)
    model.step()


def _z_config(zero_stage, offload_optimizer, precision):
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, **precision,
              "zero_optimization": {"stage": zero_stage}}
    if offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


ZERO = pytest.mark.parametrize("zero_stage,offload_optimizer", [(1, False), (1, True), (2, False), (2, True)])


@ZERO
def test_Z_TestZeROFloat16_no_overflow(zero_stage, offload_optimizer):
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}}
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, fp16),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    expected_loss_scale = 2**8
    expected_scale_window = 2
    loss_scaler = optim.loss_scaler
    assert optim.dynamic_loss_scale == True  # noqa: E712
    assert loss_scaler.cur_scale == expected_loss_scale
    assert loss_scaler.scale_window == expected_scale_window
    num_iterations = 10
    grad_values = np.random.uniform(-0.1, 0.1, num_iterations)
    data_loader = random_dataloader(model=model, total_samples=num_iterations, hidden_dim=hidden_dim,
                                    device=model.device, dtype=torch.float16)
    for i, (batch, grad_value) in enumerate(zip(data_loader, grad_values)):
        run_model_step(model, batch[0], batch[1], grad_value)
        assert loss_scaler.cur_scale == expected_loss_scale
        assert loss_scaler.cur_iter == (i + 1)
        if loss_scaler.cur_iter % expected_scale_window == 0:
            expected_loss_scale *= 2


@ZERO
def test_Z_TestZeROFloat16_all_overflow(zero_stage, offload_optimizer):
    overflow_gradients = [float('inf'), float('-inf')] + [float('nan')] * 6
    initial_scale_power = len(overflow_gradients)
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                     "loss_scale_window": 2, "hysteresis": 1}}
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, fp16),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    expected_loss_scale = 2**initial_scale_power
    expected_scale_window = 2
    loss_scaler = optim.loss_scaler
    assert optim.dynamic_loss_scale == True  # noqa: E712
    assert loss_scaler.cur_scale == expected_loss_scale
    assert loss_scaler.scale_window == expected_scale_window
    data_loader = random_dataloader(model=model, total_samples=len(overflow_gradients), hidden_dim=hidden_dim,
                                    device=model.device, dtype=torch.float16)
    for i, (batch, grad_value) in enumerate(zip(data_loader, overflow_gradients)):
        run_model_step(model, batch[0], batch[1], grad_value)
        expected_loss_scale = max(expected_loss_scale / 2, 1)
        assert loss_scaler.cur_scale == expected_loss_scale
        assert loss_scaler.cur_iter == (i + 1)


@ZERO
def test_Z_TestZeROFloat16_some_overflow(zero_stage, offload_optimizer):
    initial_scale_power = 8
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                     "loss_scale_window": 2, "hysteresis": 1}}
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, fp16),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    expected_loss_scale = 2**initial_scale_power
    expected_scale_window = 2
    loss_scaler = optim.loss_scaler
    assert optim.dynamic_loss_scale == True  # noqa: E712
    assert loss_scaler.cur_scale == expected_loss_scale
    assert loss_scaler.scale_window == expected_scale_window
    expected_iteration = 0
    for gradients, change in (([float('inf'), float('nan')], "down"), (None, "up"), ([float('inf')], "down")):
        if gradients is None:  # scale_window + 1 finite steps grow the scale once
            gradients = np.random.uniform(-0.1, 0.1, expected_scale_window + 1)
        expected_iteration += len(gradients)
        data_loader = random_dataloader(model=model, total_samples=len(gradients), hidden_dim=hidden_dim,
                                        device=model.device, dtype=torch.float16)
        for batch, grad_value in zip(data_loader, gradients):
            run_model_step(model, batch[0], batch[1], grad_value)
        if change == "down":
            expected_loss_scale /= (2**len(gradients))
        else:
            expected_loss_scale *= 2
        assert loss_scaler.cur_scale == expected_loss_scale
        assert loss_scaler.cur_iter == expected_iteration


@ZERO
def test_Z_TestZeROBFloat16_no_overflow(zero_stage, offload_optimizer):
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, {"bf16": {"enabled": True}}),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    num_iterations = 10
    grad_values = np.random.uniform(-0.1, 0.1, num_iterations)
    data_loader = random_dataloader(model=model, total_samples=num_iterations, hidden_dim=hidden_dim,
                                    device=model.device, dtype=torch.bfloat16)
    for i, (batch, grad_value) in enumerate(zip(data_loader, grad_values)):
        run_model_step(model, batch[0], batch[1], grad_value)
    assert model.skipped_steps == 0
    assert all([not has_inf_or_nan(p) for p in model.parameters()])


@ZERO
def test_Z_TestZeROBFloat16_detect_grad_overflow(zero_stage, offload_optimizer):
    bf16 = {"bf16": {"enabled": True, "check_grad_overflow": True}}
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, bf16),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    overflow_gradients = [float('inf'), float('-inf')] + [float('nan')] * 6
    data_loader = random_dataloader(model=model, total_samples=len(overflow_gradients), hidden_dim=hidden_dim,
                                    device=model.device, dtype=torch.bfloat16)
    for i, (batch, grad_value) in enumerate(zip(data_loader, overflow_gradients)):
        run_model_step(model, batch[0], batch[1], grad_value)
        assert model.skipped_steps == (i + 1)
    assert all([not has_inf_or_nan(p) for p in model.parameters()])


@ZERO
def test_Z_TestZeROBFloat16_ignore_grad_overflow(zero_stage, offload_optimizer):
    bf16 = {"bf16": {"enabled": True, "check_grad_overflow": False}}
    hidden_dim = 10
    model, optim, _, _ = initialize(config=_z_config(zero_stage, offload_optimizer, bf16),
                                    model=SimpleModel(hidden_dim), model_parameters=None)
    overflow_gradients = [float('inf'), float('-inf')] + [float('nan')] * 6
    data_loader = random_dataloader(model=model, total_samples=len(overflow_gradients), hidden_dim=hidden_dim,
                                    device=model.device, dtype=torch.bfloat16)
    for i, (batch, grad_value) in enumerate(zip(data_loader, overflow_gradients)):
        run_model_step(model, batch[0], batch[1], grad_value)
    assert model.skipped_steps == 0
    assert all([has_inf_or_nan(p) for p in model.parameters()])


# --- P1: test_precision_config_dynamic_scale.py -----------------------------------------------------

FIELDS = pytest.mark.parametrize("field", ["loss_scale_window", "min_loss_scale"])


@FIELDS
@pytest.mark.parametrize("value", [0, -1])
def test_P1_fp16_dynamic_scale_rejects_nonpositive_when_dynamic(field, value):
    with pytest.raises(ValidationError):
        fp16_config(enabled=True, loss_scale=0, **{field: value})


@FIELDS
@pytest.mark.parametrize("value", [1, 1000])
def test_P1_fp16_dynamic_scale_accepts_positive_when_dynamic(field, value):
    cfg = fp16_config(enabled=True, loss_scale=0, **{field: value})
    assert getattr(cfg, field) > 0


@FIELDS
@pytest.mark.parametrize("value", [0, -1])
def test_P1_fp16_dynamic_scale_ignored_with_static_loss_scale(field, value):
    cfg = fp16_config(enabled=True, loss_scale=128, **{field: value})
    assert getattr(cfg, field) == value


@FIELDS
@pytest.mark.parametrize("value", [0, -1])
def test_P1_fp16_dynamic_scale_ignored_when_fp16_disabled(field, value):
    cfg = fp16_config(enabled=False, loss_scale=0, **{field: value})
    assert getattr(cfg, field) == value


@FIELDS
@pytest.mark.parametrize("value", [True, False])
def test_P1_fp16_dynamic_scale_rejects_bool(field, value):
    with pytest.raises(ValidationError):
        fp16_config(enabled=True, loss_scale=0, **{field: value})


@FIELDS
@pytest.mark.parametrize("value", [float("inf"), float("nan"), "abc", None])
def test_P1_fp16_dynamic_scale_rejects_non_integer(field, value):
    with pytest.raises(ValidationError):
        fp16_config(enabled=True, loss_scale=0, **{field: value})


# --- P2: test_precision_config_loss_scale.py --------------------------------------------------------

@pytest.mark.parametrize("loss_scale", [-1, float("inf"), float("nan"), True])
def test_P2_fp16_loss_scale_rejects_invalid_values(loss_scale):
    with pytest.raises(ValidationError):
        fp16_config(loss_scale=loss_scale)


@pytest.mark.parametrize("loss_scale", [0, 1, 2.0, "3"])
def test_P2_fp16_loss_scale_accepts_valid_values(loss_scale):
    cfg = fp16_config(loss_scale=loss_scale)
    assert math.isfinite(cfg.loss_scale)
    assert cfg.loss_scale >= 0


@pytest.mark.parametrize("loss_scale", [[], {}])
def test_P2_fp16_loss_scale_invalid_type_has_clear_error(loss_scale):
    with pytest.raises(ValidationError) as excinfo:
        fp16_config(loss_scale=loss_scale)
    assert "must be a number" in str(excinfo.value)


# --- ampbridge's own checks: the swap is not vacuous ----------------------------------------------

def test_without_first_growth_interval_the_upstream_no_overflow_test_would_fail():
    """Issue 38's finding, kept as a check: the old reading (growth every window from the start)
    grows at step 2, where DeepSpeed's test expects 256 still."""
    model, optim, _, _ = initialize(config=_d_config("Adam", 8), model=SimpleModel(1), model_parameters=None)
    model.scaler = abt.GradScaler(model.loss_scale.replace(first_growth_interval=None), "cpu")
    model.scaler.scale(torch.ones(()))
    run_model_step_d(model, [0.05, 0.05])
    assert optim.cur_scale == 512.0 != 256
