"""A Keras ``fit`` epoch with ampbridge against the hand-written native equivalent.

Same process, same model and data; epochs alternate between the two (native, ampbridge,
native, ...) and each side's median epoch time is compared. Native: a global
``mixed_float16`` policy, ``dtype="float32"`` on the norm and embedding, a float32 output
``Activation`` and Keras's ``LossScaleOptimizer``. ampbridge: the same model built in float32,
``ampbridge.keras.apply`` and ``ampbridge.keras.optimizer``. Under JAX it also counts the
StableHLO ops of one compiled train step on each side (an exact count, unlike the clock).

Usage: python benchmarks/bench_keras.py [--backends tensorflow,jax[,torch]] [--rounds N]
Each backend runs in its own process (Keras picks its backend at import).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _model(keras, native: bool, seq: int, dim: int, vocab: int):
    L = keras.layers
    pin = {"dtype": "float32"} if native else {}
    tokens = keras.Input((seq,), dtype="int32")
    x = L.Embedding(vocab, dim, name="embed", **pin)(tokens)
    x = L.Dense(4 * dim, activation="relu", name="ffn_in")(x)
    x = L.Dense(dim, name="ffn_out")(x)
    x = L.LayerNormalization(name="norm", **pin)(x)
    x = L.Add(name="residual")([x, L.MultiHeadAttention(4, dim // 4, dropout=0.1, seed=3, name="attn")(x, x)])
    x = L.GlobalAveragePooling1D(name="pool")(x)
    logits = L.Dense(8, name="head")(x)
    if native:
        logits = L.Activation("linear", dtype="float32", name="out_cast")(logits)
    return keras.Model(tokens, logits)


def run_one(backend: str, rounds: int, steps: int) -> dict:
    os.environ["KERAS_BACKEND"] = backend
    import numpy as np

    try:
        import torch  # noqa: F401  (before tensorflow, as the tests do)
    except ImportError:
        pass
    import keras

    import ampbridge
    import ampbridge.keras as ak

    seq, dim, vocab, batch = 32, 64, 512, 32
    rng = np.random.RandomState(0)
    x = rng.randint(0, vocab, (steps * batch, seq)).astype("int32")
    y = rng.randint(0, 8, (steps * batch,)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    native = _model(keras, True, seq, dim, vocab)
    keras.config.set_dtype_policy(previous)
    native.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0 ** 15,
                                                       dynamic_growth_steps=1000), loss)

    keras.utils.set_random_seed(0)
    amp = _model(keras, False, seq, dim, vocab)
    amp.set_weights(native.get_weights())
    policy = ampbridge.preset("mixed_float16").replace(
        keep_float32=("kind:norm", "kind:embedding"),
        loss_scale=ampbridge.LossScaleConfig(initial_scale=2.0 ** 15, growth_interval=1000))
    ak.apply(amp, policy)
    amp.compile(ak.optimizer(keras.optimizers.Adam(1e-3), policy), loss)

    def epoch(model) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return time.perf_counter() - start

    epoch(native), epoch(amp)  # compile / warm up
    times = {"native": [], "ampbridge": []}
    for i in range(rounds):
        order = (("native", native), ("ampbridge", amp)) if i % 2 == 0 else (("ampbridge", amp), ("native", native))
        for name, model in order:
            times[name].append(epoch(model))
    result = {"backend": backend, "steps": steps, "rounds": rounds,
              "native_s": statistics.median(times["native"]), "ampbridge_s": statistics.median(times["ampbridge"])}
    result["ratio"] = result["ampbridge_s"] / result["native_s"]
    paired = sorted(a / b for a, b in zip(times["ampbridge"], times["native"]))  # round by round
    result["iqr"] = (paired[len(paired) // 4], paired[(3 * len(paired)) // 4])
    # the fastest epoch of each side: what contention from other processes cannot inflate
    result["min_ratio"] = min(times["ampbridge"]) / min(times["native"])
    if backend == "jax":
        result.update(_hlo_counts(keras, native, amp, x[:batch], y[:batch]))
    if backend == "tensorflow":
        result.update(_tf_graph_counts(native, amp, x[:batch], y[:batch]))
    return result


def _tf_graph_counts(native, amp, x, y) -> dict:
    """Ops in the traced TensorFlow train step (cond branches included), and how many are Casts."""
    import tensorflow as tf

    out = {}
    spec = (tf.TensorSpec(x.shape, tf.int32), tf.TensorSpec(y.shape, tf.int32))
    for name, model in (("native", native), ("ampbridge", amp)):
        graph = tf.function(model.train_step).get_concrete_function(spec).graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        out[f"{name}_graph_ops"] = len(nodes)
        out[f"{name}_graph_casts"] = sum(n.op == "Cast" for n in nodes)
    return out


def _hlo_counts(keras, native, amp, x, y) -> dict:
    """StableHLO ops in one jitted train step (all, and dtype converts) for each side."""
    import jax

    out = {}
    for name, model in (("native", native), ("ampbridge", amp)):
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        text = jax.jit(model.train_step).lower(state, (x, y)).as_text()
        ops = [line for line in text.splitlines() if "= stablehlo." in line or "stablehlo.return" in line]
        out[f"{name}_hlo_ops"] = len(ops)
        out[f"{name}_hlo_converts"] = sum("stablehlo.convert" in line for line in ops)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds, args.steps)))
        return 0
    rows = []
    for backend in args.backends.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", backend, "--rounds", str(args.rounds),
                               "--steps", str(args.steps)], capture_output=True, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if proc.returncode != 0:
            print(f"{backend}: failed\n{proc.stderr[-2000:]}")
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"Keras fit epoch ({rows[0]['steps']} steps, median of {rows[0]['rounds']} interleaved rounds): "
          "ampbridge / native (target <= 1.03)")
    print(f"{'backend':<11} {'native s':>9} {'ampbridge s':>12} {'ratio':>6} {'paired IQR':>11} {'n':>3} {'min ratio':>9}  exact counts")
    for r in rows:
        counts = ""
        if "native_hlo_ops" in r:
            counts = (f"HLO ops/step {r['ampbridge_hlo_ops']} vs {r['native_hlo_ops']}, converts "
                      f"{r['ampbridge_hlo_converts']} vs {r['native_hlo_converts']}")
        if "native_graph_ops" in r:
            counts = (f"graph ops/step {r['ampbridge_graph_ops']} vs {r['native_graph_ops']}, casts "
                      f"{r['ampbridge_graph_casts']} vs {r['native_graph_casts']}")
        print(f"{r['backend']:<11} {r['native_s']:>9.3f} {r['ampbridge_s']:>12.3f} {r['ratio']:>6.3f} "
              f"{'%.3f-%.3f' % tuple(r['iqr']):>11} {r['rounds']:>3} {r['min_ratio']:>9.3f}  {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
