"""amp.monitor: the shared numerics log, overflow attribution, statistics against numpy, sampling,
host syncs, and `ampbridge report` on a real run."""

import copy
import io
import math
import contextlib

import numpy as np
import pytest

import ampbridge
import ampbridge.cli.commands
import ampbridge._testing
from ampbridge import Policy, Rule
from ampbridge.diagnostics.runlog import STAT_KEYS, layer_stats, read_log

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch import monitor as torch_monitor  # noqa: E402

nn = torch.nn


class GradBoom(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e30 (inf in float16)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return GradBoom.apply(x, self.factor) if self.armed else x

    factor = 1e30


def chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), Boom(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 1))


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def loss_fn(out, y):  # small enough that scaled gradients stay below 65504 unless a test plants more
    return 0.05 * (out.float() - y).square().mean()


def train(model, amp, opt, batches, plant=None):
    """Real steps with amp.step; ``plant(step)`` is a context manager that plants an overflow."""
    results = []
    for i, (x, y) in enumerate(batches):
        with plant(i) if plant else contextlib.nullcontext():
            results.append(bool(amp.step(loss_fn(model(x), y), opt)))
        opt.zero_grad()
    return results


def by_step(log):
    return {s["step"]: s for s in log.steps}


# --- overflow attribution ----------------------------------------------------------------------

def test_a_forward_overflow_names_the_layer_whose_output_overflowed(helpers, tmp_path):
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def plant(i):  # float16 output beyond 65504 at step 3; everything after it follows
        return helpers.big_weights(model[2], 1e5) if i == 3 else contextlib.nullcontext()

    with amp.monitor(tmp_path / "run.jsonl", every=100):
        applied = train(model, amp, opt, data(6), plant)
    assert applied == [True, True, True, False, True, True]
    log = read_log(tmp_path / "run.jsonl")
    step = by_step(log)[3]
    assert step["found_inf"] and step["skipped"]
    # unsampled, yet with every layer's statistics: a non-finite step always has them (issue 23)
    assert set(step["layers"]) == {"0", "2", "4", "6"} and step["layers"]["2"]["nonfinite"] > 0
    assert step["first_nonfinite"] == {"path": "2", "where": "output"}
    assert step["loss_scale"] == 65536.0 and amp.scaler.get_scale() == 32768.0  # the scale it used, then backed off
    assert sorted(by_step(log)) == [0, 3]  # step 0 sampled, the skipped step always logged


def test_a_backward_only_overflow_names_the_layer_whose_gradient_overflowed(tmp_path):
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @contextlib.contextmanager
    def plant(i):
        model[3].armed = i == 2
        yield
        model[3].armed = False

    with amp.monitor(tmp_path / "run.jsonl", every=1):
        applied = train(model, amp, opt, data(4), plant)
    assert applied == [True, True, False, True]
    step = by_step(read_log(tmp_path / "run.jsonl"))[2]
    assert step["first_nonfinite"] == {"path": "3", "where": "gradient"}
    assert math.isfinite(step["loss"])  # the forward was fine
    # every layer before the planted one got the non-finite gradient; the ones after did not
    assert step["layers"]["0"]["nonfinite"] > 0 and step["layers"]["6"]["nonfinite"] == 0


def test_a_parameter_gradient_overflow_without_an_input_gradient_names_the_first_layer(helpers, tmp_path):
    """The first layer's input needs no gradient: its weight gradient (x^T g, in float16) is what
    overflows, and the attribution falls back to the layers' own parameter gradients."""
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = data(3)
    x, y = batches[1]
    batches[1] = (x * 1e4, y)  # finite in float16; x^T g * 65536 is not
    with helpers.big_weights(model[0], 1e-5), amp.monitor(tmp_path / "run.jsonl"):
        assert train(model, amp, opt, batches) == [True, False, True]
    step = by_step(read_log(tmp_path / "run.jsonl"))[1]
    assert step["first_nonfinite"] == {"path": "0", "where": "gradient"}
    assert step["layers"]["0"]["nonfinite"] > 0 and step["layers"]["2"]["nonfinite"] == 0


