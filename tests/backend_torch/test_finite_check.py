"""The finite check over every leaf shape, order and position: a non-finite gradient anywhere skips the step.

For each of 18 of the 120 orders of the leaf shapes ``()``, ``(1,)``, ``(0,)``, ``(3,)``, ``(2, 2)``, inf and
NaN in each non-empty leaf, with SGD (momentum) in its foreach, for-loop and fused forms, bfloat16 and
float32 parameters: ``amp.step`` skips, the parameters and optimizer state stay as they were, the scale
backs off. (torch's own ``_amp_foreach_non_finite_check_and_unscale_`` is the check; ampbridge's scaler
and monitor read its flag. The fuzzer, test_fuzz_loss_scale.py, draws the other orders.)
"""

from __future__ import annotations

import itertools
import math

import pytest

from ampbridge._testing import require

torch = require("torch")

import ampbridge.torch as at  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402

SHAPES = [(), (1,), (0,), (3,), (2, 2)]
ORDERS = list(itertools.permutations(SHAPES))[::7]


class Leaves(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"l{i}", torch.nn.Parameter(torch.full(shape, 0.5)))

    def forward(self, x):
        return x


@pytest.mark.parametrize("impl", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "forloop", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_nonempty_leaf_position_skips(impl, dtype):
    for order in ORDERS:
        model = Leaves(order)
        policy = Policy(compute_dtype="float16", param_dtype=dtype,
                        loss_scale=LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=1000))
        amp = at.apply(model, policy, device_type="cpu")
        params = list(model.parameters())
        assert all(p.dtype == getattr(torch, dtype) for p in params)
        opt = torch.optim.SGD(params, lr=0.25, momentum=0.5, **impl)
        # one finite step first, so the momentum buffers exist and a skip must leave them alone too
        assert amp.step(sum((p.float() * 0.25).sum() for p in params), opt)
        opt.zero_grad()
        for bad_leaf, shape in enumerate(order):
            if not math.prod(shape):
                continue
            for bad in (math.inf, math.nan):
                before = [p.detach().clone() for p in params]
                state = [t.clone() for p in params for t in opt.state[p].values()]
                scale = amp.scaler.get_scale()
                g = [torch.full(p.shape, 0.25) for p in params]
                g[bad_leaf].view(-1)[-1] = bad
                result = amp.step(sum((p.float() * x).sum() for p, x in zip(params, g)), opt)
                opt.zero_grad()
                where = (order, bad_leaf, bad, impl, dtype)
                assert not result, where
                assert amp.scaler.get_scale() == scale / 2, where
                assert all(torch.equal(a, b) for a, b in zip(params, before)), where
                assert all(torch.equal(a, b) for a, b in
                           zip([t for p in params for t in opt.state[p].values()], state)), where
                assert all(bool(torch.isfinite(p).all()) for p in params), where


def test_monitor_without_a_scaler_flag_finds_only_non_finite_gradients(tmp_path):
    """Mode none without skipping (the scaler checks nothing): the monitor's own check. inf or NaN in
    any leaf is found; large finite gradients are not, even in a float32 accumulator (mps's: the
    check summed the extremes there, which overflowed to inf on two gradients of 2e38)."""
    from ampbridge.diagnostics.runlog import read_log

    shapes = [(3,), (), (0,), (2, 2)]
    model = Leaves(shapes)
    amp = at.apply(model, Policy(loss_scale=LossScaleConfig(mode="none", skip_nonfinite=False)), device_type="cpu")
    assert not amp.scaler._enabled
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    cases = [None, (0, math.inf), (1, math.nan), (3, -math.inf), "large", None]
    with amp.monitor(tmp_path / "run.jsonl", every=1, attribution=False) as monitor:
        monitor._acc = torch.float32  # the accumulator mps uses (no float64 there)
        for case in cases:
            g = [torch.full(s, 0.25) for s in shapes]
            if case == "large":
                g = [torch.full(s, 2.0e38) for s in shapes]
            elif case is not None:
                g[case[0]].view(-1)[-1] = case[1]
            amp.step(sum((p * x).sum() for p, x in zip(params, g)), opt)
            opt.zero_grad()
    records = [r for r in read_log(tmp_path / "run.jsonl").steps]
    found = {r["step"]: r["found_inf"] for r in records}
    assert found == {n: case not in (None, "large") for n, case in enumerate(cases)}
