"""FP8 records in the run log and ``ampbridge report``: the saturation rule (in the framework's
arithmetic), the record's shape checked on reading, the report's float8 table and finding line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ampbridge._testing import require
from ampbridge.diagnostics.report import format_summary, summarize
from ampbridge.diagnostics.runlog import Fp8TensorStats, RunLogWriter, read_log


def bf16_quotient(a, b):
    """a / b in bfloat16, by ml_dtypes (operands and result rounded to bfloat16)."""
    ml_dtypes = require("ml_dtypes", "bfloat16 arithmetic to check the saturation rule against")
    return float(np.asarray(a, ml_dtypes.bfloat16) / np.asarray(b, ml_dtypes.bfloat16))


@pytest.mark.parametrize("amax,scale", [(0.953125, 0.0021275111939758062), (0.703125, 0.0015694753965362906),
                                        (900.0, 1.0), (3.0, 3.0 / 448), (1e-3, 1e-9), (448.0, 1.0), (449.0, 1.0)])
def test_divide_saturates_as_the_compute_dtype_computes(amax, scale):
    for dtype, quotient in (("bfloat16", bf16_quotient(amax, scale)),
                            ("float32", float(np.float32(amax) / np.float32(scale)))):
        s = Fp8TensorStats(amax, scale, "divide", 448.0, compute_dtype=dtype)
        assert s.scaled_amax == quotient, (dtype, amax, scale)
        assert s.saturated == (quotient > 448.0), (dtype, amax, scale)
    # the steady-weight case: one bfloat16 step over 448 (clipped), not in float32
    assert Fp8TensorStats(0.953125, 0.0021275111939758062, "divide", 448.0, compute_dtype="bfloat16").saturated
    assert not Fp8TensorStats(0.953125, 0.0021275111939758062, "divide", 448.0).saturated


def test_edges_multiply_and_non_finite():
    assert not Fp8TensorStats(2.0, 224.0, "multiply", 448.0).saturated
    assert Fp8TensorStats(2.0, 225.0, "multiply", 448.0).saturated
    assert Fp8TensorStats(float("inf"), 0.0, "multiply", 448.0).saturated  # torchao: inf amax, scale 0
    assert Fp8TensorStats(float("nan"), 1.0, "divide", 448.0).saturated
    assert Fp8TensorStats(1.0, 0.0, "divide", 448.0).saturated  # x / 0 = inf, clipped
    assert not Fp8TensorStats(0.0, 0.0, "divide", 448.0).saturated  # 0 / 0: nothing clipped
    assert Fp8TensorStats(1.0, 1.0, "divide", 448.0, saturated_fraction=0.25).saturated
    with pytest.raises(ValueError, match="scale_op must be"):
        Fp8TensorStats(1.0, 1.0, "scale", 448.0)


def write(path, records):
    with RunLogWriter(path, framework="keras (tensorflow)", compute_dtype="bfloat16", layers=["fc1", "fc2"]) as log:
        for step, fp8 in records:
            log.step(step, loss=1.0, loss_scale=1.0, found_inf=False, skipped=False, fp8=fp8)
        log.end(len(records), first_step=0, last_step=len(records) - 1)


def quiet(amax=3.0):
    return Fp8TensorStats(amax, amax / 448, "divide", 448.0, compute_dtype="bfloat16")


def records():
    grad = Fp8TensorStats(0.5, 1e-5, "divide", 57344.0, compute_dtype="bfloat16")
    steady = Fp8TensorStats(0.953125, 0.0021275111939758062, "divide", 448.0, compute_dtype="bfloat16")
    out = []
    for step in range(4):
        spike = Fp8TensorStats(3000.0, 3.0 / 448, "divide", 448.0, compute_dtype="bfloat16")
        out.append((step, {"fc1": {"input": spike if step == 2 else quiet(), "weight": quiet(), "grad_output": grad},
                           "fc2": {"input": quiet(), "weight": steady, "grad_output": grad}}))
    return out


def test_report_shows_each_float8_layer_and_names_the_one_that_saturated(tmp_path):
    path = tmp_path / "run.jsonl"
    write(path, records())
    log = read_log(path)
    assert log.steps[2]["fp8"]["fc1"]["input"]["saturated"] is True
    s = summarize(log)
    assert s.fp8["fc1"]["input"]["saturated_steps"] == [2] == s.fp8["fc1"]["input"]["clipped_steps"]
    assert s.fp8["fc1"]["input"]["max_amax"] == 3000.0 and s.fp8["fc1"]["input"]["steps"] == 4
    assert s.fp8["fc2"]["weight"]["saturated_steps"] == [0, 1, 2, 3]  # one bfloat16 step over 448: clipped
    assert s.fp8["fc2"]["weight"]["clipped_steps"] == []  # but rounding, not flagged
    text = format_summary(s)
    assert "float8 saturation, by steps: fc1 (1)" in text
    assert "fc1 saturated float8 on 1 step(s) (first at step 2): input (1 step(s), up to 1.01e+03 times the max)" in text
    assert "fc2 saturated" not in text
    row = next(line for line in text.splitlines() if line.startswith("fc1") and " input " in line)
    assert row.split()[2:] == ["4", "3000", "1006", "1", "(2)", "/", "0.00669643"]


def test_cli_report_prints_the_float8_section(tmp_path):
    path = tmp_path / "run.jsonl"
    write(path, records())
    out = subprocess.run([sys.executable, "-m", "ampbridge", "report", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "float8 layers" in out.stdout and "float8 saturation, by steps: fc1 (1)" in out.stdout


@pytest.mark.parametrize("bad,says", [
    ({"fc1": {"inputs": {}}}, "'inputs'"),
    ({"fc1": {"input": {"amax": "x", "scale": 1.0, "scale_op": "divide", "fp8_max": 448.0, "saturated": True}}},
     "'input'"),
    ({"fc1": {"input": {"amax": 1.0, "scale": 1.0, "scale_op": "times", "fp8_max": 448.0, "saturated": True}}},
     "'times'"),
    ([1], "'fp8' must map"),
])
def test_a_bad_fp8_field_is_one_line_naming_the_line(tmp_path, bad, says):
    path = tmp_path / "run.jsonl"
    write(path, [])
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "step", "step": 0, "loss": 1.0, "loss_scale": 1.0, "found_inf": False,
                            "skipped": False, "layers": {}, "fp8": bad}) + "\n")
    with pytest.raises(ValueError) as info:
        read_log(path)
    assert f"{path}:3: 'fp8' must map" in str(info.value) and says in str(info.value)
    assert read_log(path, partial=True).problem.startswith(f"{path}:3:")


def test_current_scaling_saturates_only_on_a_non_finite_amax(tmp_path):
    path = tmp_path / "run.jsonl"
    inf = Fp8TensorStats(float("inf"), 0.0, "multiply", 448.0)
    fine = Fp8TensorStats(2.0, 224.0, "multiply", 448.0)
    write(path, [(0, {"fc1": {"input": fine}}), (1, {"fc1": {"input": inf}})])
    text = format_summary(summarize(read_log(path)))
    assert "float8 saturation, by steps: fc1 (1)" in text
    assert "current scaling clips only a non-finite amax" in text and "* 0" in text


def test_a_float8_layer_whose_scale_never_followed_the_data_is_named(tmp_path):
    """Keras's float8 Dense called without training=True records no amax and keeps scale 1 (TensorFlow,
    torch) or stores 0 (JAX): the report says so instead of nothing (or a saturation)."""
    stuck = Fp8TensorStats(0.0, 1.0, "divide", 448.0, compute_dtype="bfloat16")
    path = tmp_path / "run.jsonl"
    write(path, [(step, {"fc1": {"input": stuck, "weight": stuck}, "fc2": {"input": quiet(), "weight": quiet()}})
                 for step in range(3)])
    text = format_summary(summarize(read_log(path)))
    assert "fc1: its float8 input and weight recorded no amax on any of 3 recorded steps (scale 1)" in text
    assert "training=True" in text and "fc2: its float8" not in text
    # one recorded step is not enough to tell (a fresh history before its first update)
    write(path, [(0, {"fc1": {"input": stuck, "weight": stuck}})])
    assert "recorded no amax" not in format_summary(summarize(read_log(path)))