def test_a_non_finite_loss_with_finite_layers_is_the_loss(tmp_path):
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp.monitor(tmp_path / "run.jsonl"):
        x, y = data(1)[0]
        assert not amp.step(loss_fn(model(x), y) * float("inf"), opt)
    step = read_log(tmp_path / "run.jsonl").steps[0]  # (read_log reads a null loss as nan)
    assert math.isnan(step["loss"]) and step["first_nonfinite"] == {"path": "", "where": "loss"}


# --- the statistics --------------------------------------------------------------------------------

def test_layer_statistics_equal_numpy_on_the_same_gradients(tmp_path):
    """The native loop feeds the monitor too; the gradients are fetched before the scaler unscales."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    overrides=(Rule(("4",), compute_dtype="bfloat16"),))
    amp = abt.apply(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    owned = {path: [p for p in m.parameters(recurse=False)] for path, m in model.named_modules() if path}
    fetched = []
    with amp.monitor(tmp_path / "run.jsonl") as monitor:
        for i, (x, y) in enumerate(data(3)):
            with amp.autocast():
                loss = loss_fn(model(x), y[:, :1]) * (1e-9 if i == 0 else 1.0)  # step 0: gradients underflow
            amp.scaler.scale(loss).backward()
            if i == 2:
                model[2].weight.grad[0, :5] = float("inf")
                model[2].weight.grad[1, :3] = float("nan")
            fetched.append(({path: np.concatenate([p.grad.double().numpy().ravel() for p in ps])
                             for path, ps in owned.items() if ps}, amp.scaler.get_scale()))
            amp.scaler.step(opt)
            amp.scaler.update()
            opt.zero_grad()
    assert monitor.closed
    steps = read_log(tmp_path / "run.jsonl").steps
    assert [s["step"] for s in steps] == [0, 1, 2] and [s["found_inf"] for s in steps] == [False, False, True]
    underflowed = 0
    for record, (grads, scale) in zip(steps, fetched):
        assert record["loss_scale"] == scale
        assert sorted(record["layers"]) == ["0", "2", "3", "4"]  # the ReLU owns nothing
        for path, g in grads.items():
            want = layer_stats(g, scale, amp.plan[path].compute_dtype)
            got = record["layers"][path]
            for key in ("zero", "nonfinite", "underflow", "overflow"):
                assert got[key] == want[key], (record["step"], path, key)
            for key in ("grad_max_abs", "grad_rms"):
                assert got[key] == pytest.approx(want[key], rel=1e-6), (record["step"], path, key)
            underflowed += want["underflow"] > 0
    assert underflowed >= 2  # the check is not vacuous: float16 rows did underflow at step 0
    assert steps[0]["layers"]["3"]["underflow"] == 0  # the float32 LayerNorm: float32's subnormals
    assert steps[2]["layers"]["2"]["nonfinite"] == 8 / (64 * 64 + 64)


# --- sampling, syncs, the header -----------------------------------------------------------------

def test_every_100_samples_steps_0_100_200_and_logs_every_skip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x, y = torch.randn(2, 4), torch.randn(2, 1)

    with amp.monitor(tmp_path / "run.jsonl", every=100):
        for i in range(201):
            loss = loss_fn(model(x), y) * (float("nan") if i in (57, 150) else 1.0)
            amp.step(loss, opt)
            opt.zero_grad()
    steps = by_step(read_log(tmp_path / "run.jsonl"))
    assert sorted(steps) == [0, 57, 100, 150, 200]
    assert {k for k, s in steps.items() if s["layers"]} == {0, 57, 100, 150, 200}  # and every non-finite one
    assert [k for k, s in steps.items() if s["skipped"]] == [57, 150]
    assert steps[150]["first_nonfinite"] == {"path": "", "where": "loss"}
    # the closing record: every step the monitor saw, logged or not (issue 23)
    assert read_log(tmp_path / "run.jsonl").end == {"kind": "end", "steps": 201, "skipped": 2, "first_step": 0,
                                                    "last_step": 200}


@pytest.mark.parametrize("case", ["ordinary", "fused", "fused, flag on a device"])
def test_host_syncs_and_transfers(helpers, tmp_path, counter, monkeypatch, case):
    """No monitor: one read per step (ordinary optimizer), none (fused); the monitor adds no read
    on an unsampled finite step and exactly one transfer on a sampled or a non-finite step. A
    fused optimizer on the CPU device: the monitor reads found_inf from host memory (no aten op),
    so the skipped step is logged at once. Where the flag lies in device memory (an accelerator,
    stood in for here) the host never learns found_inf: the skipped step waits on the device and
    is read with the next sampled step (its attribution intact)."""
    transfers = []
    real = torch_monitor._to_host
    monkeypatch.setattr(torch_monitor, "_to_host", lambda t: transfers.append(t.numel()) or real(t))
    if case == "fused, flag on a device":
        monkeypatch.setattr(torch_monitor, "_flag_in_host_memory", lambda found: None)
    fused = case != "ordinary"
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    # (torch's for-loop Adam reads its step counters: SGD is the ordinary optimizer here)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = data(7)
    plan = {3: lambda: helpers.big_weights(model[2], 1e5)}
    counts = []
    monitor = amp.monitor(tmp_path / "run.jsonl", every=5)
    for i, (x, y) in enumerate(batches):
        transfers.clear()
        with plan.get(i, contextlib.nullcontext)():
            with counter() as c:
                result = amp.step(loss_fn(model(x), y), opt)
        opt.zero_grad()
        counts.append((c.syncs, len(transfers)))
        assert bool(result) == (i != 3)
    monitor.close()
    if case == "fused, flag on a device":  # 0 and 5 sampled: step 3 is read at step 5
        assert counts == [(0, 1), (0, 0), (0, 0), (0, 0), (0, 0), (0, 1), (0, 0)]
    elif fused:  # no sync, and the skipped step is read (and replayed) at once
        assert counts == [(0, 1), (0, 0), (0, 0), (0, 1), (0, 0), (0, 1), (0, 0)]
    else:
        assert counts == [(1, 1), (1, 0), (1, 0), (1, 1), (1, 0), (1, 1), (1, 0)]
    log = read_log(tmp_path / "run.jsonl")
    steps = by_step(log)
    assert sorted(steps) == [0, 3, 5] and steps[3]["skipped"]
    # the step that waited on the device counts as skipped in the closing record too
    assert (log.end["steps"], log.end["skipped"], log.end["last_step"]) == (7, 1, 6)
    assert steps[3]["first_nonfinite"] == {"path": "2", "where": "output"}
    # a skipped step read at the step (not one that waited on the device) has every layer's statistics
    assert bool(steps[3]["layers"]) == (case != "fused, flag on a device")
    model2 = chain()  # without a monitor: the same reads
    amp2 = abt.apply(model2, "mixed_float16")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3, fused=True) if fused else \
        torch.optim.SGD(model2.parameters(), lr=1e-3)
    x, y = batches[0]
    with counter() as c:
        amp2.step(loss_fn(model2(x), y), opt2)
    assert c.syncs == (0 if fused else 1)


def test_a_fused_optimizer_s_skipped_step_has_the_statistics_of_an_ordinary_one(tmp_path):
    """A fused optimizer's overflow check leaves the gradients scaled (its kernel unscales them,
    and skips on an overflow): the skipped step's layer statistics, read at the step on the CPU
    device, equal those of the same step under a for-loop Adam, whose scaler unscaled in place."""
    layers = {}
    for fused in (False, True):
        model = chain()
        amp = abt.apply(model, "mixed_float16")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused, foreach=False if not fused else None)
        with amp.monitor(tmp_path / f"run-{fused}.jsonl", every=5):
            for i, (x, y) in enumerate(data(3)):
                model[3].armed = i == 1  # layers 4 and 6 keep finite gradients
                assert bool(amp.step(loss_fn(model(x), y), opt)) == (i != 1)
                opt.zero_grad()
        step = by_step(read_log(tmp_path / f"run-{fused}.jsonl"))[1]
        assert step["skipped"] and step["first_nonfinite"] == {"path": "3", "where": "gradient"}
        layers[fused] = step["layers"]
    assert sorted(layers[True]) == sorted(layers[False]) == ["0", "2", "4", "6"]
    for path, ordinary in layers[False].items():
        for key, value in ordinary.items():
            if value is None:
                assert layers[True][path][key] is None, (path, key)
            else:  # the two Adams' first steps agree to rounding, not bit for bit
                assert layers[True][path][key] == pytest.approx(value, rel=1e-3, abs=1e-12, nan_ok=True), (path, key)
    assert layers[True]["6"]["nonfinite"] == 0 and layers[True]["6"]["grad_max_abs"] > 0  # not vacuous


def test_the_monitor_does_not_change_training(helpers, tmp_path):
    """Bit for bit: same losses and parameters with and without the monitor (its input views keep
    MultiheadAttention's self-attention path: query is key is value)."""
    a, b = helpers.twin(helpers.Tiny())
    runs = []
    for model, monitored in ((a, False), (b, True)):
        amp = abt.apply(model, ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        monitor = amp.monitor(tmp_path / "run.jsonl", every=2) if monitored else None
        losses = []
        for tokens, targets in helpers.batches(4):
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            amp.step(loss, opt)
            opt.zero_grad()
            losses.append(loss.item())
        if monitor:
            monitor.close()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))
    header = read_log(tmp_path / "run.jsonl").header
    assert header["layers"] == ["embed", "ln1", "attn", "attn.out_proj", "ln2", "fc1", "act", "fc2", "ln3", "head"]
    assert header["framework"] == "torch" and header["compute_dtype"] == "float16" and header["min_scale"] is None
    assert header["policy"]["keep_float32"] == ["kind:norm"]


