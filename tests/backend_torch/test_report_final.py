"""``ampbridge report`` on a real sampled torch run: the final loss scale is the run's, rebuilt from
the policy and the skipped steps (the issue: a 60-step run with every=10 ended at 262144 and the
report said 131072, the last logged step's), and the plotted curve has every growth where it happened."""

from __future__ import annotations

from ampbridge._testing import require

torch = require("torch")

import ampbridge.torch as abt  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402
from ampbridge.diagnostics.report import format_summary, scale_after_steps, summarize  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402


def _run(tmp_path, poisoned, steps=60, every=10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    amp = abt.apply(model, Policy(compute_dtype="bfloat16", loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** 16, growth_interval=7)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scales = []
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with amp.monitor(tmp_path / "run.jsonl", every=every):
        for i in range(steps):
            loss = torch.nn.functional.mse_loss(amp.model(x).float(), y) * (float("inf") if i in poisoned else 1.0)
            amp.step(loss, opt)
            opt.zero_grad()
            scales.append((i, float(amp.scaler.get_scale())))
    return read_log(tmp_path / "run.jsonl"), scales


def test_the_final_scale_and_every_growth_are_the_runs(tmp_path):
    log, scales = _run(tmp_path, poisoned={13, 14, 41})
    summary = summarize(log)
    assert summary.scale_final == scales[-1][1]
    assert summary.scale_final != log.steps[-1]["loss_scale"]  # the last logged step's is not the run's
    assert summary.scale_final_source == "rebuilt from the policy and the skipped steps"
    assert scale_after_steps(log) == scales  # growths at the steps they happened, not at the next logged one
    text = format_summary(summary)
    assert f"final {scales[-1][1]:g} (rebuilt from the policy and the skipped steps)" in text
    assert "final loss: " in text and "(step 50, the last finite loss logged)" in text
