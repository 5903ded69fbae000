"""A DeepSpeed recipe, converted by ampbridge.recipes and run through the torch backend, follows
DeepSpeed's own loss-scale trajectory (hysteresis and the raise at the minimum included)."""

import math

import pytest

import ampbridge
from ampbridge import recipes
from ampbridge._testing import DeepSpeedDynamicLossScaler, require

torch = require("torch")
import ampbridge.torch as abt  # noqa: E402

# a ZeRO-2 fp16 recipe as DeepSpeed's docs write one, with a short window so growth shows
RECIPE = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 4,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
}


# absorbed by hysteresis, backed off, grown, bursts; every case of update_scale
OVERFLOWS = ([False] * 5 + [True] + [False] * 3 + [True, True] + [False] * 9 + [True] * 3 + [False] * 4
             + [True, False, True] + [False] * 10 + [True, False] * 3 + [False] * 6)


def train(policy, overflows, growth_test="modulo"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    amp = abt.apply(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = DeepSpeedDynamicLossScaler(2.0 ** 8, 4, 1.0, 2, False, growth_test=growth_test)
    for step, overflow in enumerate(overflows):
        state = amp.scaler.loss_scale_state()
        assert (state.scale, state.hysteresis_left) == (ds.cur_scale, ds.cur_hysteresis), step
        loss = amp.model(torch.randn(8, 8)).float().pow(2).mean()
        try:
            ds.update_scale(overflow)
        except Exception:
            with pytest.raises(ampbridge.LossScaleError):
                amp.step(loss * math.inf, opt)
            return step
        applied = amp.step(loss * math.inf if overflow else loss, opt)
        opt.zero_grad()
        assert bool(applied) is (not overflow), step
    state = amp.scaler.loss_scale_state()
    assert (state.scale, state.hysteresis_left, state.steps) == (ds.cur_scale, ds.cur_hysteresis, len(overflows))
    return None


def test_converted_recipe_follows_deepspeeds_trajectory_through_the_torch_backend():
    conversion = recipes.from_deepspeed(RECIPE, release="modulo")
    policy = conversion.result
    ls = policy.loss_scale
    assert (policy.compute_dtype, ls.mode, ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale,
            ls.on_min_scale) == ("float16", "dynamic", 256.0, 4, 2, 1.0, "error")
    assert not [loss for loss in conversion.losses if "loss_scale" in loss.setting]
    assert train(policy, OVERFLOWS) is None
    # and it checked something: the scale both grew and backed off along the way
    seen = {s.scale for s in ampbridge.trajectory(policy.resolved_loss_scale, OVERFLOWS)}
    assert min(seen) < 256.0 < max(seen)


def test_the_raise_at_the_minimum_comes_at_the_same_step():
    policy = recipes.from_deepspeed(RECIPE, release="modulo").result
    # step 0 is absorbed by hysteresis, steps 1-8 back off 256 -> 1, step 9 overflows at the minimum:
    # DeepSpeed raises there, and so does ampbridge (on_min_scale = "error")
    assert train(policy, [True] * 40) == 9


def test_the_later_release_is_followed_exactly_through_the_torch_backend():
    """0.19.8 (stable_interval, e440506, PR 6976, from 0.17.1): first_growth_interval = window + 1 (issue 38)."""
    conversion = recipes.from_deepspeed(RECIPE)
    assert conversion.exact and conversion.result.loss_scale.first_growth_interval == 5
    assert train(conversion.result, OVERFLOWS, growth_test="stable_interval") is None
    # the two releases' trajectories differ on this sequence: the setting is doing something
    late, early = (ampbridge.trajectory(recipes.from_deepspeed(RECIPE, release=r).result.resolved_loss_scale,
                                        OVERFLOWS) for r in ("stable_interval", "modulo"))
    assert [s.scale for s in late] != [s.scale for s in early]
