"""``ampbridge.torch.tune`` (issue 41): a model with one layer whose outputs leave float16's range is
non-finite on every forward under ``mixed_float16``; tune pins that layer and what its float32
output needs next (found by re-running), the tuned policy trains 30 finite steps with a falling
loss, and the user's model, weights and RNG are untouched."""

from __future__ import annotations

import copy
import math

from ampbridge._testing import require

torch = require("torch")
pytest = require("pytest")

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn


class Scale(nn.Module):
    """Multiplies by 1e6: every output element is beyond float16's 65504."""

    def forward(self, x):
        return x * 1e6


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Scale(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():  # brings the 1e6-scaled values back to O(1): float32 trains fine
        model[2].weight.mul_(1e-6)
        model[2].bias.zero_()
    return model


def _data(n=4):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def _train(model, policy, data, steps):
    amp = abt.apply(model, policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, skipped = [], []
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        skipped.append(not amp.step(loss, opt))
        opt.zero_grad()
    return losses, skipped


def test_tune_pins_the_overflowing_layer_then_what_its_output_needs_next():
    model, data = _model(), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dtypes = {k: p.dtype for k, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    # under mixed_float16 every forward is non-finite
    losses, _ = _train(copy.deepcopy(model), "mixed_float16", data, 4)
    assert not any(math.isfinite(x) for x in losses)

    result = abt.tune(model, "mixed_float16", data, nn.functional.mse_loss, steps=8)

    # the first layer out of range ("1"), then the Linear its float32 output overflows when cast
    # to float16 ("2"); nothing else: the Tanh brings the values back
    assert result.added == ("1", "2")
    assert result.finite
    assert result.policy.compute_dtype == "float16"
    assert result.policy == ampbridge.preset("mixed_float16").replace(keep_float32=("1", "2"))
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    assert result.diff().splitlines() == ['-keep_float32 = []', '+keep_float32 = ["1", "2"]']
    assert result.evidence["1"].nonfinite == "output" and result.evidence["1"].pinned
    assert result.evidence["2"].nonfinite == "output" and not result.evidence["0"].pinned
    assert result.chosen.gap_after is not None and result.chosen.gap_after < 0.05
    assert "keep_float32" in str(result)

    # the user's model: same weights bit for bit, same dtypes, no hooks left, RNG as it was
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert {k: p.dtype for k, p in model.named_parameters()} == dtypes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), rng)

    # 30 steps with the tuned policy: finite, and the loss falls
    losses, skipped = _train(copy.deepcopy(model), result.policy, data, 30)
    assert all(math.isfinite(x) for x in losses)
    assert sum(skipped) < 10  # only the loss scale's first back-offs
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4


def test_tune_compares_compute_dtypes_and_says_why():
    model = nn.Sequential(nn.Linear(4, 8), Scale(), nn.LayerNorm(8), nn.Linear(8, 1))
    result = abt.tune(model, "mixed_float16", _data(), nn.functional.mse_loss, steps=4,
                      dtypes=("float16", "bfloat16"))
    by_dtype = {c.compute_dtype: c for c in result.candidates}
    assert by_dtype["float16"].added == ("1",) and by_dtype["float16"].finite
    assert by_dtype["bfloat16"].added == () and by_dtype["bfloat16"].finite  # bfloat16 holds 1e6
    assert result.policy.compute_dtype == "bfloat16"
    assert "fewer pins" in result.reason
    assert result.diff() == '-compute_dtype = "float16"\n+compute_dtype = "bfloat16"'


def test_tune_keeps_a_finite_policy_as_it_is():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    result = abt.tune(model, "mixed_float16", _data(), nn.functional.mse_loss, steps=3)
    assert result.added == () and result.diff() == "" and result.policy == ampbridge.preset("mixed_float16")


def test_tune_refuses_bad_arguments_by_name():
    model = nn.Sequential(nn.Linear(4, 1))
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        abt.tune(model, "mixed_float16", _data(), nn.functional.mse_loss, steps=0)
    with pytest.raises(ValueError, match="'int8' is not a compute dtype"):
        abt.tune(model, "mixed_float16", _data(), nn.functional.mse_loss, dtypes=("int8",))
    with pytest.raises(ValueError, match="at least one batch"):
        abt.tune(model, "mixed_float16", [], nn.functional.mse_loss)


OFFSET = 1000.0  # bfloat16 holds 1000 + s to the nearest 4: the signal s (std 1) is lost


def _offset_model():
    """A first Linear that removes a large offset from its inputs (weight I, bias -1000), then an MLP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.fill_(-OFFSET)
    return model


def _offset_data(n=4):
    """Inputs 1000 + s; targets the model's own float32 outputs on s, plus a term to learn."""
    g = torch.Generator().manual_seed(1)
    w, teacher = torch.randn(4, 1, generator=g), _offset_model()
    out = []
    for _ in range(n):
        s = torch.randn(16, 4, generator=g)
        with torch.no_grad():
            out.append((s + OFFSET, teacher[1:](s) + 0.3 * torch.tanh(s @ w)))
    return out


def test_tune_pins_the_layer_a_finite_run_diverges_at():
    """Finite but far off: under mixed_bfloat16 the offset layer's input loses its signal (every
    forward finite, no skipped step); tune pins that layer for the loss gap, and the gap falls under
    the tolerance. With the divergence step off (tries=0) nothing is pinned and the gap stays."""
    model, data = _offset_model(), _offset_data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = abt.tune(model, "mixed_bfloat16", data, nn.functional.mse_loss, steps=8)
    c = result.chosen
    assert c.finite and c.skipped == 0 and c.gap_before > 0.3  # far off: over 30% (measured 60%)
    assert result.added == ("0",) and result.evidence["0"].diverged and not result.evidence["1"].pinned
    assert c.gap_after < 0.05 < c.gap_before and c.close  # under the default tolerance (measured 0.2%)
    assert result.policy == ampbridge.preset("mixed_bfloat16").replace(keep_float32=("0",))
    assert "within the tolerance" in result.reason
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # a tolerance the run already meets: nothing to pin
    loose = abt.tune(model, "mixed_bfloat16", data, nn.functional.mse_loss, steps=8, tolerance=0.9)
    assert loose.added == () and loose.chosen.close


def test_a_tolerance_of_zero_pins_until_the_run_is_the_reference():
    # every bfloat16 layer rounds: each pin lowers the gap, and with both Linears pinned the run is float32
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    result = abt.tune(model, "mixed_bfloat16", _data(), nn.functional.mse_loss, steps=3, tolerance=0.0)
    assert sorted(result.added) == ["0", "2"] and result.chosen.gap_before > 0
    assert result.chosen.gap_after == 0.0 and result.chosen.close


def test_tune_on_a_schedule_pins_in_the_phase_the_steps_run_in():
    policy = ampbridge.loads('extends = "mixed_float16"\n[[phase]]\nuntil_step = 50\n'
                             '[[phase]]\ncompute_dtype = "bfloat16"\n')
    result = abt.tune(_model(), policy, _data(), nn.functional.mse_loss, steps=4)
    assert result.added == ("1", "2") and result.policy.phases[0].policy.keep_float32 == ("1", "2")
    assert result.policy.phases[1] == policy.phases[1]  # the bfloat16 phase as it was
    assert ampbridge.loads(ampbridge.dumps(result.policy)) == result.policy
    with pytest.raises(ValueError, match="cross the \\[\\[phase\\]\\] bound at step 50"):
        abt.tune(_model(), policy, _data(), nn.functional.mse_loss, steps=60)
