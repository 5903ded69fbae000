"""The model author's float32 modules in torch: transformers' ``_keep_in_fp32_modules`` (and
``_strict``) are part of the Plan, kept by default (the row says "set by the model"), overridden by a
rule that names the module. Real tiny T5 (random init), real autocast on CPU."""

from __future__ import annotations

from ampbridge._testing import require

torch = require("torch")
transformers = require("transformers")

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402

WO = ("encoder.block.0.layer.1.DenseReluDense.wo", "decoder.block.0.layer.2.DenseReluDense.wo")
WI = "encoder.block.0.layer.1.DenseReluDense.wi"


def _t5(cls=None):
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    return (cls or transformers.T5ForConditionalGeneration)(config)


def _ran(model, paths):
    """path -> (input dtype, weight dtype, output dtype) of one training forward."""
    seen = {}
    modules = dict(model.named_modules())

    def hook(path):
        def record(module, args, out):  # returns None: the output is left as it is
            seen.setdefault(path, (args[0].dtype, module.weight.dtype, out.dtype))
        return record

    hooks = [modules[p].register_forward_hook(hook(p)) for p in paths]
    ids = torch.arange(8).reshape(2, 4) % 32
    try:
        out = model(input_ids=ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    out.loss.backward()
    return seen


def test_t5_wo_is_float32_set_by_the_model_under_float16():
    policy = ampbridge.preset("mixed_float16")
    plan = abt.plan(_t5(), policy)
    for path in WO:
        row = plan[path]
        assert (row.compute_dtype, row.param_dtype, row.output_dtype, row.rule, row.decided_by) == (
            "float32", "float32", "float32", "set by the model", "set by the model")
        assert row.note == "T5ForConditionalGeneration._keep_in_fp32_modules 'wo'"
    assert plan[WI].rule == "default" and plan[WI].compute_dtype == "float16"
    amp = abt.apply(_t5(), policy)
    ran = _ran(amp.model, WO + (WI,))
    for path in WO:
        assert ran[path] == (torch.float32, torch.float32, torch.float32), path
    assert ran[WI][2] == torch.float16


def test_a_rule_naming_wo_overrides_the_model_and_bfloat16_does_not_pin_it():
    policy = ampbridge.preset("mixed_float16").replace(
        overrides=({"match": ("re:.*DenseReluDense\\.wo",), "compute_dtype": "float16"},))
    amp = abt.apply(_t5(), policy)
    assert {amp.plan[p].rule for p in WO} == {"override[0]"}
    assert {_ran(amp.model, WO)[p][2] for p in WO} == {torch.float16}
    # a rule on an ancestor does not reach through the author's choice (as in Keras)
    ancestor = ampbridge.preset("mixed_float16").replace(
        overrides=({"match": ("encoder",), "compute_dtype": "float16"},))
    assert abt.plan(_t5(), ancestor)[WO[0]].rule == "set by the model"
    # _keep_in_fp32_modules (not _strict) is transformers' float16-only upcast: bfloat16 runs wo in bfloat16
    amp = abt.apply(_t5(), "mixed_bfloat16")
    assert {amp.plan[p].rule for p in WO} == {"default"}
    assert {_ran(amp.model, WO)[p][2] for p in WO} == {torch.bfloat16}


class _StrictHead(transformers.T5ForConditionalGeneration):
    _keep_in_fp32_modules_strict = ["lm_head"]


def test_strict_entries_pin_under_bfloat16_too():
    amp = abt.apply(_t5(_StrictHead), "mixed_bfloat16")
    row = amp.plan["lm_head"]
    assert (row.compute_dtype, row.rule) == ("float32", "set by the model")
    assert row.note == "_StrictHead._keep_in_fp32_modules_strict 'lm_head'"
    ran = _ran(amp.model, ("lm_head",) + WO)
    assert ran["lm_head"] == (torch.float32, torch.float32, torch.float32)
    assert {ran[p][2] for p in WO} == {torch.bfloat16}  # the non-strict wo: bfloat16
    # float32 compute: nothing to keep, no row says "set by the model"
    assert all(r.rule == "default" for r in abt.plan(_t5(_StrictHead), "float32"))
