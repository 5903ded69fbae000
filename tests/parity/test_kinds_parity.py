"""A policy with a [kinds] table gives the same Plan rows for the demo model in torch, Keras and Flax
(path, kind, dtypes, deciding rule, and the kind's source where the table decided it)."""

from __future__ import annotations

import pytest

import ampbridge
from ampbridge._testing import require

require("torch")
require("keras")
require("jax")

import torch  # noqa: E402, F401  (torch before TensorFlow)

POLICY = ampbridge.loads("""
compute_dtype = "bfloat16"
keep_float32 = ["kind:attention", "kind:embedding", "kind:norm"]
[kinds]
attention = ["Block"]                 # a whole transformer block, named explicitly
none = ["SelfAttention"]              # the model says attention; the table takes it back
norm = ["re:LayerNorm(alization)?"]   # torch's, Flax's and Keras's class names in one line
""")


def _plans():
    import jax.numpy as jnp

    import ampbridge.jax as abj
    import ampbridge.keras as ak
    import ampbridge.torch as abt
    from ampbridge.cli.demo import flax_model as fm
    from ampbridge.cli.demo import keras_model as km
    from ampbridge.cli.demo import torch_model as tm
    from ampbridge.cli.demo.model import batches

    module, _ = fm.build(0)
    x0 = jnp.asarray(batches(1)[0][0])
    return {"torch": abt.plan(tm.build(0), POLICY), "keras": ak.plan(km.build(0), POLICY),
            "jax": abj.plan(module, POLICY, x0)}


def test_kinds_table_gives_the_same_rows_in_every_framework():
    plans = _plans()
    for fw in ("keras", "jax"):
        assert plans["torch"].differences(plans[fw]) == [], fw
    torch_rows = {r.path: r for r in plans["torch"].rows}
    blocks = [p for p, r in torch_rows.items() if r.class_name == "Block"]
    assert blocks
    for fw, plan in plans.items():
        for path in blocks:
            assert plan[path].kind == "attention" and plan[path].kind_source == "[kinds] table", fw
            attn = plan[path + ".attn"]
            # the demo declares ampbridge_kind = "attention" on its SelfAttention: the table overrules that too
            assert attn.kind is None and attn.kind_source.startswith("[kinds] table; overrules attention"), (fw, attn)
            assert attn.compute_dtype == "float32" and attn.inherited_from == path, fw
        assert {r.kind_source for r in plan.rows if r.kind == "norm"} == {"[kinds] table"}, fw


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
