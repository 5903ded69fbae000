"""The reference FP8 scaling (ampbridge.core.fp8): its properties over random amax sequences.

The frameworks' own functions are compared with it in tests/backend_* (test_fp8*.py); here the
algorithm is held to what it promises without a framework."""

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampbridge.core.fp8 import (FP8_MAX, TORCHAO_EPS, amax_of, current_scale, delayed_initial, delayed_step,
                                delayed_trajectory, history_amax)
from ampbridge.core.loss_scale import f32

EXAMPLES = 2000 if os.environ.get("AMPBRIDGE_FUZZ") else 150
f32s = st.floats(min_value=0.0, max_value=3.4028234663852886e38, allow_nan=False, width=32)
amaxes = st.one_of(f32s, st.sampled_from([0.0, math.inf, math.nan, 1e-45, 3.4028234663852886e38]))
formats = st.sampled_from(sorted(FP8_MAX))


def quantize(x, scale, fmt):
    """x times a multiplier, clipped to the format (what an fp8 cast of a scaled tensor keeps in range)."""
    return max(-FP8_MAX[fmt], min(FP8_MAX[fmt], f32(x * scale)))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.floats(2.0 ** -39, 2.0 ** 99, width=32), formats, st.integers(0, 8))  # above torchao's 1e-12 floor; normal scales
def test_current_scale_maps_the_amax_to_the_formats_max_less_the_margin(amax, fmt, margin):
    scale = current_scale(amax, fmt, margin)
    target = FP8_MAX[fmt] / 2 ** margin
    # one float32 rounding of the quotient: amax * scale lands within a float32 ulp of fp8_max / 2**margin
    assert abs(amax * scale - target) <= target * 2 ** -23 * 1.01 or scale in (0.0, math.inf)


def test_current_scale_edges_are_torchaos():
    assert current_scale(0.0, "e4m3") == f32(448.0 / TORCHAO_EPS)  # the 1e-12 floor, not a division by 0
    assert current_scale(math.inf, "e5m2") == 0.0
    assert math.isnan(current_scale(math.nan, "e4m3"))
    assert current_scale(1.0, "e4m3", margin=3) == 56.0


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(amaxes, min_size=1, max_size=40), st.integers(1, 6), formats, st.integers(0, 4),
       st.sampled_from(["max", "most_recent"]))
def test_delayed_scaling_uses_only_past_amaxes_and_keeps_its_divisor_without_one(seq, length, fmt, margin,
                                                                                 compute):
    # IEEE arithmetic with subnormals (Keras on torch); the flushing default is held to XLA/TF by the backend tests
    states = delayed_trajectory(seq, fmt, length, margin=margin, amax_compute=compute, flush_denormals=False)
    previous = delayed_initial(length)
    for amax, state in zip(seq, states):
        assert len(state.history) == length
        assert state.history[0] == f32(amax) or (math.isnan(amax) and math.isnan(state.history[0]))
        used = history_amax(previous.history, compute)
        if used > 0 and math.isfinite(used):
            sf = f32(f32(FP8_MAX[fmt] / used) / 2 ** margin)
            assert state.divisor == f32(1 / sf) or sf == math.inf and state.divisor == 0.0
        else:  # no usable amax yet: the divisor survives a double reciprocal
            assert previous.divisor in (0.0, math.inf) or state.divisor == f32(1 / f32(1 / previous.divisor))
        previous = state


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.floats(2.0 ** -10, 2.0 ** 10, width=32), min_size=2, max_size=30), st.integers(1, 5))
def test_a_history_of_n_remembers_the_largest_of_the_last_n_amaxes(seq, n):
    states = delayed_trajectory(seq, "e4m3", n)
    for i in range(1, len(seq)):
        window = [f32(a) for a in seq[max(0, i - n):i]]  # the amaxes steps i-n..i-1 recorded
        assert history_amax(states[i - 1].history) == max(window)
        expected = f32(1 / f32(448.0 / max(window)))
        assert states[i].divisor == expected
        # what the divisor scales the window's largest value to: within rounding of the format's max
        assert abs(max(window) / expected - 448.0) <= 448.0 * 2 ** -21


def test_the_history_rolls_as_the_frameworks_roll():
    s = delayed_initial(3)
    for a in (1.0, 2.0, 3.0, 4.0):
        s = delayed_step(s, a, "e4m3")
    # roll(h, -1).at[0].set(a): the new amax at the front, the oldest cycling to the back
    assert s.history == (4.0, 2.0, 3.0)  # the last three amaxes, the newest first
    assert history_amax(s.history, "most_recent") == 4.0
    assert delayed_step(delayed_initial(1), 5.0, "e5m2").history == (5.0,)


def test_nonfinite_amaxes_are_recorded_but_never_set_the_scale():
    s = delayed_trajectory([2.0, math.inf], "e4m3", 1)
    assert s[1].divisor == f32(1 / f32(448.0 / 2.0)) and s[1].history == (math.inf,)
    after = delayed_step(s[1], 1.0, "e4m3")
    assert after.divisor == f32(1 / f32(1 / s[1].divisor))  # inf amax: kept
    assert math.isnan(history_amax((1.0, math.nan)))


def test_amax_of_and_bad_arguments():
    assert amax_of([-3.0, 2.0]) == 3.0 and math.isnan(amax_of([1.0, math.nan])) and amax_of([]) == 0.0
    with pytest.raises(ValueError, match="accepted: e4m3, e5m2"):
        current_scale(1.0, "e3m4")
    with pytest.raises(ValueError, match="max, most_recent"):
        history_amax((1.0,), "mean")
    with pytest.raises(ValueError, match=">= 1"):
        delayed_initial(0)


def test_flush_denormals_computes_as_xla_and_tensorflow():
    """A subnormal amax counts as 0 (the divisor is kept) and a subnormal divisor is 0, as XLA and TF compute;
    without flushing (Keras on torch) 448 / 1e-45 overflows and the divisor is 1 / inf = 0."""
    s = delayed_step(delayed_step(delayed_initial(2), 1e-45, "e4m3"), 1.0, "e4m3")
    assert s.divisor == 1.0 and s.history == (1.0, f32(1e-45))
    s = delayed_step(delayed_step(delayed_initial(2), 1e-45, "e4m3"), 1.0, "e4m3", flush_denormals=False)
    assert s.divisor == 0.0
    tiny = f32(448.0 / 3e38)  # 448 / amax = 3e38 is finite; its reciprocal 3.3e-39 is subnormal
    assert delayed_trajectory([tiny, 1.0], "e4m3", 1)[-1].divisor == 0.0
    assert delayed_trajectory([tiny, 1.0], "e4m3", 1, flush_denormals=False)[-1].divisor == f32(1 / f32(448.0 / tiny))
