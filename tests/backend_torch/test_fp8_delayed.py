"""FP8 delayed scaling on torch (ampbridge's own ``DelayedFloat8Linear``: torchao has none), held to the
reference ``core.fp8.delayed_step`` (torch computes with subnormals: ``flush_denormals=False``); Flax's
``fp8_ops`` is compared in tests/parity/test_fp8_conformance.py. Here: the input and output-gradient
scale trajectories over random amax sequences and settings, the output gradient's format, a resume
from a ``state_dict`` checkpoint, parameters and optimizers, phases and the Plan row."""

import copy
import io
import math
import os
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ampbridge
import ampbridge._testing
from ampbridge import Fp8Config, Policy
from ampbridge.core.fp8 import FP8_MAX, delayed_trajectory

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch.fp8_delayed import DelayedFloat8Linear  # noqa: E402

nn = torch.nn
EXAMPLES = 1000 if os.environ.get("AMPBRIDGE_FUZZ") else 100
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DELAYED = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), amax_history=4))
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

AMAX = (st.floats(0.0, 3.4028234663852886e38, width=32)
        | st.sampled_from([0.0, 1e-45, 1e-40, 2.0 ** -126, math.inf, math.nan, 448.0, 57344.0]))


def _same(a, b) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _layer(history, **kw):
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    return DelayedFloat8Linear.from_linear(lin, amax_history=history, **kw)


def _ref_qdq(x: float, divisor: float, fmt: str) -> float:
    """The float8 round trip written out once more (torch's own casts, not the module's helper)."""
    top = FP8_MAX[fmt]
    d = torch.tensor(divisor, dtype=torch.float32)
    return ((torch.tensor(x, dtype=torch.float32) / d).clamp(-top, top).to(DTYPES[fmt]).float() * d).item()


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(AMAX, min_size=1, max_size=10), st.integers(1, 6), st.integers(0, 3),
       st.sampled_from(["max", "most_recent"]), st.sampled_from(["e4m3", "e5m2"]), st.booleans())
@example([1.0, 1000.0, 1.0, 1.0, 1.0], 3, 0, "max", "e4m3", False)  # the spike leaves the history
def test_the_input_scale_trajectory_is_the_reference(amaxes, history, margin, amax_compute, fmt, negative):
    layer = _layer(history, forward=fmt, margin=margin, amax_compute=amax_compute)
    ref = delayed_trajectory(amaxes, fmt, history, margin=margin, amax_compute=amax_compute, flush_denormals=False)
    for t, (a, r) in enumerate(zip(amaxes, ref)):
        layer(torch.tensor([[-a if negative else a]], dtype=torch.float32))
        assert _same(layer.input_divisor.item(), r.divisor), (t, layer.input_divisor, r)
        assert all(map(_same, layer.input_amax_history.tolist(), r.history)), (t, layer.input_amax_history, r)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, 3e-3, -70000.0]), min_size=1, max_size=8),
       st.integers(1, 4), st.integers(0, 2), st.sampled_from(["e4m3", "e5m2"]))
def test_the_output_gradient_is_scaled_in_the_backward_format(grads, history, margin, backward):
    """The output gradient's divisor follows the reference in the ``backward`` format, and the weight's
    gradient is the float8 gradient (quantized with this step's divisor) times the float8 input."""
    layer = _layer(history, backward=backward, margin=margin)
    ref_g = delayed_trajectory([abs(g) for g in grads], backward, history, margin=margin, flush_denormals=False)
    ref_x = delayed_trajectory([1.0] * len(grads), "e4m3", history, margin=margin, flush_denormals=False)
    for t, g in enumerate(grads):
        layer.weight.grad = None
        layer(torch.ones(1, 1)).backward(torch.tensor([[g]]))
        assert layer.grad_output_divisor.item() == ref_g[t].divisor, (t, layer.grad_output_divisor, ref_g[t])
        assert layer.grad_output_amax_history.tolist() == list(ref_g[t].history)
        expected = torch.tensor(_ref_qdq(g, ref_g[t].divisor, backward)) * torch.tensor(_ref_qdq(1.0, ref_x[t].divisor,
                                                                                              "e4m3"))
        assert _same(layer.weight.grad.item(), expected.item()), (t, g, layer.weight.grad, expected)
    assert layer.input_amax_history.tolist()[0] == 1.0  # the forward state moved too, once a step


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def _data(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g) * 2, torch.randn(4, 4, generator=g)) for _ in range(n)]


