"""apply(): what it accepts, what it refuses (clearly), and the scope of its settings."""

import copy
import logging
import pickle

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import Policy, Rule, UnsupportedOptionError

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch import environment as torch_env  # noqa: E402
from ampbridge.backends.torch import forward as torch_forward  # noqa: E402

nn = torch.nn


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_policy_as_object_preset_name_or_file(tmp_path):
    path = tmp_path / "amp.toml"
    path.write_text('compute_dtype = "bf16"\nkeep_float32 = ["kind:norm"]\n')
    assert abt.apply(small(), str(path)).plan["1"].compute_dtype == "float32"
    assert abt.apply(small(), path).plan["0"].compute_dtype == "bfloat16"
    assert abt.apply(small(), "mixed_float16").scaler.config.mode == "dynamic"
    with pytest.raises(TypeError, match="preset name .* or a policy file path; received 3"):
        abt.apply(small(), 3)
    with pytest.raises(ampbridge.PolicyError):
        abt.apply(small(), "mixed_flaot16")  # neither a preset nor a file


def test_applying_twice_is_an_error_and_remove_undoes_it():
    model = small()
    amp = abt.apply(model, "bfloat16")
    assert model[0].weight.dtype == torch.bfloat16
    with pytest.raises(abt.ModelNotSupportedError, match="already applied .* amp.remove"):
        abt.apply(model, "mixed_float16")
    outer = nn.Sequential(model)
    with pytest.raises(abt.ModelNotSupportedError, match="module '0' .* already part of an applied model"):
        abt.apply(outer, "mixed_float16")
    # a submodule of an applied model (its forward left alone: no rule changes it) is refused by name
    # (issue 37: accepted before, then undone by the outer remove())
    with pytest.raises(abt.ModelNotSupportedError, match="this module is '1' of an applied Sequential"):
        abt.apply(model[1], "mixed_float16")
    amp.remove()
    assert model[0].weight.dtype == torch.float32 and all("forward" not in m.__dict__ for m in model.modules())
    abt.apply(model[1], "mixed_float16").remove()  # free again after remove()
    with torch.autocast("cpu", enabled=False):
        assert model(torch.ones(1, 4)).dtype == torch.float32
    amp2 = abt.apply(model, "mixed_float16")
    assert model(torch.ones(1, 4)).dtype == torch.float32 and amp2.plan["0"].compute_dtype == "float16"


@pytest.mark.filterwarnings("ignore:`torch.jit.script.*` is deprecated")
def test_scripted_and_compiled_models_are_refused_with_the_fix():
    with pytest.raises(abt.ModelNotSupportedError, match="TorchScript .* script afterwards"):
        abt.apply(torch.jit.script(small()), "mixed_float16")
    with pytest.raises(abt.ModelNotSupportedError, match=r"apply to the eager module first, then compile"):
        abt.apply(torch.compile(small()), "mixed_float16")
    with pytest.raises(abt.ModelNotSupportedError, match="needs a torch.nn.Module; received list"):
        abt.apply([small()], "mixed_float16")


