"""The zoo's traced rows (issue 37): for MoE and state-space models (transformers' tiny Mixtral,
Qwen2-MoE, Mamba, Mamba2; random init, no downloads), ``amp.trace`` rows equal what one forward
really ran, module by module, containers included, with and without pins: each row's compute dtype
is what the conftest probe (module hooks plus a dispatch mode, written apart from ampbridge) saw
the module compute in, and its output dtype what the module returned. A pin on a module whose
``forward`` the model never calls (Mamba reads ``conv1d``'s and ``dt_proj``'s weights directly)
warns that it has no effect."""

from __future__ import annotations

import warnings

import pytest

from ampbridge._testing import require

require("torch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampbridge  # noqa: E402

PINS = {"keep_float32": ["kind:norm", "kind:embedding"]}
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _build(name):
    t = transformers
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2)
    if name == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**small, intermediate_size=32, num_attention_heads=2,
                                                    num_key_value_heads=1, num_local_experts=4,
                                                    num_experts_per_tok=2, max_position_embeddings=32))
    if name == "qwen2_moe":
        return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**small, intermediate_size=32, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=32, num_attention_heads=2,
                                                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                                      max_position_embeddings=32))
    if name == "mamba":
        return t.MambaForCausalLM(t.MambaConfig(**small, state_size=4, expand=2, conv_kernel=2))
    if name == "mamba2":
        return t.Mamba2ForCausalLM(t.Mamba2Config(**small, state_size=4, expand=2, conv_kernel=2, num_heads=4,
                                                  head_dim=8, n_groups=1, chunk_size=4))
    raise KeyError(name)


def _mismatches(traced, probe):
    """Rows whose compute or output dtype is not what the probe saw the module run."""
    out = []
    for row in traced.rows:
        if row.path not in probe.ran:
            assert "did not run" in (row.note or "") or "used by" in (row.note or ""), row
            continue
        computed = probe.computed(row.path)
        if computed is not None:
            seen = {NAMES[d] for d in computed}
            odd = {o.rsplit(" ", 1)[-1] for o in row.other_ops}  # a mixed row names its other ops' dtypes
            if row.compute_dtype not in seen or not seen <= {row.compute_dtype} | odd:
                out.append(f"{row.path} ({row.class_name}): row computes {row.compute_dtype}, ran {sorted(seen)}")
        delivered = probe.out.get(row.path)
        if delivered is not None and NAMES[delivered] != row.output_dtype:
            out.append(f"{row.path} ({row.class_name}): row outputs {row.output_dtype}, returned {NAMES[delivered]}")
    return out


@pytest.mark.parametrize("pins", [False, True], ids=["no rules", "pinned"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "mamba", "mamba2"])
def test_traced_rows_equal_what_ran(name, pins, probe):
    model = _build(name).eval()
    # Mamba2's gated RMSNorm is no norm by inference (its name ends in "Gated"): named, as a user would
    kinds = {"norm": ["Mamba2RMSNormGated"]} if name == "mamba2" else {}
    policy = ampbridge.Policy(compute_dtype="bfloat16", **(dict(PINS, kinds=kinds) if pins else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unmatched rule, an idle rule: fails
        amp = ampbridge.torch.apply(model, policy)
        traced = amp.trace(_ids())
    with torch.no_grad(), probe.Probe(model) as seen:
        model(_ids())
    containers = [r for r in traced.rows if next(amp.model.get_submodule(r.path).children(), None) is not None]
    assert len(containers) >= 5 and len(seen.ran) >= 10
    assert _mismatches(traced, seen) == []
    if pins:
        assert any(r.rule != "default" and r.path in seen.ran for r in traced.rows)


@pytest.mark.parametrize("match", ["conv1d", "dt_proj"])
def test_a_pin_on_a_module_whose_forward_never_runs_warns(match):
    model = _build("mamba").eval()
    amp = ampbridge.torch.apply(model, ampbridge.Policy(compute_dtype="bfloat16", keep_float32=(f"**.{match}",)))
    with pytest.warns(ampbridge.errors.IdleRuleWarning, match=f"keep_float32.*has no effect.*{match}"):
        traced = amp.trace(_ids())
    assert any("has no effect" in n for n in traced.notes)
