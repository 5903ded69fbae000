"""Lossy combinations are named: by ``validate``, and (tests/backend_torch/test_lossy_policy.py) by ``apply``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ampbridge import LossScaleConfig, Policy
from ampbridge.cli import main
from ampbridge.core.policy import Phase, Rule
from ampbridge.core.risks import lossy_settings

DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
MODES = st.sampled_from(["auto", "dynamic", "static", "none"])


@st.composite
def policies(draw):
    overrides = tuple(Rule(("head",), compute_dtype=draw(DTYPES)) for _ in range(draw(st.integers(0, 2))))
    return Policy(compute_dtype=draw(DTYPES), param_dtype=draw(st.sampled_from(["float32", "float16"])),
                  reduce_dtype=draw(st.one_of(st.none(), DTYPES)), overrides=overrides,
                  loss_scale=LossScaleConfig(mode=draw(MODES), skip_nonfinite=draw(st.booleans())))


def _runs_float16(p):
    return "float16" in (p.compute_dtype, p.param_dtype) or any(r.compute_dtype == "float16" for r in p.overrides)


@given(policies())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_each_lossy_combination_is_named_and_nothing_else(policy):
    keys = {r.key for r in lossy_settings(policy)}
    mode = policy.loss_scale.mode
    unscaled = mode == "none" or (mode == "auto" and policy.compute_dtype != "float16")
    assert ("loss_scale.mode" in keys) == (unscaled and _runs_float16(policy))
    assert ("reduce_dtype" in keys) == (unscaled and policy.reduce_dtype == "float16")
    dynamic = mode == "dynamic" or (mode == "auto" and policy.compute_dtype == "float16")
    assert ("loss_scale.skip_nonfinite" in keys) == (dynamic and not policy.loss_scale.skip_nonfinite)


def test_the_issue_cases_and_a_phase():
    bf16_wire = Policy(compute_dtype="bfloat16", reduce_dtype="float16")
    assert [r.key for r in lossy_settings(bf16_wire)] == ["reduce_dtype"]
    no_scale = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="none"))
    assert "flush to zero" in str(lossy_settings(no_scale)[0])
    phased = Policy(phases=(Phase(policy=no_scale),))
    assert [str(r).split(":")[0] for r in lossy_settings(phased)] == ["phase[0]"]
    assert lossy_settings(Policy(compute_dtype="float16")) == ()  # auto scales float16


def test_validate_warns_and_still_exits_0(tmp_path, capsys):
    f = tmp_path / "p.toml"
    f.write_text('compute_dtype = "bfloat16"\nreduce_dtype = "float16"\n')
    assert main(["validate", str(f)]) == 0
    out, err = capsys.readouterr()
    assert f"ok: {f}" in out
    assert err.strip() == (f"warning: {f}: reduce_dtype = 'float16': gradients are all-reduced in float16 with no "
                           "loss scaling: values below 2^-24 (6e-8) are zeroed on the wire and above 65504 overflow; "
                           "use reduce_dtype 'bfloat16' or 'float32', or a loss scale")
