"""Plan paths do not depend on the process's history: Keras's automatic names (``dense_7``) carry
a process-wide counter, ampbridge numbers them among their siblings instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ampbridge._testing import require

keras = require("keras")

BUILD = textwrap.dedent("""
    import json, keras, ampbridge, ampbridge.keras as ak
    L = keras.layers

    class Block(L.Layer):  # unnamed sublayers, named automatically when built
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense, self.norm = L.Dense(4), L.LayerNormalization()
            self.mha = L.MultiHeadAttention(2, 2)

        def call(self, x):
            return self.norm(self.dense(x)) + self.mha(x, x)

    def build():
        inputs = keras.Input((3, 4))
        x = Block()(L.Dense(4)(inputs))
        x = L.Dense(4)(Block()(x))
        return keras.Model(inputs, L.Dense(2, name="dense_99")(x))  # a hand-given name stays

    def rows(model):
        policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm", "block_1.dense"))
        ak.apply(model, policy)
        return [[r.path, r.compute_dtype, r.output_dtype, r.rule] for r in ak.plan(model, policy).rows]
""")


def test_plan_rows_equal_a_fresh_process(tmp_path):
    scope: dict = {}
    exec(BUILD, scope)  # noqa: S102 - the same code in both processes
    for _ in range(3):
        scope["build"]()  # three models first: Keras's counters move on
    model = scope["build"]()
    here = scope["rows"](model)
    assert {layer.name for layer in model.layers} & {"dense_3", "block_6"}  # Keras's names did move
    fresh = subprocess.run([sys.executable, "-c", BUILD + "\nprint(json.dumps(rows(build())))"],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert here == json.loads(fresh.stdout.strip().splitlines()[-1])
    paths = [row[0] for row in here]
    assert {"dense", "block.dense", "block.layer_normalization", "block.multi_head_attention.query", "block_1.dense",
            "dense_1", "dense_99"} <= set(paths)
    assert next(r for r in here if r[0] == "block_1.dense")[1] == "float32"  # a path rule finds it
