"""amp.monitor between samples (issue 24): an unsampled step dispatches exactly the aten ops, casts
and host syncs of a step without a monitor; a non-finite step is attributed by replaying it (same
inputs, same RNG), and the replay leaves training bit-identical."""

import contextlib
import warnings

import pytest

import ampbridge
import ampbridge._testing
from ampbridge.diagnostics.runlog import read_log

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn


class GradBoom(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e30 (inf in float16)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1e30


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return GradBoom.apply(x) if self.armed else x


def chain():
    """Linear, ReLU, Dropout, Linear, Boom, Linear, ReLU, Linear (paths 0..7)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 16), Boom(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def loss_fn(out, y):
    return 0.05 * (out.float() - y).square().mean()


@contextlib.contextmanager
def armed(boom):
    boom.armed = True
    try:
        yield
    finally:
        boom.armed = False


OPTIMIZERS = {"SGD": lambda p: torch.optim.SGD(p, lr=0.01),
              "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),  # for-loop Adam (CPU default)
              # no host sync: on the CPU device the monitor reads found_inf from host memory
              "fused AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_an_unsampled_step_dispatches_what_a_step_without_a_monitor_dispatches(optimizer, counter, tmp_path):
    """every=100: steps 1..5 against the same steps without a monitor, aten op by aten op
    (casts = _to_copy, host syncs = _local_scalar_dense); then a non-finite step (6, from the
    backward) and a finite one (7) still come out attributed, and unsampled again after it."""
    ops = {}
    for monitored in (False, True):
        model = chain()
        amp = abt.apply(model, "mixed_float16")
        opt = OPTIMIZERS[optimizer](model.parameters())
        monitor = amp.monitor(tmp_path / "run.jsonl", every=100) if monitored else None
        per_step = []
        for i, (x, y) in enumerate(data(9)):
            with armed(model[4]) if i == 6 else contextlib.nullcontext(), counter() as c:
                result = amp.step(loss_fn(model(x), y), opt)
            opt.zero_grad()
            assert bool(result) == (i != 6)  # (read outside the count: a fused step's result reads its flag)
            per_step.append(c.ops)
        if monitor is not None:
            monitor.close()
        ops[monitored] = per_step
    for i in (1, 2, 3, 4, 5, 7, 8):  # step 0: sampled (and probed: the monitor learns its case)
        assert ops[True][i] == ops[False][i], i
    plain = ops[False][1]
    assert plain["_to_copy"] > 0  # the counts are not vacuous
    if optimizer == "fused AdamW":  # no sync without a monitor, none with one
        assert plain["_local_scalar_dense"] == 0
    else:  # the scaler's read (and the for-loop Adam's step counters)
        assert plain["_local_scalar_dense"] >= 1
    assert sum(ops[True][0].values()) > sum(ops[False][0].values())  # a sampled step does read statistics
    steps = {s["step"]: s for s in read_log(tmp_path / "run.jsonl").steps}
    assert sorted(steps) == [0, 6]
    assert steps[6]["first_nonfinite"] == {"path": "4", "where": "gradient"}
    assert steps[6]["layers"]["0"]["nonfinite"] > 0 and steps[6]["layers"]["7"]["nonfinite"] == 0


def test_the_replay_sees_the_step_s_dropout_mask_and_training_is_bit_identical(helpers, tmp_path):
    """Forward overflows at steps 4 and 5 (unsampled): each replay's dropout draws its step's own
    mask (its output equals the original's), the layer is named, and losses and parameters after
    8 steps equal those of the run without a monitor (RNG and buffers restored after a replay)."""
    runs = []
    for monitored in (False, True):
        model = chain()
        model.insert(1, nn.BatchNorm1d(16))  # a buffer the replay's forward moves: restored
        amp = abt.apply(model, "mixed_float16")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        drops = []
        model[3].register_forward_hook(lambda m, a, out: drops.append(out.detach().clone()))
        monitor = amp.monitor(tmp_path / "run.jsonl", every=100) if monitored else None
        losses = []
        for i, (x, y) in enumerate(data(8)):
            with helpers.big_weights(model[4], 1e5) if i in (4, 5) else contextlib.nullcontext():
                loss = loss_fn(model(x), y)
                assert bool(amp.step(loss, opt)) == (i not in (4, 5))
            opt.zero_grad()
            losses.append(loss.item())
        if monitor is not None:
            monitor.close()
        runs.append((losses, [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())], drops))
    (losses0, state0, drops0), (losses1, state1, drops1) = runs
    assert repr(losses0) == repr(losses1)  # repr: the skipped step's nan equals nan
    assert all(torch.equal(a, b) for a, b in zip(state0, state1))
    assert len(drops1) == len(drops0) + 2  # steps 4 and 5 ran the dropout twice: the step, its replay
    assert torch.equal(drops1[4], drops1[5]) and torch.equal(drops1[4], drops0[4])
    assert torch.equal(drops1[6], drops1[7]) and torch.equal(drops1[6], drops0[5])
    assert not torch.equal(drops0[3], drops0[4])  # masks differ per step: the equality is not vacuous
    steps = {s["step"]: s for s in read_log(tmp_path / "run.jsonl").steps}
    assert sorted(steps) == [0, 4, 5]
    for k in (4, 5):
        assert steps[k]["first_nonfinite"] == {"path": "4", "where": "output"}
        assert steps[k]["layers"]["4"]["nonfinite"] > 0


def test_a_model_returning_its_loss_in_a_mapping_with_accumulation_is_replayed(tmp_path):
    """The loss inside the model's output (as a transformers model returns it), two micro-batches
    per step (both forwards replayed), the overflow in the second one's backward."""
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = chain()

        def forward(self, x, labels):
            out = self.net(x)
            return {"logits": out, "loss": loss_fn(out, labels)}

    model = WithLoss()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp.monitor(tmp_path / "run.jsonl", every=100):
        for i, (x, y) in enumerate(data(8)):
            with armed(model.net[4]) if i == 5 else contextlib.nullcontext():
                result = amp.step(model(x, labels=y)["loss"], opt, accumulate=2)
            if not result.accumulating:
                opt.zero_grad()
    steps = {s["step"]: s for s in read_log(tmp_path / "run.jsonl").steps}
    assert sorted(steps) == [0, 2]  # micro-batch 5 is in optimizer step 2
    assert steps[2]["skipped"] and steps[2]["first_nonfinite"] == {"path": "net.4", "where": "gradient"}


def test_a_step_that_cannot_be_replayed_falls_back_to_the_parameter_gradients(tmp_path):
    """The caller changed the input in place after the forward: the replay's forward fails (a
    wrong shape here); the monitor warns once, by name, and attributes from the gradients."""
    model = chain()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp.monitor(tmp_path / "run.jsonl", every=100), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data(3)):
            with armed(model[4]) if i == 2 else contextlib.nullcontext():
                loss = loss_fn(model(x), y)
                x.resize_(4, 3)  # the recorded input no longer fits the model
                assert bool(amp.step(loss, opt)) == (i != 2)
            opt.zero_grad()
    (warning,) = [w for w in caught if issubclass(w.category, ampbridge.errors.AmpBridgeWarning)]
    assert "could not replay the non-finite step" in str(warning.message)
    step = {s["step"]: s for s in read_log(tmp_path / "run.jsonl").steps}[2]
    assert step["first_nonfinite"] == {"path": "3", "where": "gradient"}  # Linear 3's weight gradient


def test_outputs_from_one_autograd_node_keep_their_own_gradients(tmp_path):
    """Two unequal pieces of one split (one autograd node, outputs 0 and 1) and a parameter handed
    back as is (a leaf): the replay seeds each with its own recorded gradient (a mix-up would not
    even fit the shapes, and would warn) and names the layer whose gradient overflowed."""
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = chain()[:7]  # up to the ReLU: 16 features
            self.bias = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            small, large = self.net(x).float().split([4, 12], dim=-1)  # float32: no output cast after it
            return small, large, self.bias

    model = Split()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp.monitor(tmp_path / "run.jsonl", every=100), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data(4)):
            with armed(model.net[4]) if i == 2 else contextlib.nullcontext():
                small, large, bias = model(x)
                loss = 0.05 * (small.float().sum(-1, keepdim=True) - y).square().mean() \
                    + 0.01 * large.float().square().mean() + bias.square().sum()
                assert bool(amp.step(loss, opt)) == (i != 2)
            opt.zero_grad()
    assert not [w for w in caught if issubclass(w.category, ampbridge.errors.AmpBridgeWarning)]
    step = {s["step"]: s for s in read_log(tmp_path / "run.jsonl").steps}[2]
    assert step["skipped"] and step["first_nonfinite"] == {"path": "net.4", "where": "gradient"}
