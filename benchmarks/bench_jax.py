"""JAX backend cost: the ampbridge train step against the hand-written jmp + optax step.

Both steps train the same Flax transformer-ish model (the conformance model, made wider so a step
takes a few milliseconds) with float16 compute, float32 master weights and dynamic loss scaling.
The jmp step is what a careful JAX user writes today: ``jmp`` policy casts, ``jmp.DynamicLossScale``,
and the skip done by hand with ``jmp.select_tree(jmp.all_finite(grads), ...)``.

Reported:
- HLO ops: every ``<dialect>.<op>`` occurrence in ``jax.jit(step).lower(...).as_text()``
  (StableHLO, before XLA optimises), ``func.func``/``func.return`` excluded; and the instructions of
  the optimised module (``.compile().as_text()``, lines ``%name = type op(...)``, fusion bodies included), which is what runs.
- host callbacks in the jitted step (must be 0).
- step time: both compiled steps in one process, interleaved round by round (order alternating),
  each round ``--steps`` steps; the ratio is the median over rounds of ampbridge / jmp.

Usage: python benchmarks/bench_jax.py [--rounds 41] [--steps 20] [--dim 128]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import ampbridge
import ampbridge.jax as abj
from ampbridge.cli.demo.flax_model import build, loss_fn
from ampbridge.cli.demo.model import Config, batches


def lowered_ops(text: str) -> collections.Counter:
    ops = re.findall(r"\b((?:stablehlo|chlo|mhlo|func|sdy)\.\w+)", text)
    return collections.Counter(op for op in ops if op not in ("func.func", "func.return"))


def compiled_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = ", line))


def host_callbacks(text: str) -> int:
    return len(re.findall(r"callback|outfeed|infeed|send\(|recv\(", text))


def make_steps(model, policy, jmp_policy, inner, scale0, period):
    amp = abj.apply(model, policy)
    tx = abj.optimizer(inner, policy)

    def ampbridge_step(params, opt_state, x, y):
        def scaled_loss(p):
            return abj.scale_loss(loss_fn(amp.apply({"params": p}, x), y), opt_state)

        grads = jax.grad(scaled_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # jmp.DynamicLossScale cannot be an argument of jit(...).lower() (its tree_unflatten runs a
    # dtype check on lowering placeholders and fails), so its two arrays travel instead
    def jmp_step(params, opt_state, scale, counter, x, y):
        loss_scale = jmp.DynamicLossScale(scale, counter, period=period)

        def scaled_loss(p):
            logits = model.apply({"params": jmp_policy.cast_to_compute(p)}, jmp_policy.cast_to_compute(x))
            return loss_scale.scale(loss_fn(jmp_policy.cast_to_output(logits), y))

        grads = loss_scale.unscale(jax.grad(scaled_loss)(params))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale.loss_scale, loss_scale.counter

    return tx, ampbridge_step, jmp_step, (jnp.float32(scale0), jnp.zeros((), jnp.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()

    config = Config(dim=args.dim, hidden=4 * args.dim, heads=4, seq=16, batch=16, vocab=256)
    model, variables = build(0, config)
    params = variables["params"]
    data = [tuple(map(jnp.asarray, b)) for b in batches(max(args.steps, 8), config=config)]
    scale0, period = 2.0 ** 15, 2000
    policy = ampbridge.Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=scale0, growth_interval=period, min_scale=1.0))
    tx, amp_step, ref_step, scale_j = make_steps(model, policy, jmp.get_policy("p=f32,c=f16,o=f32"),
                                                 optax.adam(1e-3), scale0, period)
    state_a = jax.jit(tx.init)(params)
    state_j = jax.jit(optax.adam(1e-3).init)(params)

    lowered_a = jax.jit(amp_step, donate_argnums=()).lower(params, state_a, *data[0])
    lowered_j = jax.jit(ref_step).lower(params, state_j, *scale_j, *data[0])
    text_a, text_j = lowered_a.as_text(), lowered_j.as_text()
    ops_a, ops_j = lowered_ops(text_a), lowered_ops(text_j)
    compiled_a, compiled_j = lowered_a.compile(), lowered_j.compile()
    inst_a, inst_j = compiled_instructions(compiled_a.as_text()), compiled_instructions(compiled_j.as_text())

    # the preset's loss scale has no min_scale: its scale arithmetic takes the subnormal-safe path
    tx_p, step_p, _, _ = make_steps(model, ampbridge.preset("mixed_float16"), jmp.get_policy("p=f32,c=f16,o=f32"),
                                    optax.adam(1e-3), scale0, period)
    ops_p = lowered_ops(jax.jit(step_p).lower(params, jax.jit(tx_p.init)(params), *data[0]).as_text())

    # same numbers first: the comparison is only fair if both steps compute the same thing
    pa, sa = params, state_a
    pj, sj, lj = params, state_j, scale_j
    for x, y in data[:5]:
        pa, sa = compiled_a(pa, sa, x, y)
        pj, sj, *lj = compiled_j(pj, sj, *lj, x, y)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pj)))

    def run_a(n):
        nonlocal pa, sa
        for i in range(n):
            pa, sa = compiled_a(pa, sa, *data[i % len(data)])
        jax.block_until_ready(pa)

    def run_j(n):
        nonlocal pj, sj, lj
        for i in range(n):
            pj, sj, *lj = compiled_j(pj, sj, *lj, *data[i % len(data)])
        jax.block_until_ready(pj)

    run_a(args.steps), run_j(args.steps)  # warm up
    times_a, times_j, ratios = [], [], []
    for r in range(args.rounds):
        order = (("a", run_a), ("j", run_j)) if r % 2 == 0 else (("j", run_j), ("a", run_a))
        took = {}
        for name, fn in order:
            t0 = time.perf_counter()
            fn(args.steps)
            took[name] = (time.perf_counter() - t0) / args.steps
        times_a.append(took["a"])
        times_j.append(took["j"])
        ratios.append(took["a"] / took["j"])

    ms = statistics.median(times_a) * 1e3, statistics.median(times_j) * 1e3
    ratio = statistics.median(ratios)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    print(f"model: conformance transformer dim={config.dim} hidden={config.hidden} seq={config.seq} "
          f"batch={config.batch} ({n_params} params), float16 compute, dynamic loss scale, adam")
    print(f"device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print(f"same parameters after 5 steps: {same}")
    print()
    rows = [("", "ampbridge", "jmp (hand-written)", "ratio"),
            ("lowered StableHLO ops", str(sum(ops_a.values())), str(sum(ops_j.values())),
             f"{sum(ops_a.values()) / sum(ops_j.values()):.3f}"),
            ("  (preset mixed_float16: no min_scale)", str(sum(ops_p.values())), "-", "-"),
            ("optimised HLO instructions", str(inst_a), str(inst_j), f"{inst_a / inst_j:.3f}"),
            ("host callbacks in the step", str(host_callbacks(text_a)), str(host_callbacks(text_j)), "-"),
            ("step time, median (ms)", f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{ratio:.3f}")]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    q1, q3 = np.percentile(ratios, [25, 75])
    print(f"\nratio over {args.rounds} interleaved rounds of {args.steps} steps: median {ratio:.3f} "
          f"(interquartile {q1:.3f}-{q3:.3f}); target <= 1.03: {'met' if ratio <= 1.03 else 'MISSED'}")
    diff = (ops_a - ops_j) + (ops_j - ops_a)
    extra = ", ".join(f"{op.split('.')[-1]} {ops_a[op] - ops_j[op]:+d}" for op, _ in diff.most_common(8))
    print(f"lowered op difference (ampbridge - jmp): {extra}")


if __name__ == "__main__":
    main()
