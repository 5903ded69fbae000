"""What ampbridge's numerics monitor costs a Keras ``fit`` epoch: none vs every=1 vs every=100.

Same process, same model (the small transformer of bench_keras.py under mixed_float16 with the
norm and embedding pinned) and data; six copies with the same weights, each compiled once:
no monitor, a second one (the control: its ratio is the machine's noise), one with a callback
that only has a batch-end hook (what any such callback costs: the host then waits for each
step), ``MonitorCallback(every=1)``, ``every=100``, and ``every=100`` with
``attribution=False`` (what the per-step forward/backward flags cost). Epochs rotate between
the copies; each round's epoch time is divided by the unmonitored copy's in the same round
(median, IQR and number of these paired ratios; the CPU ratio likewise with this process's CPU
time, Keras's and XLA's threads included). Exact counts too: the ops of one traced train step
(TensorFlow graph ops, JAX StableHLO ops) as an unsampled step runs it (the function
MonitorCallback's dispatch runs between samples) and as a sampled step does.

Usage: python benchmarks/bench_monitor_keras.py [--backends tensorflow[,jax,torch]] [--rounds N] [--steps N]
Each backend runs in its own process (Keras picks its backend at import).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = (("none", None), ("none again (control)", None), ("a batch-end callback", "batch-end"),
           ("every=1", dict(every=1)), ("every=100", dict(every=100)),
           ("every=100, no attribution", dict(every=100, attribution=False)))


def _model(keras, seq: int, dim: int, vocab: int):
    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    x = L.Embedding(vocab, dim, name="embed")(tokens)
    x = L.Dense(4 * dim, activation="relu", name="ffn_in")(x)
    x = L.Dense(dim, name="ffn_out")(x)
    x = L.LayerNormalization(name="norm")(x)
    x = L.Add(name="residual")([x, L.MultiHeadAttention(4, dim // 4, dropout=0.1, seed=3, name="attn")(x, x)])
    x = L.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, L.Dense(8, name="head")(x))


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
    policy = ampbridge.preset("mixed_float16").replace(
        keep_float32=("kind:norm", "kind:embedding"),
        loss_scale=ampbridge.LossScaleConfig(initial_scale=2.0 ** 15, growth_interval=1000))
    folder = tempfile.mkdtemp()

    class BatchEnd(keras.callbacks.Callback):
        """Any callback passed to fit with a batch-end hook and no ``async_safe`` (Keras's own
        ProgbarLogger counts only when passed explicitly): Keras then reads each step's logs and
        runs the callbacks on the calling thread, so the host waits for each step; without one it
        hands them to a thread of its own."""

        def on_train_batch_end(self, batch, logs=None):
            pass
    models, callbacks = {}, {}
    weights = None
    for name, kwargs in CONFIGS:
        keras.utils.set_random_seed(0)
        model = _model(keras, seq, dim, vocab)
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        ak.apply(model, policy)
        model.compile(ak.optimizer(keras.optimizers.Adam(1e-3), policy), loss)
        models[name] = model
        if kwargs is None:
            callbacks[name] = []
        elif kwargs == "batch-end":
            callbacks[name] = [BatchEnd()]
        else:
            callbacks[name] = [ak.MonitorCallback(os.path.join(folder, f"{len(callbacks)}.jsonl"), **kwargs)]

    cpu: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}

    def epoch(name: str) -> float:
        start, start_cpu = time.perf_counter(), time.process_time()
        models[name].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks[name])
        cpu[name].append(time.process_time() - start_cpu)
        return time.perf_counter() - start

    for name, _ in CONFIGS:
        epoch(name)  # compile / warm up
        cpu[name].clear()
    times: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    names = [name for name, _ in CONFIGS]
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(epoch(name))
    base = statistics.median(times["none"])
    result = {"backend": backend, "steps": steps, "rounds": rounds, "configs": []}
    for name in names:
        median = statistics.median(times[name])
        paired = sorted(a / b for a, b in zip(times[name], times["none"]))
        paired_cpu = [a / b for a, b in zip(cpu[name], cpu["none"])]
        result["configs"].append({"name": name, "s": median, "ratio": statistics.median(paired),
                                  "cpu_ratio": statistics.median(paired_cpu),
                                  "iqr": (paired[len(paired) // 4], paired[(3 * len(paired)) // 4]), "n": len(paired),
                                  "min_ratio": min(times[name]) / min(times["none"]),
                                  "per_step_ms": 1000 * (median - base) / steps})
    result["dispatch_us"] = _dispatch_host_us(models["every=100"], callbacks["every=100"][0], epoch)
    counts = {}
    count = {"tensorflow": _tf_graph_ops, "jax": _hlo_ops}.get(backend)
    if count is not None:
        for name, model in models.items():
            # unsampled: the function MonitorCallback's dispatch runs between samples; sampled: the other
            monitor = getattr(callbacks[name][0], "monitor", None) if callbacks[name] else None
            with monitor._unsampled() if monitor is not None else contextlib.nullcontext():
                unsampled = count(model, x[:batch], y[:batch])
            counts[name] = (unsampled, count(model, x[:batch], y[:batch]))
    for c in result["configs"]:
        c["ops"] = counts.get(c["name"])
    for cb in callbacks.values():
        for c in cb:
            getattr(c, "close", lambda: None)()
    return result


def _dispatch_host_us(model, callback, epoch) -> float:
    """MonitorCallback's own host work per unsampled step, in microseconds: the time in its
    dispatch less the time in Keras's train function and in the one read (median over an epoch's
    unsampled steps; Keras's data iterator, which every step runs, is included)."""
    dispatch = callback._dispatch
    original, plain, skipped = type(dispatch), dispatch.plain, dispatch._skipped
    inner = [0.0]

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inner[0] += time.perf_counter() - start
        return run

    own = []

    class Timed(original):  # Python looks __call__ up on the class, so the class is swapped
        def __call__(self, *args):
            inner[0] = 0.0
            start = time.perf_counter()
            step = self.step
            out = super().__call__(*args)
            if step % self.monitor.every:
                own.append(time.perf_counter() - start - inner[0])
            return out

    dispatch.plain, dispatch._skipped = timed(plain), timed(skipped)
    dispatch.__class__ = Timed
    try:
        epoch("every=100")
    finally:
        dispatch.__class__ = original
        dispatch.plain = plain
        del dispatch._skipped  # the method again
    return 1e6 * statistics.median(own)


