"""The framework-free search of ``tune`` (``ampbridge.diagnostics.tune``), on a simulated backend: a
chain of layers with known output magnitudes, run as float16 computes them (a layer overflows when
its output, or its input cast to float16, leaves float16's range, unless it is pinned to float32).
The pins tune finds are exactly the ones that chain needs, in forward order, each verified by a
re-run; the diff, the evidence and the dtype choice follow from them."""

from __future__ import annotations

import math
import os

from hypothesis import given, settings
from hypothesis import strategies as st

import ampbridge
from ampbridge.diagnostics.runlog import RunLog
from ampbridge.diagnostics.tune import reference_policy, tune_policy

FUZZ = settings(max_examples=2000 if os.environ.get("AMPBRIDGE_FUZZ") else 100, deadline=None)
F16_MAX = 65504.0
BF16_MAX = 3.39e38


def _simulated(magnitudes, calls):
    """``run(policy)``: layer i's output has magnitude magnitudes[i]; the log a monitor would write."""
    limit = {"float16": F16_MAX, "bfloat16": BF16_MAX, "float32": math.inf}

    def run(policy):
        calls.append(policy)
        top = limit[policy.compute_dtype]
        first, previous = None, 1.0
        for i, m in enumerate(magnitudes):
            if f"l{i}" not in policy.keep_float32 and (m > top or previous > top):
                first = f"l{i}"
                break
            previous = m
        step = {"step": 0, "loss": math.nan if first else 1.0, "loss_scale": 1.0, "found_inf": bool(first),
                "skipped": bool(first), "layers": {},
                "first_nonfinite": {"path": first, "where": "output"} if first else None}
        return RunLog({"layers": [f"l{i}" for i in range(len(magnitudes))]}, [step])

    return run


def _needed(magnitudes, top):
    """The pins the chain needs: every layer whose output or input leaves the range."""
    out, previous = [], 1.0
    for i, m in enumerate(magnitudes):
        if m > top or previous > top:
            out.append(f"l{i}")
        previous = m
    return out


magnitudes = st.lists(st.sampled_from([1.0, 100.0, 6e4, 7e4, 1e6, 1e40]), min_size=1, max_size=8)


@FUZZ
@given(magnitudes)
def test_tune_pins_exactly_what_the_chain_needs(mags):
    calls = []
    result = tune_policy(ampbridge.preset("mixed_float16"), _simulated(mags, calls), max_rounds=32)
    needed = _needed(mags, F16_MAX)
    assert list(result.added) == needed  # forward order, none missing, none extra
    assert result.finite
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=tuple(needed))
    # one reference, one run per pin plus the first: every pin was verified by the run after it
    assert calls[0] == reference_policy(result.input_policy) and len(calls) == len(needed) + 2
    assert calls[-1] == result.policy
    assert {p for p, e in result.evidence.items() if e.pinned} == set(needed)
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    if needed:
        assert result.diff().splitlines()[-1] == "+keep_float32 = [" + ", ".join(f'"{p}"' for p in needed) + "]"
    else:
        assert result.diff() == ""


@FUZZ
@given(magnitudes)
def test_tune_keeps_the_dtype_that_needs_fewer_pins(mags):
    result = tune_policy(ampbridge.preset("mixed_float16"), _simulated(mags, []), dtypes=("float16", "bfloat16"))
    f16, bf16 = (len(_needed(mags, top)) for top in (F16_MAX, BF16_MAX))
    by = {c.compute_dtype: c for c in result.candidates}
    assert len(by["float16"].added) == f16 and len(by["bfloat16"].added) == bf16
    best = "bfloat16" if bf16 < f16 else "float16"  # a tie keeps the first asked for
    assert result.policy.compute_dtype == best


def test_a_pin_that_does_not_help_stops_the_search_and_says_so():
    def run(policy):  # "l0" goes non-finite whatever its dtype
        bad = policy.compute_dtype != "float32"
        step = {"step": 0, "loss": math.nan if bad else 1.0, "loss_scale": 1.0, "found_inf": bad, "skipped": bad,
                "layers": {}, "first_nonfinite": {"path": "l0", "where": "output"} if bad else None}
        return RunLog({"layers": ["l0"]}, [step])

    result = tune_policy(ampbridge.preset("mixed_float16"), run)
    assert not result.finite and result.added == ("l0",)
    assert "'l0' is pinned to float32 and still goes non-finite" in result.summary()


