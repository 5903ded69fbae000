"""The torch monitor's float8 records: torchao ``Float8Linear`` (current scaling, through ``[fp8]``)
gets hooks on the recorded steps only, and the logged amax and scale are torchao's own
(``tensor_to_amax`` of the tensor as torchao casts it, ``amax_to_scale``); delayed-scaling modules
with public buffers are read from them."""

import pytest

import ampbridge._testing
from ampbridge import Fp8Config, Policy
from ampbridge.diagnostics.report import format_summary, summarize
from ampbridge.diagnostics.runlog import read_log

torch = ampbridge._testing.require("torch")
ampbridge._testing.require("torchao.float8", "the [fp8] table on torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch.fp8_stats import delayed_stats  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402

nn = torch.nn
CURRENT = Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), scaling="current"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.head = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("autocast_cast", [False, True])
def test_torchao_amax_and_scale_are_torchaos_own_on_recorded_steps_only(tmp_path, monkeypatch, autocast_cast):
    import torchao.float8.float8_scaling_utils as scaling

    used = {}  # per step: (float8 dtype, amax, scale) of every cast torchao itself scaled
    native = scaling.tensor_to_scale

    def tensor_to_scale(x, float8_dtype, *args, **kwargs):
        scale = native(x, float8_dtype, *args, **kwargs)
        used.setdefault(step, set()).add((float8_dtype, torch.max(torch.abs(x)).float().item(), scale.item()))
        return scale

    monkeypatch.setattr(scaling, "tensor_to_scale", tensor_to_scale)
    if autocast_cast:  # Float8Linear casts its input where torch.is_autocast_enabled() (CUDA's) says so
        enabled = torch.is_autocast_enabled
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a, **k: True if not (a or k) else enabled(*a, **k))
    step = -1
    torch.manual_seed(0)
    amp = abt.apply(Net(), CURRENT)
    float8 = {p: m for p, m in amp.model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert set(float8) == {"fc1", "head"}
    seen = {}  # per step, per layer: (input as torchao gets it, weight, grad_output), by torchao's own hooks

    def watch(path, module, args, out):
        x = args[0].to(torch.get_autocast_dtype("cuda")) if torch.is_autocast_enabled() else args[0]
        seen.setdefault(step, {})[path] = [x.detach().clone(), module.weight.detach().clone(), None]
        out.register_hook(lambda g: seen[step][path].__setitem__(2, g.detach().clone()))

    for p, m in float8.items():
        m.register_forward_hook(lambda m, a, o, p=p: watch(p, m, a, o))
    opt = torch.optim.SGD(amp.model.parameters(), lr=1e-4)
    path = tmp_path / "run.jsonl"
    g = torch.Generator().manual_seed(1)
    with amp.monitor(path, every=2) as monitor:
        for step in range(5):
            before = sum(getattr(getattr(h, "func", None), "__qualname__", "") == "CurrentScalingProbe._forward"
                         for m in float8.values() for h in m._forward_hooks.values())
            with amp.autocast():
                out = amp.model(torch.randn(8, 16, generator=g) * (100.0 if step == 2 else 1.0))
            amp.step(((out.float() - 1) ** 2).mean(), opt)
            # the monitor's float8 hooks are there only on a recorded step (0, 2, 4): one per layer
            assert before == (2 if step % 2 == 0 else 0), (step, before)
    assert monitor._fp8_probe is None
    log = read_log(path)
    assert [s["step"] for s in log.steps] == [0, 2, 4]
    for s in log.steps:
        for layer in ("fc1", "head"):
            for name, tensor, dtype in zip(("input", "weight", "grad_output"), seen[s["step"]][layer],
                                           (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)):
                t = s["fp8"][layer][name]
                assert tensor is not None, (s["step"], layer, name, t)
                amax = torch.max(torch.abs(tensor))  # torchao's tensor_to_amax
                assert t["amax"] == amax.float().item(), (s["step"], layer, name)
                assert t["scale"] == amax_to_scale(amax, dtype).item(), (s["step"], layer, name)
                assert t["scale_op"] == "multiply"
                assert (dtype, t["amax"], t["scale"]) in used[s["step"]]  # what torchao scaled with
                scaled = (tensor.float().abs().max() * amax_to_scale(amax, dtype)).item()
                assert t["saturated"] == (scaled > torch.finfo(dtype).max), (s["step"], layer, name)
    text = format_summary(summarize(log))
    assert "float8 layers" in text and "* " in text  # current scaling: a spike is scaled by its own amax
    assert "saturated float8" not in text


def test_delayed_buffers_are_read():
    lin = nn.Linear(4, 4)
    for i, name in enumerate(("input", "weight", "grad_output")):
        lin.register_buffer(f"{name}_divisor", torch.tensor(0.01 * (i + 1)))
        lin.register_buffer(f"{name}_amax_history", torch.tensor([5.0 * (i + 1), 1.0, 2.0]))
    stats = delayed_stats(lin)
    assert [(s.amax, s.scale) for s in stats.values()] == [
        (5.0, torch.tensor(0.01).item()), (10.0, torch.tensor(0.02).item()), (15.0, torch.tensor(0.03).item())]
    assert [s.saturated for s in stats.values()] == [True, True, False]  # 500, 500 > 448; 500 < 57344


def test_an_unrecorded_step_dispatches_the_ops_of_a_step_without_a_monitor(tmp_path):
    """every=4: steps 1 and 2 run no float8 hook; their aten ops (syncs and casts included) are the
    unmonitored model's, op for op."""
    import copy

    from ampbridge._testing import aten_op_counts

    torch.manual_seed(0)
    base = Net()
    amps = [abt.apply(copy.deepcopy(base), CURRENT) for _ in range(2)]
    opts = [torch.optim.SGD(a.model.parameters(), lr=1e-4) for a in amps]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    counts = [[], []]
    with amps[1].monitor(tmp_path / "run.jsonl", every=4):
        for step in range(3):
            for k, (amp, opt) in enumerate(zip(amps, opts)):
                with aten_op_counts() as ops:
                    with amp.autocast():
                        out = amp.model(x)
                    amp.step(((out.float() - 1) ** 2).mean(), opt)
                counts[k].append(ops)
    assert counts[1][0] != counts[0][0]  # step 0 is recorded: the float8 amaxes (and the statistics) cost ops
    assert counts[1][1:] == counts[0][1:]  # steps 1 and 2: nothing more
    assert counts[0][1]["aten.abs.default"] > 0  # torchao's own amaxes are counted there too
