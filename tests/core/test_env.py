import warnings

import pytest

import ampbridge
from ampbridge.diagnostics.environment import effective_policy
from ampbridge.errors import AmpBridgeWarning, PolicyError, _warned


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("AMPBRIDGE_DISABLE", raising=False)
    monkeypatch.delenv("AMPBRIDGE_POLICY", raising=False)
    _warned.clear()


def test_no_variable_no_change():
    p = ampbridge.preset("mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert effective_policy(p, "torch") is p


def test_disable_runs_float32_and_says_so_once(monkeypatch):
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "1")
    with pytest.warns(AmpBridgeWarning, match="AMPBRIDGE_DISABLE is set: running in float32") as record:
        a = effective_policy(ampbridge.preset("mixed_float16"), "torch")
        b = effective_policy(ampbridge.preset("mixed_bfloat16"), "torch")
    assert a == b == ampbridge.preset("float32")
    assert len(record) == 1
    monkeypatch.setenv("AMPBRIDGE_DISABLE", "0")
    assert effective_policy(ampbridge.preset("bfloat16"), "torch") == ampbridge.preset("bfloat16")


def test_policy_variable_takes_a_preset_or_file(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPBRIDGE_POLICY", "float32")
    with pytest.warns(AmpBridgeWarning):
        assert effective_policy(ampbridge.preset("mixed_float16"), "jax") == ampbridge.preset("float32")
    f = tmp_path / "p.toml"
    f.write_text('compute_dtype = "bf16"\n')
    monkeypatch.setenv("AMPBRIDGE_POLICY", str(f))
    with pytest.warns(AmpBridgeWarning):
        assert effective_policy(ampbridge.preset("mixed_float16"), "jax").compute_dtype == "bfloat16"
    monkeypatch.setenv("AMPBRIDGE_POLICY", str(tmp_path / "missing.toml"))
    with pytest.raises(ampbridge.PolicyError, match="no such file"):
        effective_policy(ampbridge.preset("mixed_float16"), "jax")


def test_a_bad_environment_policy_names_the_variable(monkeypatch):
    monkeypatch.setenv("AMPBRIDGE_POLICY", "nosuch")
    with pytest.raises(PolicyError, match="AMPBRIDGE_POLICY: the environment variable names no usable policy"):
        effective_policy(ampbridge.preset("mixed_float16"), "torch", warn=False)
