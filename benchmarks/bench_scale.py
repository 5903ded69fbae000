"""The cost of plan and apply on a 10,000-module model, per framework (target: under 1 s).

torch: an ``nn.Sequential`` of 2,500 (Linear, LayerNorm, ReLU, Dropout) groups. Keras: a
subclassed model of 5,000 (Dense, LayerNormalization) pairs. Flax linen: a module of 5,000 (Dense,
LayerNorm) pairs (a linen module's tree exists only while it is traced, so its Plan needs one trace; the
table also shows what Flax's own ``jax.eval_shape(model.init, ...)`` costs; "apply" there is
``apply(...).init``: planning, casting and creating the parameters). Each
figure is the median of several rounds; building the model itself is not counted.

Usage: python benchmarks/bench_scale.py [--frameworks torch,keras,jax] [--modules N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings

POLICY_TEXT = """
compute_dtype = "bfloat16"
keep_float32 = ["kind:norm", "re:.*\\\\.1$"]
[[override]]
match = "**.3"
compute_dtype = "float32"
"""


def timed(fn, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def bench_torch(n: int, rounds: int) -> list[tuple[str, float, float]]:
    import copy

    import torch

    import ampbridge
    import ampbridge.torch as abt

    policy = ampbridge.loads(POLICY_TEXT)
    groups = n // 4
    model = torch.nn.Sequential(*[m for _ in range(groups) for m in (
        torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Dropout(0.0))])
    assert len(list(model.modules())) - 1 == n
    copies = [copy.deepcopy(model) for _ in range(rounds)]
    out = [("torch", "plan", *timed(lambda: abt.plan(model, policy), rounds))]
    it = iter(copies)
    out.append(("torch", "apply", *timed(lambda: abt.apply(next(it), policy), rounds)))
    return out


def bench_keras(n: int, rounds: int) -> list[tuple[str, float, float]]:
    import keras

    import ampbridge
    import ampbridge.keras as ak

    policy = ampbridge.loads(POLICY_TEXT)

    class Deep(keras.Model):  # subclassed: a 10,000-layer Sequential overflows Keras's own graph recursion
        def __init__(self):
            super().__init__()
            self.stack = [keras.layers.Dense(8, name=f"d{i}") if i % 2 == 0 else
                          keras.layers.LayerNormalization(name=f"n{i}") for i in range(n)]

        def call(self, x):
            for layer in self.stack:
                x = layer(x)
            return x

    model = Deep()
    model(keras.ops.ones((2, 8)))
    out = [("keras", "plan", *timed(lambda: ak.plan(model, policy, warn=False), rounds))]
    out.append(("keras", "apply", *timed(lambda: ak.apply(model, policy, warn=False), rounds)))
    return out


def bench_jax(n: int, rounds: int) -> list[tuple[str, float, float]]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import ampbridge
    import ampbridge.jax as abj

    policy = ampbridge.loads(POLICY_TEXT)

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(n // 2):
                x = nn.LayerNorm(name=f"n{i}")(nn.Dense(8, name=f"d{i}")(x))
            return x

    x = jnp.ones((2, 8))
    model = Deep()
    out = [("jax", "plan", *timed(lambda: abj.plan(model, policy, x, warn=False), rounds))]
    out.append(("jax", "apply", *timed(lambda: abj.apply(model, policy).init(jax.random.key(0), x), rounds)))
    # for scale: Flax's own abstract trace of the same model, which a linen Plan cannot avoid
    out.append(("flax", "trace", *timed(lambda: jax.eval_shape(model.init, jax.random.key(0), x), rounds)))
    return out


BENCHES = {"torch": bench_torch, "keras": bench_keras, "jax": bench_jax}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="torch,keras,jax")
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fw, what, median, best in BENCHES[args.one](args.modules, args.rounds):
                print(f"RESULT {fw} {what} {median:.4f} {best:.4f}")
        return
    print(f"plan/apply of a {args.modules:,}-module model (median and best of {args.rounds} rounds; target < 1 s)")
    print(f"{'framework':<10} {'what':<6} {'median s':>9} {'best s':>8}")
    for fw in args.frameworks.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", fw, "--modules", str(args.modules),
                               "--rounds", str(args.rounds)], capture_output=True, text=True)
        results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not results:
            print(f"{fw:<10} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        for _, name, what, median, best in results:
            flag = "" if float(median) < 1.0 else "  (over the 1 s target)"
            print(f"{name:<10} {what:<6} {float(median):>9.3f} {float(best):>8.3f}{flag}")


if __name__ == "__main__":
    main()