def test_bad_arguments_are_refused_by_name():
    import pytest

    run = _simulated([1.0], [])
    with pytest.raises(ValueError, match="'float8_e4m3fn' is not a compute dtype tune considers"):
        tune_policy(ampbridge.preset("mixed_float16"), run, dtypes=("float8_e4m3fn",))
    with pytest.raises(ValueError, match="tune runs steps 0 to 3, which cross the \\[\\[phase\\]\\] bound at step 2"):
        tune_policy(ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 2\n'), run, steps=4)


def test_batches_that_are_not_pairs_are_refused_in_one_line():
    import pytest

    from ampbridge.diagnostics.tune import StepCycle

    assert StepCycle.of([(1, 2), [3, 4]], 3).batches == [(1, 2), [3, 4], (1, 2)]
    with pytest.raises(TypeError, match=r"^tune's batches are \(inputs, target\) pairs; batch 1 is a tuple of length 3 "):
        StepCycle.of([(1, 2), (1, 2, 3)], 2)
    with pytest.raises(TypeError, match="batch 0 is a str "):
        StepCycle.of(["tokens"], 1)


PHASED = """compute_dtype = "float16"
keep_float32 = ["l9"]
[[phase]]
until_step = 100
keep_float32 = ["l8"]
[[phase]]
until_step = 200
"""


def test_a_policy_with_phases_gets_the_pins_in_the_phase_its_steps_run_in():
    calls = []
    policy = ampbridge.loads(PHASED)
    result = tune_policy(policy, _simulated([1.0, 1e6, 1.0], calls), steps=8)
    # the runs saw the first phase's complete policy, no schedule
    assert all(not c.phases for c in calls) and calls[1] == policy.at(step=0)
    assert result.added == ("l1", "l2")
    assert result.policy.phases[0].policy.keep_float32 == ("l8", "l1", "l2")
    assert result.policy.phases[1].policy == policy.phases[1].policy  # the other phase as it was
    assert result.policy.keep_float32 == ("l9",)
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    assert "phase 1" in result.reason
    assert result.diff().splitlines()[-1] == '+keep_float32 = ["l8", "l1", "l2"]'


def _diverging(bad_layers, gaps):
    """``run(policy)``: finite; each unpinned layer in ``bad_layers`` adds its share to the loss gap
    (``gaps[layer]``); the per-layer gradient RMS of the others differs a little from the reference."""

    def run(policy):
        ref = policy.compute_dtype == "float32"
        extra = 0.0 if ref else sum(gaps[p] for p in bad_layers if p not in policy.keep_float32)
        layers = {p: {"grad_rms": 1.0 + (0 if ref else (0.5 if p == "loud" else 0.01)), "zero": 0.0,
                      "underflow": 0.0} for p in ("l0", "loud", "l2")}
        steps = [{"step": i, "loss": 1.0 + extra, "loss_scale": 1.0, "found_inf": False, "skipped": False,
                  "layers": layers, "first_nonfinite": None} for i in range(2)]
        return RunLog({"layers": ["l0", "loud", "l2"]}, steps)

    return run


def test_a_finite_run_over_the_tolerance_gets_the_pin_that_lowers_its_gap():
    # "loud" differs most but pinning it does not help; "l0" (earliest) carries the gap
    result = tune_policy(ampbridge.preset("mixed_bfloat16"), _diverging(["l0"], {"l0": 0.5}))
    assert result.added == ("l0",) and result.chosen.gap_before == 0.5 and result.chosen.gap_after == 0.0
    assert result.evidence["l0"].diverged and not result.evidence["loud"].pinned
    assert result.chosen.runs == 3  # the policy run, the undone pin on "loud", the kept pin on "l0"
    # the divergence step off: the run is finite, nothing pinned, the gap stays
    off = tune_policy(ampbridge.preset("mixed_bfloat16"), _diverging(["l0"], {"l0": 0.5}), tries=0)
    assert off.added == () and not off.chosen.close


def test_a_pin_that_does_not_lower_the_gap_is_undone_and_said():
    # the gap comes from no layer tune can pin (say a layer without parameters)
    result = tune_policy(ampbridge.preset("mixed_bfloat16"), _diverging(["nobody"], {"nobody": 0.2}), tolerance=0.1)
    assert result.added == () and result.chosen.finite and not result.chosen.close
    assert "did not lower it" in result.reason and "'loud'" in result.reason


def test_tolerance_is_checked():
    import pytest

    with pytest.raises(ValueError, match="tolerance: -1 is not accepted"):
        tune_policy(ampbridge.preset("mixed_float16"), _simulated([1.0], []), tolerance=-1)
