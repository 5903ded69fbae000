"""ampbridge's own share of a 10,000-module linen plan and apply, beside Flax's own floor.

bench_scale.py's linen model (5,000 Dense + LayerNorm pairs) in one process: Flax's module
construction (every module created and called, no maths), ``ampbridge.jax.plan`` and
``apply(...).cast_params`` on float32 variables built directly (no abstract init), in
interleaved rounds, timed in process CPU time (steadier than wall time on a shared machine).
``own`` is a row's median minus the floor's. ``--profile`` runs one plan under cProfile and
prints the ampbridge functions by own time (``tottime``).

Usage: python benchmarks/bench_linen_share.py [--modules N] [--rounds R] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]  # this checkout's ampbridge

from bench_scale import POLICY_TEXT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import ampbridge
    import ampbridge.jax as abj

    pairs = args.modules // 2
    policy = ampbridge.loads(POLICY_TEXT)

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(pairs):
                x = nn.LayerNorm(name=f"n{i}")(nn.Dense(8, name=f"d{i}")(x))
            return x

    def no_maths(next_fun, args_, kwargs, context):
        # every module is created and called, none computes: Flax's own cost of walking the tree
        if context.method_name == "setup" or not isinstance(context.module.parent, nn.Module):
            return next_fun(*args_, **kwargs)
        return args_[0]

    x, model = jnp.ones((2, 8)), Deep()
    zeros = {"d": {"kernel": jnp.zeros((8, 8)), "bias": jnp.zeros(8)},
             "n": {"scale": jnp.zeros(8), "bias": jnp.zeros(8)}}
    variables = {"params": {f"{k}{i}": dict(zeros[k]) for i in range(pairs) for k in "dn"}}

    def tree():
        with nn.intercept_methods(no_maths):
            return jax.eval_shape(model.init, jax.random.key(0), x)

    rows = {
        "flax tree": tree,
        "linen plan": lambda: abj.plan(model, policy, x, warn=False),
        "linen apply": lambda: abj.apply(model, policy).cast_params(variables, x),
    }
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(rows["linen plan"])
        stats = pstats.Stats(profile).sort_stats("tottime")
        stats.print_stats("ampbridge", 25)
        return
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    floor = statistics.median(times["flax tree"])
    print(f"{args.modules:,} linen modules, process CPU s, median of {args.rounds} interleaved rounds "
          f"({Path(ampbridge.__file__).parent})")
    for name, values in times.items():
        median = statistics.median(values)
        note = "" if name == "flax tree" else f"  {median / floor:.2f}x floor, own +{median - floor:.2f} s"
        print(f"{name:<12} {median:7.3f}{note}")


if __name__ == "__main__":
    main()
