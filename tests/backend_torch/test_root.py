"""The model itself is the Plan's root row "" (as in the Keras and JAX backends): its own
parameters follow the row, and a rule matching it decides the whole model."""

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import Policy, Rule

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn


class ViT(nn.Module):
    """A model owning a parameter itself (a position embedding), as a ViT does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.randn(3, 4))
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(x + self.pos))


def wrapped(model):
    return sorted(p for p, m in model.named_modules() if "forward" in m.__dict__)


def test_the_root_row_describes_the_model(tiny):
    plan = abt.plan(tiny, "mixed_bfloat16")
    root = plan.rows[0]
    assert (root.path, root.kind, root.class_name, root.param_count) == ("", None, "Tiny", 0)
    assert (root.compute_dtype, root.param_dtype, root.output_dtype, root.rule) == (
        "bfloat16", "float32", "float32", "default")
    assert root.note == "model outputs cast to output_dtype float32"
    assert abt.plan(tiny, "bfloat16")[""].note is None  # outputs in bfloat16: nothing cast
    tiny.ampbridge_kind = "attention"
    assert abt.plan(tiny, "mixed_bfloat16")[""].kind == "attention"


def test_the_roots_own_parameters_follow_its_row(probe):
    model = ViT()
    amp = abt.apply(model, "bfloat16")
    assert amp.plan[""].param_count == 12 and amp.plan[""].param_dtype == "bfloat16"
    assert model.pos.dtype == torch.bfloat16 and model.fc.weight.dtype == torch.bfloat16
    model(torch.randn(2, 3, 4)).float().sum().backward()
    assert model.pos.grad.dtype == torch.bfloat16
    amp.remove()
    assert model.pos.dtype == torch.float32
    abt.apply(model, "mixed_bfloat16")
    assert model.pos.dtype == torch.float32


def test_a_rule_on_the_root_decides_everything_under_it(probe):
    model = ViT()
    amp = abt.apply(model, Policy(compute_dtype="bfloat16", param_dtype="bfloat16", keep_float32=("type:ViT",)))
    rows = {r.path: r for r in amp.plan.rows}
    assert {(r.compute_dtype, r.param_dtype) for r in rows.values()} == {("float32", "float32")}
    assert rows["fc"].rule == "keep_float32[0]" and rows["fc"].inherited_from == ""
    assert model.pos.dtype == model.fc.weight.dtype == torch.float32
    with probe.Probe(model) as seen:
        model(torch.randn(2, 3, 4))
    assert seen.computed("fc") == {torch.float32} and seen.computed("norm") == {torch.float32}
    assert wrapped(model) == [""]  # the root's region is float32: its children need nothing of their own

    # a later rule on a child still wins inside the pinned root
    amp.remove()
    amp = abt.apply(model, Policy(compute_dtype="bfloat16", keep_float32=("type:ViT",),
                                  overrides=(Rule(("fc",), compute_dtype="bfloat16"),)))
    with probe.Probe(model) as seen:
        out = model(torch.randn(2, 3, 4))
    assert seen.computed("fc") == {torch.bfloat16} and seen.computed("norm") == {torch.float32}
    assert out.dtype == torch.float32 and amp.plan["norm"].inherited_from == ""


@pytest.mark.parametrize("pattern", ["**", "re:.*"])
def test_catch_all_patterns_match_the_root(pattern, probe):
    model = ViT()
    amp = abt.apply(model, Policy(compute_dtype="bfloat16", param_dtype="bfloat16", keep_float32=(pattern,)))
    assert [(r.path, r.rule, r.inherited_from) for r in amp.plan.rows] == [
        ("", "keep_float32[0]", None), ("fc", "keep_float32[0]", None), ("norm", "keep_float32[0]", None)]
    assert model.pos.dtype == torch.float32
    with probe.Probe(model) as seen:
        model(torch.randn(2, 3, 4))
    assert seen.computed("fc") == {torch.float32} and wrapped(model) == [""]
    assert probe.check_plan(amp.plan, seen, model=model) == 3


def test_root_parameters_stored_low_are_presented_in_its_compute_dtype():
    model = ViT()
    amp = abt.apply(model, Policy(overrides=(Rule(("type:ViT",), param_dtype="bfloat16"),)))
    assert amp.plan[""].param_dtype == "bfloat16" and model.pos.dtype == torch.bfloat16
    x = torch.randn(2, 3, 4)
    out = model(x)  # float32 compute with bfloat16 storage: x + pos runs on pos presented in float32
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model.pos.grad.dtype == torch.bfloat16 and model.fc.weight.grad.dtype == torch.bfloat16


def test_fsdp_takes_a_rule_on_the_root_as_the_roots_policy():
    pytest.importorskip("torch.distributed.fsdp")
    model = ViT()
    fsdp = abt.fsdp_policy(Policy(compute_dtype="bfloat16", keep_float32=("**",)), model)
    assert dict(fsdp.pinned) == {}  # nothing to shard on its own: the root's policy is float32
    assert fsdp.root_mp_policy.param_dtype == torch.float32 and fsdp.mp_policy.param_dtype == torch.float32
    assert fsdp.mixed_precision.param_dtype == torch.float32
