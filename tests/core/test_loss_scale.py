"""The reference loss scaler against transcriptions of torch's and DeepSpeed's own code."""

import math
import random
import warnings

import pytest

from ampbridge import LossScaleConfig, LossScaleError, LossScaler, LossScaleState, initial_state, next_state, trajectory
from ampbridge.core.loss_scale import f32
from ampbridge._testing import DeepSpeedDynamicLossScaler
from ampbridge.errors import AmpBridgeWarning


def torch_grad_scaler(init, growth, backoff, interval, found_infs):
    """torch's _amp_update_scale_cpu_kernel (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp),
    transcribed: a float32 scale times a double factor, rounded back to float32; growth is
    skipped when it would reach inf."""
    scale, tracker, out = f32(init), 0, []
    for found_inf in found_infs:
        if found_inf:
            scale = f32(scale * backoff)
            tracker = 0
        else:
            successful = tracker + 1
            if successful == interval:
                new = f32(scale * growth)
                if math.isfinite(new):
                    scale = new
                tracker = 0
            else:
                tracker = successful
        out.append((scale, tracker))
    return out


def random_sequence(n, p_inf, seed):
    rng = random.Random(seed)
    return [rng.random() < p_inf for _ in range(n)]


def bursty_sequence(n, seed):
    """Long finite stretches broken by bursts of overflows (what hysteresis is for)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        out += [False] * rng.randint(0, 2500)
        out += [True] * rng.choice([1, 1, 2, 3, 5])
    return out[:n]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("growth,backoff,interval", [(2.0, 0.5, 2000), (2.0, 0.5, 3), (3.0, 0.25, 7), (1.1, 0.9, 5)])
def test_hysteresis_1_is_torch_grad_scaler(seed, growth, backoff, interval):
    seq = random_sequence(10_000, 0.05, seed) if interval < 100 else bursty_sequence(10_000, seed)
    cfg = LossScaleConfig(mode="dynamic", growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    # ampbridge applies factors as float32 values; torch gets the float32-rounded factors
    expected = torch_grad_scaler(65536.0, f32(growth), f32(backoff), interval, seq)
    got = trajectory(cfg, seq)
    assert [(s.scale, s.good_steps) for s in got] == expected
    assert got[-1].skipped == sum(seq) and got[-1].steps == len(seq)


def test_torch_growth_stops_short_of_inf():
    cfg = LossScaleConfig(mode="dynamic", growth_interval=1, initial_scale=2.0**120)
    states = trajectory(cfg, [False] * 20)
    assert states[-1].scale == 2.0**127
    assert [(s.scale, s.good_steps) for s in states] == torch_grad_scaler(2.0**120, 2.0, 0.5, 1, [False] * 20)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_hysteresis_2_window_1000_min_1(seed, consecutive):
    seq = bursty_sequence(10_000, seed) if seed % 2 else random_sequence(10_000, 0.002, seed)
    ds = DeepSpeedDynamicLossScaler(2.0**16, 1000, 1.0, 2, consecutive, raise_error_at_min_scale=False)
    cfg = LossScaleConfig(mode="dynamic", growth_interval=1000, hysteresis=2, min_scale=1.0,
                          consecutive_hysteresis=consecutive)
    state = initial_state(cfg)
    for step, found_inf in enumerate(seq):
        ds.update_scale(found_inf)
        state = next_state(cfg, state, found_inf)
        assert (state.scale, state.hysteresis_left) == (ds.cur_scale, ds.cur_hysteresis), step


def test_deepspeed_raises_at_min_scale_like_on_min_scale_error():
    seq = [True] * 40
    ds = DeepSpeedDynamicLossScaler(2.0**4, 1000, 1.0, 2, False)
    cfg = LossScaleConfig(mode="dynamic", initial_scale=16.0, growth_interval=1000, hysteresis=2, min_scale=1.0,
                          on_min_scale="error")
    state = initial_state(cfg)
    for step, found_inf in enumerate(seq):
        try:
            ds.update_scale(found_inf)
        except Exception:
            with pytest.raises(LossScaleError, match="min_scale=1.0"):
                next_state(cfg, state, found_inf)
            break
        state = next_state(cfg, state, found_inf)
    else:
        pytest.fail("DeepSpeed never raised")
    assert step == 5  # step 0 absorbed by hysteresis, steps 1-4 back off 16 -> 1, step 5 raises


def test_hysteresis_sequence_by_hand():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=8.0, growth_interval=2, hysteresis=2, growth_factor=3.0,
                          backoff_factor=0.25, max_scale=50.0, min_scale=0.5)
    seq = [True, True, True, False, False, True, False, False, False, False, True, True, True, True]
    got = [(s.scale, s.hysteresis_left, s.good_steps) for s in trajectory(cfg, seq)]
    assert got == [
        (8.0, 1, 0),    # absorbed by hysteresis
        (2.0, 1, 0),    # backoff x0.25
        (0.5, 1, 0),    # backoff, clamped to min 0.5
        (0.5, 1, 1),
        (1.5, 2, 0),    # growth x3 refills hysteresis
        (1.5, 1, 0),    # absorbed
        (1.5, 1, 1),
        (4.5, 2, 0),
        (4.5, 2, 1),
        (13.5, 2, 0),
        (13.5, 1, 0),
        (3.375, 1, 0),
        (0.84375, 1, 0),
        (0.5, 1, 0),    # clamped
    ]
    capped = trajectory(cfg.replace(initial_scale=40.0, hysteresis=1), [False, False])
    assert capped[-1].scale == 50.0  # 120 capped at max_scale


def test_consecutive_hysteresis_refills_on_every_finite_step():
    cfg = LossScaleConfig(mode="dynamic", hysteresis=2, consecutive_hysteresis=True, growth_interval=100)
    got = [s.scale for s in trajectory(cfg, [True, False, True, False, True, True])]
    assert got == [65536.0] * 5 + [32768.0]


def test_static_and_none_modes():
    seq = [False, True, False, True, True]
    static = trajectory(LossScaleConfig(mode="static", initial_scale=128.0), seq)
    assert {s.scale for s in static} == {128.0} and static[-1].skipped == 3
    none = trajectory(LossScaleConfig(mode="none"), seq)
    assert {s.scale for s in none} == {1.0} and none[-1].skipped == 3
    kept = trajectory(LossScaleConfig(mode="static", skip_nonfinite=False), seq)
    assert kept[-1].skipped == 0


def test_on_min_scale_warn_warns_once_and_clamps():
    scaler = LossScaler(LossScaleConfig(mode="dynamic", initial_scale=2.0, min_scale=1.0, on_min_scale="warn"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            assert scaler.update(True) is False
    assert scaler.scale == 1.0
    assert len([w for w in caught if issubclass(w.category, AmpBridgeWarning)]) == 1


def test_clamp_stays_silently():
    scaler = LossScaler(LossScaleConfig(mode="dynamic", initial_scale=1.0, min_scale=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.update(True)
    assert scaler.scale == 1.0


def test_auto_must_be_resolved_and_the_scaler_resolves_it():
    with pytest.raises(ValueError, match="resolve"):
        initial_state(LossScaleConfig())
    assert LossScaler(LossScaleConfig(), "bfloat16").config.mode == "none"
    assert LossScaler(LossScaleConfig(), "float16").config.mode == "dynamic"


def test_state_serialises_and_restores():
    cfg = LossScaleConfig(mode="dynamic", growth_interval=3, hysteresis=2)
    seq = random_sequence(200, 0.2, 7)
    whole = LossScaler(cfg)
    for x in seq:
        whole.update(x)
    first = LossScaler(cfg)
    for x in seq[:90]:
        first.update(x)
    saved = first.state_dict()
    second = LossScaler(cfg)
    second.load_state_dict(saved)
    for x in seq[90:]:
        second.update(x)
    assert second.state == whole.state
    assert LossScaleState.from_dict(whole.state.to_dict()) == whole.state
    with pytest.raises(ValueError, match="missing \\['skipped'\\]"):
        LossScaleState.from_dict({"scale": 1.0, "good_steps": 0, "hysteresis_left": 1, "steps": 0})


def test_scales_are_float32_values():
    cfg = LossScaleConfig(mode="dynamic", initial_scale=0.1, growth_factor=1.1, growth_interval=1)
    s = trajectory(cfg, [False] * 3)
    assert s[0].scale == f32(f32(0.1) * f32(1.1))
    assert all(f32(x.scale) == x.scale for x in s)
