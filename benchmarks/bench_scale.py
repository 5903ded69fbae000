"""The cost of plan and apply on a 10,000-module model, per framework (target: under 1 s).

torch: an ``nn.Sequential`` of 2,500 (Linear, LayerNorm, ReLU, Dropout) groups. Keras: a
subclassed model of 5,000 (Dense, LayerNormalization) pairs. Flax linen: a module of 5,000 (Dense,
LayerNorm) pairs; "apply" there is ``ampbridge.jax.apply(model, policy).cast_params(variables, x)``,
the plan realised on an existing float32 checkpoint (learning the module tree, casting every
parameter), as torch's and Keras's apply realise it on a built model. Flax NNX: the same pairs in
an ``nnx.List``; its apply returns a converted copy.

A linen module's tree exists only while Flax runs it, and an NNX copy is Flax's own clone, so the
table also shows what Flax itself takes for those on the same model: its module construction alone
(every module created and called, no maths: the floor of any linen Plan), its abstract ``init``,
and its fastest ``nnx.clone``. ampbridge pauses Python's cycle collector while it plans (see
``ampbridge.core.plan.gc_paused``); Flax's rows run as Flax runs them. Each figure is the median of
several rounds (Flax's abstract init: one round); building the models is not counted. The CPU
column is the median process CPU time of the same rounds: on a loaded machine it moves far less
than wall time (the target is read against wall time on a quiet machine).

Usage: python benchmarks/bench_scale.py [--frameworks torch,keras,jax,nnx] [--modules N] [--rounds R]
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
    times, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    times.sort()  # (median, best, first quartile, third quartile, rounds, median process CPU time)
    return (statistics.median(times), times[0], times[len(times) // 4], times[(3 * len(times)) // 4], len(times),
            statistics.median(cpu))


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

    def no_maths(next_fun, args, kwargs, context):
        # every module is created and called, none computes: Flax's own cost of walking the tree
        if context.method_name == "setup" or not isinstance(context.module.parent, nn.Module):
            return next_fun(*args, **kwargs)
        return args[0]

    def module_tree():
        with nn.intercept_methods(no_maths):
            return jax.eval_shape(model.init, jax.random.key(0), x)

    x = jnp.ones((2, 8))
    model = Deep()
    shapes = {}

    def flax_init():
        shapes["v"] = jax.eval_shape(model.init, jax.random.key(0), x)

    out = [("flax", "init", *timed(flax_init, 1))]
    variables = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["v"])
    out.append(("flax", "tree", *timed(module_tree, rounds)))
    out.append(("linen", "plan", *timed(lambda: abj.plan(model, policy, x, warn=False), rounds)))
    out.append(("linen", "apply", *timed(lambda: abj.apply(model, policy).cast_params(variables, x), rounds)))
    return out


def bench_nnx(n: int, rounds: int) -> list[tuple[str, float, float]]:
    from flax import nnx

    import ampbridge
    import ampbridge.jax as abj

    policy = ampbridge.loads(POLICY_TEXT)

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) if i % 2 == 0 else nnx.LayerNorm(8, rngs=rngs)
                                    for i in range(n)])

    model = Deep(nnx.Rngs(0))
    out = [("flax", "clone", *timed(lambda: nnx.clone(model, graph=False), rounds))]
    out.append(("nnx", "plan", *timed(lambda: abj.plan(model, policy, warn=False), rounds)))
    out.append(("nnx", "apply", *timed(lambda: abj.apply(model, policy), rounds)))
    return out


BENCHES = {"torch": bench_torch, "keras": bench_keras, "jax": bench_jax, "nnx": bench_nnx}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="torch,keras,jax,nnx")
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fw, what, median, best, q1, q3, n, cpu in BENCHES[args.one](args.modules, args.rounds):
                print(f"RESULT {fw} {what} {median:.4f} {best:.4f} {q1:.4f} {q3:.4f} {n} {cpu:.4f}")
        return
    print(f"plan/apply of a {args.modules:,}-module model (median and best of {args.rounds} rounds; target < 1 s)")
    print(f"{'framework':<10} {'what':<6} {'median s':>9} {'best s':>8} {'IQR s':>13} {'n':>2} {'CPU s':>6}  note")
    floors = {"linen": ("tree", "Flax's module construction"), "nnx": ("clone", "Flax's nnx.clone")}
    for fw in args.frameworks.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", fw, "--modules", str(args.modules),
                               "--rounds", str(args.rounds)], capture_output=True, text=True)
        results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not results:
            print(f"{fw:<10} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        flax = {what: float(median) for _, name, what, median, *_ in results if name == "flax"}
        for _, name, what, median, best, q1, q3, n, cpu in results:
            if name == "flax":
                note = "Flax itself, for scale"
            else:
                note = "meets the target" if float(median) < 1.0 else "over the 1 s target"
                floor = floors.get(name)
                if floor and floor[0] in flax:
                    note += f"; {float(median) / flax[floor[0]]:.2f}x {floor[1]}"
            print(f"{name:<10} {what:<6} {float(median):>9.3f} {float(best):>8.3f} "
                  f"{f'{float(q1):.3f}-{float(q3):.3f}':>13} {n:>2} {float(cpu):>6.3f}  {note}")


if __name__ == "__main__":
    main()