def test_compiling_after_apply_runs_the_same_plan():
    model = small()
    amp = abt.apply(model, Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",), matmul_precision="high"))
    x = torch.randn(3, 4)
    eager = model(x)
    compiled = torch.compile(amp.model, backend="eager", fullgraph=True)  # no graph break from ampbridge
    with amp.autocast():
        out = compiled(x)
    assert torch.equal(out, eager) and out.dtype == torch.float32


def test_device_errors_are_clear(monkeypatch):
    with pytest.raises(UnsupportedOptionError, match="device_type='nonsense': torch autocast is not available"):
        abt.apply(small(), "mixed_float16", device_type="nonsense")
    with pytest.raises(ampbridge.AmpBridgeError, match="device_type='cuda' but the model's tensors are on cpu"):
        abt.apply(small(), "mixed_float16", device_type="cuda")
    # a device whose autocast cannot run the dtype (as a GPU without bfloat16): refused, not ignored
    monkeypatch.setattr(torch_env, "_supported_compute_dtypes", lambda device: frozenset({"float32", "float16"}))
    with pytest.raises(UnsupportedOptionError, match="compute_dtype='bfloat16': torch autocast cannot run "
                                                     "bfloat16 on this cpu device; accepted here: float16, float32"):
        abt.apply(small(), "mixed_bfloat16")
    with pytest.raises(UnsupportedOptionError, match=r"override\[0\].compute_dtype='bfloat16'"):
        abt.apply(small(), Policy(compute_dtype="float16", overrides=(Rule(("0",), compute_dtype="bf16"),)))
    # auto is the core's decision (ampbridge.diagnostics.hardware): a CPU without native bfloat16 gets float32
    from ampbridge.diagnostics.hardware import Device

    monkeypatch.setattr(torch_env, "_device", lambda device_type: Device("cpu", cpu_flags=frozenset({"avx2"})))
    with pytest.warns(ampbridge.AmpBridgeWarning, match="chose float32"):
        amp = abt.apply(small(), Policy(compute_dtype="auto"))
    assert amp.active_policy.compute_dtype == "float32"
    assert any("compute_dtype auto -> float32" in n for n in amp.plan.notes)


def test_the_real_cpu_capabilities_and_auto():
    from ampbridge.diagnostics.hardware import auto_dtype

    assert torch_env._supported_compute_dtypes("cpu") == {"float32", "float16", "bfloat16"}
    chosen, reason = auto_dtype(torch_env._device("cpu"))
    amp = abt.apply(small(), Policy(compute_dtype="auto"))
    assert amp.active_policy.compute_dtype == chosen and any(reason in n for n in amp.plan.notes)
    assert amp.scaler.config.mode == ("dynamic" if chosen == "float16" else "none")


def test_matmul_precision_applies_inside_the_scope_only(caplog):
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append(("forward", torch.get_float32_matmul_precision()))
            return x

    model = nn.Sequential(nn.Linear(4, 4), Record())
    model[0].weight.register_hook(lambda g: seen.append(("backward", torch.get_float32_matmul_precision())))
    with caplog.at_level(logging.INFO, logger="ampbridge.torch"):
        amp = abt.apply(model, Policy(compute_dtype="bfloat16", matmul_precision="high"))
    assert "matmul precision high inside the applied scope" in caplog.text
    assert any("set_float32_matmul_precision('high') inside amp.model" in n for n in amp.plan.notes)
    assert torch.get_float32_matmul_precision() == "highest"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.step(model(torch.randn(2, 4)).float().sum(), opt)
    scope = amp.autocast()  # nothing happens until it is entered
    assert torch.get_float32_matmul_precision() == "highest" and not torch.is_autocast_enabled("cpu")
    with scope:
        assert torch.get_float32_matmul_precision() == "high" and torch.is_autocast_enabled("cpu")
    assert seen == [("forward", "high"), ("backward", "high")]
    assert torch.get_float32_matmul_precision() == "highest" and not torch.is_autocast_enabled("cpu")
    with pytest.raises(ZeroDivisionError):  # restored when the forward raises
        class Boom(nn.Module):
            def forward(self, x):
                raise ZeroDivisionError

        boom = nn.Sequential(Boom())
        abt.apply(boom, Policy(matmul_precision="medium"))
        boom(torch.ones(1))
    assert torch.get_float32_matmul_precision() == "highest"


def test_lazy_modules():
    lazy = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
    with pytest.raises(ampbridge.AmpBridgeError, match="'0' .LazyLinear. has uninitialised lazy parameters; run one "
                                                       "forward to materialise them before applying param_dtype="):
        abt.apply(lazy, "bfloat16")
    amp = abt.apply(lazy, "mixed_bfloat16")  # float32 storage: nothing to cast, the lazy module materialises later
    assert lazy(torch.ones(2, 5)).dtype == torch.float32 and amp.plan["0"].param_count == 0


def test_a_rule_on_a_module_whose_forward_is_bypassed_is_refused():
    model = nn.Sequential(nn.MultiheadAttention(4, 2))
    with pytest.raises(UnsupportedOptionError, match=r"override\[0\] \(re:.*proj\) sets '0.out_proj' to compute "
                                                     r"in float32, but MultiheadAttention '0' uses its parameters"):
        abt.apply(model, Policy(compute_dtype="float16", overrides=(Rule(("re:.*proj",), compute_dtype="float32"),)))
    amp = abt.apply(model, Policy(compute_dtype="float16", keep_float32=("kind:attention",)))
    assert amp.plan["0.out_proj"].compute_dtype == "float32"  # follows its MultiheadAttention


def test_step_result_and_repr():
    model = small()
    amp = abt.apply(model, "mixed_float16")
    opt = torch.optim.Adam(model.parameters(), fused=True)
    result = amp.step(model(torch.randn(2, 4)).float().mean() * 1e-3, opt)
    assert isinstance(result, abt.StepResult) and result == True and repr(result) == "StepResult(True)"  # noqa: E712
    assert "compute float16" in repr(amp) and "loss scale dynamic" in repr(amp)
    two = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    assert amp.step(model(torch.randn(2, 4)).float().mean() * 1e-3, two)  # several optimizers, one loss


def test_amp_state_dict_round_trip():
    model = small()
    amp = abt.apply(model, Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(hysteresis=2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        amp.step(model(torch.randn(2, 4)).float().sum(), opt)
    state = amp.state_dict()
    assert state["loss_scale"] == amp.scaler.loss_scale_state().to_dict() and state["step"] == 3
    other = abt.apply(small(), Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(hysteresis=2)))
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="not an ampbridge.torch state dict"):
        other.load_state_dict({"scale": 1.0})


def test_an_applied_model_copies_and_pickles_with_its_plan():
    model = small()
    abt.apply(model, Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",)))
    x = torch.randn(2, 4)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(twin(x), model(x))
        assert twin[1].forward.module is twin[1]  # its own wrappers, not the original's
        with pytest.raises(abt.ModelNotSupportedError, match="already applied"):
            abt.apply(twin, "mixed_float16")


def test_rules_inside_a_transformer_layer_hold_on_its_eval_fast_path(monkeypatch):
    """In eval without gradients TransformerEncoderLayer runs one fused kernel and never calls its
    children; ampbridge keeps it on the ordinary path when a rule decides one of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 2)).eval()
    calls = []
    real = torch_forward._Forward.__call__
    monkeypatch.setattr(torch_forward._Forward, "__call__", lambda self, *a, **k: calls.append(self.spec.path) or real(self, *a, **k))
    amp = abt.apply(model, Policy(overrides=(Rule(("0.linear1",), compute_dtype="bfloat16"),)))
    with torch.no_grad():
        model(torch.randn(2, 3, 8))
    assert "0.linear1" in calls
    amp.remove()
    assert not model[0]._forward_pre_hooks
    calls.clear()
    abt.apply(model, "float32")  # nothing inside to honour: torch's fast path stays
    with torch.no_grad():
        model(torch.randn(2, 3, 8))
    assert calls == [""] and not model[0]._forward_pre_hooks


def test_a_single_module_model_is_its_own_row():
    norm = nn.LayerNorm(4)
    amp = abt.apply(norm, Policy(compute_dtype="float16", keep_float32=("kind:norm",), output_dtype="bfloat16"))
    assert [r.path for r in amp.plan.rows] == [""] and amp.plan[""].compute_dtype == "float32"
    with torch.autocast("cpu", dtype=torch.float16):  # the policy's region wins over the caller's
        out = norm(torch.randn(2, 4, dtype=torch.float16))
    assert out.dtype == torch.bfloat16 and amp.plan[""].output_dtype == "bfloat16"
    lin = nn.Linear(3, 2)
    abt.apply(lin, "mixed_bfloat16")
    assert lin(torch.ones(1, 3)).dtype == torch.float32
