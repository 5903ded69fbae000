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
    assert "run: jax, compute float16, 301 step(s) (to the last logged step: the log has no closing record), 5 in the log" in format_summary(s)
    assert "(the loss) (1)" in format_summary(s)


# --- the closing record (issue 23: a sampled log read right) ----------------------------------------

def write_sampled(path, *, end=True, every=5, steps=60, skipped=(14, 30), first=None):
    """A sampled log as a monitor writes it: every N-th step with statistics, each skipped step
    (with statistics only when sampled), the scale halving after each skip; then the closing record."""
    scale = 65536.0
    with RunLogWriter(path, framework="torch", compute_dtype="float16", layers=["a", "b"], min_scale=None,
                      policy={"compute_dtype": "float16", "loss_scale": {"mode": "dynamic"}}) as log:
        for i in range(steps):
            bad = i in skipped
            if i % every == 0 or bad:
                stats = {p: {"grad_max_abs": 1.0, "grad_rms": 0.1, "zero": 0.0, "nonfinite": 1.0 if bad else 0.0,
                             "underflow": 0.0, "overflow": 0.0} for p in ("a", "b")} if i % every == 0 else {}
                log.step(i, loss=None if bad else 1.0 / (i + 1), loss_scale=scale, found_inf=bad, skipped=bad,
                         layers=stats, first_nonfinite={"path": first, "where": "gradient"} if bad and first else None)
            if bad:
                scale /= 2
        if end:
            log.end(steps, first_step=0, last_step=steps - 1)


def test_the_closing_record_counts_the_steps_a_sampled_log_left_out(tmp_path):
    path = tmp_path / "run.jsonl"
    write_sampled(path)
    assert json.loads(path.read_text().splitlines()[-1]) == {
        "kind": "end", "steps": 60, "skipped": 2, "first_step": 0, "last_step": 59}
    log = read_log(path)
    assert len(log.steps) == 13 and log.end["steps"] == 60
    s = summarize(log)
    assert (s.steps, s.steps_run, s.steps_counted, s.skipped, s.skipped_steps) == (13, 60, "closing record", 2, [14, 30])
    text = format_summary(s)
    assert "run: torch, compute float16, 60 step(s) (steps 0-59), 13 in the log" in text
    assert "skipped steps: 2 (14, 30)" in text


def test_a_log_without_a_closing_record_still_reads_and_says_how_it_counted(tmp_path):
    path = tmp_path / "old.jsonl"
    write_sampled(path, end=False)
    log = read_log(path)
    assert log.end is None
    s = summarize(log)
    assert (s.steps_run, s.steps_counted, s.skipped) == (56, "last logged step", 2)
    assert "56 step(s) (to the last logged step: the log has no closing record), 13 in the log" in format_summary(s)


def test_closing_records_the_last_counts_and_steps_may_follow(tmp_path):
    """A Keras fit writes one when it ends; a later fit appends steps and another."""
    path = tmp_path / "run.jsonl"
    with RunLogWriter(path, framework="keras (jax)", compute_dtype="float16", layers=[]) as log:
        log.step(0, loss=1.0, loss_scale=2.0, found_inf=True, skipped=True)
        log.end(10, first_step=0, last_step=9)
        log.step(10, loss=1.0, loss_scale=1.0, found_inf=False, skipped=False)
        log.end(20, first_step=0, last_step=19)
    log = read_log(path)
    assert [s["step"] for s in log.steps] == [0, 10]
    assert (log.end["steps"], log.end["skipped"], log.end["last_step"]) == (20, 1, 19)
    assert summarize(log).steps_run == 20


@pytest.mark.parametrize("record,message", [
    ('{"kind": "end", "skipped": 0}', "end record: 'steps' must be an integer >= 0; received None"),
    ('{"kind": "end", "steps": -1, "skipped": 0}', "end record: 'steps' must be an integer >= 0; received -1"),
    ('{"kind": "end", "steps": 3, "skipped": true}', "end record: 'skipped' must be an integer >= 0; received True"),
    ('{"kind": "end", "steps": 3, "skipped": 0, "last_step": "x"}', "end record: 'last_step' must be an integer or null"),
    ('{"kind": "stop"}', "unknown record kind 'stop'; accepted: step, end"),
])
def test_bad_closing_records(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "run", "version": 1}\n' + record + "\n")
    with pytest.raises(ValueError, match=":2: " + message.replace("(", r"\(").replace(")", r"\)")):
        read_log(path)


def test_steps_non_finite_counts_every_skipped_step_of_the_log(tmp_path):
    """Step 30 is sampled (both layers' statistics non-finite), step 14 is not (only its
    attribution names a): a counts both, b the one whose statistics show it."""
    path = tmp_path / "run.jsonl"
    write_sampled(path, first="a")
    s = summarize(read_log(path))
    assert s.nonfinite_layers == {"a": 2, "b": 1}
    assert (s.nonfinite_steps, s.nonfinite_sampled) == (2, 1)
    text = format_summary(s)
    assert "a      0.00%      2" in text and "b      0.00%      1" in text
    assert "(1 of the 2 non-finite steps have no per-layer statistics (a torch fused optimizer" in text


