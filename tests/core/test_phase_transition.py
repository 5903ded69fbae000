"""The loss-scale state at a phase boundary (``ampbridge.core.loss_scale.enter_phase``)."""

from ampbridge import LossScaleConfig
from ampbridge.core.loss_scale import LossScaleState, enter_phase, trajectory

DYN = LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=3, hysteresis=2)
DYN2 = DYN.replace(growth_factor=4.0, initial_scale=8.0)
NONE = LossScaleConfig(mode="none")
STATIC = LossScaleConfig(mode="static", initial_scale=64.0)


def test_dynamic_to_dynamic_carries_everything():
    s = trajectory(DYN, [False, False, False, True, False])[-1]
    assert enter_phase(DYN2, s, previous=DYN) == s


def test_reset_and_mode_changes_start_fresh_but_keep_the_counters():
    s = trajectory(DYN, [True, True, False, True])[-1]
    for cfg, previous, reset in ((DYN2, DYN, True), (DYN, NONE, False), (STATIC, DYN, False), (NONE, DYN, False),
                                 (STATIC.replace(initial_scale=2.0), STATIC, False)):
        out = enter_phase(cfg, s, previous=previous, reset=reset)
        assert out.steps == s.steps and out.skipped == s.skipped
        assert (out.scale, out.good_steps, out.hysteresis_left) == (
            1.0 if cfg.mode == "none" else cfg.initial_scale, 0, cfg.hysteresis), cfg


def test_no_previous_phase_means_fresh():
    assert enter_phase(DYN, LossScaleState(scale=3.0, steps=5)) == LossScaleState(
        scale=1024.0, good_steps=0, hysteresis_left=2, steps=5, skipped=0)


def test_dynamic_to_dynamic_stays_inside_the_new_bounds():
    s = LossScaleState(scale=4096.0, good_steps=90, hysteresis_left=3, steps=200, skipped=4)
    tight = LossScaleConfig(mode="dynamic", initial_scale=512.0, growth_interval=10, hysteresis=2, min_scale=1.0,
                            max_scale=1024.0)
    out = enter_phase(tight, s, previous=DYN.replace(growth_interval=100, hysteresis=3))
    assert out == LossScaleState(scale=1024.0, good_steps=9, hysteresis_left=2, steps=200, skipped=4)
    # and the next finite step grows again (good_steps reaches the new interval)
    assert trajectory(tight, [False], state=out)[-1].good_steps == 0
    floor = LossScaleConfig(mode="dynamic", min_scale=8192.0, max_scale=131072.0)
    assert enter_phase(floor, s, previous=DYN).scale == 8192.0
