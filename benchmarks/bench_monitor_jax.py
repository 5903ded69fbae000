"""JAX numerics monitor cost: the train step without a monitor, with every=1, with every=100.

All steps train the conformance transformer (made wider, as in bench_jax.py) with float16
compute, float32 master weights, dynamic loss scaling and Adam. One step function
``step(params, opt_state, x, y, sample)`` calls ``ampbridge.jax.numerics(..., sample=sample)``;
``sample`` is static, so it compiles to two programs:

- ``no monitor``: the same step written with ``ampbridge.jax.value_and_grad`` (what
  ``numerics(sample=False)`` is), no Monitor;
- ``every=100 (wrap)``: ``Monitor(every=100).wrap(step)``: the host picks the program by its own
  step counter (no device read): statistics and attribution on steps 0, 100, ...; the program
  without a monitor on the others (a skipped one among them is replayed with statistics at the
  next sampled step, reading the loss-scale counters once there);
- ``every=100 (wrap), 'outputs'``: the same with ``attribution="outputs"`` on the sampled steps
  (the parameters stay bit-identical to the run without a monitor);
- ``every=100 (cond)``: the older one-program form: ``numerics(every=100)`` every step
  (statistics under a ``lax.cond``, attribution flags every step) and ``Monitor.record`` each step;
- ``every=1 (wrap)``: statistics and attribution every step;
- ``no monitor again (control)``: a second copy of the loop without a monitor, timed like the
  others: its ratio is what the machine's noise alone gives.

Reported: per compiled program, lowered StableHLO ops (``jax.jit(step).lower(...).as_text()``,
``func`` ops excluded), ``stablehlo.convert`` ops among them (casts), optimised HLO instructions
(``.compile().as_text()``) and host callbacks (must be 0); per unsampled step of the train loop,
the device reads (array values read, asynchronous copies to the host, waits), counted over 99
unsampled steps with and without the monitor; step time: all variants in one process,
in pairs: each round times every variant (rotating order) beside a block of the loop without a
monitor (the pair's order alternating round by round), each block ``--steps`` steps ending with
``block_until_ready``; per variant the median, interquartile range and number of rounds of the
per-pair ratio variant / no monitor (wall time, and this process's CPU time, XLA's threads
included).

Usage: python benchmarks/bench_monitor_jax.py [--rounds 41] [--steps 100] [--dim 64] [--only "every=100 (wrap)"]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ampbridge
import ampbridge.jax as abj
from ampbridge._testing import jax_device_reads as device_reads
from ampbridge.cli.demo.flax_model import build, loss_fn
from ampbridge.cli.demo.model import Config, batches

sys.path.insert(0, str(Path(__file__).parent))
from _stats import spread  # noqa: E402


def lowered_ops(text: str) -> int:
    ops = re.findall(r"\b((?:stablehlo|chlo|mhlo|func|sdy)\.\w+)", text)
    return sum(1 for op in ops if op not in ("func.func", "func.return"))


def compiled_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = ", line))


def host_callbacks(text: str) -> int:
    return len(re.findall(r"callback|outfeed|infeed|send\(|recv\(", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--only", default="", help="comma-separated train-loop variants to time (default: all; "
                        "'no monitor' is always timed)")
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

    def loss_of(p, x, y):
        return loss_fn(amp.apply({"params": p}, x), y)

    @jax.jit
    def plain(params, opt_state, x, y):
        loss, grads = abj.value_and_grad(loss_of, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, None

    @functools.partial(jax.jit, static_argnames=("sample", "attribution", "every"))
    def step(params, opt_state, x, y, sample=False, attribution=True, every=1):
        loss, grads, stats = abj.numerics(amp, loss_of, opt_state, sample=sample, attribution=attribution,
                                          every=every)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    programs = {  # the jitted function and its static arguments
        "no monitor (abj.value_and_grad)": (plain, {}),
        "unsampled step (sample=False)": (step, {"sample": False}),
        "sampled step (sample=True)": (step, {"sample": True}),
        "sampled step, attribution='outputs'": (step, {"sample": True, "attribution": "outputs"}),
        "sampled step, no attribution": (step, {"sample": True, "attribution": False}),
        "every=100 (cond), every step": (step, {"sample": True, "every": 100}),
        "flags only (every=None)": (step, {"sample": True, "every": None}),
    }
    x0, y0 = data[0]
    counts = {}
    for name, (fn, static) in programs.items():
        lowered = fn.lower(params, opt_state, x0, y0, **static)
        text = lowered.as_text()
        counts[name] = (lowered_ops(text), text.count("stablehlo.convert"),
                        compiled_instructions(lowered.compile().as_text()), host_callbacks(text))

    folder = tempfile.mkdtemp()

    def variant(name, every=None, mode="wrap", attribution=True):
        state = {"p": params, "s": opt_state, "i": 0}
        monitor = abj.Monitor(os.path.join(folder, f"{name}.jsonl"), amp, x0, every=every) if every else None
        if monitor is None:
            call = plain
        elif mode == "wrap":
            call = monitor.wrap(functools.partial(step, attribution=attribution))
        else:
            cond = functools.partial(step, sample=True, every=every, attribution=attribution)

            def call(p, s, x, y):
                out = cond(p, s, x, y)
                monitor.record(state["i"], out[2])
                return out

        def run(n):
            for _ in range(n):
                i = state["i"]
                state["p"], state["s"], _ = call(state["p"], state["s"], *data[i % len(data)])
                state["i"] = i + 1
            jax.block_until_ready(state["p"])

        return run, state, monitor

    variants = {
        "no monitor": variant("plain"),
        "no monitor again (control)": variant("plain, control"),
        "every=100 (wrap)": variant("wrap", every=100),
        "every=100 (wrap), 'outputs'": variant("wrap-outputs", every=100, attribution="outputs"),
        "every=100 (cond)": variant("cond", every=100, mode="cond"),
        "every=1 (wrap)": variant("every1", every=1),
    }
    if args.only:
        wanted = {"no monitor", *(name.strip() for name in args.only.split(","))}
        unknown = wanted - set(variants)
        if unknown:
            parser.error(f"--only: unknown variant(s) {sorted(unknown)}; accepted: {list(variants)}")
        variants = {name: v for name, v in variants.items() if name in wanted}
    for run, _, _ in variants.values():
        run(5)  # warm up: both programs compiled (steps 0-4: 0 sampled)

    # exact counts per unsampled step: steps 1-99 (step 0 sampled) with and without the monitor
    run_plain, _, _ = variant("count: no monitor")
    run_wrap, _, counting_monitor = variant("count: every=100 (wrap)", every=100)
    run_plain(1)
    run_wrap(1)
    with device_reads() as reads_plain:
        run_plain(99)
    with device_reads() as reads_wrap:
        run_wrap(99)
    counting_monitor.close()
    # both blocks end with one block_until_ready of the parameters (the loop's own)

    names = list(variants)
    others = [name for name in names if name != "no monitor"]
    times = collections.defaultdict(list)
    cpu = collections.defaultdict(list)
    ratios = {name: [1.0] * args.rounds if name == "no monitor" else [] for name in names}
    cpu_ratios = {name: list(values) for name, values in ratios.items()}

    def block(name):
        t0, c0 = time.perf_counter(), time.process_time()
        variants[name][0](args.steps)
        wall, process = (time.perf_counter() - t0) / args.steps, (time.process_time() - c0) / args.steps
        times[name].append(wall)
        cpu[name].append(process)
        return wall, process

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for r in range(args.rounds):
        # each variant's block is timed beside a block of the loop without a monitor, the pair's
        # order alternating round by round and the variants' order rotating, so each ratio
        # compares neighbours in time and drifting load hits both sides alike
        for name in others[r % len(others):] + others[:r % len(others)]:
            measured = {n: block(n) for n in (("no monitor", name) if r % 2 == 0 else (name, "no monitor"))}
            ratios[name].append(measured[name][0] / measured["no monitor"][0])
            cpu_ratios[name].append(measured[name][1] / measured["no monitor"][1])
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for _, _, monitor in variants.values():
        if monitor is not None:
            monitor.close()

    # the loop without a monitor that ran as many steps as each variant (the timing's "no monitor"
    # ran one block beside each variant's): the control
    reference = "no monitor again (control)"

    def same_as_plain(name):
        """'(N steps): NAME True|False', or why it was not checked."""
        if name not in variants or reference not in variants:
            return f": {name} not run (needs {name!r} and {reference!r})"
        steps = variants[reference][1]["i"]
        if variants[name][1]["i"] != steps:
            raise AssertionError(f"{name!r} ran {variants[name][1]['i']} steps, {reference!r} {steps}")
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree_util.tree_leaves(variants[reference][1]["p"]), jax.tree_util.tree_leaves(variants[name][1]["p"])))
        return f" ({steps} steps): {name} {same}"

    n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    print(f"model: conformance transformer dim={config.dim} hidden={config.hidden} seq={config.seq} "
          f"batch={config.batch} ({n_params} params, {len(jax.tree_util.tree_leaves(params))} arrays), "
          "float16 compute, dynamic loss scale, adam")
    print(f"device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"load average {load:.1f} before the timed rounds, {load_after:.1f} after ({os.cpu_count()} cores)")
    outputs = "every=100 (wrap), 'outputs'"
    print(f"parameters bit-identical to the run without a monitor{same_as_plain(outputs)}")
    print()
    base = counts["no monitor (abj.value_and_grad)"]
    table = [("compiled step", "lowered ops", "converts", "optimised HLO", "host callbacks")]
    for name, (ops, converts, inst, cb) in counts.items():
        table.append((name, f"{ops} ({ops / base[0]:.2f}x)", str(converts), f"{inst} ({inst / base[2]:.2f}x)", str(cb)))
    show(table)
    equal = counts["unsampled step (sample=False)"] == base
    print(f"unsampled step = no monitor, every count: {equal}")
    print(f"per 99 unsampled steps (then one wait): no monitor {reads_plain}; every=100 (wrap) {reads_wrap}")
    print()
    table = [("train loop", "ms/step (median)", "wall ratio: median (IQR, rounds)", "CPU-time ratio (median)")]
    for name in names:
        table.append((name, f"{statistics.median(times[name]) * 1e3:.3f}", spread(ratios[name]),
                      f"{statistics.median(cpu_ratios[name]):.3f}"))
    show(table)
    print(f"\n{args.rounds} interleaved rounds; in each, every variant's block of {args.steps} steps timed beside one of "
          "the loop without a monitor (every block of the every=100 variants holds one sampled step)")


def show(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
