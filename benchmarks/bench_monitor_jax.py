"""JAX numerics monitor cost: the train step without a monitor, with every=1, with every=100.

All steps train the conformance transformer (made wider, as in bench_jax.py) with float16
compute, float32 master weights, dynamic loss scaling and Adam. Variants:

- ``plain``: ``jax.grad`` of ``scale_loss(loss)``, ``tx.update`` (no monitor);
- ``every=1``: ``ampbridge.jax.numerics(..., every=1)`` (statistics and attribution every step)
  and ``Monitor(every=1).record`` each step (a log line per step);
- ``every=100 (cond)``: one compiled step, statistics under a ``lax.cond`` on the step counter;
  attribution flags every step; ``Monitor(every=100)``;
- ``every=100 (2 programs)``: the host picks one of two compiled steps, ``every=None`` (flags
  only) or ``every=1`` (on steps 0, 100, ...), by ``monitor.due(step)``;
- ``every=100 (2 programs), 'outputs'``: the same with ``attribution="outputs"`` (output
  gradients watched; the parameters stay bit-identical to the run without a monitor);
- ``every=100 (2 programs), no attribution``: statistics only (``attribution=False``);
- ``flags only``: ``every=None`` every step (what attribution costs on its own), no monitor.

Reported: lowered StableHLO ops (``jax.jit(step).lower(...).as_text()``, ``func`` ops excluded),
optimised HLO instructions (``.compile().as_text()``), host callbacks (must be 0), and step time:
all variants in one process, interleaved round by round (rotating order), each round
``--steps`` steps ending with ``block_until_ready`` (and ``monitor.flush()``); the ratios are the
medians over rounds of variant / no monitor, of wall time and of this process's CPU time (XLA's
threads included; steadier than wall time when other work shares the machine).

Usage: python benchmarks/bench_monitor_jax.py [--rounds 15] [--steps 100] [--dim 64]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ampbridge
import ampbridge.jax as abj
from ampbridge.cli.demo.flax_model import build, loss_fn
from ampbridge.cli.demo.model import Config, batches


def lowered_ops(text: str) -> int:
    ops = re.findall(r"\b((?:stablehlo|chlo|mhlo|func|sdy)\.\w+)", text)
    return sum(1 for op in ops if op not in ("func.func", "func.return"))


def compiled_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = ", line))


def host_callbacks(text: str) -> int:
    return len(re.findall(r"callback|outfeed|infeed|send\(|recv\(", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()

    config = Config(dim=args.dim, hidden=4 * args.dim, heads=4, seq=16, batch=16, vocab=256)
    model, variables = build(0, config)
    data = [tuple(map(jnp.asarray, b)) for b in batches(16, config=config)]
    policy = ampbridge.Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** 15, growth_interval=2000, min_scale=1.0))
    amp = abj.apply(model, policy)
    tx = abj.optimizer(optax.adam(1e-3), policy)
    params = amp.cast_params(variables, data[0][0])["params"]
    opt_state = jax.jit(tx.init)(params)

    def plain(params, opt_state, x, y):
        grads = jax.grad(lambda p: abj.scale_loss(loss_fn(amp.apply({"params": p}, x), y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, None

    def monitored(params, opt_state, x, y, every, attribution=True):
        _, grads, stats = abj.numerics(amp, lambda p: loss_fn(amp.apply({"params": p}, x), y), opt_state,
                                       every=every, attribution=attribution)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    programs = {
        "plain": plain,
        "numerics every=1": functools.partial(monitored, every=1),
        "numerics every=100 (cond)": functools.partial(monitored, every=100),
        "numerics every=None (flags only)": functools.partial(monitored, every=None),
        "numerics every=1, attribution='outputs'": functools.partial(monitored, every=1, attribution="outputs"),
        "numerics every=None, attribution='outputs'": functools.partial(monitored, every=None,
                                                                         attribution="outputs"),
        "numerics every=1, no attribution": functools.partial(monitored, every=1, attribution=False),
        "numerics every=None, no attribution": functools.partial(monitored, every=None, attribution=False),
    }
    x0, y0 = data[0]
    counts = {}
    compiled = {}
    for name, fn in programs.items():
        lowered = jax.jit(fn).lower(params, opt_state, x0, y0)
        text = lowered.as_text()
        exe = lowered.compile()
        compiled[name] = exe
        counts[name] = (lowered_ops(text), compiled_instructions(exe.as_text()), host_callbacks(text))

    folder = tempfile.mkdtemp()

    def variant(name, program, every=None, choose=None):
        state = {"p": params, "s": opt_state, "i": 0}
        monitor = abj.Monitor(os.path.join(folder, f"{len(name)}-{every}.jsonl"), amp, x0, every=every) \
            if every else None

        def run(n):
            for _ in range(n):
                i = state["i"]
                exe = compiled[choose(monitor, i)] if choose else compiled[program]
                state["p"], state["s"], stats = exe(state["p"], state["s"], *data[i % len(data)])
                if monitor is not None:
                    monitor.record(i, stats)
                state["i"] = i + 1
            jax.block_until_ready(state["p"])
            if monitor is not None:
                monitor.flush()

        return run, state

    def two_programs(monitor, i):
        return "numerics every=1" if monitor.due(i) else "numerics every=None (flags only)"

    def two_programs_outputs(monitor, i):
        return ("numerics every=1, attribution='outputs'" if monitor.due(i)
                else "numerics every=None, attribution='outputs'")

    def two_programs_bare(monitor, i):
        return "numerics every=1, no attribution" if monitor.due(i) else "numerics every=None, no attribution"

    variants = {
        "no monitor": variant("plain", "plain"),
        "every=1": variant("every=1", "numerics every=1", every=1),
        "every=100 (cond)": variant("every=100 (cond)", "numerics every=100 (cond)", every=100),
        "every=100 (2 programs)": variant("every=100 (2 programs)", None, every=100, choose=two_programs),
        "every=100 (2 programs), 'outputs'": variant("every=100 (2 programs) outputs", None, every=100,
                                                     choose=two_programs_outputs),
        "every=100 (2 programs), no attribution": variant("every=100 (2 programs) bare", None, every=100,
                                                          choose=two_programs_bare),
        "flags only, no monitor": variant("flags", "numerics every=None (flags only)"),
    }
    for run, _ in variants.values():
        run(5)  # warm up
    names = list(variants)
    times = collections.defaultdict(list)
    cpu = collections.defaultdict(list)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name][0](args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    ratios = {name: [t / b for t, b in zip(times[name], times["no monitor"])] for name in names}
    cpu_ratios = {name: [t / b for t, b in zip(cpu[name], cpu["no monitor"])] for name in names}
    def same_as_plain(name):
        return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree_util.tree_leaves(variants["no monitor"][1]["p"]), jax.tree_util.tree_leaves(variants[name][1]["p"])))

    n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    print(f"model: conformance transformer dim={config.dim} hidden={config.hidden} seq={config.seq} "
          f"batch={config.batch} ({n_params} params, {len(jax.tree_util.tree_leaves(params))} arrays), "
          "float16 compute, dynamic loss scale, adam")
    print(f"device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    same_inputs, same_outputs = same_as_plain("every=1"), same_as_plain("every=100 (2 programs), 'outputs'")
    print(f"parameters bit-identical to the run without a monitor, after {variants['no monitor'][1]['i']} "
          f"steps: attribution 'inputs' {same_inputs}, 'outputs' {same_outputs}")
    print()
    table = [("compiled step", "lowered ops", "optimised HLO", "host callbacks")]
    for name, (ops, inst, cb) in counts.items():
        table.append((name, f"{ops} ({ops / counts['plain'][0]:.2f}x)", f"{inst} ({inst / counts['plain'][1]:.2f}x)",
                      str(cb)))
    show(table)
    print()
    table = [("train loop", "ms/step (median)", "wall ratio (median)", "interquartile", "rounds", "CPU-time ratio (median)")]
    for name in names:
        q1, q3 = np.percentile(ratios[name], [25, 75])
        table.append((name, f"{statistics.median(times[name]) * 1e3:.3f}", f"{statistics.median(ratios[name]):.3f}",
                      f"{q1:.3f}-{q3:.3f}", str(len(ratios[name])), f"{statistics.median(cpu_ratios[name]):.3f}"))
    show(table)
    print(f"\n{args.rounds} interleaved rounds of {args.steps} steps each")


def show(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
