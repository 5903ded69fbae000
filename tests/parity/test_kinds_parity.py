"""A policy with a [kinds] table gives the same Plan rows for the demo model in torch, Keras and Flax
(path, kind, dtypes, deciding rule, and the kind's source where the table decided it)."""

from __future__ import annotations

import warnings

import pytest

import ampbridge
from ampbridge._testing import require

require("torch")
require("keras")
require("jax")

import torch  # noqa: E402, F401  (torch before TensorFlow)

from ampbridge.cli.demo.run import semantic_differences  # noqa: E402

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


def _wrapper_models():
    """The same model (a root named ``TinyNorm``, a ``PreNorm`` wrapper holding a LayerNorm and a
    linear map, a head) in torch, Keras, Flax linen and Flax NNX, with the same paths."""
    import flax.linen as fnn
    import jax.numpy as jnp
    import keras
    import numpy as np
    from flax import nnx
    from torch import nn

    class TorchPreNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fn = nn.LayerNorm(4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fn(self.norm(x))

    class TorchTinyNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.head = TorchPreNorm(), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(x + self.pre(x))

    t = TorchTinyNorm()

    class PreNorm(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.norm, self.fn = keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(4, name="fn")

        def call(self, x):
            return self.fn(self.norm(x))

    class TinyNorm(keras.Model):
        def __init__(self):
            super().__init__()
            self.pre, self.head = PreNorm(name="pre"), keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(x + self.pre(x))

    k = TinyNorm()
    k(np.ones((1, 4), "float32"))

    class LinenPreNorm(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(4, name="fn")(fnn.LayerNorm(name="norm")(x))

    class LinenTinyNorm(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(2, name="head")(x + LinenPreNorm(name="pre")(x))

    class NnxPreNorm(nnx.Module):
        def __init__(self, rngs):
            self.norm, self.fn = nnx.LayerNorm(4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)

    class NnxTinyNorm(nnx.Module):
        def __init__(self, rngs):
            self.pre, self.head = NnxPreNorm(rngs), nnx.Linear(4, 2, rngs=rngs)

    return t, k, (LinenTinyNorm(), jnp.ones((1, 4))), NnxTinyNorm(nnx.Rngs(0))


def test_a_wrapper_and_the_root_get_no_inferred_kind_in_every_framework():
    import ampbridge.jax as abj
    import ampbridge.keras as ak
    import ampbridge.torch as abt

    t, k, (linen, x), nnx_model = _wrapper_models()
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    for explicit in (False, True):
        # each framework's wrapper class by its own name (an entry naming no class of the model warns)
        kinds = {fw: policy.replace(kinds={"norm": [name]} if explicit else {}) for fw, name in
                 (("torch", "TorchPreNorm"), ("keras", "PreNorm"), ("linen", "LinenPreNorm"), ("nnx", "NnxPreNorm"))}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plans = {"torch": abt.plan(t, kinds["torch"]), "keras": ak.plan(k, kinds["keras"]),
                     "linen": abj.plan(linen, kinds["linen"], x), "nnx": abj.plan(nnx_model, kinds["nnx"])}
        broad = [w for w in caught if issubclass(w.category, ampbridge.BroadRuleWarning)]
        assert len(broad) == (4 if explicit else 0)  # the pinned wrapper holds most of the model
        amp = abt.apply(t, kinds["torch"])  # the torch rows that carry a promoted stream on (its realisation)
        promoted = amp._realisation.promoted
        amp.remove()
        for fw, plan in plans.items():
            # the frameworks' own semantics part only there: Keras and Flax cast the next layer's inputs
            rest, _ = semantic_differences(plans["torch"], plan, promoted)
            assert rest == [], fw
            assert plan[""].kind is None, fw
        pinned = plans["torch"]["pre.fn"].compute_dtype
        assert pinned == ("float32" if explicit else "bfloat16")


def test_a_kinds_entry_naming_no_class_warns_in_every_framework():
    import jax

    import ampbridge.jax as abj
    import ampbridge.keras as ak
    import ampbridge.torch as abt

    t, k, (linen, x), nnx_model = _wrapper_models()
    policy = ampbridge.Policy(compute_dtype="bfloat16", kinds={"norm": ["PreNrom"]})
    said = {}
    for fw, plan in (("torch", lambda: abt.apply(t, policy).remove()), ("keras", lambda: ak.plan(k, policy)),
                     ("linen", lambda: abj.apply(linen, policy).init(jax.random.key(0), x)),
                     ("nnx", lambda: abj.apply(nnx_model, policy))):
        with pytest.warns(ampbridge.UnmatchedRuleWarning) as caught:
            plan()
        said[fw] = [str(w.message) for w in caught]
    for fw, lines in said.items():
        assert lines[0].startswith('[kinds] norm = "PreNrom" matches no class of the model (a typo?)'), fw
    assert said["keras"][0].endswith("did you mean 'PreNorm'?")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