def test_header_layers_follow_the_forward_not_the_definition(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = nn.Linear(4, 1)
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.early = nn.Linear(4, 4)

        def forward(self, x):
            return self.late(self.block(self.early(x)))

    model = Net()
    amp = abt.apply(model, "mixed_bfloat16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp.monitor(tmp_path / "run.jsonl"):
        amp.step(model(torch.randn(2, 4)).sum(), opt)
    assert read_log(tmp_path / "run.jsonl").header["layers"] == ["early", "block", "block.0", "block.1", "late"]


def test_in_place_residuals_and_activations_train_under_attribution(tmp_path):
    """torch's full backward hooks refuse `out += identity` after a hooked module; the monitor's
    input views do not (a ResNet block)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.relu = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.bn(self.fc(x))
            out += x
            return self.relu(out)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 1))
    amp = abt.apply(model, "mixed_bfloat16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp.monitor(tmp_path / "run.jsonl"):
        for _ in range(2):
            assert amp.step(model(torch.randn(3, 4)).float().sum(), opt)
            opt.zero_grad()
    assert len(read_log(tmp_path / "run.jsonl").steps) == 2


def test_monitor_lifecycle(tmp_path):
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    with pytest.raises(ValueError, match="every must be an integer >= 1.*received 0"):
        amp.monitor(tmp_path / "a.jsonl", every=0)
    monitor = amp.monitor(tmp_path / "a.jsonl", every=3)
    with pytest.raises(ampbridge.AmpBridgeError, match="already has a monitor"):
        amp.monitor(tmp_path / "b.jsonl")
    twin = copy.deepcopy(model)  # an EMA copy: allowed, the hooks keep one log
    assert twin[0].weight is not model[0].weight
    amp.remove()
    assert monitor.closed and amp.scaler.observer is None
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert read_log(tmp_path / "a.jsonl").header["layers"][0] == "0"  # a header even without steps
    with pytest.raises(OSError):
        abt.apply(chain(), "mixed_float16").monitor(tmp_path / "missing" / "x.jsonl")


def test_float32_without_a_scaler_and_skip_off(tmp_path):
    """mode none without skipping: nothing reads found_inf; the monitor checks the gradients itself
    (on the device) and logs the non-finite step at the next read (here: close)."""
    model = chain()
    amp = abt.apply(model, Policy(loss_scale={"mode": "none", "skip_nonfinite": False}))
    assert not amp.scaler._enabled
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    model[3].factor = float("inf")

    @contextlib.contextmanager
    def plant(i):
        model[3].armed = i == 3  # the last step: an applied non-finite step poisons the parameters
        yield
        model[3].armed = False

    with amp.monitor(tmp_path / "run.jsonl", every=2):
        train(model, amp, opt, data(4), plant)
    steps = by_step(read_log(tmp_path / "run.jsonl"))
    assert sorted(steps) == [0, 2, 3]
    assert steps[3]["found_inf"] and not steps[3]["skipped"] and steps[3]["loss_scale"] == 1.0
    assert steps[3]["first_nonfinite"] == {"path": "3", "where": "gradient"}


# --- the report ------------------------------------------------------------------------------------

def test_report_names_the_planted_layer_and_counts_skips(helpers, tmp_path):
    model = chain()
    amp = abt.apply(model, Policy(compute_dtype="float16", loss_scale={"mode": "dynamic", "min_scale": 1.0}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp.monitor(tmp_path / "run.jsonl", every=4):
        train(model, amp, opt, data(24), lambda i: helpers.big_weights(model[4], 1e6) if i in (5, 9, 10) else
              contextlib.nullcontext())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ampbridge.cli.commands.main(["report", str(tmp_path / "run.jsonl"), "--plot", str(tmp_path / "run.png")]) == 0
    text = out.getvalue()
    assert "run: torch, compute float16, 24 step(s) (steps 0-23), 9 in the log" in text  # not 21 (issue 23)
    assert "skipped steps: 3 (5, 9, 10)" in text
    assert "first layer to go non-finite, by steps: 4 (3)" in text
    assert "4      0.00%      3" in text  # steps non-finite: the 3 unsampled skipped steps count too
    assert '4 was the first layer to go non-finite on 3 step(s): pin it (keep_float32 = ["4"])' in text
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for record in read_log(tmp_path / "run.jsonl").steps:
        assert set(record) >= {"step", "loss", "loss_scale", "found_inf", "skipped", "first_nonfinite", "layers"}
        for stats in record["layers"].values():
            assert tuple(stats) == STAT_KEYS


def test_the_step_that_stops_the_run_is_logged(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    amp = abt.apply(model, Policy(compute_dtype="float16", loss_scale={
        "mode": "dynamic", "initial_scale": 1.0, "min_scale": 1.0, "on_min_scale": "error"}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp.monitor(tmp_path / "run.jsonl", every=10):
        with pytest.raises(ampbridge.LossScaleError, match="min_scale=1.0"):
            amp.step(model(torch.ones(1, 2)).sum() * float("inf"), opt)
    (step,) = read_log(tmp_path / "run.jsonl").steps
    assert step["found_inf"] and step["loss_scale"] == 1.0 and step["first_nonfinite"]["where"] == "loss"


def test_every_non_finite_step_has_layer_statistics_and_the_report_counts_both(helpers, tmp_path):
    """Two skipped steps, 4 (sampled) and 5 (not): both carry every layer's statistics, equal to
    those of an every=1 monitor on the same run, and `report` counts 2 per layer (issue 23)."""
    logs = {}
    for every in (1, 4):
        model = chain()
        amp = abt.apply(model, Policy(compute_dtype="float16", loss_scale={"mode": "dynamic", "min_scale": 1.0}))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with amp.monitor(tmp_path / f"run{every}.jsonl", every=every):
            applied = train(model, amp, opt, data(8), lambda i: helpers.big_weights(model[4], 1e6) if i in (4, 5) else
                            contextlib.nullcontext())
        assert applied == [True] * 4 + [False, False, True, True]
        logs[every] = by_step(read_log(tmp_path / f"run{every}.jsonl"))
    assert sorted(logs[4]) == [0, 4, 5]
    for step in (4, 5):
        assert repr(logs[4][step]["layers"]) == repr(logs[1][step]["layers"])  # repr: nan equals nan
        assert logs[4][step]["layers"]["4"]["nonfinite"] > 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ampbridge.cli.commands.main(["report", str(tmp_path / "run4.jsonl")]) == 0
    text = out.getvalue()
    assert "skipped steps: 2 (4, 5)" in text
    bad = [p for p, s in logs[4][5]["layers"].items() if s["nonfinite"] > 0]
    for path in bad:
        assert any(line.split()[:1] == [path] and line.split()[-1] == "2" for line in text.splitlines()), text
    assert "have no per-layer statistics" not in text
