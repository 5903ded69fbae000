"""carry_state: the loss-scale state a new phase starts from (shared by every backend)."""

import pytest

from ampbridge import LossScaleConfig, LossScaleState, initial_state, trajectory
from ampbridge._loss_scale import carry_state

DYN = LossScaleConfig(mode="dynamic", growth_interval=4, hysteresis=3)


def test_dynamic_to_dynamic_carries_everything():
    s = trajectory(DYN, [False, False, True])[-1]
    assert carry_state(DYN, DYN, s) == s


def test_reset_restarts_counters_too():
    s = trajectory(DYN, [True] * 5)[-1]
    assert carry_state(DYN, DYN, s, reset=True) == initial_state(DYN)


@pytest.mark.parametrize("old", ["none", "static"])
def test_entering_dynamic_from_another_mode_starts_from_its_scale(old):
    s = LossScaleState(1.0 if old == "none" else 8.0, 0, 1, 12, 3)
    out = carry_state(LossScaleConfig(mode=old, initial_scale=8.0), DYN, s)
    assert out == LossScaleState(65536.0, 0, 3, 12, 3)


def test_clamped_to_the_new_settings():
    s = LossScaleState(2.0**20, good_steps=9, hysteresis_left=3, steps=30, skipped=1)
    new = LossScaleConfig(mode="dynamic", initial_scale=512.0, growth_interval=5, hysteresis=2, max_scale=1024.0)
    assert carry_state(DYN, new, s) == LossScaleState(1024.0, 4, 2, 30, 1)


def test_needs_resolved_configs():
    with pytest.raises(ValueError, match="resolve"):
        carry_state(LossScaleConfig(), DYN, initial_state(DYN))
