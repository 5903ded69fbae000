import json

import pytest

from ampbridge.diagnostics.report import advise, format_summary, plot, summarize
from ampbridge.diagnostics.runlog import RunLogWriter, layer_stats, read_log
from ampbridge._testing import require

np = require("numpy")


def test_layer_stats_definitions():
    g = np.array([0.0, 0.0, 2.0**-30, -3.0, 70000.0, np.inf, np.nan, 1.0], dtype=np.float32)
    s = layer_stats(g, loss_scale=1.0, compute_dtype="float16")
    assert s["zero"] == 2 / 8 and s["nonfinite"] == 2 / 8
    assert s["underflow"] == 1 / 8  # 2^-30 < float16's smallest subnormal 2^-24
    assert s["overflow"] == 1 / 8  # 70000 > 65504
    assert s["grad_max_abs"] == 70000.0
    scaled = layer_stats(g * 1024, loss_scale=1024.0, compute_dtype="float16")
    assert scaled["underflow"] == 1 / 8 and scaled["grad_max_abs"] == 70000.0
    bf = layer_stats(g, loss_scale=1.0, compute_dtype="bfloat16")
    assert bf["underflow"] == 0 and bf["overflow"] == 0


def write_run(path, steps):
    with RunLogWriter(path, framework="torch", compute_dtype="float16", layers=["embed", "block.attn", "head"],
                      min_scale=1.0, policy={"compute_dtype": "float16"}) as log:
        for i, (scale, inf, first, under) in enumerate(steps):
            log.step(i, loss=float("nan") if inf else 2.0 - i * 0.01, loss_scale=scale, found_inf=inf, skipped=inf,
                     layers={"block.attn": {"grad_max_abs": 1.0, "grad_rms": 0.1, "zero": 0.0,
                                            "nonfinite": 1.0 if inf else 0.0, "underflow": under, "overflow": 0.0},
                             "head": {"grad_max_abs": 1.0, "grad_rms": 0.1, "zero": 0.0, "nonfinite": 0.0,
                                      "underflow": 0.0, "overflow": 0.0}},
                     first_nonfinite={"path": first, "where": "output"} if first else None)


def test_write_read_and_summarize(tmp_path):
    path = tmp_path / "run.jsonl"
    steps = [(65536.0, False, None, 0.0)] * 10 + [(65536.0, True, "block.attn", 0.0)] + [(32768.0, False, None, 0.05)] * 5
    steps += [(1.0, True, "block.attn", 0.0), (1.0, True, "block.attn", 0.0)]
    write_run(path, steps)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "run" and len(lines) == 1 + len(steps)
    log = read_log(path)
    s = summarize(log)
    assert s.skipped_steps == [10, 16, 17]
    assert (s.scale_min, s.scale_max, s.scale_final) == (1.0, 65536.0, 1.0)
    assert s.steps_at_min_scale == 2
    assert s.overflow_origins == {"block.attn": 3}
    assert s.worst_underflow[0][0] == "block.attn"
    text = format_summary(s)
    assert "skipped steps: 3 (10, 16, 17)" in text and "block.attn" in text
    joined = " ".join(s.advice)
    assert 'keep_float32 = ["block.attn"]' in joined
    assert "sat at min_scale=1" in joined
    assert "would underflow" in joined
    assert "steps were skipped" in joined


def test_healthy_run_gets_no_advice(tmp_path):
    path = tmp_path / "ok.jsonl"
    write_run(path, [(65536.0, False, None, 0.0)] * 30)
    s = summarize(read_log(path))
    assert s.advice == [] and advise(s) == []
    assert "the numbers look healthy" in format_summary(s)


def test_plot_writes_a_png(tmp_path):
    require("matplotlib")
    path = tmp_path / "run.jsonl"
    write_run(path, [(65536.0, False, None, 0.01)] * 5 + [(65536.0, True, "head", 0.0)] + [(32768.0, False, None, 0.02)] * 5)
    out = tmp_path / "run.png"
    plot(read_log(path), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text,message", [
    ("", "empty log"),
    ('{"kind": "step"}\n', "first record must be the run header"),
    ('{"kind": "run", "version": 9}\n', "log version 9"),
    ('{"kind": "run", "version": 1}\n{"kind": "step", "step": 1}\n', "without 'loss_scale'"),
    ('{"kind": "run", "version": 1}\nnot json\n', ":2: not JSON"),
])
def test_bad_logs(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_log(path)


def test_report_cli(tmp_path, capsys):
    from ampbridge.cli.commands import main

    path = tmp_path / "run.jsonl"
    write_run(path, [(65536.0, False, None, 0.0)] * 3 + [(65536.0, True, "embed", 0.0)])
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "first layer to go non-finite, by steps: embed (1)" in out
    assert main(["report", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overflow_origins"] == {"embed": 1}
    assert main(["report", str(tmp_path / "none.jsonl")]) == 1  # a missing input file (issue 23)
    (tmp_path / "bad.jsonl").write_text("{}\n")
    assert main(["report", str(tmp_path / "bad.jsonl")]) == 1


def test_sampled_logs_count_skips_against_the_steps_run_and_a_loss_origin_gets_its_own_advice(tmp_path):
    path = tmp_path / "sampled.jsonl"
    with RunLogWriter(path, framework="jax", compute_dtype="float16", layers=["a"], min_scale=None) as log:
        for step in (0, 100, 200, 250, 300):
            skipped = step == 250
            log.step(step, loss=1.0, loss_scale=2.0, found_inf=skipped, skipped=skipped,
                     first_nonfinite={"path": "", "where": "loss"} if skipped else None)
    s = summarize(read_log(path))
    assert (s.steps, s.steps_run, s.skipped_steps) == (5, 301, [250])
    assert not any("steps were skipped" in a for a in s.advice)  # 1 of 301, not 1 of 5
    assert any(a.startswith("the loss itself was non-finite on 1 step(s)") for a in s.advice)
    assert not any('keep_float32 = [""]' in a for a in s.advice)
    assert "run: jax, compute float16, 301 step(s), 5 in the log" in format_summary(s)
    assert "(the loss) (1)" in format_summary(s)
