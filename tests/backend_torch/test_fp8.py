"""FP8 on torch: ``[fp8] scaling = "current"`` against torchao's own ``convert_to_float8_training``
(emulate=True) under ``torch.autocast(bfloat16)``, the scale against torchao's ``amax_to_scale``,
and what torch refuses by name."""

import copy
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ampbridge
import ampbridge._testing
from ampbridge import Fp8Config, Policy
from ampbridge.core.fp8 import current_scale

torch = ampbridge._testing.require("torch")
torchao_float8 = ampbridge._testing.require("torchao.float8", "the [fp8] table on torch")
import ampbridge.torch as abt  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402

nn = torch.nn
EXAMPLES = 2000 if os.environ.get("AMPBRIDGE_FUZZ") else 150
CURRENT = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), scaling="current"))


class Net(nn.Module):
    """Linear dims multiples of 16 (what float8 kernels need), a norm between them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm = nn.Linear(32, 48), nn.LayerNorm(48)
        self.fc2, self.head = nn.Linear(48, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(self.norm(torch.relu(self.fc1(x))))))


def batches(n=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g) * 3, torch.randn(16, 16, generator=g)) for _ in range(n)]


def train_native(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_ampbridge(model, policy, data):
    amp = abt.apply(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        with amp.autocast():
            out = amp.model(x)
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        amp.step(loss, opt)
        losses.append(loss.item())
    return amp, losses


@pytest.mark.parametrize("match,native_fqns", [(("kind:linear",), None), (("fc2",), {"fc2"})])
def test_current_scaling_trains_bit_identical_to_torchaos_conversion(match, native_fqns):
    torch.manual_seed(0)
    base, data = Net(), batches(8)
    native = copy.deepcopy(base)
    convert_to_float8_training(native, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=None if native_fqns is None else lambda m, fqn: fqn in native_fqns)
    expected = train_native(native, data)
    mine = copy.deepcopy(base)
    amp, got = train_ampbridge(mine, CURRENT.replace(fp8=CURRENT.fp8.replace(match=match)), data)
    assert got == expected
    for (name, p), (_, q) in zip(mine.named_parameters(), native.named_parameters()):
        assert torch.equal(p, q), name
    converted = {path for path, m in mine.named_modules() if isinstance(m, Float8Linear)}
    assert converted == (native_fqns or {"fc1", "fc2", "head"})
    assert {r.path for r in amp.plan if r.fp8} == converted
    assert amp.plan["fc2"].fp8_by == "torchao Float8Linear (emulated)" and amp.plan["fc2"].fp8_scaling == "current"
    # and float8 really changed the numbers: plain autocast trains differently
    plain = copy.deepcopy(base)
    assert train_native(plain, data) != expected


def test_pins_win_over_the_fp8_match():
    torch.manual_seed(0)
    model = Net()
    amp = abt.apply(model, CURRENT.replace(keep_float32=("head",)))
    assert not isinstance(model.head, Float8Linear) and isinstance(model.fc1, Float8Linear)
    assert not amp.plan["head"].fp8 and amp.plan["head"].compute_dtype == "float32"


def test_a_phase_turns_fp8_on_after_warm_up_and_the_parameters_stay_the_optimizers():
    torch.manual_seed(0)
    model = Net()
    policy = ampbridge.loads('compute_dtype = "bf16"\n[[phase]]\nuntil_step = 3\n'
                             '[[phase]]\n[phase.fp8]\nmatch = ["kind:linear"]\nscaling = "current"\n')
    amp = abt.apply(model, policy)
    weight = model.fc1.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kinds = []
    for x, y in batches(5):
        kinds.append(type(model.fc1).__name__)
        with amp.autocast():
            loss = ((amp.model(x) - y) ** 2).mean()
        opt.zero_grad()
        amp.step(loss, opt)
    assert kinds == ["Linear", "Linear", "Linear", "Float8Linear", "Float8Linear"]
    assert model.fc1.weight is weight and amp.plan["fc1"].fp8
    amp.set_step(0)  # back to the warm-up phase: plain Linear again, same parameters
    assert type(model.fc1) is nn.Linear and model.fc1.weight is weight


@pytest.mark.parametrize("fp8,says", [
    (Fp8Config(("norm",)), "'norm' (LayerNorm) in float8, but ampbridge's delayed scaling replaces"),
    (Fp8Config(("kind:linear",), scaling="current", margin=1), "fp8.margin = 1 is not realised on torch"),
    (Fp8Config(("norm",), scaling="current"), "'norm' (LayerNorm) in float8, but torchao converts"),
    (Fp8Config(("type:Net",), scaling="current"), "fp8.match matches the model itself"),
])
def test_what_torchao_cannot_carry_is_refused_by_name(fp8, says):
    model = Net()
    with pytest.raises(ampbridge.UnsupportedOptionError, match=says.replace("(", r"\(").replace(")", r"\)")):
        abt.apply(model, Policy(compute_dtype="bfloat16", fp8=fp8))
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.head))  # refused before any change


def test_a_policy_without_fp8_does_not_import_torchao():
    code = ("import sys, torch, ampbridge.torch as abt; abt.apply(torch.nn.Linear(2, 2), 'mixed_bfloat16'); "
            "assert 'torchao' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_static_plan_says_what_apply_will_run():
    plan = abt.plan(Net(), CURRENT)
    assert [r.path for r in plan if r.fp8] == ["fc1", "fc2", "head"]
    assert "realised by torchao Float8Linear (emulated)" in plan.table()


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.floats(0.0, 3.4028234663852886e38, width=32) | st.sampled_from([0.0, 1e-45, math.inf]),
       st.sampled_from(["e4m3", "e5m2"]))
def test_the_reference_current_scale_is_torchaos_amax_to_scale(amax, fmt):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    native = amax_to_scale(torch.tensor(amax, dtype=torch.float32), dtype).item()
    assert current_scale(amax, fmt) == native