def _train(amp, opt, data):
    losses = []
    for x, y in data:
        with amp.autocast():
            out = amp.model(x)
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        amp.step(loss, opt)
        losses.append(loss.item())
    return losses


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_resume_from_a_state_dict_continues_bit_identically():
    torch.manual_seed(0)
    data, base = _data(10), Net()
    whole = copy.deepcopy(base)
    amp = abt.apply(whole, DELAYED)
    expected = _train(amp, torch.optim.Adam(whole.parameters(), lr=1e-2), data)

    first = copy.deepcopy(base)
    amp = abt.apply(first, DELAYED)
    opt = torch.optim.Adam(first.parameters(), lr=1e-2)
    losses = _train(amp, opt, data[:6])  # 6 steps: the 4-entry histories have wrapped
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert "fc1.grad_output_amax_history" in saved["model"] and saved["model"]["fc1.input_divisor"].item() != 1.0

    fresh = Net()  # other initial weights: everything must come from the checkpoint
    amp = abt.apply(fresh, DELAYED)
    fresh.load_state_dict(saved["model"])
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    losses += _train(amp, opt, data[6:])
    assert losses == expected
    got, want = _state(fresh), _state(whole)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_the_parameters_stay_the_optimizers_and_move():
    torch.manual_seed(0)
    model = Net()
    weight, opt = model.fc1.weight, torch.optim.SGD(model.parameters(), lr=0.1)  # built before apply
    before = weight.detach().clone()
    amp = abt.apply(model, DELAYED)
    assert isinstance(model.fc1, DelayedFloat8Linear) and model.fc1.weight is weight
    assert type(model.norm) is nn.LayerNorm
    losses = _train(amp, opt, _data(1) * 8)  # one batch: the loss must fall
    assert not torch.equal(weight, before) and losses[-1] < losses[0]
    assert amp.plan["fc1"].fp8_by == "ampbridge delayed scaling (emulated)" and amp.plan["fc1"].fp8_scaling == "delayed"
    assert "realised by ampbridge delayed scaling (emulated)" in abt.plan(Net(), DELAYED).table()
    # float8 really changed the numbers: plain bfloat16 autocast trains differently
    torch.manual_seed(0)
    plain = Net()
    assert _train(abt.apply(plain, "mixed_bfloat16"), torch.optim.SGD(plain.parameters(), lr=0.1), _data(1) * 8) != losses


def test_eval_and_no_grad_forwards_store_nothing():
    layer = _layer(2)
    layer(torch.tensor([[3.0]]))  # training: recorded
    state = _state(layer)
    with torch.no_grad():
        layer(torch.tensor([[5.0]]))
    layer.eval()
    out = layer(torch.tensor([[5.0]]))
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())
    # quantized with the divisor step 2 would compute (from the history [3, 0]), as Flax's in_q does
    d_x = delayed_trajectory([3.0, 5.0], "e4m3", 2, flush_denormals=False)[1].divisor
    d_w = delayed_trajectory([1.0, 1.0], "e4m3", 2, flush_denormals=False)[1].divisor
    assert d_x != 1.0 and out.item() == (torch.tensor(_ref_qdq(5.0, d_x, "e4m3")) * _ref_qdq(1.0, d_w, "e4m3")).item()


def test_a_phase_turns_delayed_fp8_on_and_off_keeping_state_while_unchanged():
    torch.manual_seed(0)
    model = Net()
    fp8 = '[phase.fp8]\nmatch = ["kind:linear"]\namax_history = 8\n'
    policy = ampbridge.loads('compute_dtype = "bf16"\n[[phase]]\nuntil_step = 2\n'
                             f'[[phase]]\nuntil_step = 4\n{fp8}'
                             f'[[phase]]\nuntil_step = 5\ncompute_dtype = "float32"\n{fp8}'  # fp8 unchanged
                             f'[[phase]]\n{fp8}margin = 2\n')
    amp = abt.apply(model, policy)
    weight, kinds, histories = model.fc1.weight, [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(7):
        kinds.append(type(model.fc1).__name__)
        histories.append(getattr(model.fc1, "input_amax_history", torch.zeros(8)).tolist())
        _train(amp, opt, [(x, y)])
    assert kinds == ["Linear", "Linear"] + ["DelayedFloat8Linear"] * 5
    assert histories[4][-1] == histories[3][0] != 0.0 and histories[4][0] != 0.0  # step 4: kept, rolled on
    assert histories[5] == [0.0] * 8 and model.fc1.margin == 2  # step 5: a new margin, fresh state
    assert model.fc1.weight is weight
    amp.set_step(0)
    assert type(model.fc1) is nn.Linear and model.fc1.weight is weight


def test_delayed_fp8_does_not_need_torchao():
    code = ("import sys, torch, ampbridge, ampbridge.torch as abt; m = torch.nn.Sequential(torch.nn.Linear(2, 2)); "
            "abt.apply(m, ampbridge.Policy(fp8=ampbridge.Fp8Config(['kind:linear']))); m(torch.ones(1, 2)); "
            "assert 'torchao' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_product_is_float32_on_dequantised_values_rounded_to_the_autocast_dtype():
    """As torchao's emulate=True: float32 products of the float8 values, the output in the autocast dtype;
    the operands enter in the autocast dtype (their amaxes are Keras's and Flax's, whose layers cast first)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(32, 16), torch.randn(8, 32) * 3
    layer = DelayedFloat8Linear.from_linear(copy.deepcopy(lin), amax_history=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        out = layer(x * 2)  # step 2: divisors from step 1's amaxes

    def fp8(t, d):
        return (t / d).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * d

    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    assert layer.input_amax_history[0] == bf16(x * 2).abs().max() != (x * 2).abs().max()
    xq, wq = fp8(bf16(x * 2), layer.input_divisor), fp8(bf16(lin.weight.detach()), layer.weight_divisor)
    expected = (xq @ wq.t()).to(torch.bfloat16) + lin.bias.detach().to(torch.bfloat16)
    assert layer.input_divisor.item() != 1.0 and out.dtype == torch.bfloat16 and torch.equal(out, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(out, torch.nn.functional.linear(xq, wq) + lin.bias.detach().to(torch.bfloat16))


def test_a_state_cast_away_from_float32_is_refused_by_name():
    layer = _layer(2).to(torch.bfloat16)
    with pytest.raises(TypeError, match="input_divisor/input_amax_history of a DelayedFloat8Linear are torch.bfloat16"):
        layer(torch.ones(1, 1, dtype=torch.bfloat16))


def test_the_modules_examples_run():
    import doctest

    from ampbridge.backends.torch import fp8_delayed

    assert doctest.testmod(fp8_delayed).failed == 0