def test_the_scale_after_each_step_backs_off_at_the_skipped_step(tmp_path):
    from ampbridge.diagnostics.report import scale_after_steps

    path = tmp_path / "run.jsonl"
    write_sampled(path)
    points = dict(scale_after_steps(read_log(path)))
    # 14: skipped, 15 logged (its scale is exact); 30: skipped and sampled, 31 not logged: the
    # reference algorithm's backoff
    assert (points[13], points[14], points[15]) == (65536.0, 32768.0, 32768.0)
    assert (points[29], points[30], points[35]) == (32768.0, 16384.0, 16384.0)
    assert all(points[k] == 65536.0 for k in points if k < 14)
    assert all(points[k] == 32768.0 for k in points if 14 <= k < 30)


@pytest.mark.parametrize("loss_scale,after", [
    ({"mode": "dynamic", "hysteresis": 2}, 4.0),  # the first overflow only spends hysteresis: held
    ({"mode": "static", "initial_scale": 4.0}, 4.0),
    ({"mode": "dynamic", "min_scale": 4.0}, 4.0),  # clamped at min_scale
    ({"mode": "dynamic", "backoff_factor": 0.25}, 1.0),
])
def test_the_scale_after_a_lone_skipped_step_follows_the_policy(tmp_path, loss_scale, after):
    from ampbridge.diagnostics.report import scale_after_steps

    path = tmp_path / "run.jsonl"
    with RunLogWriter(path, framework="jax", compute_dtype="float16", layers=[],
                      policy={"compute_dtype": "float16", "loss_scale": loss_scale}) as log:
        for step, bad in ((0, False), (7, True), (10, False)):
            log.step(step, loss=1.0, loss_scale=4.0, found_inf=bad, skipped=bad)
    assert dict(scale_after_steps(read_log(path)))[7] == after


def test_the_plot_shows_the_loss_and_the_backoff_at_the_skipped_step(tmp_path):
    require("matplotlib")
    from ampbridge.diagnostics.report import figure

    path = tmp_path / "run.jsonl"
    write_sampled(path)
    fig = figure(read_log(path))
    loss_axis, scale_axis, _ = fig.axes
    assert fig.axes[0].get_title() == "torch / float16: 2 skipped of 60 steps (13 in the log)"
    (loss,) = [line for line in loss_axis.lines if line.get_label() == "loss"]
    assert list(loss.get_xdata()) == [0, 5, 10, 15, 20, 25, 35, 40, 45, 50, 55]  # the skipped steps' loss is not finite
    assert loss.get_ydata()[1] == pytest.approx(1 / 6)
    (scale,) = [line for line in scale_axis.lines if line.get_label() == "loss scale"]
    assert scale.get_drawstyle() == "steps-post" and "after each step" in scale_axis.get_ylabel()
    xs, ys = list(scale.get_xdata()), list(scale.get_ydata())
    drops = [xs[k] for k in range(1, len(xs)) if ys[k] < ys[k - 1]]
    assert drops == [14, 30] and xs[-1] == 59 and ys[-1] == 16384.0  # to the closing record's last step
    skip_lines = [line for line in scale_axis.lines if line.get_label() == "skipped step"]
    assert len(skip_lines) == 1 and list(skip_lines[0].get_xdata()) == [14, 14]
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.parametrize("tail,problem", [
    ('{"kind": "step", "step": 3, "loss": 1.0, "loss_sc', ":4: not JSON: Unterminated string starting at (a line cut short?)"),
    ('{"kind": "step", "step": "3", "loss": 1.0, "loss_scale": 2.0, "found_inf": false, "skipped": false}',
     ":4: 'step' must be an integer >= 0; received '3'"),
    ('{"kind": "step", "step": 3, "loss": 1.0, "loss_scale": 2.0, "found_inf": 0, "skipped": false}',
     ":4: 'found_inf' must be true or false; received 0"),
    ('{"kind": "step", "step": 3, "loss": [1], "loss_scale": 2.0, "found_inf": false, "skipped": false}',
     ":4: 'loss' must be a number or null; received [1]"),
    ('{"kind": "step", "step": 3, "loss": 1.0, "loss_scale": 2.0, "found_inf": false, "skipped": false, '
     '"layers": {"a": {"zero": "x"}}}', ":4: 'layers' must map each layer to its numeric statistics"),
    ('{"kind": "end", "steps": 2, "skipped": 0, "first_step": 0, "last_step": 0}',
     ":4: end record: last_step 0 but step 1 was logged before it"),
])
def test_a_bad_record_ends_the_good_part_with_one_line(tmp_path, capsys, tail, problem):
    from ampbridge.cli.commands import main

    path = tmp_path / "run.jsonl"
    write_run(path, [(2.0, False, None, 0.0)] * 2)
    path.write_text(path.read_text() + tail)
    with pytest.raises(ValueError, match=":4: "):
        read_log(path)  # strict by default
    log = read_log(path, partial=True)
    assert len(log.steps) == 2 and log.end is None
    assert log.problem == f"{path}{problem}; read up to line 3" or problem.split(" (")[0] in log.problem
    assert main(["report", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"ampbridge report: warning: {path}:4: ")
    assert "2 step(s)" in out


def test_plot_names_the_file_it_writes_and_refuses_a_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from ampbridge.cli.commands import main

    path = tmp_path / "run.jsonl"
    write_run(path, [(2.0, False, None, 0.0)] * 3)
    assert main(["report", str(path), "--plot", str(tmp_path / "noext")]) == 0
    assert f"plot written to {tmp_path / 'noext.png'}" in capsys.readouterr().out
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(path), "--plot", str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err