def _tf_graph_ops(model, x, y) -> int:
    """Ops in a fresh trace of the TensorFlow train step, cond branches included."""
    import tensorflow as tf

    spec = (tf.TensorSpec(x.shape, tf.int32), tf.TensorSpec(y.shape, tf.int32))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def _hlo_ops(model, x, y) -> int:
    """StableHLO ops in a fresh lowering of the JAX train step."""
    import jax

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    text = jax.jit(lambda *a: model.train_step(*a)).lower(state, (x, y)).as_text()
    return sum("= stablehlo." in line or "stablehlo.return" in line for line in text.splitlines())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds, args.steps)))
        return 0
    for backend in args.backends.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", backend, "--rounds", str(args.rounds),
                               "--steps", str(args.steps)], capture_output=True, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if proc.returncode != 0:
            print(f"{backend}: failed\n{proc.stderr[-2000:]}")
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"Keras {r['backend']}: fit epoch of {r['steps']} steps, {r['rounds']} rotated rounds; ratio: the median "
              "of the per-round ratios monitored / unmonitored (wall time; CPU ratio: this process's CPU time)")
        print(f"  {'monitor':<27} {'epoch s':>8} {'ratio':>6} {'paired IQR':>11} {'n':>3} {'min ratio':>9} {'CPU ratio':>9} {'ms/step':>8} {'ops: unsampled/sampled':>22}")
        for c in r["configs"]:
            ops = "" if c["ops"] is None else "%d/%d" % tuple(c["ops"])
            print(f"  {c['name']:<27} {c['s']:>8.3f} {c['ratio']:>6.3f} {'%.3f-%.3f' % tuple(c['iqr']):>11} {c['n']:>3} {c['min_ratio']:>9.3f} {c['cpu_ratio']:>9.3f} "
                  f"{c['per_step_ms']:>+8.2f} {ops:>22}")
        if r["backend"] == "jax":
            print("  host reads per unsampled step: none when monitored (the finite flags of the steps since a sample "
                  "are read in one transfer at the next sample or the epoch's end); a sampled step reads its record")
        else:
            print("  host reads per unsampled step: one 4-byte scalar (the skipped-step counter) when monitored; "
                  "a sampled step reads its record")
        print(f"  dispatch host work per unsampled step (every=100; Keras's data iterator included): "
              f"{r['dispatch_us']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
